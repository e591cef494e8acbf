"""Issue 45's probe cases on the server's surface, through the real HTTP server: a tool schema
nested 300 levels, lone surrogates in any text field (with and without ``compression``), and
tool calls to tools the request did not declare. Each is a 400 naming the field or, for tool
calls, text that stays in ``content``; the server stays up for the next request."""

from __future__ import annotations

import json

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_server

from lmplug.serve import ServeSettings


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("hostile-surface"), tokenizer=True)


@pytest.fixture(scope="module")
def server(model):
    llm = model.llm(kvcache="contiguous", scheduler={"backend": "continuous", "max_num_seqs": 4})
    # a body limit above the compression bound, so that bound is what refuses the longest prompt
    with running_server(llm, ServeSettings(api_key="", max_body_bytes=4 << 20)) as running:
        yield running


def post(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.v1 + path, content=raw, timeout=120, headers={"Content-Type": "application/json"})


def check_400(resp: httpx.Response, param: str, names: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert names in error["message"], error


def still_up(server) -> None:
    resp = post(server, "/completions", json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode())
    assert resp.status_code == 200, resp.text


def nested_parameters(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("stream", [False, True])
def test_tool_parameters_nested_300_levels_is_a_400(server, stream):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream,
            "tools": [{"type": "function", "function": {"name": "deep", "parameters": nested_parameters(300)}}]}
    check_400(post(server, "/chat/completions", json.dumps(body).encode()), "tools[0].function.parameters",
              "nested")
    still_up(server)


# json.dumps writes "\ud800" as the escape the probe sent; the raw bytes are valid JSON
SURROGATE_BODIES = [
    ("prompt-compression", "/completions",
     {"prompt": "hello \ud800 world", "max_tokens": 2, "compression": "truncate"}, "prompt", "prompt"),
    ("protect-compression", "/completions",
     {"prompt": "hello world", "max_tokens": 2, "compression": {"method": "truncate", "protect": "\udc80"}},
     "compression", "compression.protect"),
    ("chat-compression", "/chat/completions",
     {"messages": [{"role": "user", "content": "a \ud800"}], "max_tokens": 2, "compression": "truncate"},
     "messages", "messages[0].content"),
    ("stop", "/completions", {"prompt": "hello", "max_tokens": 2, "stop": ["x\ud800"]}, "stop", "stop[0]"),
    ("user", "/completions", {"prompt": "hello", "max_tokens": 2, "user": "\udfff"}, "user", "user"),
    ("tool-description", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
      "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
     "tools", "tools[0].function.description"),
    ("key", "/completions", {"prompt": "hello", "max_tokens": 2, "logit_bias": {"\ud800": 1}},
     "logit_bias", "logit_bias (a key)"),
]


@pytest.mark.parametrize("path,body,param,names", [c[1:] for c in SURROGATE_BODIES],
                         ids=[c[0] for c in SURROGATE_BODIES])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param, names):
    raw = json.dumps(body).encode()
    assert b"\\ud" in raw or b"\\ud" in raw.lower()  # the escape JSON allows, as the probe sent it
    check_400(post(server, path, raw), param, names)
    still_up(server)


def test_text_json_allows_is_accepted(server):
    # a surrogate pair written as two escapes is one valid character; NUL and U+FFFF are text too
    raw = b'{"prompt": "a \\ud83d\\ude00 b \\u0000 c \\uffff", "max_tokens": 2, "compression": "truncate"}'
    resp = post(server, "/completions", raw)
    assert resp.status_code == 200, resp.text


# -- prompt compression's bounds (issue 45, item 5) ------------------------------------------------


def test_protect_over_its_bound_is_a_400(server):
    from lmplug.interfaces.compressor import MAX_PROTECT_CHARS
    big = "a" * (MAX_PROTECT_CHARS + 1)
    body = {"prompt": big + " end", "max_tokens": 2, "compression": {"method": "truncate", "protect": big}}
    check_400(post(server, "/completions", json.dumps(body).encode()), "compression.protect",
              f"at most {MAX_PROTECT_CHARS}")
    still_up(server)


def test_prompt_over_the_compression_bound_is_a_400(server):
    from lmplug.compression import MAX_COMPRESS_CHARS
    body = {"prompt": "a" * (MAX_COMPRESS_CHARS + 1), "max_tokens": 2, "compression": "truncate"}
    check_400(post(server, "/completions", json.dumps(body).encode()), "compression",
              f"at most {MAX_COMPRESS_CHARS}")
    still_up(server)


def test_the_probes_overlapping_protect_is_split_exactly():
    # the probe: a 128k-character prompt with a 64k-character protect string (O(N*L) before)
    from lmplug.compression import occurrences, split_text
    text = "a" * 128_000 + "\n\nWhat?"
    segments = split_text(text, ["a" * 64_000], final_question=False)
    assert [(len(s.text), s.protected) for s in segments] == [(128_000, True), (len("\n\nWhat?"), False)]
    assert occurrences("a" * 10, "aaa") == list(range(8))


@pytest.mark.parametrize("seed", range(3))
def test_occurrences_match_a_plain_search(seed):
    import random

    from lmplug.compression import occurrences
    rng = random.Random(seed)
    for _ in range(500):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 40)))
        span = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        assert occurrences(text, span) == [i for i in range(len(text)) if text.startswith(span, i)]


def test_a_cancelled_compression_stops_its_worker_thread():
    # the server cancels the awaiting task when the client leaves (app._unless_disconnected); the
    # worker thread must then stop at its next check instead of scoring on for nobody
    import asyncio
    import threading
    import time

    from lmplug.compression import CompressionCancelled, check_cancelled
    from lmplug.serve import compress

    started, stopped = threading.Event(), threading.Event()

    def endless_scoring() -> None:
        started.set()
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                check_cancelled()  # what EngineScorer does between engine steps
                time.sleep(0.005)
        except CompressionCancelled:
            stopped.set()

    async def leave_early() -> None:
        task = asyncio.ensure_future(compress._run(endless_scoring))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    assert stopped.wait(5), "the compression thread went on after its caller left"
