"""``torch_distributed``: push a prefill instance's KV blocks to a decode instance
(``kvconnector: {backend: torch_distributed, role: producer|consumer, address: HOST:PORT}``).

Prefill/decode disaggregation over the prefix-hash tier: the producer (the prefill instance) is
handed every full block its paged cache registers (write-through) and sends it to the consumer
(the decode instance), which keeps what arrives in a bounded host-memory store (``HostConnector``,
LRU, ``memory_gb``). When the same prompt reaches the consumer, its prefix blocks are found there
by ``contains``/``get``; a block that has not arrived is simply computed locally, so the decode
side never waits for the peer. The producer's own ``get``/``contains`` find nothing: it computes
its prefixes itself.

Transport: a process group of two over gloo (TCP, host tensors), built directly as a
``ProcessGroupGloo`` on its own ``TCPStore`` rather than with ``init_process_group``, so it never
touches the default group (which tensor parallelism owns) and works whether or not one exists.
The consumer listens on ``address`` (it is the store's server, rank 1); the producer connects
(rank 0). Before the group is built each side writes its ``KVBlockFormat`` into the store and
reads the other's: a different model or block layout is a ``ConfigError`` on both sides naming
both formats, and a peer that does not appear within ``timeout_s`` is a ``ConfigError`` naming the
address.

Wire format, one block: a header of ``HEADER_LEN`` int64 (``BLOCK``, the 128-bit key as two
int64 halves, the tensor count, then per tensor its name as 8 ASCII bytes, a dtype code, the
number of dimensions and up to ``MAX_DIMS`` sizes), then one uint8 tensor holding every
tensor's bytes in that order (bit-exact for every dtype; one message saves round trips).
``BYE`` ends the stream. A put only enqueues; a sender thread sends
(each send waits at most ``timeout_s``) and ``flush`` waits for the queue. A dead peer is logged
once, and every later block is dropped; the consumer's receiver thread ends quietly when the
producer goes away.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time
from typing import Literal

import torch
import torch.distributed as dist
from lmplug_kvconnector.host import HostConnector, HostOptions
from pydantic import Field, field_validator

from lmplug.api import BackendOptions, Capabilities, KVBlockFormat, KVConnector
from lmplug.errors import ConfigError

logger = logging.getLogger(__name__)

BYE, BLOCK = 0, 1  # header[0]
MAX_TENSORS, MAX_DIMS = 4, 8
_PER_TENSOR = 3 + MAX_DIMS  # name, dtype code, ndim, sizes
HEADER_LEN = 4 + MAX_TENSORS * _PER_TENSOR
PRODUCER, CONSUMER = 0, 1  # ranks
_RECV_WAIT = datetime.timedelta(days=365)  # the receiver waits for blocks as long as the peer lives
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.float64, torch.bool)
_MASK64 = (1 << 64) - 1


class TorchDistributedOptions(BackendOptions):
    role: Literal["producer", "consumer"] = Field(
        description="producer: the prefill instance (sends its blocks); consumer: the decode instance "
                    "(listens on address, keeps the blocks it receives)")
    address: str = Field(description="HOST:PORT of the rendezvous; the consumer listens there")
    timeout_s: float = Field(default=30.0, gt=0, description="longest wait for the peer at start-up, "
                             "and for one send")
    memory_gb: float = Field(default=4.0, gt=0, description="the consumer's store of received blocks, "
                             "in GiB (LRU beyond it)")

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
        self.timeout = datetime.timedelta(seconds=options.timeout_s)
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        self._received = HostConnector(HostOptions(memory_gb=options.memory_gb))  # the consumer's blocks
        self._queue: queue.Queue[tuple[int, dict[str, torch.Tensor]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._peer_gone = False
        self._lock = threading.Lock()
        self._counts = ({"puts": 0, "sent": 0, "dropped": 0, "bytes_sent": 0, "send_us": 0}
                        if self.role == "producer" else {"received": 0, "bytes_received": 0})

    # -- start-up ---------------------------------------------------------------------------------
    def open(self, fmt: KVBlockFormat) -> None:
        super().open(fmt)
        peer = self._handshake(fmt)
        if peer != _describe(fmt):
            producer, consumer = (_describe(fmt), peer) if self.role == "producer" else (peer, _describe(fmt))
            raise ConfigError(
                f"kvconnector: torch_distributed at {self.options.address}: the producer and the consumer "
                f"hold KV blocks of different formats (model or block layout differ): producer "
                f"model={producer['model']!r} layout={producer['layout']!r}; consumer "
                f"model={consumer['model']!r} layout={consumer['layout']!r}; serve the same model with "
                "the same dtype and kvcache options on both")
        rank = PRODUCER if self.role == "producer" else CONSUMER
        try:
            self._group = dist.ProcessGroupGloo(dist.PrefixStore("lmplug-kv/group", self._store), rank, 2,
                                                self.timeout)
        except RuntimeError as exc:  # torch's DistError family
            raise ConfigError(f"kvconnector: torch_distributed: the process group with the peer at "
                              f"{self.options.address} did not form within {self.options.timeout_s:g} s "
                              f"({type(exc).__name__}: {exc})") from None
        target = self._send_loop if self.role == "producer" else self._receive_loop
        self._thread = threading.Thread(target=target, name=f"lmplug-kv-{self.role}", daemon=True)
        self._thread.start()

    def _handshake(self, fmt: KVBlockFormat) -> dict[str, str]:
        """Write this side's format into the rendezvous store and return the peer's."""
        host, _, port = self.options.address.rpartition(":")
        mine, theirs = ("producer", "consumer") if self.role == "producer" else ("consumer", "producer")
        try:
            self._store = dist.TCPStore(host, int(port), 2, is_master=self.role == "consumer",
                                        timeout=self.timeout, wait_for_workers=False)
            if self.role == "consumer":  # the producer reads ours before it writes its own
                self._store.set(f"lmplug-kv/{mine}", json.dumps(_describe(fmt)))
            self._store.wait([f"lmplug-kv/{theirs}"], self.timeout)
            peer = json.loads(self._store.get(f"lmplug-kv/{theirs}"))
            if self.role == "producer":
                self._store.set(f"lmplug-kv/{mine}", json.dumps(_describe(fmt)))
        except (RuntimeError, ValueError) as exc:  # torch's DistError family; a foreign JSON value
            what = "listen on" if self.role == "consumer" else "reach the consumer at"
            raise ConfigError(f"kvconnector: torch_distributed ({self.role}): could not {what} "
                              f"{self.options.address}, or no {theirs} came within "
                              f"{self.options.timeout_s:g} s (timeout_s) "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        return peer

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
        elif self._group is not None:
            try:
                self._group.abort()  # ends a receive in progress
            except Exception:  # a group already broken by the peer: nothing left to release
                logger.debug("kvconnector torch_distributed: abort after close", exc_info=True)

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
                        self._send_header(_header_bye())
                    return
                if self._peer_gone:
                    self._count(dropped=1)
                    continue
                self._send_block(*item)
            except RuntimeError as exc:  # gloo: connection closed by peer, timeout
                self._peer_gone = True
                self._count(dropped=0 if item is None else 1)
                logger.warning("kvconnector torch_distributed: the consumer at %s is gone (%s: %s); "
                               "dropping this and every later block (the decode instance computes them)",
                               self.options.address, type(exc).__name__, str(exc).splitlines()[0])
            finally:
                self._queue.task_done()

    def _send_block(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        try:
            header = _header_block(key, payload)
        except ValueError as exc:
            logger.warning("kvconnector torch_distributed: block %032x not sent: %s", key, exc)
            self._count(dropped=1)
            return
        started = time.perf_counter()
        self._send_header(header)
        data = torch.cat([_as_bytes(t) for t in payload.values()])  # one message: fewer round trips
        if data.numel():
            self._group.send([data], CONSUMER, 0).wait(self.timeout)
        self._count(sent=1, bytes_sent=data.numel(), send_us=int((time.perf_counter() - started) * 1e6))

    def _send_header(self, header: torch.Tensor) -> None:
        self._group.send([header], CONSUMER, 0).wait(self.timeout)

    # -- the consumer's receiver thread -----------------------------------------------------------
    def _receive_loop(self) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            while True:
                self._group.recv([header], PRODUCER, 0).wait(_RECV_WAIT)
                if int(header[0]) == BYE:
                    logger.info("kvconnector torch_distributed: the producer closed the stream")
                    return
                key, specs = _parse_header(header)
                sizes = [_nbytes(dtype, shape) for _, dtype, shape in specs]
                data = torch.empty(sum(sizes), dtype=torch.uint8)
                if data.numel():
                    self._group.recv([data], PRODUCER, 0).wait(_RECV_WAIT)
                parts = data.split(sizes)
                self._received.put(key, {name: _typed(part, dtype, shape)
                                         for (name, dtype, shape), part in zip(specs, parts)})
                self._count(received=1, bytes_received=data.numel())
        except (RuntimeError, IndexError, ValueError) as exc:  # gloo: peer closed or aborted; a bad header
            if not self._closing:
                logger.info("kvconnector torch_distributed: the producer went away (%s); blocks not "
                            "received are computed here", str(exc).splitlines()[0] if str(exc) else exc)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount


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
