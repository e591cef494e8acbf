"""What keeps the server safe to run next to a browser and slow or hostile clients.

- :class:`Guard` (ASGI middleware): the ``Host`` header must name this server (a page on
  ``evil.example.com`` that rebinds its DNS to 127.0.0.1 sends ``Host: evil.example.com``),
  and a request body must arrive within ``read_timeout`` seconds (408 otherwise).
- :func:`protocol_with_header_timeout`: uvicorn's HTTP protocol, closing a connection
  that has not sent a whole request head within ``read_timeout`` seconds (slowloris).
- :func:`allowed_hosts`: loopback names when bound to loopback, anything on a wildcard
  address, the bound address otherwise; plus ``--allowed-hosts``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: list[str] | tuple[str, ...] = ()) -> frozenset[str] | None:
    """Host names a request may name, lower case and without port; ``None``: any."""
    extra = [h.strip().lower() for h in extra if h.strip()]
    if "*" in extra:
        return None
    if bind_host in WILDCARDS:
        return frozenset(extra) if extra else None
    names = set(LOOPBACK_NAMES) if is_loopback(bind_host) else {bind_host.lower()}
    return frozenset(names | set(extra))


def host_name(header: str) -> str:
    """``"[::1]:8000"`` -> ``"::1"``, ``"Example.com:80"`` -> ``"example.com"``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header


class BodyTimeout(Exception):
    """The client did not send its whole body in time."""


class Guard:
    """ASGI middleware: Host check, then a deadline on reading the request body."""

    def __init__(self, app: Any, hosts: frozenset[str] | None, read_timeout: float) -> None:
        self.app, self.hosts, self.read_timeout = app, hosts, read_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and host_name(host) not in self.hosts:
            await _error(send, 400, f"Host header {host!r} is not allowed here (allowed: "
                         f"{', '.join(sorted(self.hosts))}; see --allowed-hosts)", "invalid_host")
            return
        await self.app(scope, _deadline_receive(receive, self.read_timeout), send)


def _deadline_receive(receive: Any, seconds: float) -> Any:
    """``receive`` with the whole body due within ``seconds``; later calls (waiting for a
    disconnect while a long answer streams) have no deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    done = False

    async def wrapped() -> dict:
        nonlocal done
        if done:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
        except asyncio.TimeoutError:
            raise BodyTimeout(f"request body: not received within {seconds:g} s") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            done = True
        return message

    return wrapped


async def _error(send: Any, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _HeaderDeadline(H11Protocol):
    """Closes a connection whose request head (first or next) takes over ``read_timeout`` s."""

    read_timeout: float = 30.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        self._watch = self.loop.call_later(self.read_timeout, self._expire)

    def _expire(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request in flight: its body deadline and the app own it
        if not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_timeout(read_timeout: float) -> type[H11Protocol]:
    return type("LmplugHTTPProtocol", (_HeaderDeadline,), {"read_timeout": read_timeout})
