"""The disk tier's index: its folders' block files in last-use order, and eviction past ``max_gb``.

Built at ``open`` from every real format folder under ``path`` (stale temporary files dropped),
kept on the reader and writer threads as blocks are read and written, and trimmed, least
recently used first, whenever the total passes the limit (files another engine removed first
are skipped). A mixin of ``DiskConnector`` (which sets these attributes), apart from its
contract and threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from lmplug_kvconnector.disk_files import (
    BLOCK_NAME,
    STALE_TMP_S,
    TMP_NAME,
    open_folder,
    regular_and_mine,
)

from lmplug.api import KVBlockFormat

logger = logging.getLogger("lmplug_kvconnector.disk")  # the name its records had before the split


class FolderIndex:
    """The LRU index of the tier's files: (format folder, file name) -> bytes, kept under ``_lock``."""

    format: KVBlockFormat
    root: Path
    limit: int
    _dirs: dict[str, int]
    _dir: int
    _index: OrderedDict[tuple[str, str], int]
    _bytes: int
    _lock: threading.Lock
    _counts: dict[str, int]

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
                    if not regular_and_mine(st):  # a link, FIFO, device or another user's file
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
