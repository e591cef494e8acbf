"""The prefill/decode router against hostile clients (issue 45, item 7): it applies the rules of
``lmplug serve`` itself, with the same code: Host names (DNS rebinding), CORS origins, JSON-only
bodies under the byte limit, the request-head and body deadlines (a chunked body that never
finishes gets a 408), and the API key, checked by the router (the decode instance behind it
here has no key, so a 401 can only be the router's). Real uvicorn servers on 127.0.0.1, the
official openai client, httpx and raw sockets."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_router, running_server

from lmplug import LLM
from lmplug.serve import ServeSettings
from lmplug.serve.router import RouterSettings

KEY = "router-key"
READ_TIMEOUT = 1.0
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    """A real decode-side server (a tiny model, no key), and the same settings it runs with."""
    path = get_model("llama", tmp_path_factory.mktemp("tiny"), tokenizer=True).path
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    settings = ServeSettings(api_key="", served_model_name="tiny", read_timeout_s=READ_TIMEOUT,
                             max_body_bytes=4096, cors_origins=("https://ok.example",))
    with running_server(llm, settings) as running:
        yield running.url


@pytest.fixture(scope="module")
def router(decode):
    settings = RouterSettings(decode, None, api_key=KEY, read_timeout_s=READ_TIMEOUT, max_body_bytes=4096,
                              allowed_hosts=("api.example.com",), cors_origins=("https://ok.example",))
    with running_router(settings) as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_the_openai_client_needs_the_key_at_the_router(router):
    import openai

    good = openai.OpenAI(base_url=router + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert good.completions.create(**BODY).choices[0].text is not None
    assert [m.id for m in good.models.list().data] == ["tiny"]
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=router + "/v1", api_key=key or "x", max_retries=0, timeout=60,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(**BODY)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert httpx.get(router + "/health").status_code == 401
    assert httpx.get(router + "/health", headers=AUTH).status_code == 200


def test_public_health_is_a_choice(decode):
    with running_router(RouterSettings(decode, None, api_key=KEY, public_health=True)) as url:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401


def test_foreign_host_is_refused_like_the_instance(router, decode):
    """DNS rebinding: the router answers what the instance answers, before any forwarding."""
    for url in (router, decode):
        resp = httpx.post(url + "/v1/completions", json=BODY, headers={**AUTH, "Host": "evil.example.com"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_host", url
    port = router.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "api.example.com"):
        resp = httpx.post(router + "/v1/completions", json=BODY, headers={**AUTH, "Host": host}, timeout=60)
        assert resp.status_code == 200, (host, resp.text)


def test_cors_only_for_configured_origins(router, decode):
    def preflight(url: str, origin: str) -> httpx.Response:
        return httpx.options(url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    for url in (router, decode):
        assert preflight(url, "https://ok.example").headers.get("access-control-allow-origin") == \
            "https://ok.example"
        assert "access-control-allow-origin" not in preflight(url, "https://evil.example").headers


@pytest.mark.parametrize("case, status, code", [
    ("too_large", 413, "request_too_large"), ("too_large_chunked", 413, "request_too_large"),
    ("text_plain", 415, "unsupported_media_type"), ("not_json", 400, "invalid_json"),
    ("array", 400, "invalid_json"), ("lone_surrogate", 400, None),
])
def test_bodies_are_checked_at_the_router(router, decode, case, status, code):
    def content():  # fresh for each server (a generator is read once)
        if case == "too_large":
            return b'{"prompt": "' + b"a" * 8000 + b'"}'
        if case == "too_large_chunked":  # no Content-Length: the limit holds on what arrives
            return iter([b'{"prompt": "', b"a" * 3000, b"a" * 3000, b'"}'])
        return {"not_json": b'{"prompt": ', "array": b"[1, 2]",
                "lone_surrogate": b'{"prompt": "\\ud800", "max_tokens": 1}'}.get(case, b'{"prompt": "hi"}')

    headers = {**AUTH, "Content-Type": "text/plain" if case == "text_plain" else "application/json"}
    for url in (router, decode):
        resp = httpx.post(url + "/v1/completions", content=content(), headers=headers, timeout=60)
        assert resp.status_code == status, (url, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert code is None or error["code"] == code


def connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)


def answer_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """What the server sends until it closes the connection, if it does within ``seconds``."""
    deadline, got = time.monotonic() + seconds, b""
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def test_a_chunked_body_that_never_ends_gets_408(router, decode):
    """As the instance: a 408 after ``read_timeout_s``, the connection closed."""
    for url in (router, decode):
        sock = connect(url)
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"4\r\n{\"pr\r\n")
            closed, got = answer_within(sock, READ_TIMEOUT + 6)
        finally:
            sock.close()
        assert closed and got.startswith(b"HTTP/1.1 408"), (url, got[:200])
        assert b"request_timeout" in got


def test_a_request_head_that_never_ends_is_cut(router):
    sock = connect(router)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert answer_within(sock, READ_TIMEOUT + 6)[0]
    finally:
        sock.close()
    assert httpx.get(router + "/health", headers=AUTH).status_code == 200
