"""``MixerConformance``: the mixer ops (``lmplug.interfaces.mixer``) against float64 recurrences.

Every op family (causal conv1d, Mamba2's SSD, the gated delta rule, lightning attention) runs in
a few settings (``CASES``: activation or none, dt clamping and decay near 0 or 1, GQA heads, raw
q/k with a custom scale) and each is checked three ways, on a pool of ``num_slots`` state slots
that all start random and nonzero, with sequences in random slots (``state_indices``, int32):

- ``test_scan_matches_reference``: sequences of ``seq_lens`` tokens, flattened, in one ``*_scan``;
  outputs and the sequences' pool rows after the call equal the per-token recurrences of
  ``mixer_reference`` started from the rows' old states; every other row is left bit-for-bit alone;
- ``test_scan_in_two_pieces``: prompts scanned in two calls (``pieces``: a chunked prefill, the
  state carried in the pool) equal the recurrence over the whole prompts;
- ``test_update_steps``: ``decode_steps`` ``*_update`` calls in a row, one token per sequence,
  equal the recurrence step by step.

Chunk sizes (``ssd_chunk_size``, ``delta_chunk_size``, ``lightning_block_size``) change only the
rounding. The SSD one (4) divides none of the lengths, so every scan ends in a partial chunk; the
longer prompts (17 and 19 tokens) cross chunks of 16 as well.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from lmplug.testing import mixer_reference as ref
from lmplug.testing.base import Conformance
from lmplug.testing.compare import DTYPES, fail, find_mismatch, reported, tolerance_for

Tensors = dict[str, torch.Tensor | None]


class MixerCase(ABC):
    """One op in one setting: makes its inputs and calls it as a scan, an update and the reference.

    ``params`` are the per-layer tensors (weights, A, slope), ``tokens`` the per-token ones, each
    ``[n, ...]`` so that slicing rows selects tokens; the reference runs one sequence."""

    name: str
    op: ClassVar[str]

    @abstractmethod
    def params(self, gen: torch.Generator, dtype: torch.dtype) -> Tensors: ...

    @abstractmethod
    def tokens(self, gen: torch.Generator, n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def pool(self, gen: torch.Generator, num_slots: int, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def scan(self, backend: Any, tok: Tensors, par: Tensors, cu: torch.Tensor, pool: torch.Tensor,
             idx: torch.Tensor, chunk: int) -> torch.Tensor: ...

    @abstractmethod
    def update(self, backend: Any, tok: Tensors, par: Tensors, pool: torch.Tensor,
               idx: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def reference(self, tok: Tensors, par: Tensors, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def output_like(self, tok: Tensors) -> torch.Tensor:
        """The input the output takes its shape and dtype from (x, or v's shape with q's dtype)."""
        return tok["x"]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


@dataclass(frozen=True)
class Conv1dCase(MixerCase):
    name: str
    activation: str | None = "silu"
    bias: bool = True
    channels: int = 8
    width: int = 4  # K
    op: ClassVar[str] = "conv1d"

    def params(self, gen, dtype):
        return {"weight": _randn(gen, self.channels, self.width, scale=0.5).to(dtype),
                "bias": _randn(gen, self.channels).to(dtype) if self.bias else None}

    def tokens(self, gen, n, dtype):
        return {"x": _randn(gen, n, self.channels).to(dtype)}

    def pool(self, gen, num_slots, dtype):  # the last K-1 inputs, in the model dtype
        return _randn(gen, num_slots, self.channels, self.width - 1).to(dtype)

    def scan(self, backend, tok, par, cu, pool, idx, chunk):
        return backend.conv1d_scan(tok["x"], par["weight"], par["bias"], cu, pool, idx, activation=self.activation)

    def update(self, backend, tok, par, pool, idx):
        return backend.conv1d_update(tok["x"], par["weight"], par["bias"], pool, idx, activation=self.activation)

    def reference(self, tok, par, state):
        return ref.conv1d_sequence(tok["x"], par["weight"], par["bias"], state, self.activation)


@dataclass(frozen=True)
class SSDCase(MixerCase):
    """``decay``: None for random dt (raw ~ N(0, 1) plus a bias, clamped to ``dt_limit``) and
    A in [-1.5, -0.3]; a number d for dt ~ 0.5 and A = log(d) / 0.5, so ``exp(dt A) ~ d``."""

    name: str
    decay: float | None = None
    dt_softplus: bool = True
    with_bias_and_D: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)
    heads: int = 4  # H, reading G = 2 groups of B and C: h // 2, not h % 2
    groups: int = 2
    head_dim: int = 4  # P
    state_size: int = 8  # N
    op: ClassVar[str] = "ssd"

    def params(self, gen, dtype):
        h = self.heads
        if self.decay is None:
            A, bias = -(0.3 + 1.2 * torch.rand(h, generator=gen)), _randn(gen, h, scale=0.5)
        else:
            A, bias = torch.full((h,), math.log(self.decay) / 0.5), torch.full((h,), math.log(math.expm1(0.5)))
        with_extras = self.with_bias_and_D
        return {"A": A, "D": _randn(gen, h).to(dtype) if with_extras else None,
                "dt_bias": bias.to(dtype) if with_extras else None}

    def tokens(self, gen, n, dtype):
        if not self.dt_softplus:  # dt used as given: positive steps
            dt = 0.05 + torch.rand(n, self.heads, generator=gen)
        else:
            dt = _randn(gen, n, self.heads, scale=1.0 if self.decay is None else 0.05)
        return {"x": _randn(gen, n, self.heads, self.head_dim).to(dtype), "dt": dt.to(dtype),
                "B": _randn(gen, n, self.groups, self.state_size, scale=0.5).to(dtype),
                "C": _randn(gen, n, self.groups, self.state_size, scale=0.5).to(dtype)}

    def pool(self, gen, num_slots, dtype):
        return _randn(gen, num_slots, self.heads, self.head_dim, self.state_size, scale=0.5)

    def _dt_kw(self, par: Tensors) -> dict[str, Any]:
        return {"dt_bias": par["dt_bias"], "dt_softplus": self.dt_softplus, "dt_limit": self.dt_limit}

    def scan(self, backend, tok, par, cu, pool, idx, chunk):
        return backend.ssd_scan(tok["x"], tok["dt"], par["A"], tok["B"], tok["C"], par["D"], cu, pool, idx,
                                chunk_size=chunk, **self._dt_kw(par))

    def update(self, backend, tok, par, pool, idx):
        return backend.ssd_update(tok["x"], tok["dt"], par["A"], tok["B"], tok["C"], par["D"], pool, idx,
                                  **self._dt_kw(par))

    def reference(self, tok, par, state):
        return ref.ssd_sequence(tok["x"], tok["dt"], par["A"], tok["B"], tok["C"], par["D"], state,
                                **self._dt_kw(par))


@dataclass(frozen=True)
class GatedDeltaCase(MixerCase):
    """``scale`` None with L2-normalised q/k (Qwen3-Next); a number with raw q/k of norm ~1."""

    name: str
    use_qk_l2norm: bool = True
    scale: float | None = None
    k_heads: int = 2  # Hk; value head h reads h // 2, not h % 2
    v_heads: int = 4  # Hv
    head_k: int = 8
    head_v: int = 8
    op: ClassVar[str] = "gated_delta"

    def params(self, gen, dtype):
        return {}

    def tokens(self, gen, n, dtype):
        qk_scale = 1.0 if self.use_qk_l2norm else self.head_k ** -0.5
        return {"q": _randn(gen, n, self.k_heads, self.head_k, scale=qk_scale).to(dtype),
                "k": _randn(gen, n, self.k_heads, self.head_k, scale=qk_scale).to(dtype),
                "v": _randn(gen, n, self.v_heads, self.head_v).to(dtype),
                "g": -0.5 * torch.rand(n, self.v_heads, generator=gen),  # log decay, fp32 as models pass it
                "beta": torch.rand(n, self.v_heads, generator=gen).to(dtype)}

    def pool(self, gen, num_slots, dtype):
        return _randn(gen, num_slots, self.v_heads, self.head_k, self.head_v, scale=0.5)

    def scan(self, backend, tok, par, cu, pool, idx, chunk):
        return backend.gated_delta_scan(tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], cu, pool, idx,
                                        chunk_size=chunk, use_qk_l2norm=self.use_qk_l2norm, scale=self.scale)

    def update(self, backend, tok, par, pool, idx):
        return backend.gated_delta_update(tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], pool, idx,
                                          use_qk_l2norm=self.use_qk_l2norm, scale=self.scale)

    def reference(self, tok, par, state):
        return ref.gated_delta_sequence(tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], state,
                                        use_qk_l2norm=self.use_qk_l2norm, scale=self.scale)

    def output_like(self, tok):
        return tok["v"].to(tok["q"].dtype)


@dataclass(frozen=True)
class LightningCase(MixerCase):
    name: str
    heads: int = 2
    head_k: int = 8
    head_v: int = 8
    op: ClassVar[str] = "lightning"

    def params(self, gen, dtype):  # decays exp(-slope) from 0.37 to 0.95
        return {"slope": 0.05 + 0.95 * torch.rand(self.heads, generator=gen)}

    def tokens(self, gen, n, dtype):
        return {"q": _randn(gen, n, self.heads, self.head_k, scale=self.head_k ** -0.5).to(dtype),
                "k": _randn(gen, n, self.heads, self.head_k, scale=self.head_k ** -0.5).to(dtype),
                "v": _randn(gen, n, self.heads, self.head_v).to(dtype)}

    def pool(self, gen, num_slots, dtype):
        return _randn(gen, num_slots, self.heads, self.head_k, self.head_v, scale=0.5)

    def scan(self, backend, tok, par, cu, pool, idx, chunk):
        return backend.lightning_scan(tok["q"], tok["k"], tok["v"], par["slope"], cu, pool, idx, block_size=chunk)

    def update(self, backend, tok, par, pool, idx):
        return backend.lightning_update(tok["q"], tok["k"], tok["v"], par["slope"], pool, idx)

    def reference(self, tok, par, state):
        return ref.lightning_sequence(tok["q"], tok["k"], tok["v"], par["slope"], state)

    def output_like(self, tok):
        return tok["v"].to(tok["q"].dtype)


CASES: tuple[MixerCase, ...] = (
    Conv1dCase("conv1d"),
    Conv1dCase("conv1d-linear", activation=None, bias=False),
    SSDCase("ssd", dt_limit=(0.2, 1.0)),  # both ends of the clamp are hit
    SSDCase("ssd-decay0.01", decay=0.01),
    SSDCase("ssd-decay0.999", decay=0.999),
    SSDCase("ssd-raw-dt", dt_softplus=False, with_bias_and_D=False),
    GatedDeltaCase("gated_delta"),
    GatedDeltaCase("gated_delta-raw-qk", use_qk_l2norm=False, scale=0.7),
    LightningCase("lightning"),
)



@dataclass
class _Batch:
    """The sequences of a test: their pool slots and the reference's float64 state of each,
    advanced as their tokens are checked."""

    slots: list[int]
    states: list[torch.Tensor]


Invoke = Callable[[Tensors, Tensors, torch.Tensor, torch.Tensor], torch.Tensor]


class MixerConformance(Conformance):
    """Subclass, name the backend, and narrow what it cannot run: ``case_names`` (a subset of
    ``CASES`` by name), the chunk sizes it accepts, ``dtypes``; ``tolerances`` are per dtype,
    for outputs and states alike."""

    family = "mixer"
    cases: ClassVar[tuple[MixerCase, ...]] = CASES
    case_names: ClassVar[list[str] | None] = None  # a subset of the cases by name; default: all
    num_slots: ClassVar[int] = 6
    seq_lens: ClassVar[tuple[int, ...]] = (1, 5, 13)
    pieces: ClassVar[tuple[tuple[int, int], ...]] = ((2, 5), (17, 19))  # per prompt: first, second piece
    decode_steps: ClassVar[int] = 3
    ssd_chunk_size: ClassVar[int] = 4
    delta_chunk_size: ClassVar[int] = 16
    lightning_block_size: ClassVar[int | None] = 16
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {
        "float32": (1e-4, 1e-4),
        "float16": (5e-3, 5e-3),
        "bfloat16": (3e-2, 3e-2),
    }

    def params_case(self) -> list:
        known = {c.name: c for c in self.cases}
        names = self.case_names or list(known)
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"{type(self).__name__}.case_names: unknown cases {unknown}; available: "
                             f"{', '.join(known)}")
        return [pytest.param(known[n], id=n) for n in names]

    # -- tests -------------------------------------------------------------------------------------
    def test_scan_matches_reference(self, backend_class, backend_options, case: MixerCase, dtype: str) -> None:
        gen = _generator(case, "scan")
        par, pool = case.params(gen, DTYPES[dtype]), case.pool(gen, self.num_slots, DTYPES[dtype])
        batch = self._batch(gen, pool, len(self.seq_lens))
        self._scan(backend_class(backend_options), gen, case, dtype, par, pool, batch, list(self.seq_lens), "")

    def test_scan_in_two_pieces(self, backend_class, backend_options, case: MixerCase, dtype: str) -> None:
        gen = _generator(case, "pieces")
        par, pool = case.params(gen, DTYPES[dtype]), case.pool(gen, self.num_slots, DTYPES[dtype])
        batch = self._batch(gen, pool, len(self.pieces))
        backend = backend_class(backend_options)
        for piece in (0, 1):
            cuts = " and ".join(f"{a}+{b}" for a, b in self.pieces)
            what = (f", piece {piece + 1} of 2 of prompts cut as {cuts} tokens "
                    "(a chunked prefill: the state carried in the pool)")
            self._scan(backend, gen, case, dtype, par, pool, batch, [p[piece] for p in self.pieces], what)

    def test_update_steps(self, backend_class, backend_options, case: MixerCase, dtype: str) -> None:
        gen = _generator(case, "update")
        par, pool = case.params(gen, DTYPES[dtype]), case.pool(gen, self.num_slots, DTYPES[dtype])
        batch = self._batch(gen, pool, len(self.seq_lens))
        backend = backend_class(backend_options)
        for step in range(self.decode_steps):
            tok = case.tokens(gen, len(batch.slots), DTYPES[dtype])
            where = (f"{self.label()}, {case.op}_update (case {case.name!r}, dtype {dtype}, one token of each "
                     f"sequence in slots {batch.slots}), decode step {step + 1} of {self.decode_steps}")
            self._call(where, case, dtype, tok, par, pool, batch, [1] * len(batch.slots),
                       lambda t, p, rows, idx: case.update(backend, t, p, rows, idx))

    # -- one call and its checks ---------------------------------------------------------------------
    def _scan(self, backend, gen: torch.Generator, case: MixerCase, dtype: str, par: Tensors,
              pool: torch.Tensor, batch: _Batch, lens: list[int], what: str) -> None:
        chunk = {"ssd": self.ssd_chunk_size, "gated_delta": self.delta_chunk_size,
                 "lightning": self.lightning_block_size}.get(case.op)
        size = "" if chunk is None else f", chunk {chunk}"
        where = (f"{self.label()}, {case.op}_scan (case {case.name!r}, dtype {dtype}, sequences of {lens} "
                 f"tokens in slots {batch.slots}{size}){what}")
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
        self._call(where, case, dtype, case.tokens(gen, sum(lens), DTYPES[dtype]), par, pool, batch, lens,
                   lambda t, p, rows, idx: case.scan(backend, t, p, cu, rows, idx, chunk))

    def _call(self, where: str, case: MixerCase, dtype: str, tok: Tensors, par: Tensors, pool: torch.Tensor,
              batch: _Batch, lens: list[int], invoke: Invoke) -> None:
        """Run ``invoke`` on the test's device and compare its output and pool with the reference
        over the same tokens; then ``pool`` (on the host) takes the backend's rows."""
        rows = pool.to(self.device, copy=True)
        idx = torch.tensor(batch.slots, dtype=torch.int32, device=self.device)
        with reported(where):
            out = invoke(_to(tok, self.device), _to(par, self.device), rows, idx)
        atol, rtol = tolerance_for(self.tolerances, dtype)
        self._check_output(where, case, out, tok, par, batch, lens, atol, rtol)
        after = rows.cpu()
        for i, slot in enumerate(batch.slots):
            bad = find_mismatch(after[slot], batch.states[i], atol, rtol)
            if bad is not None:
                fail(f"{where}: pool row {slot} (sequence {i}'s slot) after the call differs from the "
                     f"recurrence's final state: {bad.summary(atol, rtol)}")
        changed = [s for s in range(pool.shape[0]) if s not in batch.slots and not torch.equal(after[s], pool[s])]
        if changed:
            fail(f"{where}: pool rows {changed} changed, but no sequence of the call holds them "
                 f"(state_indices = {batch.slots}): an op may write only its sequences' rows")
        pool.copy_(after)

    def _check_output(self, where: str, case: MixerCase, out: Any, tok: Tensors, par: Tensors, batch: _Batch,
                      lens: list[int], atol: float, rtol: float) -> None:
        like = case.output_like(tok)
        if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(type(out))
            fail(f"{where}: returned {got}; expected a tensor {tuple(like.shape)} {like.dtype}")
        expected, starts = [], [0, *torch.tensor(lens).cumsum(0).tolist()]
        for i, n in enumerate(lens):
            piece = {k: v[starts[i]:starts[i] + n] for k, v in tok.items()}
            y, batch.states[i] = case.reference(piece, par, batch.states[i])
            expected.append(y)
        bad = find_mismatch(out.cpu(), torch.cat(expected), atol, rtol)
        if bad is not None:
            i = max(j for j, s in enumerate(starts[:-1]) if s <= bad.index[0])
            fail(f"{where}: the output differs from the float64 recurrence: {bad.summary(atol, rtol)}; "
                 f"the worst value is token {bad.index[0] - starts[i]} of sequence {i} (slot {batch.slots[i]})")

    def _batch(self, gen: torch.Generator, pool: torch.Tensor, num_seqs: int) -> _Batch:
        slots = torch.randperm(self.num_slots, generator=gen)[:num_seqs].tolist()
        return _Batch(slots, [pool[s].double() for s in slots])


def _to(tensors: Tensors, device: str) -> Tensors:
    return {k: None if v is None else v.to(device) for k, v in tensors.items()}


def _generator(case: MixerCase, purpose: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{purpose}".encode()))
