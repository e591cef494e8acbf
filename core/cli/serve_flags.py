"""``lmplug serve``'s own flags (the engine flags are ``cli_args.engine_args``): binding, keys,
limits, browser access, tool-call parsing and prefill/decode disaggregation. Only argparse here:
declaring them must not import the server stack."""

from __future__ import annotations

import argparse


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", help="model name in the cache, HF folder, or .gguf file")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (visible in `ps`: prefer "
                   "--api-key-file or $LMPLUG_API_KEY)")
    s.add_argument("--api-key-file", help="read the API key from the first line of this file")
    s.add_argument("--served-model-name", help="the model id clients send (default: the config's model)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get a 413")
    s.add_argument("--max-open-seqs", type=int, default=1024, metavar="N",
                   help="sequences (n x prompts) all open requests may hold together; past it a 429")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish on shutdown before they are cut")
    s.add_argument("--allowed-hosts", action="append", metavar="HOST[,HOST]", help="more Host header names "
                   "to accept (default: loopback names on loopback, any on 0.0.0.0; '*': any)")
    s.add_argument("--cors-origins", action="append", metavar="ORIGIN[,ORIGIN]",
                   help="browser origins allowed to call the API ('*': any; default: none)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's head, then its body (default: 30)")
    s.add_argument("--public-health", action="store_true", help="serve /health without the API key")
    s.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="let special-token text in chat messages become control tokens (unsafe)")
    s.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3", "mistral", "none"),
                   help="how tool calls are read out of chat output (tool_choice \"auto\"); auto: by the "
                   "chat template's markers, hermes when it has none (default: auto)")
    lo = s.add_argument_group("LoRA adapters (the lora: config section)")
    lo.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                    help="PEFT adapter folders served beside the base model; a request picks one with model: NAME")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters (loaded at run time with /v1/load_lora_adapter)")
    lo.add_argument("--max-loras", type=int, metavar="N", help="adapters on the device at once (lora.max_loras)")
    lo.add_argument("--max-lora-rank", type=int, metavar="R", help="largest adapter rank (lora.max_lora_rank)")
    r = s.add_argument_group("prefill/decode disaggregation")
    r.add_argument("--role", default="single", choices=("single", "prefill", "decode", "router", "pd"),
                   help="prefill / decode: one side, KV blocks sent over --kv-peer; router: only the router "
                   "(--prefill URL --decode URL); pd: both sides as child processes plus the router")
    r.add_argument("--kv-peer", metavar="HOST:PORT", help="where the decode instance listens for KV blocks")
    r.add_argument("--prefill", metavar="URL", help="--role router: the prefill instance")
    r.add_argument("--decode", metavar="URL", help="--role router: the decode instance")
    r.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds the router waits for a "
                   "prefill before decode computes the prompt itself (default: 60)")
