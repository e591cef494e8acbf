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

The file format is ``disk_format.py``; the file-access rules ``disk_files.py``; the LRU
index ``disk_index.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

import torch
from lmplug_kvconnector.disk_files import (
    STALE_TMP_S,
    WRITE_FLAGS,
    block_name,
    exists,
    open_folder,
    own_file,
    read_regular,
)
from lmplug_kvconnector.disk_format import BadBlockFile, decode, encode
from lmplug_kvconnector.disk_index import FolderIndex
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, KVBlockFormat, KVConnector
from lmplug.errors import ConfigError

__all__ = ["STALE_TMP_S", "DiskConnector", "DiskOptions"]  # STALE_TMP_S: the tests' import path

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class DiskOptions(BackendOptions):
    path: str = Field(description="folder of the tier (created if missing; `~` expanded)")
    max_gb: float = Field(default=10.0, gt=0, description="size limit of the folder in GiB (LRU beyond it)")
    fsync: bool = Field(default=False, description="fsync each file before it becomes visible")
    io_timeout_s: float = Field(default=5.0, gt=0, description="longest the engine thread waits for one "
                                "read of the tier (a hung disk or mount); past it the tier is switched "
                                "off with a WARNING and blocks are computed")


class DiskConnector(FolderIndex, KVConnector):
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
            os.close(os.open(probe, WRITE_FLAGS, 0o600, dir_fd=self._dir))
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

    def file(self, key: int) -> Path:
        return self.folder / block_name(key)

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
            if key in self._pending or (self.format.digest, block_name(key)) in self._index:
                return True
        return bool(self._bounded(own_file, block_name(key), self._dir))

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
        name, path = block_name(key), self.file(key)
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
        name = block_name(key)
        tmp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            if exists(name, self._dir):  # stored already (or a non-file is in the way: left alone)
                return
            blob = encode(self.format, key, payload)
            if len(blob) <= self.limit:
                with os.fdopen(os.open(tmp, WRITE_FLAGS, 0o600, dir_fd=self._dir), "wb") as fh:
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
