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
sender thread sends (each send waits at most ``timeout_s``) and ``flush`` waits for the queue.
A dead peer is logged once, and every later block is dropped; the consumer's receiver ends
quietly when the producer goes away.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from lmplug_kvconnector.host import HostConnector, HostOptions
from pydantic import Field, SecretStr, field_validator

from lmplug.api import BackendOptions, Capabilities, KVBlockFormat, KVConnector
from lmplug.errors import ConfigError
from lmplug.kit.paths import cache_dir

logger = logging.getLogger(__name__)

BYE, BLOCK = 0, 1  # header[0]
MAX_TENSORS, MAX_DIMS = 4, 8
_PER_TENSOR = 3 + MAX_DIMS  # name, dtype code, ndim, sizes
HEADER_LEN = 4 + MAX_TENSORS * _PER_TENSOR
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.float64, torch.bool)
_MASK64 = (1 << 64) - 1
MAGIC = b"LMPKVP1\n"
_NONCE = 32
_TAG = 16
_LENGTH = struct.Struct("<Q")
MAX_HANDSHAKES = 4  # connections proving the secret at once; more are refused at once
_LOUD_REFUSALS = 10  # refusals logged at WARNING; later ones at DEBUG


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


class TorchDistributedConnector(KVConnector):
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
        self._channel: _Channel | None = None  # the producer's stream, or the consumer's current one
        self._ready: queue.Queue[str | None] = queue.Queue()  # the consumer's first peer: None or an error
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._received = HostConnector(HostOptions(memory_gb=options.memory_gb))  # the consumer's blocks
        self._queue: queue.Queue[tuple[int, dict[str, torch.Tensor]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._peer_gone = False
        self._lock = threading.Lock()
        self._counts = ({"puts": 0, "sent": 0, "dropped": 0, "bytes_sent": 0, "send_us": 0}
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
                _make_key_file(path)
            key = path.read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"kvconnector.key_file: cannot read the shared secret from {str(path)!r} "
                              f"({type(exc).__name__}: {exc})") from None
        if not key or not key[0].strip():
            raise ConfigError(f"kvconnector.key_file: {str(path)!r} is empty; expected the shared secret "
                              "on its first line")
        return key[0].strip().encode()

    def _connect(self) -> _Channel:
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
            challenge = _recv_exact(sock, len(MAGIC) + _NONCE)
            if challenge[:len(MAGIC)] != MAGIC:
                raise ConfigError(f"kvconnector: torch_distributed (producer): {self.options.address} is not "
                                  "a torch_distributed consumer (no greeting)")
            theirs, mine = challenge[len(MAGIC):], secrets.token_bytes(_NONCE)
            sock.sendall(MAGIC + mine + _mac(self._key, b"producer", theirs, mine))
            try:
                proof = _recv_exact(sock, 32)
            except ConnectionError:
                raise ConfigError(f"kvconnector: torch_distributed (producer): the consumer at "
                                  f"{self.options.address} refused this instance's shared secret; give both "
                                  "the same API key or kvconnector.key_file") from None
            if not hmac.compare_digest(proof, _mac(self._key, b"consumer", theirs, mine)):
                raise ConfigError(f"kvconnector: torch_distributed (producer): the peer at {self.options.address} "
                                  "did not prove the shared secret; refusing to send it KV blocks")
            channel = _Channel(sock, _mac(self._key, b"session", theirs, mine), sending=b"P", receiving=b"C")
            channel.send(json.dumps(_describe(self.format)).encode())
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
        if peer == _describe(self.format):
            return
        producer, consumer = ((_describe(self.format), peer) if self.role == "producer"
                              else (peer, _describe(self.format)))
        raise ConfigError(
            f"kvconnector: torch_distributed at {self.options.address}: the producer and the consumer "
            f"hold KV blocks of different formats (model or block layout differ): producer "
            f"model={producer.get('model')!r} layout={producer.get('layout')!r}; consumer "
            f"model={consumer.get('model')!r} layout={consumer.get('layout')!r}; serve the same model with "
            "the same dtype and kvcache options on both")

    def _listen(self) -> None:
        try:
            listener = socket.create_server((self._host, self._port), family=_family(self._host), backlog=16)
        except OSError as exc:
            raise ConfigError(f"kvconnector: torch_distributed (consumer): could not listen on "
                              f"{self.options.address} ({type(exc).__name__}: {exc})") from None
        self._listener = listener

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
        if self.role == "producer" and self._thread is not None:
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
                if item is None:
                    if not self._peer_gone:
                        self._channel.send(_header_bye().numpy().tobytes())
                    self._channel.close()
                    return
                if self._peer_gone:
                    self._count(dropped=1)
                    continue
                self._send_block(*item)
            except OSError as exc:  # connection closed by the peer, timeout
                self._peer_gone = True
                self._count(dropped=0 if item is None else 1)
                logger.warning("kvconnector torch_distributed: the consumer at %s is gone (%s: %s); "
                               "dropping this and every later block (the decode instance computes them)",
                               self.options.address, type(exc).__name__, exc)
            finally:
                self._queue.task_done()

    def _send_block(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        try:
            header = _header_block(key, payload)
        except ValueError as exc:
            logger.warning("kvconnector torch_distributed: block %032x not sent: %s", key, exc)
            self._count(dropped=1)
            return
        if self._channel.closed_by_peer():  # the consumer sends nothing after the formats: this is its end
            raise ConnectionError("the consumer closed the connection")
        started = time.perf_counter()
        data = torch.cat([_as_bytes(t) for t in payload.values()]) if payload else torch.empty(0, dtype=torch.uint8)
        self._channel.send(header.numpy().tobytes(), memoryview(data.numpy()))
        self._count(sent=1, bytes_sent=data.numel(), send_us=int((time.perf_counter() - started) * 1e6))

    # -- the consumer: accepting, proving, receiving ----------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was closed
            if not self._handshakes.acquire(blocking=False):
                self._refuse(sock, peer, f"more than {MAX_HANDSHAKES} connections proving the secret at once")
                continue
            threading.Thread(target=self._serve_peer, args=(sock, peer), name="lmplug-kv-peer", daemon=True).start()

    def _serve_peer(self, sock: socket.socket, peer: tuple) -> None:
        try:
            channel = self._prove(sock, peer)
        finally:
            self._handshakes.release()
        if channel is None:
            return
        try:
            channel.send(json.dumps(_describe(self.format)).encode())
            try:
                self._check_formats(json.loads(channel.recv(1 << 16)))
            except ConfigError as exc:
                logger.error("%s", exc)
                self._ready.put(str(exc))
                channel.close()
                return
        except (OSError, ValueError) as exc:
            self._refuse(sock, peer, f"broke off after proving the secret ({type(exc).__name__}: {exc})")
            return
        sock.settimeout(None)  # blocks come as long as the producer lives
        previous, self._channel = self._channel, channel
        if previous is not None:
            logger.info("kvconnector torch_distributed: a producer from %s replaces the previous one", _addr(peer))
            previous.close()
        self._ready.put(None)
        self._receive_loop(channel)

    def _prove(self, sock: socket.socket, peer: tuple) -> _Channel | None:
        """The producer's proof of the secret, then ours; ``None`` (refused, logged) otherwise."""
        sock.settimeout(self.options.timeout_s)
        mine = secrets.token_bytes(_NONCE)
        try:
            sock.sendall(MAGIC + mine)
            answer = _recv_exact(sock, len(MAGIC) + _NONCE + 32)
        except (OSError, ConnectionError) as exc:
            self._refuse(sock, peer, f"no proof of the shared secret within {self.options.timeout_s:g} s "
                         f"({type(exc).__name__})")
            return None
        theirs, proof = answer[len(MAGIC):len(MAGIC) + _NONCE], answer[len(MAGIC) + _NONCE:]
        if answer[:len(MAGIC)] != MAGIC or not hmac.compare_digest(proof, _mac(self._key, b"producer", mine, theirs)):
            self._refuse(sock, peer, "it did not prove the shared secret (a wrong or missing key)")
            return None
        try:
            sock.sendall(_mac(self._key, b"consumer", mine, theirs))
        except OSError as exc:
            self._refuse(sock, peer, f"gone after proving the secret ({type(exc).__name__})")
            return None
        return _Channel(sock, _mac(self._key, b"session", mine, theirs), sending=b"C", receiving=b"P")

    def _refuse(self, sock: socket.socket, peer: tuple, why: str) -> None:
        with contextlib.suppress(OSError):
            sock.close()
        with self._lock:
            self._counts["refused"] += 1
            loud = self._counts["refused"] <= _LOUD_REFUSALS
        logger.log(logging.WARNING if loud else logging.DEBUG,
                   "kvconnector torch_distributed: refused a connection from %s to %s: %s%s", _addr(peer),
                   self.options.address, why, " (further refusals are logged at DEBUG)"
                   if loud and self._counts["refused"] == _LOUD_REFUSALS else "")

    def _receive_loop(self, channel: _Channel) -> None:
        limit = HEADER_LEN * 8 + int(self.options.memory_gb * 2**30)
        try:
            while True:
                frame = channel.recv(limit)
                if len(frame) < HEADER_LEN * 8:
                    raise ValueError(f"a frame of {len(frame)} bytes is shorter than a block header")
                header = torch.frombuffer(frame, dtype=torch.int64, count=HEADER_LEN)
                if int(header[0]) == BYE:
                    logger.info("kvconnector torch_distributed: the producer closed the stream")
                    return
                key, specs = _parse_header(header)
                sizes = [_nbytes(dtype, shape) for _, dtype, shape in specs]
                body = len(frame) - HEADER_LEN * 8
                if sum(sizes) != body:
                    raise ValueError(f"the header lists {sum(sizes)} bytes, the frame holds {body}")
                data = (torch.frombuffer(frame, dtype=torch.uint8, offset=HEADER_LEN * 8) if body
                        else torch.empty(0, dtype=torch.uint8))
                parts = data.split(sizes)
                self._received.put(key, {name: _typed(part, dtype, shape)
                                         for (name, dtype, shape), part in zip(specs, parts)})
                self._count(received=1, bytes_received=data.numel())
        except (OSError, ConnectionError, IndexError, ValueError) as exc:  # peer closed; a bad frame
            if not self._closing and self._channel is channel:
                logger.info("kvconnector torch_distributed: the producer went away (%s); blocks not "
                            "received are computed here", exc)
        finally:
            channel.close()

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount


class _Channel:
    """Frames over one authenticated socket: length, payload, a BLAKE2b tag over the direction,
    the frame's sequence number and the payload."""

    def __init__(self, sock: socket.socket, key: bytes, sending: bytes, receiving: bytes) -> None:
        self.sock, self.key = sock, key
        self.sending, self.receiving = sending, receiving
        self.sent = self.received = 0

    def send(self, *parts: bytes | memoryview) -> None:
        length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        tag = self._tag(self.sending, self.sent, parts)
        self.sent += 1
        self.sock.sendall(_LENGTH.pack(length))
        for part in parts:
            self.sock.sendall(part)
        self.sock.sendall(tag)

    def recv(self, limit: int) -> bytearray:
        (length,) = _LENGTH.unpack(_recv_exact(self.sock, _LENGTH.size))
        if length > limit:
            raise ValueError(f"a frame of {length} bytes, over the limit of {limit}")
        payload = _recv_exact(self.sock, length)
        tag = _recv_exact(self.sock, _TAG)
        if not hmac.compare_digest(tag, self._tag(self.receiving, self.received, (payload,))):
            raise ValueError("a frame failed its authentication tag")
        self.received += 1
        return payload

    def _tag(self, direction: bytes, seq: int, parts: tuple) -> bytes:
        h = hashlib.blake2b(key=self.key, digest_size=_TAG)
        h.update(direction + seq.to_bytes(8, "little"))
        for part in parts:
            h.update(part)
        return h.digest()

    def closed_by_peer(self) -> bool:
        """Whether the peer has closed (a send could still land in the kernel's buffer)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            return bool(readable) and not self.sock.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def _mac(key: bytes, label: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    return hmac.new(key, label + consumer_nonce + producer_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the peer closed the connection ({got} of {n} bytes)")
        got += k
    return buf


def _make_key_file(path: Path) -> None:
    """This user's default shared secret, made once (0600; two starting instances agree)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        for _ in range(50):  # another instance is writing it
            if path.stat().st_size:
                return
            time.sleep(0.02)
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    logger.info("kvconnector torch_distributed: made the shared secret %s (an instance on another host "
                "needs the same key: copy it there and set kvconnector.key_file, or give both an API key)", path)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _addr(peer: tuple) -> str:
    return f"{peer[0]}:{peer[1]}" if peer else "?"


# -- the wire format --------------------------------------------------------------------------------


def _describe(fmt: KVBlockFormat) -> dict[str, str]:
    return {"model": fmt.model, "layout": fmt.layout, "digest": fmt.digest}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _name_code(name: str) -> int:
    raw = name.encode("ascii")
    if len(raw) > 8:
        raise ValueError(f"tensor name {name!r} is longer than 8 ASCII characters")
    return _signed(int.from_bytes(raw.ljust(8, b"\0"), "little"))


def _header_bye() -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = BYE
    return header


def _header_block(key: int, payload: dict[str, torch.Tensor]) -> torch.Tensor:
    if len(payload) > MAX_TENSORS:
        raise ValueError(f"{len(payload)} tensors, more than {MAX_TENSORS}")
    fields = [BLOCK, _signed(key & _MASK64), _signed((key >> 64) & _MASK64), len(payload)]
    for name, t in payload.items():
        if t.dtype not in DTYPES or t.dim() > MAX_DIMS:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} / {t.dim()} dimensions cannot be sent")
        fields += [_name_code(name), DTYPES.index(t.dtype), t.dim(), *t.shape]
        fields += [0] * (MAX_DIMS - t.dim())
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def _parse_header(header: torch.Tensor) -> tuple[int, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    values = header.tolist()
    key = (values[1] & _MASK64) | ((values[2] & _MASK64) << 64)
    specs = []
    for i in range(values[3]):
        name_code, dtype_code, ndim, *dims = values[4 + i * _PER_TENSOR:4 + (i + 1) * _PER_TENSOR]
        name = (name_code & _MASK64).to_bytes(8, "little").rstrip(b"\0").decode("ascii")
        specs.append((name, DTYPES[dtype_code], tuple(dims[:ndim])))
    return key, specs


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when it is contiguous on the CPU)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _typed(part: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A slice of the received bytes as the tensor it was (copied when its offset in the buffer
    is not a multiple of the dtype's size, which ``view`` needs)."""
    if part.storage_offset() % torch.empty((), dtype=dtype).element_size():
        part = part.clone()
    return part.view(dtype).reshape(shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
