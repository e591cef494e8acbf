"""Run the app under uvicorn, with a graceful shutdown.

On SIGINT/SIGTERM (or ``server.should_exit = True``) the server stops accepting
connections, lets in-flight requests finish for ``shutdown_grace_s`` seconds,
then cuts the rest: each gets a last chunk (or a whole response) with
``finish_reason: "abort"``. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import argparse
import logging
import socket

import uvicorn

from lmplug.llm import LLM
from lmplug.serve.app import ServeSettings, create_app
from lmplug.serve.async_engine import AsyncEngine

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
                 port: int = 8000, log_level: str = "info") -> Server:
    settings = settings or ServeSettings()
    app = create_app(llm, settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=log_level == "debug")
    return Server(config, app.state.engine, settings.shutdown_grace_s)


def serve(llm: LLM, settings: ServeSettings | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Serve until interrupted (blocks)."""
    settings = settings or ServeSettings()
    if host not in LOOPBACK and not settings.api_key:
        logger.warning("listening on %s without an API key: anyone who can reach this port can use the "
                       "model (set --api-key or $LMPLUG_API_KEY)", host)
    server = build_server(llm, settings, host=host, port=port, log_level=log_level)
    server.run()


def serve_from_args(args: argparse.Namespace, llm: LLM) -> int:
    """``lmplug serve``: the CLI's flags -> settings -> ``serve``."""
    settings = ServeSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                             served_model_name=args.served_model_name, shutdown_grace_s=args.shutdown_timeout)
    log_level = "debug" if args.verbose > 1 else "info"
    serve(llm, settings, host=args.host, port=args.port, log_level=log_level)
    return 0
