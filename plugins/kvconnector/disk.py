"""``disk``: a tier of KV blocks in a folder that outlives the engine
(``kvconnector: {backend: disk, path: ~/.cache/lmplug/kv, max_gb: 10}``).

Layout: ``<path>/<KVBlockFormat.digest>/<key as 32 hex digits>.kvb``, one file per block::

    magic "LMPKVB\\r\\n" | version u32 | header length u32 | BLAKE2b-128 of header + data | header | data

The header (JSON) names the block's full format (model identity and layout strings), its key and,
per tensor, name, dtype, shape and byte length; the data is the tensors' raw bytes in that order
(bfloat16 and float8 go through a uint8 view). A file is written on a worker thread to a private
temporary name and moved into place with ``os.replace``, so a reader (another engine sharing the
folder included) sees a whole file or none; a key whose file exists is not written again. ``get``
checks magic, version, format strings, key, byte lengths and the checksum: any mismatch,
truncation or read error is one WARNING naming the file and the reason, and the block is computed
again (a file that was read but is wrong is deleted, so that its key is stored afresh).

Size: the folder's files (every format's) are indexed at ``open`` in last-use order (mtime, which
``get`` touches) and the least recently used are deleted when the total passes ``max_gb``. Files
written by other engines since ``open`` are counted once this engine reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, KVBlockFormat, KVConnector
from lmplug.errors import ConfigError

logger = logging.getLogger(__name__)

MAGIC = b"LMPKVB\r\n"  # the CR/LF pair catches a copy that rewrote line endings
VERSION = 1
_PREFIX = struct.Struct("<8sII16s")  # magic, version, header length, checksum
SUFFIX = ".kvb"
STALE_TMP_S = 3600  # a temporary file this old was left by a writer that died
# The only names the tier writes (and so the only ones it ever reads, touches or deletes):
# <32 hex digits>.kvb, and <that>.tmp.<pid>.<8 hex digits> while one is being written.
BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kvb")
TMP_NAME = re.compile(r"[0-9a-f]{32}\.kvb\.tmp\.[0-9]+\.[0-9a-f]{8}")
# Never follow a link, never wait on a FIFO or device: a file that is not a plain one is not ours.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                | getattr(os, "O_CLOEXEC", 0))


def _own_file(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` when it is a regular file (not a link, FIFO or device) this user owns."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return None
    return st


def read_regular(path: Path) -> bytes:
    """The bytes of ``path``, refusing (``OSError``) anything but a regular file: ``O_NOFOLLOW``
    refuses a link, ``O_NONBLOCK`` keeps a FIFO from blocking the engine thread in ``open``, and
    ``fstat`` of what was opened refuses FIFOs and devices."""
    fd = os.open(path, _READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int32, torch.int64)}


class DiskOptions(BackendOptions):
    path: str = Field(description="folder of the tier (created if missing; `~` expanded)")
    max_gb: float = Field(default=10.0, gt=0, description="size limit of the folder in GiB (LRU beyond it)")
    fsync: bool = Field(default=False, description="fsync each file before it becomes visible")


class BadBlockFile(Exception):
    """A block file that is not what it must be (the message says why)."""


def encode(fmt: KVBlockFormat, key: int, payload: dict[str, torch.Tensor]) -> bytes:
    """One block file's bytes."""
    tensors, chunks = [], []
    for name, t in payload.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, not one of {sorted(DTYPES)}")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        tensors.append({"name": name, "dtype": dtype, "shape": list(t.shape), "nbytes": len(raw)})
        chunks.append(raw)
    header = json.dumps({"model": fmt.model, "layout": fmt.layout, "key": f"{key:032x}",
                         "tensors": tensors}).encode()
    data = b"".join(chunks)
    digest = hashlib.blake2b(header + data, digest_size=16).digest()
    return _PREFIX.pack(MAGIC, VERSION, len(header), digest) + header + data


def decode(blob: bytes, fmt: KVBlockFormat, key: int) -> dict[str, torch.Tensor]:
    """The payload in a block file's bytes; ``BadBlockFile`` when anything does not match."""
    if len(blob) < _PREFIX.size:
        raise BadBlockFile(f"truncated: {len(blob)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len, digest = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise BadBlockFile(f"not a block file (magic {magic!r})")
    if version != VERSION:
        raise BadBlockFile(f"format version {version}, this reader knows {VERSION}")
    body = blob[_PREFIX.size:]
    if header_len > len(body):
        raise BadBlockFile(f"truncated: a header of {header_len} bytes, {len(body)} bytes follow the prefix")
    try:
        header = json.loads(body[:header_len])
        specs = [(t["name"], t["dtype"], [int(n) for n in t["shape"]], int(t["nbytes"]))
                 for t in header["tensors"]]
        model, layout, stored_key = str(header["model"]), str(header["layout"]), str(header["key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadBlockFile(f"damaged header ({type(exc).__name__}: {exc})") from None
    data = body[header_len:]
    if sum(s[3] for s in specs) != len(data):
        raise BadBlockFile(f"truncated or damaged: the header lists {sum(s[3] for s in specs)} bytes of "
                           f"tensors, the file holds {len(data)}")
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise BadBlockFile("checksum mismatch (damaged)")
    if model != fmt.model:
        raise BadBlockFile(f"written for another model ({model!r}; this one is {fmt.model!r})")
    if layout != fmt.layout:
        raise BadBlockFile(f"written for another layout ({layout!r}; this one is {fmt.layout!r})")
    if stored_key != f"{key:032x}":
        raise BadBlockFile(f"holds block {stored_key}, not {key:032x}")
    return _tensors(data, specs)


def _tensors(data: bytes, specs: list[tuple[str, str, list[int], int]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, dtype_name, shape, nbytes in specs:
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise BadBlockFile(f"tensor {name!r} has unknown dtype {dtype_name!r}")
        if nbytes != torch.Size(shape).numel() * dtype.itemsize:
            raise BadBlockFile(f"tensor {name!r}: {nbytes} bytes do not make {dtype_name}{shape}")
        raw = (torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        out[name] = raw.view(dtype).reshape(shape)
        offset += nbytes
    return out


class DiskConnector(KVConnector):
    name = "disk"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), features=frozenset({"persistent"}))
    Options = DiskOptions

    def __init__(self, options: DiskOptions) -> None:
        super().__init__(options)
        self.root = Path(options.path).expanduser()
        self.limit = int(options.max_gb * 2**30)
        self.folder = self.root  # <root>/<format digest>, set by open
        self._index: OrderedDict[Path, int] = OrderedDict()  # file -> bytes, least recently used first
        self._bytes = 0
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # queued puts, served by get
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._write_failed = False
        self._counts = {"puts": 0, "writes": 0, "write_errors": 0, "hits": 0, "misses": 0,
                        "bad_files": 0, "evictions": 0}

    # -- set-up -------------------------------------------------------------------------------
    def open(self, fmt: KVBlockFormat) -> None:
        super().open(fmt)
        self.folder = self.root / fmt.digest
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"kvconnector.path: the disk tier cannot use {str(self.root)!r} "
                              f"({type(exc).__name__}: {exc}); give a folder this process can create "
                              "and write") from None
        self._scan()
        self._worker = threading.Thread(target=self._write_loop, name="lmplug-kv-disk", daemon=True)
        self._worker.start()

    def _scan(self) -> None:
        """Index every block file under the root, oldest use first; drop stale temporary files."""
        found, now = [], time.time()
        for entry in self._own_entries():
            st = _own_file(entry)
            if st is None:  # a link, FIFO, device or another user's file: never ours to touch
                continue
            try:
                if TMP_NAME.fullmatch(entry.name) and now - st.st_mtime > STALE_TMP_S:
                    entry.unlink()
                elif BLOCK_NAME.fullmatch(entry.name):
                    found.append((st.st_mtime, entry, st.st_size))
            except OSError:  # gone meanwhile (another engine evicted it)
                continue
        with self._lock:
            for _, entry, size in sorted(found, key=lambda f: f[0]):
                self._index[entry] = size
                self._bytes += size
            self._evict()

    def _own_entries(self) -> list[Path]:
        """Files in the root's format folders, each folder a real one (a link to elsewhere is
        skipped: what it points at is not the tier's to index or evict)."""
        out = []
        try:
            folders = [f for f in self.root.iterdir() if stat.S_ISDIR(os.lstat(f).st_mode)]
        except OSError:
            return out
        for folder in folders:
            try:
                out.extend(folder.iterdir())
            except OSError:
                continue
        return out

    def file(self, key: int) -> Path:
        return self.folder / f"{key:032x}{SUFFIX}"

    # -- the contract -------------------------------------------------------------------------
    def put(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if key in self._pending or self._worker is None:
                return
            self._pending[key] = payload
            self._counts["puts"] += 1
        self._queue.put((key, payload))

    def get(self, key: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            payload = self._pending.get(key)
        if payload is not None:
            self._count("hits")
            return payload
        path = self.file(key)
        try:
            blob = read_regular(path)
        except FileNotFoundError:
            self._count("misses")
            return None
        except OSError as exc:
            logger.warning("kvconnector disk: cannot read %s (%s); computing the block instead", path, exc)
            self._count("misses")
            return None
        try:
            payload = decode(blob, self.format, key)
        except BadBlockFile as exc:
            logger.warning("kvconnector disk: ignoring %s: %s; computing the block instead", path, exc)
            self._count("bad_files")
            self._discard(path)
            return None
        self._touch(path, len(blob))
        self._count("hits")
        return payload

    def contains(self, key: int) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return _own_file(self.file(key)) is not None

    def flush(self) -> None:
        if self._worker is not None:
            self._queue.join()

    def close(self) -> None:
        if self._worker is None:
            return
        self._queue.put(None)
        self._queue.join()
        self._worker.join()
        self._worker = None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "files": len(self._index), "bytes": self._bytes}

    # -- writes (worker thread) ---------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        path = self.file(key)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            if os.path.lexists(path):  # stored already (or a non-file is in the way: left alone)
                return
            blob = encode(self.format, key, payload)
            if len(blob) <= self.limit:
                with os.fdopen(os.open(tmp, _WRITE_FLAGS, 0o600), "wb") as fh:
                    fh.write(blob)
                    if self.options.fsync:
                        fh.flush()
                        os.fsync(fh.fileno())
                os.replace(tmp, path)
                self._touch(path, len(blob))
                self._count("writes")
        # a put never raises (the contract), and a worker that died would leave flush waiting
        except Exception as exc:  # noqa: BLE001
            self._count("write_errors")
            level = logging.DEBUG if self._write_failed else logging.WARNING
            self._write_failed = True
            logger.log(level, "kvconnector disk: could not store block %032x in %s (%s: %s); it will be "
                       "computed again when needed (further failures are logged at DEBUG)",
                       key, self.folder, type(exc).__name__, exc)
            tmp.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._pending.pop(key, None)

    # -- the index ----------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _touch(self, path: Path, size: int) -> None:
        """Mark ``path`` (of ``size`` bytes) as just used, then evict over the limit."""
        try:
            os.utime(path, follow_symlinks=False)  # a link's target is never touched
        except (OSError, NotImplementedError):
            pass  # evicted by another engine meanwhile: its next get is a miss
        with self._lock:
            self._bytes += size - self._index.pop(path, 0)
            self._index[path] = size
            self._evict()

    def _discard(self, path: Path) -> None:
        with self._lock:
            self._bytes -= self._index.pop(path, 0)
        try:
            path.unlink()
        except OSError:
            pass  # gone already, or not ours to delete: the next get warns again

    def _evict(self) -> None:
        """Delete least recently used files until the total fits (the lock is held)."""
        while self._bytes > self.limit and self._index:
            path, size = self._index.popitem(last=False)
            self._bytes -= size
            self._counts["evictions"] += 1
            try:
                path.unlink()
            except FileNotFoundError:
                pass  # another engine sharing the folder evicted it first
            except OSError as exc:
                logger.debug("kvconnector disk: could not evict %s: %s", path, exc)
