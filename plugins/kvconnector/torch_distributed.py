"""``torch_distributed``: push a prefill instance's KV blocks to a decode instance
(``kvconnector: {backend: torch_distributed, role: producer|consumer, address: HOST:PORT}``).

Prefill/decode disaggregation over the prefix-hash tier: the producer (the prefill instance) is
handed every full block its paged cache registers (write-through) and sends it to the consumer
(the decode instance), which keeps what arrives in a bounded host-memory store (``HostConnector``,
LRU, ``memory_gb``). When the same prompt reaches the consumer, its prefix blocks are found there
by ``contains``/``get``; a block that has not arrived is simply computed locally, so the decode
side never waits for the peer. The producer's own ``get``/``contains`` find nothing: it computes
its prefixes itself.

Transport: one TCP stream, authenticated. The consumer listens on ``address``; the producer
connects. Both prove a shared secret (``key_file``; else ``secret``, which ``lmplug serve
--role`` sets to the API key; else this user's ``<cache>/kv-peer.key``, made on first use, which
two instances of one user on one host share) by HMAC-SHA256 over two fresh nonces, in both
directions, so the producer never sends blocks to an impostor and the consumer keeps nothing
from one: a connection that does not prove it within ``timeout_s`` is refused, closed and
logged with its address (``refused`` in ``stats``), and the engine goes on. Every later frame
carries a BLAKE2b tag under a key derived from the nonces and its sequence number (nothing can
be injected, replayed or reordered). Then each side sends its ``KVBlockFormat``: a different
model or block layout is a ``ConfigError`` on both sides naming both formats. A peer that does
not appear within ``timeout_s`` is a ``ConfigError`` naming the address. A producer that
reconnects later (a restarted prefill instance) replaces the previous one.

Wire format, one block: a header of ``HEADER_LEN`` int64 (``BLOCK``, the 128-bit key as two
int64 halves, the tensor count, then per tensor its name as 8 ASCII bytes, a dtype code, the
number of dimensions and up to ``MAX_DIMS`` sizes), then every tensor's bytes in that order
(bit-exact for every dtype), in one frame. ``BYE`` ends the stream. A put only enqueues; a
sender thread sends (each send waits at most ``timeout_s``). ``flush`` waits until the consumer
has stored every block put so far: after the queue's blocks the sender sends a numbered
``SYNC``, which the consumer answers with an ``ACK`` once the blocks before it are in its store
(a block in the socket's buffers is not yet at the decode side).
A dead peer is logged once, and every later block is dropped; the consumer's receiver ends
quietly when the producer goes away.

The wire format is ``peer_wire.py``; the authenticated stream ``peer_channel.py``; the
consumer's threads ``peer_consumer.py``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from lmplug_kvconnector.host import HostConnector, HostOptions
from lmplug_kvconnector.peer_channel import MAGIC, NONCE, Channel, mac, make_key_file, recv_exact
from lmplug_kvconnector.peer_consumer import MAX_HANDSHAKES, ConsumerSide
from lmplug_kvconnector.peer_wire import (
    ACK,
    HEADER_LEN,
    SYNC,
    as_bytes,
    describe,
    header_block,
    header_bye,
    header_sync,
)
from pydantic import Field, SecretStr, field_validator

from lmplug.api import BackendOptions, Capabilities, KVBlockFormat, KVConnector
from lmplug.errors import ConfigError
from lmplug.kit.paths import cache_dir

logger = logging.getLogger(__name__)
CLOSE_WAIT_S = 5.0  # close(): the longest wait for each of the consumer's threads to end


class TorchDistributedOptions(BackendOptions):
    role: Literal["producer", "consumer"] = Field(
        description="producer: the prefill instance (sends its blocks); consumer: the decode instance "
                    "(listens on address, keeps the blocks it receives)")
    address: str = Field(description="HOST:PORT of the rendezvous; the consumer listens there")
    timeout_s: float = Field(default=30.0, gt=0, description="longest wait for the peer at start-up, "
                             "for a connection to prove the shared secret, and for one send")
    memory_gb: float = Field(default=4.0, gt=0, description="the consumer's store of received blocks, "
                             "in GiB (LRU beyond it)")
    key_file: str | None = Field(default=None, description="file whose first line is the secret both "
                                 "peers prove (default: `secret`, else this user's <cache>/kv-peer.key)")
    secret: SecretStr | None = Field(default=None, description="the shared secret itself (`lmplug serve "
                                     "--role` sets the API key here); prefer key_file in a config file")

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:29600), got {value!r}")
        return value


class TorchDistributedConnector(ConsumerSide, KVConnector):
    name = "torch_distributed"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=0)
    Options = TorchDistributedOptions

    def __init__(self, options: TorchDistributedOptions) -> None:
        super().__init__(options)
        self.role = options.role
        host, _, port = options.address.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._key = b""
        self._listener: socket.socket | None = None
        self._channel: Channel | None = None  # the producer's stream, or the consumer's current one
        self._ready: queue.Queue[str | None] = queue.Queue()  # the consumer's first peer: None or an error
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._received = HostConnector(HostOptions(memory_gb=options.memory_gb))  # the consumer's blocks
        self._queue: queue.Queue[tuple[int, dict[str, torch.Tensor]] | int | None] = queue.Queue()
        self._syncs = 0  # SYNCs the producer has asked for (their numbers)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._peers: dict[threading.Thread, socket.socket] = {}  # the consumer's connections
        self._peer_gone = False
        self._lock = threading.Lock()
        self._counts = ({"puts": 0, "sent": 0, "dropped": 0, "bytes_sent": 0, "send_us": 0, "syncs": 0}
                        if self.role == "producer" else {"received": 0, "bytes_received": 0, "refused": 0})

    # -- start-up ---------------------------------------------------------------------------------
    def open(self, fmt: KVBlockFormat) -> None:
        super().open(fmt)
        self._key = self._secret()
        if self.role == "producer":
            self._channel = self._connect()
            self._thread = threading.Thread(target=self._send_loop, name="lmplug-kv-producer", daemon=True)
        else:
            self._listen()
            self._thread = threading.Thread(target=self._accept_loop, name="lmplug-kv-consumer", daemon=True)
        self._thread.start()
        if self.role == "consumer":
            try:
                problem = self._ready.get(timeout=self.options.timeout_s)
            except queue.Empty:
                problem = (f"kvconnector: torch_distributed (consumer): no producer proved the shared secret "
                           f"at {self.options.address} within {self.options.timeout_s:g} s (timeout_s)")
            if problem is not None:
                self.close()
                raise ConfigError(problem)

    def _secret(self) -> bytes:
        """The shared secret: ``key_file``, else ``secret``, else this user's default key file."""
        if self.options.key_file is None and self.options.secret is not None:
            return self.options.secret.get_secret_value().encode()
        path = Path(self.options.key_file).expanduser() if self.options.key_file else cache_dir() / "kv-peer.key"
        try:
            if self.options.key_file is None:
                make_key_file(path)
            key = path.read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"kvconnector.key_file: cannot read the shared secret from {str(path)!r} "
                              f"({type(exc).__name__}: {exc})") from None
        if not key or not key[0].strip():
            raise ConfigError(f"kvconnector.key_file: {str(path)!r} is empty; expected the shared secret "
                              "on its first line")
        return key[0].strip().encode()

    def _connect(self) -> Channel:
        """The producer: connect (retrying until ``timeout_s``), prove the secret, check formats."""
        deadline = time.monotonic() + self.options.timeout_s
        while True:
            try:
                sock = socket.create_connection((self._host, self._port),
                                                timeout=max(deadline - time.monotonic(), 0.1))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"kvconnector: torch_distributed (producer): could not reach the consumer "
                                      f"at {self.options.address} within {self.options.timeout_s:g} s "
                                      f"(timeout_s) ({type(exc).__name__}: {exc})") from None
                time.sleep(0.1)
        sock.settimeout(self.options.timeout_s)
        try:
            challenge = recv_exact(sock, len(MAGIC) + NONCE)
            if challenge[:len(MAGIC)] != MAGIC:
                raise ConfigError(f"kvconnector: torch_distributed (producer): {self.options.address} is not "
                                  "a torch_distributed consumer (no greeting)")
            theirs, mine = challenge[len(MAGIC):], secrets.token_bytes(NONCE)
            sock.sendall(MAGIC + mine + mac(self._key, b"producer", theirs, mine))
            try:
                proof = recv_exact(sock, 32)
            except ConnectionError:
                raise ConfigError(f"kvconnector: torch_distributed (producer): the consumer at "
                                  f"{self.options.address} refused this instance's shared secret; give both "
                                  "the same API key or kvconnector.key_file") from None
            if not hmac.compare_digest(proof, mac(self._key, b"consumer", theirs, mine)):
                raise ConfigError(f"kvconnector: torch_distributed (producer): the peer at {self.options.address} "
                                  "did not prove the shared secret; refusing to send it KV blocks")
            channel = Channel(sock, mac(self._key, b"session", theirs, mine), sending=b"P", receiving=b"C")
            channel.send(json.dumps(describe(self.format)).encode())
            self._check_formats(json.loads(channel.recv(1 << 16)))
        except (OSError, ValueError) as exc:
            sock.close()
            raise ConfigError(f"kvconnector: torch_distributed (producer): the connection to the consumer at "
                              f"{self.options.address} failed while starting ({type(exc).__name__}: {exc})") from None
        except ConfigError:
            sock.close()
            raise
        sock.settimeout(self.options.timeout_s)
        return channel

    def _check_formats(self, peer: dict) -> None:
        if peer == describe(self.format):
            return
        producer, consumer = ((describe(self.format), peer) if self.role == "producer"
                              else (peer, describe(self.format)))
        raise ConfigError(
            f"kvconnector: torch_distributed at {self.options.address}: the producer and the consumer "
            f"hold KV blocks of different formats (model or block layout differ): producer "
            f"model={producer.get('model')!r} layout={producer.get('layout')!r}; consumer "
            f"model={consumer.get('model')!r} layout={consumer.get('layout')!r}; serve the same model with "
            "the same dtype and kvcache options on both")

    # -- the KVConnector contract -------------------------------------------------------------
    def put(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        if self.role != "producer" or self._thread is None:
            return
        with self._lock:
            self._counts["puts"] += 1
        self._queue.put((key, payload))

    def get(self, key: int) -> dict[str, torch.Tensor] | None:
        return self._received.get(key) if self.role == "consumer" else None

    def contains(self, key: int) -> bool:
        return self.role == "consumer" and self._received.contains(key)

    def flush(self) -> None:
        """The producer: wait until the consumer has stored (or this side dropped) every block
        put so far: the blocks, then a SYNC the consumer answers once they are in its store."""
        if self.role != "producer" or self._thread is None or self._closing:
            return
        with self._lock:
            self._syncs += 1
            self._queue.put(self._syncs)
        self._queue.join()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.role == "producer" and self._thread is not None:
            self._queue.put(None)  # after every block: the sender says BYE and ends
            self._queue.join()
            self._thread.join(self.options.timeout_s)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
            with contextlib.suppress(OSError):
                self._listener.close()
        if self._channel is not None:
            self._channel.close()  # ends a receive in progress
        if self.role == "consumer":
            if self._thread is not None:
                self._thread.join(CLOSE_WAIT_S)
            self._stop_peers(CLOSE_WAIT_S)

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        if self.role == "consumer":  # what the engine found in the received store
            host = self._received.stats()
            counts.update({name: host[name] for name in ("hits", "misses", "evictions", "blocks", "bytes")})
        return counts

    # -- the producer's sender thread -------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:  # the end, whether or not the consumer still listens
                    if not self._peer_gone:
                        with contextlib.suppress(OSError):
                            self._channel.send(header_bye().numpy().tobytes())
                    self._channel.close()
                    return
                if self._peer_gone:
                    self._count(dropped=0 if isinstance(item, int) else 1)
                    continue
                if isinstance(item, int):
                    self._sync(item)
                else:
                    self._send_block(*item)
            except (OSError, ValueError) as exc:  # connection closed by the peer, timeout, a bad answer
                self._peer_gone = True
                self._count(dropped=0 if item is None or isinstance(item, int) else 1)
                logger.warning("kvconnector torch_distributed: the consumer at %s is gone (%s: %s); "
                               "dropping this and every later block (the decode instance computes them)",
                               self.options.address, type(exc).__name__, exc)
            finally:
                self._queue.task_done()

    def _sync(self, seq: int) -> None:
        """Send SYNC ``seq``; return when its ACK is back (the blocks before it are stored)."""
        if self._channel.closed_by_peer():
            raise ConnectionError("the consumer closed the connection")
        self._channel.send(header_sync(SYNC, seq).numpy().tobytes())
        answer = self._channel.recv(HEADER_LEN * 8)  # waits at most timeout_s (the socket's timeout)
        values = torch.frombuffer(answer, dtype=torch.int64, count=HEADER_LEN).tolist() \
            if len(answer) == HEADER_LEN * 8 else []
        if values[:2] != [ACK, seq]:
            raise ValueError(f"expected the consumer's ACK {seq}, got {values[:2] or len(answer)}")
        self._count(syncs=1)

    def _send_block(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        try:
            header = header_block(key, payload)
        except ValueError as exc:
            logger.warning("kvconnector torch_distributed: block %032x not sent: %s", key, exc)
            self._count(dropped=1)
            return
        if self._channel.closed_by_peer():  # the consumer sends only ACKs (read at once): readable = its end
            raise ConnectionError("the consumer closed the connection")
        started = time.perf_counter()
        data = torch.cat([as_bytes(t) for t in payload.values()]) if payload else torch.empty(0, dtype=torch.uint8)
        self._channel.send(header.numpy().tobytes(), memoryview(data.numpy()))
        self._count(sent=1, bytes_sent=data.numel(), send_us=int((time.perf_counter() - started) * 1e6))

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount
