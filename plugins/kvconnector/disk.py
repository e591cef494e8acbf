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

What is the tier's own: only regular files of this user named as the tier names them (a block or
one of its temporary files), inside real folders under ``path`` (a format folder that is a link
is a ``ConfigError``; a link among the others is skipped). Every file is opened relative to its
folder's descriptor with ``O_NOFOLLOW`` (a link is never followed, a folder swapped after
``open`` is not reached), ``O_NONBLOCK`` and ``fstat`` (a FIFO or device is refused, never waited
on). The engine thread never does the I/O itself: ``get`` and ``contains`` hand it to a reader
thread and wait at most ``io_timeout_s``; past that (a hung disk or mount) the tier is switched
off with one WARNING and every block is computed. Writes and their evictions run on the writer
thread.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

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


_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))
_T = TypeVar("_T")


def _own_file(name: str, folder: int) -> os.stat_result | None:
    """``lstat`` of ``name`` in the folder open as ``folder`` when it is a regular file (not a
    link, FIFO or device) this user owns."""
    try:
        st = os.lstat(name, dir_fd=folder)
    except OSError:
        return None
    return st if _regular_and_mine(st) else None


def _regular_and_mine(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())


def read_regular(name: str, folder: int, limit: int) -> bytes:
    """The bytes of ``name`` in the folder open as ``folder``, refusing (``OSError``) anything but a
    regular file of this user of at most ``limit`` bytes: ``O_NOFOLLOW`` refuses a link,
    ``O_NONBLOCK`` keeps a FIFO from blocking in ``open``, and ``fstat`` of what was opened refuses
    FIFOs, devices and another user's files."""
    fd = os.open(name, _READ_FLAGS, dir_fd=folder)
    try:
        st = os.fstat(fd)
        if not _regular_and_mine(st):
            raise OSError(f"{name} is not a regular file of this user")
        if st.st_size > limit:
            raise OSError(f"{name} holds {st.st_size} bytes, more than the tier's max_gb")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit + 1)
    finally:
        os.close(fd)


def open_folder(path: Path | str, parent: int | None = None) -> int:
    """A descriptor of the real folder ``path`` (``OSError`` for a link or anything else)."""
    return os.open(path, _DIR_FLAGS, dir_fd=parent)


DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int32, torch.int64)}


class DiskOptions(BackendOptions):
    path: str = Field(description="folder of the tier (created if missing; `~` expanded)")
    max_gb: float = Field(default=10.0, gt=0, description="size limit of the folder in GiB (LRU beyond it)")
    fsync: bool = Field(default=False, description="fsync each file before it becomes visible")
    io_timeout_s: float = Field(default=5.0, gt=0, description="longest the engine thread waits for one "
                                "read of the tier (a hung disk or mount); past it the tier is switched "
                                "off with a WARNING and blocks are computed")


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
        self._dirs: dict[str, int] = {}  # format folder name -> its descriptor (the real folder)
        self._dir = -1  # this format's folder's descriptor
        # (folder name, file name) -> bytes, least recently used first
        self._index: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._bytes = 0
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # queued puts, served by get
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._stalled = False
        self._write_failed = False
        self._counts = {"puts": 0, "writes": 0, "write_errors": 0, "hits": 0, "misses": 0,
                        "bad_files": 0, "evictions": 0, "io_timeouts": 0}

    # -- set-up -------------------------------------------------------------------------------
    def open(self, fmt: KVBlockFormat) -> None:
        super().open(fmt)
        self.folder = self.root / fmt.digest
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._dir = open_folder(self.folder)
            self._dirs[fmt.digest] = self._dir
            probe = f".probe.{os.getpid()}.{secrets.token_hex(4)}"
            os.close(os.open(probe, _WRITE_FLAGS, 0o600, dir_fd=self._dir))
            os.unlink(probe, dir_fd=self._dir)
        except OSError as exc:
            self._close_folders()
            raise ConfigError(f"kvconnector.path: the disk tier cannot use {str(self.folder)!r} "
                              f"({type(exc).__name__}: {exc}); give a folder this process can create "
                              "and write (its format folder must be a real folder, not a link)") from None
        self._scan()
        self._worker = threading.Thread(target=self._write_loop, name="lmplug-kv-disk", daemon=True)
        self._worker.start()
        self._reader = threading.Thread(target=self._read_loop, name="lmplug-kv-disk-read", daemon=True)
        self._reader.start()

    def _scan(self) -> None:
        """Index every block file in the root's real format folders, oldest use first; drop
        stale temporary files (at start-up, before the engine serves)."""
        found, now = [], time.time()
        for folder, fd in self._folders():
            try:
                entries = list(os.scandir(fd))
            except OSError:
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                    if not _regular_and_mine(st):  # a link, FIFO, device or another user's file
                        continue
                    if TMP_NAME.fullmatch(entry.name) and now - st.st_mtime > STALE_TMP_S:
                        os.unlink(entry.name, dir_fd=fd)
                    elif BLOCK_NAME.fullmatch(entry.name):
                        found.append((st.st_mtime, (folder, entry.name), st.st_size))
                except OSError:  # gone meanwhile (another engine evicted it)
                    continue
        with self._lock:
            for _, entry, size in sorted(found, key=lambda f: f[0]):
                self._index[entry] = size
                self._bytes += size
            victims = self._evict()
        self._unlink(victims)

    def _folders(self) -> list[tuple[str, int]]:
        """The root's real format folders, open (a link to elsewhere is skipped: what it points
        at is not the tier's to index or evict)."""
        try:
            names = [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
            root = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # the user's path: may be a link
        except OSError:
            return list(self._dirs.items())
        try:
            for name in names:
                if name not in self._dirs:
                    try:
                        self._dirs[name] = open_folder(name, root)
                    except OSError:
                        continue
        finally:
            os.close(root)
        return list(self._dirs.items())

    def file(self, key: int) -> Path:
        return self.folder / _name(key)

    # -- the contract -------------------------------------------------------------------------
    def put(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        with self._lock:  # a stalled tier (a hung disk) queues nothing more
            if key in self._pending or self._worker is None or self._stalled:
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
        payload = self._bounded(self._load, key)
        self._count("misses" if payload is None else "hits")
        return payload

    def contains(self, key: int) -> bool:
        if self._stalled:
            return False
        with self._lock:
            if key in self._pending or (self.format.digest, _name(key)) in self._index:
                return True
        return bool(self._bounded(_own_file, _name(key), self._dir))

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
        self._reads.put(None)
        if not self._stalled:
            self._reader.join()
            self._close_folders()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "files": len(self._index), "bytes": self._bytes}

    # -- reads (reader thread, the engine thread waits at most io_timeout_s) -------------------
    def _bounded(self, fn: Callable[..., _T], *args: Any) -> _T | None:
        """``fn(*args)`` on the reader thread; ``None`` when the tier is off or it took too long."""
        if self._stalled or self._reader is None:
            return None
        done: Future = Future()
        self._reads.put((done, fn, args))
        try:
            return done.result(self.options.io_timeout_s)
        except FutureTimeout:
            self._stalled = True
            self._count("io_timeouts")
            logger.warning("kvconnector disk: a read in %s took longer than io_timeout_s=%g s; the tier is "
                           "switched off for this engine (every block is computed)", self.folder,
                           self.options.io_timeout_s)
            return None

    def _read_loop(self) -> None:
        while True:
            item = self._reads.get()
            if item is None:
                return
            done, fn, args = item
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                done.set_exception(exc)

    def _load(self, key: int) -> dict[str, torch.Tensor] | None:
        name, path = _name(key), self.file(key)
        try:
            blob = read_regular(name, self._dir, self.limit)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a link, FIFO, device, another user's file: forgotten, left alone
            logger.warning("kvconnector disk: cannot read %s (%s); computing the block instead", path, exc)
            with self._lock:
                self._bytes -= self._index.pop((self.format.digest, name), 0)
            return None
        try:
            payload = decode(blob, self.format, key)
        except BadBlockFile as exc:
            logger.warning("kvconnector disk: ignoring %s: %s; computing the block instead", path, exc)
            self._count("bad_files")
            self._discard(name)
            return None
        self._touch(name, len(blob))
        return payload

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
        name = _name(key)
        tmp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            if _exists(name, self._dir):  # stored already (or a non-file is in the way: left alone)
                return
            blob = encode(self.format, key, payload)
            if len(blob) <= self.limit:
                with os.fdopen(os.open(tmp, _WRITE_FLAGS, 0o600, dir_fd=self._dir), "wb") as fh:
                    fh.write(blob)
                    if self.options.fsync:
                        fh.flush()
                        os.fsync(fh.fileno())
                os.replace(tmp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
                self._touch(name, len(blob))
                self._count("writes")
        # a put never raises (the contract), and a worker that died would leave flush waiting
        except Exception as exc:  # noqa: BLE001
            self._count("write_errors")
            level = logging.DEBUG if self._write_failed else logging.WARNING
            self._write_failed = True
            logger.log(level, "kvconnector disk: could not store block %032x in %s (%s: %s); it will be "
                       "computed again when needed (further failures are logged at DEBUG)",
                       key, self.folder, type(exc).__name__, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir)
        finally:
            with self._lock:
                self._pending.pop(key, None)

    # -- the index (reader and writer threads) -------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _touch(self, name: str, size: int) -> None:
        """Mark ``name`` in this format's folder (of ``size`` bytes) as just used, then evict
        over the limit."""
        try:
            os.utime(name, dir_fd=self._dir, follow_symlinks=False)  # a link's target is never touched
        except (OSError, NotImplementedError):
            pass  # evicted by another engine meanwhile: its next get is a miss
        entry = (self.format.digest, name)
        with self._lock:
            self._bytes += size - self._index.pop(entry, 0)
            self._index[entry] = size
            victims = self._evict()
        self._unlink(victims)

    def _discard(self, name: str) -> None:
        with self._lock:
            self._bytes -= self._index.pop((self.format.digest, name), 0)
        with contextlib.suppress(OSError):  # gone already, or not ours to delete: the next get warns again
            os.unlink(name, dir_fd=self._dir)

    def _evict(self) -> list[tuple[str, str]]:
        """Drop least recently used files from the index until the total fits (the lock is
        held); the files to delete."""
        victims = []
        while self._bytes > self.limit and self._index:
            entry, size = self._index.popitem(last=False)
            self._bytes -= size
            self._counts["evictions"] += 1
            victims.append(entry)
        return victims

    def _unlink(self, victims: list[tuple[str, str]]) -> None:
        for folder, name in victims:
            try:
                os.unlink(name, dir_fd=self._dirs[folder])
            except FileNotFoundError:
                pass  # another engine sharing the folder evicted it first
            except OSError as exc:
                logger.debug("kvconnector disk: could not evict %s: %s", self.root / folder / name, exc)

    def _close_folders(self) -> None:
        for fd in self._dirs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dirs.clear()


def _name(key: int) -> str:
    return f"{key:032x}{SUFFIX}"


def _exists(name: str, folder: int) -> bool:
    try:
        os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return False
    return True
