"""``KVConnectorConformance``: what every KV connector (``lmplug.interfaces.kvconnector``) must hold to.

- a block comes back bit-exact (same names, dtypes, shapes and bytes) for float32, bfloat16, int8
  (with float32 scales) and float8 payloads (as the paged cache hands them over: a uint8 view),
  for a random number of blocks; before ``flush`` a get gives the block or ``None``;
- after ``flush``, ``contains`` is true for every block put; an unknown key is absent and ``get``
  gives ``None``;
- putting the same key twice (before and after ``flush``) is harmless;
- two formats (same model, different ``layout``) never see each other's entries;
- ``stats`` is a dict of ints;
- a connector claiming the ``"persistent"`` feature gives the blocks put before ``close`` (no
  ``flush``: close flushes) back to a new instance opened with the same options and format.

Options: ``connector_options(tmp_path)`` gives each test its backend section; by default the
class's ``options``. A tier that needs a place of its own (a folder) overrides it::

    class TestDisk(KVConnectorConformance):
        backend = "disk"

        def connector_options(self, tmp_path):
            return {"path": str(tmp_path / "tier")}
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import ValidationError

from lmplug.api import BackendOptions, KVBlockFormat, KVConnector
from lmplug.testing.base import Conformance
from lmplug.testing.compare import fail

# payload kinds: kv dtype as stored, and whether the block carries per-(token, head) scales
PAYLOADS = {
    "float32": (torch.float32, False),
    "bfloat16": (torch.bfloat16, False),
    "int8": (torch.int8, True),
    "float8_e4m3fn": (torch.float8_e4m3fn, True),
}
MODEL = "conformance-model:0123456789abcdef"


def block_payload(kind: str, rng: random.Random, layers: int = 2, tensors: int = 2, block_size: int = 4,
                  heads: int = 2, head_dim: int = 8) -> dict[str, torch.Tensor]:
    """One block as the paged cache hands it over: ``kv`` [L, 1|2, bs, H, D] (float8 as a uint8
    view of its bytes) and, for quantized K/V, ``scales`` [L, 1|2, bs, H] in float32."""
    dtype, scaled = PAYLOADS[kind]
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    shape = (layers, tensors, block_size, heads, head_dim)
    if dtype == torch.int8:
        kv = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    elif dtype == torch.float8_e4m3fn:  # every byte pattern, NaNs included: bits must survive
        kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    else:
        kv = torch.randn(shape, generator=g).to(dtype)
    out = {"kv": kv}
    if scaled:
        out["scales"] = torch.rand(shape[:-1], generator=g) + 0.01
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """Why payload ``b`` is not ``a`` bit for bit, or None."""
    if not isinstance(b, dict) or set(a) != set(b):
        return f"tensors {sorted(b) if isinstance(b, dict) else type(b).__name__}, expected {sorted(a)}"
    for name, want in a.items():
        got = b[name]
        if not isinstance(got, torch.Tensor):
            return f"{name!r} is a {type(got).__name__}, not a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name!r} is {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
        if got.device.type != "cpu":
            return f"{name!r} is on {got.device}, expected a CPU tensor"
        if not torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8)):
            return f"{name!r} differs in its bytes"
    return None


class KVConnectorConformance(Conformance):
    family = "kvconnector"
    payload_kinds: ClassVar[list[str]] = list(PAYLOADS)

    def connector_options(self, tmp_path: Path) -> dict[str, Any]:
        """The backend's section for one test (``tmp_path``: a folder of the test's own)."""
        return dict(self.options)

    @pytest.fixture
    def connector_opts(self, backend_class, tmp_path) -> BackendOptions:
        options = self.connector_options(tmp_path)
        try:
            return backend_class.Options(**options)
        except ValidationError as exc:
            fail(f"{self.label()}: options {options!r} are not valid for "
                 f"{backend_class.Options.__name__} (override connector_options):\n{exc}")

    @pytest.fixture
    def make_connector(self, backend_class, connector_opts) -> Iterator[Callable[[str], KVConnector]]:
        """``make(layout)``: a new connector opened for ``MODEL`` and that layout; each is closed
        (once) after the test."""
        made: list[KVConnector] = []

        def make(layout: str = "conformance bs=4") -> KVConnector:
            connector = backend_class(connector_opts)
            connector.open(KVBlockFormat(MODEL, layout))
            made.append(connector)
            return connector

        yield make
        for connector in made:
            connector.close()

    def params_payload_kind(self) -> list:
        return [pytest.param(kind, id=kind) for kind in self.payload_kinds]

    # -- the checks -----------------------------------------------------------------------
    def test_round_trip_bit_exact(self, make_connector, payload_kind):
        rng = random.Random(f"round trip {payload_kind}")
        connector = make_connector()
        blocks = {rng.getrandbits(128): block_payload(payload_kind, rng) for _ in range(rng.randint(2, 9))}
        for key, payload in blocks.items():
            connector.put(key, {name: t.clone() for name, t in payload.items()})
        for key, payload in blocks.items():  # before flush: the block, or None (not stored yet)
            early = connector.get(key)
            problem = None if early is None else same_bits(payload, early)
            assert problem is None, f"{self.label()}: get before flush of block {key:032x}: {problem}"
        connector.flush()
        for key, payload in blocks.items():
            assert connector.contains(key), f"{self.label()}: contains({key:032x}) is false after flush"
            problem = same_bits(payload, connector.get(key))
            assert problem is None, f"{self.label()}: block {key:032x} came back changed: {problem}"

    def test_unknown_key_is_absent(self, make_connector):
        rng = random.Random("unknown")
        connector = make_connector()
        unknown = rng.getrandbits(128)
        assert not connector.contains(unknown) and connector.get(unknown) is None
        connector.put(rng.getrandbits(128), block_payload("float32", rng))
        connector.flush()
        assert not connector.contains(unknown), f"{self.label()}: contains() of a key never put"
        assert connector.get(unknown) is None, f"{self.label()}: get() of a key never put is not None"

    def test_same_key_twice_is_harmless(self, make_connector):
        rng = random.Random("twice")
        connector = make_connector()
        key, payload = rng.getrandbits(128), block_payload("int8", rng)
        connector.put(key, {name: t.clone() for name, t in payload.items()})
        connector.put(key, {name: t.clone() for name, t in payload.items()})
        connector.flush()
        connector.put(key, {name: t.clone() for name, t in payload.items()})
        connector.flush()
        assert connector.contains(key)
        assert (problem := same_bits(payload, connector.get(key))) is None, problem

    def test_formats_are_kept_apart(self, make_connector):
        rng = random.Random("formats")
        a, b = make_connector("conformance bs=4"), make_connector("conformance bs=8")
        key_a, key_b, shared = rng.getrandbits(128), rng.getrandbits(128), rng.getrandbits(128)
        pa, pb = block_payload("float32", rng), block_payload("bfloat16", rng, block_size=8)
        a.put(key_a, pa)
        a.put(shared, pa)
        b.put(key_b, pb)
        b.put(shared, pb)
        a.flush()
        b.flush()
        assert not b.contains(key_a) and b.get(key_a) is None, \
            f"{self.label()}: a connector opened for another layout sees an entry of the first"
        assert not a.contains(key_b) and a.get(key_b) is None
        assert same_bits(pa, a.get(shared)) is None and same_bits(pb, b.get(shared)) is None, \
            "one key under two formats must hold each format's own block"

    def test_stats_are_ints(self, make_connector):
        rng = random.Random("stats")
        connector = make_connector()
        connector.put(rng.getrandbits(128), block_payload("float32", rng))
        connector.flush()
        stats = connector.stats()
        assert isinstance(stats, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in stats.items()
        ), f"{self.label()}: stats() must be a dict of str -> int, got {stats!r}"

    def test_close_flushes(self, backend_class, connector_opts, make_connector):
        self.require_features(backend_class, "persistent")
        rng = random.Random("close")
        connector = backend_class(connector_opts)
        connector.open(KVBlockFormat(MODEL, "conformance bs=4"))
        blocks = {rng.getrandbits(128): block_payload("bfloat16", rng) for _ in range(3)}
        for key, payload in blocks.items():
            connector.put(key, payload)
        connector.close()
        again = make_connector()
        for key, payload in blocks.items():
            assert again.contains(key), f"{self.label()}: block {key:032x} is not there after close"
            problem = same_bits(payload, again.get(key))
            assert problem is None, f"{self.label()}: block {key:032x} after reopening: {problem}"
