"""``gptq``: GPTQ (Frantar et al., 2022), written in the GPTQ v1 format.

Per linear layer, from its calibration inputs ``X [tokens, in]``:
``H = 2 XᵀX / tokens``; dead inputs (``H_jj = 0``) get ``H_jj = 1`` and a zero
weight column; with act-order the columns are visited by decreasing
``H_jj``; ``H += percdamp * mean(diag H) * I``; ``U`` = the upper Cholesky
factor of ``H⁻¹``. Columns are then quantized one by one, each one's
rounding error ``(w - q) / U_jj`` spread over the columns not yet quantized
through row ``j`` of ``U`` — inside a block of ``block_size`` columns at
once, and to the columns past the block in one matmul when the block ends
(lazy batch updates). A group's scale and zero are computed from the
(error-updated) weights when the walk reaches its first column; with
act-order, group ``k`` is the ``k``-th run of ``group_size`` visited columns and
``g_idx`` maps each input column back to it.

Layers are quantized in order and within a layer in the order the data flows
(q/k/v, o, gate/up, down: "true sequential"), each group seeing the outputs of
the already quantized ones.
"""

from __future__ import annotations

import torch
from lmplug_quant.quantizers.base import BaseQuantizer, GroupOptions, prefix, split_windows
from lmplug_quant.quantizers.formats import gptq_config, gptq_tensors
from lmplug_quant.quantizers.grid import dequantize_groups, grid_params, quantize
from pydantic import Field


class GPTQQuantizerOptions(GroupOptions):
    desc_act: bool = Field(default=False, description="act-order: quantize columns by decreasing Hessian diagonal")
    sym: bool = Field(default=True, description="symmetric grid (zero at 2**(bits-1))")
    percdamp: float = Field(default=0.01, gt=0, description="dampening, a fraction of the mean Hessian diagonal")
    block_size: int = Field(default=128, gt=0, description="columns per lazy batch update")


def hessian(x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``2 XᵀX / n`` of inputs ``x [n, in]``, or of chunks ``[..., in]`` stacked (float32)."""
    chunks = [c.reshape(-1, c.shape[-1]).float() for c in (x if isinstance(x, list) else [x])]
    n = sum(c.shape[0] for c in chunks)
    h = torch.zeros(chunks[0].shape[1], chunks[0].shape[1])
    for c in chunks:
        h.addmm_(c.T, c, alpha=2.0 / n)
    return h


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, sym: bool = True,
                  percdamp: float = 0.01, desc_act: bool = False, block_size: int = 128
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w [out, in]`` given the Hessian ``h [in, in]``. Returns ``q [out, in]`` int32,
    ``scales``/``zeros [groups, out]`` and ``g_idx [in]``, in the original column order."""
    w = w.clone().float()
    h = h.clone().float()
    out, n = w.shape
    g = n if group_size == -1 else group_size
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else torch.arange(n)
    w, h = w[:, perm], h[perm][:, perm]
    h += percdamp * torch.mean(torch.diag(h)) * torch.eye(n)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.zeros(out, n, dtype=torch.int32)
    scales, zeros = [], []
    scale = zero = None
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # a new group starts: its grid from the current (updated) weights
                ahead = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :g]
                scale, zero = grid_params(ahead, bits, sym)
                scales.append(scale)
                zeros.append(zero)
            wc = w1[:, i]
            qc = quantize(wc[:, None], scale, zero, bits)[:, 0]
            q[:, col] = qc
            e = (wc - scale * (qc.float() - zero)) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    g_idx = torch.arange(n) // g  # group of each visited position
    inv = torch.argsort(perm)
    return q[:, inv], torch.stack(scales), torch.stack(zeros), g_idx[inv]


class GPTQQuantizer(BaseQuantizer):
    name = "gptq"
    Options = GPTQQuantizerOptions

    def quantize_model(self, model, windows, progress):
        o = self.options
        tensors: dict[str, torch.Tensor] = {}
        n = model.cfg.num_layers

        def run(i: int, inputs: list[torch.Tensor], linears: tuple[str, ...]) -> None:
            h = hessian(inputs)
            for linear in linears:
                q, scales, zeros, g_idx = gptq_quantize(model.weight(i, linear), h, o.bits, o.group_size,
                                                        o.sym, o.percdamp, o.desc_act, o.block_size)
                model.set_weight(i, linear, dequantize_groups(q, scales, zeros, g_idx))
                tensors.update(gptq_tensors(prefix(i, linear), q, scales, zeros, g_idx, o.bits, o.dtype))

        with torch.no_grad():
            xs = [model.embed(w) for w in split_windows(windows)]
            for i in range(n):
                a = [model.attn_input(i, x) for x in xs]
                run(i, a, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
                c = [model.attn_context(i, ai) for ai in a]
                del a
                run(i, c, ("self_attn.o_proj",))
                xs = [model.attn_output(i, x, ci) for x, ci in zip(xs, c)]
                del c
                m = [model.mlp_input(i, x) for x in xs]
                run(i, m, ("mlp.gate_proj", "mlp.up_proj"))
                d = [model.down_input(i, mi) for mi in m]
                del m
                run(i, d, ("mlp.down_proj",))
                xs = [model.mlp_output(i, x, di) for x, di in zip(xs, d)]
                del d
                progress("gptq: layers", i + 1, n)
        return tensors, gptq_config(o.bits, o.group_size, o.desc_act, o.sym)
