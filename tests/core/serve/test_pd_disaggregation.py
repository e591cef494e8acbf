"""Prefill/decode disaggregation: the ``torch_distributed`` KV connector between two processes
(bit-exact blocks, format mismatch, unreachable peer, dead peer), and prefill + decode instances
(real ``lmplug serve --role`` processes) behind the router, whose answers must equal a single
engine's while the decode instance really loads the prompt blocks the prefill instance pushed."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from lmplug_kvconnector.torch_distributed import TorchDistributedConnector, TorchDistributedOptions
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_router, running_server

from lmplug import LLM
from lmplug.api import KVBlockFormat
from lmplug.errors import ConfigError
from lmplug.serve import ServeSettings
from lmplug.serve.roles import _strip_flags, with_role
from lmplug.serve.router import RouterSettings, prefill_body

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256"]
TIMEOUT_S = 60.0  # a spawned process imports torch: slow on a busy machine
TEXT = ("the quick brown fox jumps over the lazy dog, then the dog sleeps and the fox runs to the "
        "river where a heron waits in the reeds; ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- (a) the connector alone, producer and consumer in two processes ----------------------------


def make_blocks(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Blocks of several dtypes, keys over the whole 128-bit range (high bit set included)."""
    g = torch.Generator().manual_seed(seed)
    keys = [0, 1, 2**63, 2**64 - 1, 2**127 + 12345, 2**128 - 1] + \
        [int.from_bytes(torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8).numpy().tobytes(), "little")
         for _ in range(10)]
    blocks = {}
    for i, key in enumerate(keys):
        kv = torch.randn(2, 2, 4, 2, 8, generator=g)
        kind = i % 4
        if kind == 0:
            payload = {"kv": kv}
        elif kind == 1:
            payload = {"kv": kv.to(torch.bfloat16), "scales": torch.rand(2, 2, 4, 2, generator=g)}
        elif kind == 2:  # an fp8 pool's byte view, and a tensor that is not contiguous
            payload = {"kv": torch.randint(0, 256, (2, 2, 4, 2, 8), generator=g, dtype=torch.uint8),
                       "scales": torch.randn(2, 4, 2, generator=g).transpose(0, 1)}
        else:  # an odd byte count before a float32: the receiver's buffer offset is unaligned
            payload = {"a": torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8),
                       "kv": kv.to(torch.float16), "z": torch.randn(5, generator=g)}
        blocks[key] = payload
    return blocks


def raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as plain data (a tensor in a multiprocessing queue would be shared memory that
    dies with its process): dtype, shape and its bytes in row-major order."""
    return str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _consumer_process(address: str, layout: str, expected: list[int], out, flushed=None) -> None:
    """The decode side in its own process: open, wait for ``expected`` keys, report them, exit.
    With ``flushed`` (an event the producer sets after its ``flush``) it looks once, after it."""
    torch.set_num_threads(1)
    connector = TorchDistributedConnector(TorchDistributedOptions(role="consumer", address=address,
                                                                  timeout_s=TIMEOUT_S))
    try:
        connector.open(KVBlockFormat("tiny-model@abc", layout))
    except ConfigError as exc:
        out.put(("config_error", str(exc)))
        return
    deadline = time.monotonic() + TIMEOUT_S
    if flushed is not None:
        flushed.wait(TIMEOUT_S)
    while flushed is None and not all(connector.contains(k) for k in expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    got = {key: connector.get(key) for key in expected}
    out.put(("received", {key: None if p is None else {name: raw(t) for name, t in p.items()}
                          for key, p in got.items()}, connector.stats()))
    connector.close()


@contextlib.contextmanager
def consumer_process(layout: str, expected: list[int], flushed=None) -> Iterator[tuple[str, object, object]]:
    """(address, result queue, process) of a consumer started with ``spawn``; the producer is
    this process."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    process = ctx.Process(target=_consumer_process, args=(address, layout, expected, out, flushed))
    process.start()
    try:
        yield address, out, process
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def producer(address: str, layout: str) -> TorchDistributedConnector:
    connector = TorchDistributedConnector(TorchDistributedOptions(role="producer", address=address,
                                                                  timeout_s=TIMEOUT_S))
    connector.open(KVBlockFormat("tiny-model@abc", layout))
    return connector


def test_blocks_arrive_bit_exact_and_a_dead_peer_never_raises():
    sent = make_blocks(0)
    with consumer_process("paged bs=4 float32", list(sent)) as (address, out, process):
        connector = producer(address, "paged bs=4 float32")
        for key, payload in sent.items():
            connector.put(key, payload)
        connector.flush()
        what, got, consumer_stats = out.get(timeout=TIMEOUT_S + 30)
        process.join(30)
    assert what == "received" and process.exitcode == 0
    assert set(got) == set(sent)
    for key, payload in sent.items():
        assert got[key] is not None, f"block {key:032x} missing"
        assert set(got[key]) == set(payload)
        for name, tensor in payload.items():
            assert got[key][name] == raw(tensor), (key, name)
    stats = connector.stats()
    assert stats["sent"] == stats["puts"] == consumer_stats["received"] == len(sent)
    assert stats["bytes_sent"] == consumer_stats["bytes_received"] == sum(
        t.numel() * t.element_size() for p in sent.values() for t in p.values())
    assert connector.get(next(iter(sent))) is None and not connector.contains(next(iter(sent)))
    # the consumer has exited: later blocks are dropped (logged once), nothing raises, flush returns
    for key, payload in make_blocks(1).items():
        connector.put(key, payload)
    connector.flush()
    connector.close()
    assert connector.stats()["dropped"] == len(make_blocks(1))


def test_after_flush_the_consumer_holds_every_block():
    """``flush`` returns once the consumer has stored the blocks, not when they are in the
    socket's buffers: the prefill instance answers after it, and the router sends the request to
    the decode instance at once (a block still on the wire was a prefix-cache miss there)."""
    sent = {key: {"kv": torch.randn(64, 1024)} for key in range(1, 41)}  # 256 KiB a block
    flushed = multiprocessing.get_context("spawn").Event()
    with consumer_process("paged bs=4 float32", list(sent), flushed) as (address, out, _):
        connector = producer(address, "paged bs=4 float32")
        for key, payload in sent.items():
            connector.put(key, payload)
        connector.flush()
        flushed.set()
        what, got, consumer_stats = out.get(timeout=TIMEOUT_S + 30)
        connector.close()
    assert what == "received" and [key for key, p in got.items() if p is None] == []
    assert consumer_stats["received"] == len(sent) and connector.stats()["syncs"] == 1


def test_format_mismatch_is_a_config_error_on_both_sides():
    mine, theirs = "paged bs=16 layers=2 float32", "paged bs=32 layers=2 float32"
    with consumer_process(theirs, []) as (address, out, _):
        with pytest.raises(ConfigError) as producer_error:
            producer(address, mine)
        what, consumer_message = out.get(timeout=TIMEOUT_S + 30)
    assert what == "config_error"
    for message in (str(producer_error.value), consumer_message):
        assert mine in message and theirs in message



@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_unreachable_peer_is_a_config_error_within_the_timeout(role):
    address = f"127.0.0.1:{free_port()}"
    connector = TorchDistributedConnector(TorchDistributedOptions(role=role, address=address, timeout_s=2))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=address.replace(".", r"\.")):
        connector.open(KVBlockFormat("m", "l"))
    assert time.monotonic() - started < 2 + 8  # the store client retries once after its timeout


def test_options_and_the_prefill_copy_of_a_request():
    with pytest.raises(ValueError, match="HOST:PORT"):
        TorchDistributedOptions(role="producer", address="localhost")
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": 3, "logprobs": 2,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "seed": 3, "temperature": 0.5}
    assert prefill_body(body) == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "seed": 3,
                                  "temperature": 0.5}
    overrides = with_role({"kvcache": {"block_size": 32}, "kvconnector": {"timeout_s": 5}}, "decode", "h:1")
    assert overrides["kvcache"] == {"block_size": 32, "backend": "paged", "prefix_caching": True}
    assert overrides["kvconnector"] == {"timeout_s": 5, "backend": "torch_distributed", "role": "consumer",
                                        "address": "h:1"}
    assert _strip_flags(["m", "--role", "pd", "--port=8000", "--dtype", "float32"], ("--role", "--port")) == \
        ["m", "--dtype", "float32"]


# -- (b) prefill + decode + router, end to end --------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    src = get_model("llama", tmp_path_factory.mktemp("tiny"), tokenizer=True).path
    dst = tmp_path_factory.mktemp("pd") / "tiny-chat"
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return dst


def start_instance(model_dir, role: str, peer: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.pop("LMPLUG_API_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "lmplug.cli", "serve", str(model_dir), "--role", role,
                             "--kv-peer", peer, "--port", str(port), *ENGINE_FLAGS], env=env)


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: the instance exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy after {limit_s} s")


@pytest.fixture(scope="module")
def pd(model_dir):
    """The decode and prefill instances as ``lmplug serve --role`` processes."""
    peer, ports = f"127.0.0.1:{free_port()}", {"decode": free_port(), "prefill": free_port()}
    procs = {role: start_instance(model_dir, role, peer, port) for role, port in ports.items()}
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    try:
        for role, proc in procs.items():
            wait_healthy(urls[role], proc)
        yield urls
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def single(model_dir):
    """The reference: one ordinary engine (no prefix caching, no connector) behind the server."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=256)
    with running_server(llm, ServeSettings(api_key="")) as running:
        yield running.url


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not in {url}/metrics"
    return values[0]


def answer(url: str, path: str, body: dict, headers: dict | None = None) -> str:
    """The answer's text; a stream's deltas joined."""
    if not body.get("stream"):
        response = httpx.post(url + path, json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    parts = []
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


CASES = [
    ("/v1/completions", {"prompt": TEXT, "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": "seeded: " + TEXT, "max_tokens": 12, "temperature": 0.9, "seed": 7}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "stream " + TEXT}],
                              "max_tokens": 10, "temperature": 0, "stream": True}),
]


def test_router_answers_equal_a_single_engine_and_decode_loads_pushed_blocks(pd, single):
    received_before = metric(pd["decode"], "lmplug_kvconnector_received")
    with running_router(RouterSettings(pd["decode"], pd["prefill"])) as router:
        for path, body in CASES:
            assert answer(router, path, body) == answer(single, path, {**body, "stream": False}), (path, body)
        models = httpx.get(router + "/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"]
        health = httpx.get(router + "/health", timeout=10).json()
        assert health == {"status": "ok", "decode": "ok", "prefill": "ok"}
    assert metric(pd["prefill"], "lmplug_kvconnector_sent") >= 3 * 5  # each prompt: > 80 tokens, 16 a block
    assert metric(pd["decode"], "lmplug_kvconnector_received") - received_before >= 3 * 5
    assert metric(pd["decode"], "lmplug_kvconnector_hits") >= 3 * 5  # the decode engine loaded them


def test_prefill_down_decode_computes_the_prompt(pd, single, caplog):
    body = {"prompt": "prefill is down: " + TEXT, "max_tokens": 8, "temperature": 0}
    hits_before = metric(pd["decode"], "lmplug_kvconnector_hits")
    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="lmplug.serve.router"), \
            running_router(RouterSettings(pd["decode"], dead, prefill_timeout_s=5)) as router:
        text = answer(router, "/v1/completions", body, headers={"X-Request-Id": "req-prefill-down"})
    assert text == answer(single, "/v1/completions", body)
    assert metric(pd["decode"], "lmplug_kvconnector_hits") == hits_before  # nothing came from the peer
    assert any("req-prefill-down" in r.getMessage() and "prefill" in r.getMessage() for r in caplog.records)


def test_decode_down_is_an_openai_error():
    with running_router(RouterSettings(f"http://127.0.0.1:{free_port()}", None)) as router:
        response = httpx.post(router + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "decode_unavailable"


@pytest.mark.slow
def test_role_pd_serves_through_one_endpoint(model_dir, single):
    """``lmplug serve --role pd``: both instances as children of the router's process, stopped with it."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.pop("LMPLUG_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "lmplug.cli", "serve", str(model_dir), "--role", "pd",
                             "--port", str(port), *ENGINE_FLAGS], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, limit_s=180)
        children = children_of(proc.pid)
        assert len(children) == 2
        body = {"prompt": "pd: " + TEXT, "max_tokens": 8, "temperature": 0}
        assert answer(url, "/v1/completions", body) == answer(single, "/v1/completions", body)
    finally:
        proc.terminate()
        code = proc.wait(90)
    assert code == 128 + 15  # SIGTERM: a graceful shutdown of the router, then of the children
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], \
        "the prefill / decode children outlived the router"


def children_of(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(entry))
    return out
