"""``lmplug serve --role``: prefill/decode disaggregation on one or several hosts.

- ``--role prefill --kv-peer HOST:PORT``: an ordinary server whose KV cache writes every full
  prompt block through to a ``torch_distributed`` connector in the producer role, which pushes it
  to the decode instance listening on ``HOST:PORT``; each answer waits for the connector's
  ``flush`` (``FlushBeforeAnswer``), so the blocks are at the decode side when the router moves on.
- ``--role decode --kv-peer HOST:PORT``: the consumer: listens on ``HOST:PORT`` and keeps the
  blocks it receives, where its prefix cache finds them.
- ``--role router --prefill URL --decode URL``: only the router (``lmplug.serve.router``), no model.
- ``--role pd``: the one-host case: a prefill and a decode instance as child processes on free
  loopback ports, and the router in this process on ``--host``/``--port``; the children stop
  with it.

Both instance roles set, on top of the user's config, ``kvconnector: {backend: torch_distributed,
role, address}`` and ``kvcache: {backend: paged, prefix_caching: true}``; both serve their
connector's counters on ``/metrics`` as ``lmplug_kvconnector_<name>`` (e.g. ``_received``,
``_hits`` on decode, ``_sent``, ``_send_us`` on prefill).
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.core import GaugeMetricFamily

from lmplug.errors import LmplugError
from lmplug.interfaces.kvconnector import KVConnector
from lmplug.llm import LLM
from lmplug.serve.hardening import uvicorn_options
from lmplug.serve.router import RouterSettings, create_router
from lmplug.serve.server import _api_key, _split, serve_from_args

logger = logging.getLogger(__name__)

ROLES = ("single", "prefill", "decode", "router", "pd")
CONNECTOR_ROLES = {"prefill": "producer", "decode": "consumer"}
STARTUP_LIMIT_S = 900.0  # --role pd: how long the children may take to load the model
_ROLE_FLAGS = ("--role", "--port", "--host", "--kv-peer", "--prefill", "--decode", "--prefill-timeout")


def with_role(overrides: dict[str, Any], role: str, peer: str, secret: str | None = None) -> dict[str, Any]:
    """The engine overrides of a prefill or decode instance: the user's, plus its connector and a
    paged cache with prefix caching (other options of those sections are kept); ``secret`` (the
    API key) is what the two connectors prove to each other unless the user gave a key file."""
    out = dict(overrides)
    kv = _section(out.get("kvcache"))
    if kv.get("backend", "paged") not in ("paged", "auto"):
        raise LmplugError(f"--role {role}: kvcache backend {kv['backend']!r}: prefill/decode "
                          "disaggregation moves blocks of the paged cache; use --kvcache paged")
    out["kvcache"] = {**kv, "backend": "paged", "prefix_caching": True}
    out["kvconnector"] = {**_section(out.get("kvconnector")), "backend": "torch_distributed",
                          "role": CONNECTOR_ROLES[role], "address": peer}
    if secret and "key_file" not in out["kvconnector"]:
        out["kvconnector"]["secret"] = secret
    return out


def _section(value: Any) -> dict[str, Any]:
    return {"backend": value} if isinstance(value, str) else dict(value or {})


def kv_connector(llm: LLM) -> KVConnector:
    """The connector the engine's KV cache writes through to (the paged cache's tier)."""
    tier = getattr(llm.engine.kv, "tier", None)
    if tier is None:
        raise LmplugError(f"kvcache backend {llm.engine.kv.name!r} holds no KV connector")
    return tier.connector


class FlushBeforeAnswer:
    """ASGI middleware: before the last body message of a ``/v1/`` answer, wait (off the event
    loop) until the peer has stored every block sent so far (the connector's acknowledged
    ``flush``), so a client that has the answer knows the peer has the prompt's blocks."""

    def __init__(self, app: Any, flush: Callable[[], None]) -> None:
        self.app, self.flush = app, flush

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def send_flushed(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await anyio.to_thread.run_sync(self.flush)
            await send(message)

        await self.app(scope, receive, send_flushed)


class ConnectorMetrics:
    """A Prometheus collector: the connector's ``stats()`` as ``lmplug_kvconnector_<name>``."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in self.connector.stats().items():
            yield GaugeMetricFamily(f"lmplug_kvconnector_{name}",
                                    f"KV connector {self.connector.name}: {name}", value=value)


def serve_role(args: argparse.Namespace, build_llm: Callable[..., LLM]) -> int:
    """``lmplug serve --role ROLE``; ``build_llm(args, adjust)``: the CLI's engine, its overrides
    passed through ``adjust``."""
    if args.role == "router":
        if not args.decode:
            raise LmplugError("--role router needs --decode URL (and, to split the work, --prefill URL)")
        return run_router(router_settings(args, args.decode, args.prefill), args.host, args.port)
    if args.role == "pd":
        return run_pd(args)
    if not args.kv_peer:
        raise LmplugError(f"--role {args.role} needs --kv-peer HOST:PORT (where the decode instance "
                          "listens for the prefill instance's KV blocks)")
    llm = build_llm(args, functools.partial(with_role, role=args.role, peer=args.kv_peer, secret=_api_key(args)))
    connector = kv_connector(llm)

    def prepare(app: FastAPI) -> None:
        app.state.metrics.registry.register(ConnectorMetrics(connector))
        if args.role == "prefill":
            app.add_middleware(FlushBeforeAnswer, flush=connector.flush)

    return serve_from_args(args, llm, prepare=prepare)


def router_settings(args: argparse.Namespace, decode: str, prefill: str | None) -> RouterSettings:
    """The router's settings from ``lmplug serve``'s flags: the same key, hosts, origins and
    limits an instance would take from them."""
    return RouterSettings(decode, prefill, prefill_timeout_s=args.prefill_timeout,
                          max_body_bytes=args.max_body_bytes, api_key=_api_key(args), bind_host=args.host,
                          allowed_hosts=tuple(_split(args.allowed_hosts)),
                          cors_origins=tuple(_split(args.cors_origins)), read_timeout_s=args.read_timeout,
                          public_health=args.public_health)


def router_server(settings: RouterSettings, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """The router under uvicorn with the options ``lmplug serve`` runs with (head deadline)."""
    return uvicorn.Server(uvicorn.Config(create_router(settings), host=host, port=port, log_level=log_level,
                                         lifespan="on", access_log=False,
                                         **uvicorn_options(settings.read_timeout_s)))


def run_router(settings: RouterSettings, host: str, port: int, log_level: str = "info") -> int:
    router_server(settings, host, port, log_level).run()
    return 0


def run_pd(args: argparse.Namespace) -> int:
    """A prefill and a decode child on free loopback ports, and the router here."""
    base = _strip_flags(args.argv, _ROLE_FLAGS)
    prefill_port, decode_port, kv_port = _free_ports(3)
    peer = f"127.0.0.1:{kv_port}"
    # uvicorn re-raises the SIGTERM it shut down on; its default action would skip the `finally`
    # and orphan the children
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    children = {role: subprocess.Popen([sys.executable, "-m", "lmplug.cli", *base, "--role", role,
                                        "--kv-peer", peer, "--host", "127.0.0.1", "--port", str(port)])
                for role, port in (("decode", decode_port), ("prefill", prefill_port))}
    try:
        urls = {role: f"http://127.0.0.1:{port}" for role, port in (("decode", decode_port),
                                                                     ("prefill", prefill_port))}
        _wait_healthy(children, urls, _api_key(args))
        settings = router_settings(args, urls["decode"], urls["prefill"])
        logger.info("router on %s:%d: prefill %s, decode %s", args.host, args.port, urls["prefill"], urls["decode"])
        return run_router(settings, args.host, args.port)
    finally:
        _stop(children.values())
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` (``--flag VALUE`` or ``--flag=VALUE``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        elif not item.startswith(tuple(f + "=" for f in flags)):
            out.append(item)
    return out


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _wait_healthy(children: dict[str, subprocess.Popen], urls: dict[str, str], api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + STARTUP_LIMIT_S
    waiting = dict(urls)
    while waiting:
        for role in list(waiting):
            if children[role].poll() is not None:
                raise LmplugError(f"--role pd: the {role} instance exited with status "
                                  f"{children[role].returncode} while starting (its log is above)")
            try:
                if httpx.get(waiting[role] + "/health", headers=headers, timeout=2).status_code == 200:
                    del waiting[role]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise LmplugError(f"--role pd: {', '.join(waiting)} not healthy after {STARTUP_LIMIT_S:g} s")
        time.sleep(0.2)


def _stop(children: Any) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()  # SIGTERM: a graceful shutdown
    for child in children:
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
