"""What ``lmplug serve`` and the prefill/decode router both put in front of their routes, from
one place so that neither is less careful than the other: CORS for the allowed browser origins
and the ``Guard`` (Host names against DNS rebinding, the body deadline: 408), the API key check,
and uvicorn's options (the request-head deadline, keep-alive)."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware

from lmplug.serve.errors import APIError
from lmplug.serve.security import Guard, allowed_hosts, protocol_with_header_timeout


def guard_app(app: FastAPI, *, bind_host: str, extra_hosts: tuple[str, ...], cors_origins: tuple[str, ...],
              read_timeout: float) -> None:
    """CORS (only for ``cors_origins``), then the Host check and body deadline outermost."""
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, hosts=allowed_hosts(bind_host, extra_hosts), read_timeout=read_timeout)


def api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: 401 unless ``Authorization: Bearer <api_key>`` (nothing when no key)."""
    async def check(request: Request) -> None:
        if not api_key:
            return
        header = request.headers.get("authorization")
        if not header:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    return check


def uvicorn_options(read_timeout: float) -> dict[str, Any]:
    """A request head due within ``read_timeout`` seconds (slowloris); idle keep-alive bounded."""
    return {"http": protocol_with_header_timeout(read_timeout),
            "timeout_keep_alive": max(1, min(5, int(read_timeout)))}
