"""``AttentionConformance``: an attention backend against the float64 reference on every batch spec.

For each (layout, batch spec, dtype) the suite builds one step itself (see
``attention_case``), runs ``forward`` once and checks:

- the output has q's shape and dtype, no NaN, and matches the reference within
  the dtype's tolerance (on a mismatch it also tries the usual mistakes, e.g.
  no causal mask, and names the one the output matches);
- the step's K/V were written at ``ctx.slot_mapping`` and no other cache slot
  changed;
- where the backend offers a C attention for the native decode step
  (``native_decode``), it does the same on the decode-only specs (float32, CPU).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from lmplug.kit import extras
from lmplug.kit.native import call_attention
from lmplug.testing.attention_case import AttentionCase, build_case, same_or_both_nan
from lmplug.testing.base import Conformance
from lmplug.testing.batches import BATCH_SPECS, BatchSpec
from lmplug.testing.compare import (
    DEFAULT_TOLERANCES,
    DTYPES,
    fail,
    find_mismatch,
    reported,
    tolerance_for,
)
from lmplug.testing.reference import reference_attention

LAYOUTS = ("contiguous", "paged")


@dataclass
class AttentionRun:
    case: AttentionCase
    label: str
    dtype: str
    out: torch.Tensor | None = None
    error: str | None = None


class AttentionConformance(Conformance):
    family = "attention"
    specs: ClassVar[list[str] | None] = None  # names from BATCH_SPECS; default: all
    layouts: ClassVar[list[str] | None] = None  # default: every layout the backend reads
    tolerances: ClassVar[dict[str, tuple[float, float]]] = DEFAULT_TOLERANCES

    # -- parameters ----------------------------------------------------------------------------
    def params_spec(self) -> list:
        names = self.specs or list(BATCH_SPECS)
        unknown = sorted(set(names) - set(BATCH_SPECS))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}.specs: unknown batch specs {unknown}; "
                f"available: {', '.join(BATCH_SPECS)}"
            )
        return [
            pytest.param(
                BATCH_SPECS[n], id=n, marks=self.feature_marks(BATCH_SPECS[n].required_features)
            )
            for n in names
        ]

    def params_layout(self) -> list:
        caps = self.claimed()
        out = []
        for layout in self.layouts or LAYOUTS:
            marks = []
            if caps is not None and layout not in caps.kv_layouts:
                marks = [
                    pytest.mark.skip(
                        reason=f"{self.label()} does not read KV layout {layout!r} "
                        f"(capabilities.kv_layouts = {sorted(caps.kv_layouts)})"
                    )
                ]
            out.append(pytest.param(layout, id=layout, marks=marks))
        return out

    def extra_declaration_problems(self, backend_class: type) -> list[str]:
        caps = getattr(backend_class, "capabilities", None)
        layouts = getattr(caps, "kv_layouts", frozenset())
        if not layouts:
            return ["capabilities.kv_layouts is empty: say which KV layouts the backend reads"]
        return []

    # -- one forward per (spec, layout, dtype), shared by the tests below ----------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def attention_run(
        cls, backend_class, backend_options, spec: BatchSpec, layout: str, dtype: str
    ) -> AttentionRun:
        case = build_case(spec, layout, DTYPES[dtype], cls.device)
        block = f", block_size {case.view.block_size}" if layout == "paged" else ""
        label = (
            f"{cls.label()}, batch spec {spec.name!r} (layout {layout}{block}, dtype {dtype})\n"
            f"  spec: {spec.describe()}"
        )
        run = AttentionRun(case, label, dtype)
        try:
            impl = backend_class(
                backend_options,
                num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                **_dims(spec),
            )
            with torch.inference_mode():
                run.out = impl.forward(spec.layer, case.q, case.k, case.v, case.view, case.ctx)
        except Exception as exc:  # noqa: BLE001 - any error of the backend becomes this case's failure
            frames = "".join(traceback.format_exception(exc, limit=-4))
            run.error = f"{label}\n  forward raised {type(exc).__name__}: {exc}\n{frames}"
        return run

    # -- the checks ------------------------------------------------------------------------------------
    def test_output_matches_reference(self, attention_run: AttentionRun) -> None:
        run = _completed(attention_run)
        case, out = run.case, run.out
        if (
            not isinstance(out, torch.Tensor)
            or out.shape != case.q.shape
            or out.dtype != case.q.dtype
        ):
            got = (
                f"{type(out).__name__} {tuple(out.shape)} {out.dtype}"
                if isinstance(out, torch.Tensor)
                else repr(type(out))
            )
            fail(
                f"{run.label}\n  forward must return a tensor shaped and typed like q "
                f"({tuple(case.q.shape)} {case.q.dtype}); got {got}"
            )
        _check_finite(run)
        expected = _reference(case)
        atol, rtol = tolerance_for(self.tolerances, run.dtype)
        bad = find_mismatch(out, expected, atol, rtol)
        if bad is None:
            return
        token, head = bad.index[0], bad.index[1]
        lines = [
            run.label,
            f"  output differs from the float64 reference: {bad.summary(atol, rtol)}",
            f"  worst value: {case.locate(token)}, head {head}",
            f"  sequences with mismatches: {_bad_sequences(case, out, expected, atol, rtol)}",
        ]
        lines += [f"  hint: the output matches {hint}" for hint in _diagnose(case, out, atol, rtol)]
        fail("\n".join(lines))

    def test_kv_written_at_slot_mapping(self, attention_run: AttentionRun) -> None:
        run = _completed(attention_run)
        case = run.case
        for which, cache, before, new in (
            ("K", case.view.k_cache, case.k_before, case.k),
            ("V", case.view.v_cache, case.v_before, case.v),
        ):
            flat = cache.reshape(-1, *cache.shape[2:])
            written = flat[case.ctx.slot_mapping]
            wrong = ~(written == new).flatten(1).all(dim=1)
            if wrong.any():
                t = int(wrong.nonzero()[0])
                fail(
                    f"{run.label}\n  {int(wrong.sum())} of {len(wrong)} new {which} rows were not "
                    f"stored at their slot_mapping slot; first: {case.locate(t)} -> slot "
                    f"{int(case.ctx.slot_mapping[t])} holds {_preview(written[t])}, expected "
                    f"{_preview(new[t])}"
                )
            keep = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
            keep[case.ctx.slot_mapping] = False
            flat_before = before.reshape(flat.shape)
            changed = ~same_or_both_nan(flat[keep], flat_before[keep]).flatten(1).all(dim=1)
            if changed.any():
                slots = keep.nonzero().flatten()[changed][:5].tolist()
                fail(
                    f"{run.label}\n  the {which} cache changed at {int(changed.sum())} slots outside "
                    f"this step's slot_mapping (e.g. slots {slots}, block size {cache.shape[1]}): "
                    f"the backend overwrote other tokens' or other sequences' K/V"
                )

    def test_native_decode_matches_reference(self, backend_class, backend_options, spec: BatchSpec,
                                             layout: str) -> None:
        """Where the backend offers the native decode step a C attention (``native_decode``: a
        step of short queries, decodes or a verify's rows, float32 caches on the CPU), it writes
        the step's K/V at ``ctx.slot_mapping`` and attends as the reference does."""
        from lmplug.kit.native_step import MAX_QUERY_TOKENS

        if self.device != "cpu" or max(spec.query_lens) > MAX_QUERY_TOKENS:
            pytest.skip("the native decode step runs steps of short queries on the CPU")
        case = build_case(spec, layout, torch.float32, self.device)
        label = f"{self.label()}, batch spec {spec.name!r} (layout {layout}, float32), native decode"
        with reported(label):
            impl = backend_class(backend_options, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                 head_dim=spec.head_dim, **_dims(spec))
            call = extras.native_decode(impl, case.ctx, [case.view] * (spec.layer + 1))
        if call is None:
            pytest.skip(f"{label}: native_decode returned None")
        qkv = torch.cat([case.q.flatten(1), case.k.flatten(1), case.v.flatten(1)], dim=1)
        with reported(label):
            out = call_attention(call, spec.layer, qkv, spec.num_heads, spec.head_dim)
        flat = case.view.k_cache.reshape(-1, spec.num_kv_heads, spec.head_dim)
        if not torch.equal(flat[case.ctx.slot_mapping], case.k):
            fail(f"{label}\n  the step's K rows were not stored at their slot_mapping slots")
        atol, rtol = tolerance_for(self.tolerances, "float32")
        bad = find_mismatch(out, _reference(case), atol, rtol)
        if bad is not None:
            fail(f"{label}\n  output differs from the float64 reference: {bad.summary(atol, rtol)}")


def _completed(run: AttentionRun) -> AttentionRun:
    if run.error:
        fail(run.error)
    return run


def _dims(spec: BatchSpec) -> dict:
    """The scale, window and per-layer attention a backend is built with for ``spec``: per layer,
    the constructor's scale and window are another layer's (``BatchSpec.per_layer``)."""
    layers = spec.layer_attentions()
    if not layers:
        return {"scale": spec.softmax_scale, "sliding_window": spec.sliding_window}
    return {"scale": layers[0].scale, "sliding_window": layers[0].sliding_window, "layers": layers}


def _reference(case: AttentionCase, **variant) -> torch.Tensor:
    spec = case.spec
    kw = {"scale": spec.softmax_scale, "sliding_window": spec.sliding_window, "softcap": spec.softcap,
          **variant}
    keys, values = kw.pop("keys", case.keys), kw.pop("values", case.values)
    out = reference_attention(case.q, keys, values, list(spec.query_lens), **kw)
    return out.to(case.q.device)


def _check_finite(run: AttentionRun) -> None:
    bad = ~torch.isfinite(run.out)
    if bad.any():
        token, head = (int(i) for i in bad.nonzero()[0][:2])
        fail(
            f"{run.label}\n  {int(bad.sum())} output values are NaN or inf (first: {run.case.locate(token)}, "
            f"head {head}). The suite fills every cache slot outside the sequences' contexts, and "
            f"block-table padding, with NaN: the backend read slots it must not (past seq_len, "
            f"another row or block), or left output rows unwritten"
        )


def _bad_sequences(
    case: AttentionCase, out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float
) -> str:
    err_ok = ((out.double() - expected).abs() <= atol + rtol * expected.abs()).flatten(1).all(dim=1)
    seqs = sorted({case.sequence_of(int(t)) for t in (~err_ok).nonzero().flatten()})
    spec = case.spec
    return ", ".join(
        f"{i} (query_len {spec.query_lens[i]}, context_len {spec.context_lens[i]})" for i in seqs
    )


def _diagnose(case: AttentionCase, out: torch.Tensor, atol: float, rtol: float) -> list[str]:
    """Name the common mistakes whose result the backend's output equals."""
    spec = case.spec
    new_only = {
        "keys": [k[c:] for c, k in zip(spec.context_lens, case.keys)],
        "values": [v[c:] for c, v in zip(spec.context_lens, case.values)],
    }
    variants = [
        ("attention WITHOUT the causal mask (queries see later tokens)", {"causal": False}),
        ("attention over this step's new tokens only (the cached context is ignored)", new_only),
    ]
    if spec.sliding_window is not None:
        variants.append(("attention WITHOUT the sliding window", {"sliding_window": None}))
    if 1 < spec.num_kv_heads < spec.num_heads:
        variants.append(
            (
                (
                    "GQA with query head h reading KV head h % num_kv_heads "
                    "(expected h // (num_heads // num_kv_heads))"
                ),
                {"gqa": "interleaved"},
            )
        )
    if spec.scale is not None:
        variants.append(
            (
                "the default scale head_dim ** -0.5 instead of the `scale` given",
                {"scale": spec.head_dim**-0.5},
            )
        )
    return [
        text
        for text, kw in variants
        if find_mismatch(out, _reference(case, **kw), atol, rtol) is None
    ]


def _preview(row: torch.Tensor) -> str:
    values = ", ".join(f"{x:.4g}" for x in row.flatten()[:3].double().tolist())
    return f"[{values}, ...]"
