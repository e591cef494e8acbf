"""Run the real server on a loopback port in a background thread (a helper, not a test file)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from lmplug.serve import ServeSettings, build_server
from lmplug.serve.server import Server


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    server: Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def engine(self):
        return self.server.engine.engine

    def metric(self, name: str) -> float:
        """One sample of /metrics (summed over its labels), e.g. ``lmplug_kv_cache_usage_ratio``."""
        key = self.server.config.app.state.settings.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
        return sum(values)

    def wait_for(self, predicate, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()


@contextlib.contextmanager
def running_server(llm, settings: ServeSettings | None = None) -> Iterator[Running]:
    """Start on a free 127.0.0.1 port; on exit ask for a graceful shutdown and wait for it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = build_server(llm, settings or ServeSettings(api_key=""), host="127.0.0.1", port=port,
                          log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{port}", server, thread)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


@contextlib.contextmanager
def running_router(settings) -> Iterator[str]:
    """The prefill/decode router as ``lmplug serve --role router`` runs it (``router_server``:
    uvicorn with the head deadline) on a free loopback port; its URL."""
    from lmplug.serve.roles import router_server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = router_server(settings, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
