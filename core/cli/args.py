"""The ``lmplug`` command's shared argument groups (the engine flags, the sampling flags) and its
command parser, which declares a command's own options only when that command is used. Only
argparse here: declaring the commands must not import torch or the engine."""

from __future__ import annotations

import argparse
from typing import Any


def engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    g = p.add_argument_group("engine (flags override --config)")
    g.add_argument("--config", "-c", help="YAML config file (default: the embedded default config)")
    if model_positional:  # `serve MODEL` (kept for compatibility) or `serve --model MODEL`
        g.add_argument("--model", "-m", dest="model_option", metavar="MODEL",
                       help="model name in the cache, HF folder, or .gguf file (same as the positional MODEL)")
    else:
        g.add_argument("--model", "-m", help="model name in the cache, HF folder, or .gguf file")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--attention", help="attention backend name")
    g.add_argument("--kvcache", help="kvcache backend name")
    g.add_argument("--scheduler", help="scheduler backend name")
    g.add_argument("--tp", type=int, metavar="N", help="tensor parallel: split the model across N processes "
                   "(parallel.tensor_parallel_size; gloo on CPU, NCCL on GPUs)")
    g.add_argument("--pp", "--pp-size", dest="pp", type=int, metavar="P", help="pipeline parallel: split the "
                   "layers into P stages, each on its own processes (parallel.pipeline_parallel_size)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, dotted for plugin options (e.g. scheduler.max_num_seqs=4); repeatable")


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    g.add_argument("--ignore-eos", action="store_true")


class CommandParser(argparse.ArgumentParser):
    """A command's parser. With ``arguments_from=MODULE``, that module's ``add_arguments(parser)``
    runs only when this command is parsed or its help shown: ``quantize`` and ``eval`` import
    torch and the engine to declare their options, which ``lmplug generate`` must not pay for."""

    def __init__(self, *args: Any, arguments_from: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments_from = arguments_from

    def _add_deferred(self) -> None:
        if self._arguments_from is not None:
            import importlib

            module, self._arguments_from = self._arguments_from, None
            importlib.import_module(module).add_arguments(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_deferred()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_deferred()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_deferred()
        return super().format_help()
