"""Checks and labels the ``lmplug`` command makes before and around building an engine: the
``--set``/flag a config error is about, whether ``serve`` can bind its port, the version."""

from __future__ import annotations

import argparse

from lmplug.errors import LmplugError


def label_set_error(message: str, args: argparse.Namespace) -> str:
    """A config error about a key given with ``--set`` (or a flag such as ``--device``) names
    the ``--set``/flag, not the config it was merged into (``default config:`` or a path)."""
    from lmplug.config import DEFAULT_CONFIG

    first, _, rest = message.partition("\n")
    given = [(k, f"--{k.replace('_', '-')} {getattr(args, k)}") for k in FLAG_KEYS
             if getattr(args, k, None) is not None]
    given += [(item.partition("=")[0], f"--set {item}") for item in args.set]
    labels = [label for key, label in given if mentions(message, key)]
    sources = [str(args.config)] if args.config else ["default config", str(DEFAULT_CONFIG)]
    for source in sources:
        if labels and first.startswith(source + ": "):
            first = ", ".join(labels) + first[len(source):]
            break
    return first + ("\n" + rest if rest else "")


FLAG_KEYS = ("dtype", "device", "max_model_len", "attention", "kvcache", "scheduler")


def mentions(message: str, key: str) -> bool:
    head = key.partition(".")[0]
    return any(f"{k}{end}" in message for k in (key, head) for end in (":", "="))


def check_port(host: str, port: int) -> None:
    """``--host``/``--port`` can be bound (the way uvicorn binds them), or a ``LmplugError``."""
    import socket

    if not 0 <= port <= 65535:
        raise LmplugError(f"--port {port}: not a TCP port (0 to 65535)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise LmplugError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as exc:
            raise LmplugError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                              "choose another --port, or stop what holds it") from None


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lmplug")
    except PackageNotFoundError:
        return "unknown (not installed)"
