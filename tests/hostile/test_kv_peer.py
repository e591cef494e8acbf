"""The prefill/decode KV channel against strangers (issue 45, item 8): the decode instance's
``--kv-peer`` port takes blocks only from a producer that proves the shared secret. A local
connection that sends nothing, garbage, a wrong proof, or a real connector with another key is
refused and logged with its address, and the engine keeps serving: its answers equal a plain
engine's and the blocks of the real producer still arrive and are used."""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import socket
import threading
import time

import pytest
from lmplug_kvconnector.torch_distributed import (
    MAGIC,
    TorchDistributedConnector,
    TorchDistributedOptions,
)
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture

from lmplug import LLM, SamplingParams
from lmplug.api import KVBlockFormat
from lmplug.errors import ConfigError
from lmplug.testing.kvconnector import block_payload, same_bits

TIMEOUT_S = 5.0
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FMT = KVBlockFormat("tiny:abc", "paged bs=4 float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key_file(tmp_path, name: str, secret: str):
    path = tmp_path / name
    path.write_text(secret + "\n")
    return str(path)


def options(role: str, address: str, key: str, **extra) -> TorchDistributedOptions:
    return TorchDistributedOptions(role=role, address=address, key_file=key, timeout_s=TIMEOUT_S, **extra)


def pair(tmp_path) -> tuple[TorchDistributedConnector, TorchDistributedConnector, str]:
    """A consumer and a producer with the same key file, opened together (consumer, producer, address)."""
    address, key = f"127.0.0.1:{free_port()}", key_file(tmp_path, "key", "s3cret")
    consumer = TorchDistributedConnector(options("consumer", address, key))
    opening = threading.Thread(target=consumer.open, args=(FMT,))
    opening.start()
    producer = TorchDistributedConnector(options("producer", address, key))
    producer.open(FMT)
    opening.join(TIMEOUT_S + 5)
    return consumer, producer, address


def strangers(address: str, wrong_key: str) -> list[str]:
    """Local connections without the secret; each returns how the consumer answered."""
    host, port = address.rsplit(":", 1)
    outcomes = []

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=TIMEOUT_S + 5)

    def closed(sock: socket.socket) -> str:
        sock.settimeout(TIMEOUT_S + 5)
        try:
            while sock.recv(4096):
                pass
        except (ConnectionResetError, TimeoutError):
            pass
        sock.close()
        return "closed"

    with connect() as silent:  # says nothing: refused when the handshake time is up
        outcomes.append(closed(silent))
    with connect() as noisy:
        noisy.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 200)
        outcomes.append(closed(noisy))
    with connect() as guesser:  # the protocol, a made-up proof
        challenge = guesser.recv(len(MAGIC) + 32)
        fake = hmac.new(b"guess", b"producer" + challenge[len(MAGIC):] + b"n" * 32, hashlib.sha256).digest()
        guesser.sendall(MAGIC + b"n" * 32 + fake)
        outcomes.append(closed(guesser))
    impostor = TorchDistributedConnector(TorchDistributedOptions(role="producer", address=address,
                                                                 key_file=wrong_key, timeout_s=TIMEOUT_S))
    with pytest.raises(ConfigError, match="refused this instance's shared secret"):
        impostor.open(FMT)
    outcomes.append("refused")
    return outcomes


def test_strangers_are_refused_and_the_stream_goes_on(tmp_path, caplog):
    consumer, producer, address = pair(tmp_path)
    rng = random.Random(0)
    before = {rng.getrandbits(128): block_payload("float32", rng) for _ in range(3)}
    after = {rng.getrandbits(128): block_payload("float32", rng) for _ in range(3)}
    try:
        for key, payload in before.items():
            producer.put(key, payload)
        producer.flush()
        with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.torch_distributed"):
            assert strangers(address, key_file(tmp_path, "wrong", "not-the-secret")) == ["closed"] * 3 + ["refused"]
            # the listener logs a refusal after the stranger sees its socket close: wait for the last
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sum(
                    "refused a connection from 127.0.0.1:" in r.getMessage() for r in caplog.records) < 4:
                time.sleep(0.05)
        refusals = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1:" in r.getMessage()]
        assert len(refusals) == 4 and consumer.stats()["refused"] == 4, refusals
        for key, payload in after.items():
            producer.put(key, payload)
        producer.flush()
        deadline = time.monotonic() + 30
        while not all(consumer.contains(k) for k in after) and time.monotonic() < deadline:
            time.sleep(0.05)
        for key, payload in {**before, **after}.items():
            assert same_bits(payload, consumer.get(key)) is None, f"block {key:032x}"
        assert consumer.stats()["received"] == 6
    finally:
        producer.close()
        consumer.close()


def test_a_listener_without_the_key_gets_no_blocks(tmp_path):
    """The producer checks the consumer's proof too: a stranger listening on the peer's address
    (it speaks the protocol but cannot prove the key) is refused before any format or block."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    heard: list[bytes] = []

    def impostor() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.sendall(MAGIC + b"c" * 32)
            heard.append(sock.recv(len(MAGIC) + 64))
            sock.sendall(b"x" * 32)  # not the proof
            sock.settimeout(5)
            try:
                while chunk := sock.recv(65536):
                    heard.append(chunk)
            except (ConnectionResetError, TimeoutError):
                pass

    thread = threading.Thread(target=impostor)
    thread.start()
    producer = TorchDistributedConnector(options("producer", address, key_file(tmp_path, "k", "our key")))
    with pytest.raises(ConfigError, match="did not prove the shared secret"):
        producer.open(FMT)
    thread.join(10)
    listener.close()
    assert len(heard) == 1, "the producer sent something after the impostor's failed proof"


def test_an_empty_or_missing_key_file_is_a_config_error(tmp_path):
    for path in (key_file(tmp_path, "empty", ""), str(tmp_path / "missing")):
        connector = TorchDistributedConnector(options("consumer", f"127.0.0.1:{free_port()}", path))
        with pytest.raises(ConfigError, match="kvconnector.key_file"):
            connector.open(FMT)


@pytest.mark.slow
def test_the_decode_engine_keeps_serving_beside_strangers(tmp_path):
    """A prefill and a decode engine (in threads of this process) over an authenticated channel;
    strangers knock on the decode side's port; the decode engine still answers as a plain engine
    does, from the prefill side's blocks."""
    model = get_model("llama", tmp_path / "m").path
    address, key = f"127.0.0.1:{free_port()}", key_file(tmp_path, "key", "pd-secret")
    kv = {"backend": "paged", "block_size": 4, "num_blocks": 64, "prefix_caching": True}
    engines: dict[str, LLM] = {}

    def build(role: str) -> None:
        engines[role] = LLM(str(model), dtype="float32", device="cpu", max_model_len=64, kvcache=kv,
                            kvconnector={"backend": "torch_distributed", "role": role, "address": address,
                                         "key_file": key, "timeout_s": 60})

    builders = [threading.Thread(target=build, args=(role,)) for role in ("consumer", "producer")]
    for b in builders:
        b.start()
    for b in builders:
        b.join(120)
    prefill, decode = engines["producer"], engines["consumer"]
    prompts = [prompt_ids(n, seed) for n, seed in ((21, 1), (26, 2))]
    try:
        with LLM(str(model), dtype="float32", device="cpu", max_model_len=64) as plain:
            want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
        assert strangers(address, key_file(tmp_path, "wrong", "nope")) == ["closed"] * 3 + ["refused"]
        prefill.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
        prefill.engine.kv.tier.connector.flush()
        connector = decode.engine.kv.tier.connector
        deadline = time.monotonic() + 30
        while connector.stats()["received"] < 9 and time.monotonic() < deadline:  # 5 + 6 full blocks, less the last
            time.sleep(0.05)
        got = [o.outputs[0].token_ids for o in decode.generate(prompts, GREEDY)]
        assert got == want
        assert connector.stats()["hits"] > 0 and connector.stats()["refused"] == 4
    finally:
        prefill.close()
        decode.close()
