"""What the disk tier may touch: its own names, and regular files of this user opened safely.

The names the tier writes (a block, or its temporary file while it is written) are the only ones
it ever reads, touches or deletes; every file is opened relative to its folder's descriptor with
``O_NOFOLLOW`` and ``O_NONBLOCK``, and ``fstat`` of what was opened refuses links, FIFOs,
devices and another user's files. Kept apart so each rule reads in one place.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

SUFFIX = ".kvb"
STALE_TMP_S = 3600  # a temporary file this old was left by a writer that died
# The only names the tier writes (and so the only ones it ever reads, touches or deletes):
# <32 hex digits>.kvb, and <that>.tmp.<pid>.<8 hex digits> while one is being written.
BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kvb")
TMP_NAME = re.compile(r"[0-9a-f]{32}\.kvb\.tmp\.[0-9]+\.[0-9a-f]{8}")
# Never follow a link, never wait on a FIFO or device: a file that is not a plain one is not ours.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))
DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))


def own_file(name: str, folder: int) -> os.stat_result | None:
    """``lstat`` of ``name`` in the folder open as ``folder`` when it is a regular file (not a
    link, FIFO or device) this user owns."""
    try:
        st = os.lstat(name, dir_fd=folder)
    except OSError:
        return None
    return st if regular_and_mine(st) else None


def regular_and_mine(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())


def read_regular(name: str, folder: int, limit: int) -> bytes:
    """The bytes of ``name`` in the folder open as ``folder``, refusing (``OSError``) anything but a
    regular file of this user of at most ``limit`` bytes: ``O_NOFOLLOW`` refuses a link,
    ``O_NONBLOCK`` keeps a FIFO from blocking in ``open``, and ``fstat`` of what was opened refuses
    FIFOs, devices and another user's files."""
    fd = os.open(name, READ_FLAGS, dir_fd=folder)
    try:
        st = os.fstat(fd)
        if not regular_and_mine(st):
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
    return os.open(path, DIR_FLAGS, dir_fd=parent)


def block_name(key: int) -> str:
    return f"{key:032x}{SUFFIX}"


def exists(name: str, folder: int) -> bool:
    try:
        os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return False
    return True
