"""Run the app under uvicorn, with a graceful shutdown.

On SIGINT/SIGTERM (or ``server.should_exit = True``) the server stops accepting
connections, lets in-flight requests finish for ``shutdown_grace_s`` seconds,
then cuts the rest: each gets a last chunk (or a whole response) with
``finish_reason: "abort"``. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from lmplug.llm import LLM
from lmplug.serve.app import ServeSettings, create_app
from lmplug.serve.async_engine import AsyncEngine
from lmplug.serve.hardening import uvicorn_options
from lmplug.serve.security import is_loopback

logger = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Server(uvicorn.Server):
    """uvicorn's server with the engine drained between closing the listeners and the connections."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting; uvicorn's own shutdown closes them again, harmlessly
        if self.engine.num_active_groups:
            logger.info("draining %d request(s) for up to %.1f s", self.engine.num_active_groups, self.grace_s)
        await self.engine.drain(self.grace_s)
        await super().shutdown(sockets)


def build_server(llm: LLM, settings: ServeSettings | None = None, *, host: str = "127.0.0.1",
                 port: int = 8000, log_level: str = "info",
                 prepare: Callable[[FastAPI], None] | None = None) -> Server:
    """``prepare``: called on the app before it runs (middleware, metrics; ``lmplug.serve.roles``)."""
    settings = dataclasses.replace(settings or ServeSettings(), bind_host=host)
    app = create_app(llm, settings)
    if prepare is not None:
        prepare(app)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=log_level == "debug",
                            **uvicorn_options(settings.read_timeout_s))
    return Server(config, app.state.engine, settings.shutdown_grace_s)


def serve(llm: LLM, settings: ServeSettings | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", prepare: Callable[[FastAPI], None] | None = None) -> None:
    """Serve until interrupted (blocks)."""
    settings = settings or ServeSettings()
    if not is_loopback(host) and not settings.api_key:
        logger.warning("listening on %s without an API key: anyone who can reach this port can use the "
                       "model (set --api-key or $LMPLUG_API_KEY)", host)
    server = build_server(llm, settings, host=host, port=port, log_level=log_level, prepare=prepare)
    server.run()


def serve_from_args(args: argparse.Namespace, llm: LLM, prepare: Callable[[FastAPI], None] | None = None) -> int:
    """``lmplug serve``: the CLI's flags -> settings -> ``serve``."""
    settings = ServeSettings(api_key=_api_key(args), max_body_bytes=args.max_body_bytes,
                             served_model_name=args.served_model_name, shutdown_grace_s=args.shutdown_timeout,
                             allowed_hosts=tuple(_split(args.allowed_hosts)),
                             cors_origins=tuple(_split(args.cors_origins)), read_timeout_s=args.read_timeout,
                             public_health=args.public_health, public_metrics=args.public_metrics,
                             allow_special_in_content=args.allow_special_tokens_in_content,
                             max_num_seqs=args.max_open_seqs, tool_parser=args.tool_call_parser,
                             lora_modules=lora_modules(getattr(args, "lora_modules", None)))
    log_level = "debug" if args.verbose > 1 else "info"
    serve(llm, settings, host=args.host, port=args.port, log_level=log_level, prepare=prepare)
    return 0


def lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``--lora-modules NAME=PATH ...`` -> ((name, path), ...); a malformed or repeated NAME exits."""
    out: dict[str, str] = {}
    for item in values or ():
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise SystemExit(f"--lora-modules {item!r}: expected NAME=PATH (a PEFT adapter folder)")
        if name.strip() in out:
            raise SystemExit(f"--lora-modules: adapter name {name.strip()!r} is given twice")
        out[name.strip()] = path.strip()
    return tuple(out.items())


def _split(values: list[str] | None) -> list[str]:
    """``--opt a,b --opt c`` -> ``[a, b, c]``."""
    return [v.strip() for value in values or () for v in value.split(",") if v.strip()]


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key-file`` (first line), else ``--api-key`` (visible in ``ps``: warned), else
    ``$LMPLUG_API_KEY`` (``None``: the settings read it)."""
    if getattr(args, "api_key_file", None):
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--api-key-file {args.api_key_file}: cannot read it: {exc}") from None
        if not key or not key[0].strip():
            raise SystemExit(f"--api-key-file {args.api_key_file}: the file is empty")
        return key[0].strip()
    if args.api_key:
        logger.warning("--api-key on the command line is visible to every local user in `ps`; "
                       "prefer --api-key-file or $%s", "LMPLUG_API_KEY")
        return args.api_key
    return os.environ.get("LMPLUG_API_KEY") or None
