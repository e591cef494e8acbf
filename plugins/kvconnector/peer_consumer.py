"""The consumer side of ``torch_distributed``: listen, refuse strangers, keep the blocks that arrive.

The decode instance's half of the connector, run on its own threads: it accepts connections on
``address`` (at most ``MAX_HANDSHAKES`` proving the secret at once), refuses and logs any that does
not prove the shared secret within ``timeout_s``, checks the producer's ``KVBlockFormat``,
stores every block received into the bounded host store the engine reads, and answers each
``SYNC`` with an ``ACK`` once the blocks sent before it are stored. A mixin of
``TorchDistributedConnector`` (which sets these attributes), apart from its start-up and producer.
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
from typing import TYPE_CHECKING

import torch
from lmplug_kvconnector.host import HostConnector
from lmplug_kvconnector.peer_channel import MAGIC, NONCE, Channel, mac, recv_exact
from lmplug_kvconnector.peer_wire import (
    ACK,
    BYE,
    HEADER_LEN,
    SYNC,
    describe,
    header_sync,
    nbytes,
    parse_header,
    typed,
)

from lmplug.api import KVBlockFormat
from lmplug.errors import ConfigError

if TYPE_CHECKING:
    from lmplug_kvconnector.torch_distributed import TorchDistributedOptions

logger = logging.getLogger("lmplug_kvconnector.torch_distributed")  # the name its records had before the split

MAX_HANDSHAKES = 4  # connections proving the secret at once; more are refused at once
_LOUD_REFUSALS = 10  # refusals logged at WARNING; later ones at DEBUG


class ConsumerSide:
    """The consumer's threads: accepting, proving, receiving."""

    options: TorchDistributedOptions
    format: KVBlockFormat
    _host: str
    _port: int
    _key: bytes
    _listener: socket.socket | None
    _channel: Channel | None
    _ready: queue.Queue[str | None]
    _handshakes: threading.BoundedSemaphore
    _received: HostConnector
    _closing: bool
    _peers: dict[threading.Thread, socket.socket]
    _lock: threading.Lock
    _counts: dict[str, int]

    def _listen(self) -> None:
        try:
            listener = socket.create_server((self._host, self._port), family=_family(self._host), backlog=16)
        except OSError as exc:
            raise ConfigError(f"kvconnector: torch_distributed (consumer): could not listen on "
                              f"{self.options.address} ({type(exc).__name__}: {exc})") from None
        self._listener = listener

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was closed
            if not self._handshakes.acquire(blocking=False):
                self._refuse(sock, peer, f"more than {MAX_HANDSHAKES} connections proving the secret at once")
                continue
            thread = threading.Thread(target=self._serve_peer, args=(sock, peer), name="lmplug-kv-peer", daemon=True)
            with self._lock:
                self._peers = {t: s for t, s in self._peers.items() if t.is_alive()}
                self._peers[thread] = sock
            thread.start()

    def _stop_peers(self, wait_s: float) -> None:
        """Wake every peer thread (its socket shut) and wait for it: a thread still inside torch
        while the interpreter exits is killed mid-call, which can abort the whole process."""
        with self._lock:
            peers = dict(self._peers)
        for sock in peers.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in peers:
            thread.join(wait_s)

    def _serve_peer(self, sock: socket.socket, peer: tuple) -> None:
        try:
            channel = self._prove(sock, peer)
        finally:
            self._handshakes.release()
        if channel is None:
            return
        try:
            channel.send(json.dumps(describe(self.format)).encode())
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

    def _prove(self, sock: socket.socket, peer: tuple) -> Channel | None:
        """The producer's proof of the secret, then ours; ``None`` (refused, logged) otherwise."""
        sock.settimeout(self.options.timeout_s)
        mine = secrets.token_bytes(NONCE)
        try:
            sock.sendall(MAGIC + mine)
            answer = recv_exact(sock, len(MAGIC) + NONCE + 32)
        except (OSError, ConnectionError) as exc:
            self._refuse(sock, peer, f"no proof of the shared secret within {self.options.timeout_s:g} s "
                         f"({type(exc).__name__})")
            return None
        theirs, proof = answer[len(MAGIC):len(MAGIC) + NONCE], answer[len(MAGIC) + NONCE:]
        if answer[:len(MAGIC)] != MAGIC or not hmac.compare_digest(proof, mac(self._key, b"producer", mine, theirs)):
            self._refuse(sock, peer, "it did not prove the shared secret (a wrong or missing key)")
            return None
        try:
            sock.sendall(mac(self._key, b"consumer", mine, theirs))
        except OSError as exc:
            self._refuse(sock, peer, f"gone after proving the secret ({type(exc).__name__})")
            return None
        return Channel(sock, mac(self._key, b"session", mine, theirs), sending=b"C", receiving=b"P")

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

    def _receive_loop(self, channel: Channel) -> None:
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
                if int(header[0]) == SYNC:  # every block before it is stored: say so
                    channel.send(header_sync(ACK, int(header[1])).numpy().tobytes())
                    continue
                key, specs = parse_header(header)
                sizes = [nbytes(dtype, shape) for _, dtype, shape in specs]
                body = len(frame) - HEADER_LEN * 8
                if sum(sizes) != body:
                    raise ValueError(f"the header lists {sum(sizes)} bytes, the frame holds {body}")
                data = (torch.frombuffer(frame, dtype=torch.uint8, offset=HEADER_LEN * 8) if body
                        else torch.empty(0, dtype=torch.uint8))
                parts = data.split(sizes)
                self._received.put(key, {name: typed(part, dtype, shape)
                                         for (name, dtype, shape), part in zip(specs, parts)})
                self._count(received=1, bytes_received=data.numel())
        except (OSError, ConnectionError, IndexError, ValueError) as exc:  # peer closed; a bad frame
            if not self._closing and self._channel is channel:
                logger.info("kvconnector torch_distributed: the producer went away (%s); blocks not "
                            "received are computed here", exc)
        finally:
            channel.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _addr(peer: tuple) -> str:
    return f"{peer[0]}:{peer[1]}" if peer else "?"
