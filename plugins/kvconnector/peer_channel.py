"""``torch_distributed``'s authenticated stream: the shared secret, its proof, framed messages.

What both peers use to trust each other: the greeting (``MAGIC`` + a fresh nonce), the HMAC-SHA256
proofs over both nonces, ``Channel`` (frames each tagged with BLAKE2b under the session key, the
direction and a sequence number, so nothing can be injected, replayed or reordered) and this
user's default key file. Which side proves what, and when, is the connector's (``torch_distributed.py``,
``peer_consumer.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import time
from pathlib import Path

logger = logging.getLogger("lmplug_kvconnector.torch_distributed")  # the name its records had before the split

MAGIC = b"LMPKVP2\n"  # 2: the SYNC/ACK of flush
NONCE = 32
_TAG = 16
_LENGTH = struct.Struct("<Q")


class Channel:
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
        (length,) = _LENGTH.unpack(recv_exact(self.sock, _LENGTH.size))
        if length > limit:
            raise ValueError(f"a frame of {length} bytes, over the limit of {limit}")
        payload = recv_exact(self.sock, length)
        tag = recv_exact(self.sock, _TAG)
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


def mac(key: bytes, label: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    return hmac.new(key, label + consumer_nonce + producer_nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the peer closed the connection ({got} of {n} bytes)")
        got += k
    return buf


def make_key_file(path: Path) -> None:
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
