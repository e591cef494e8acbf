"""``awq``: activation-aware weight quantization (Lin et al., 2023), written in the AWQ GEMM format.

Per decoder layer, on the float model's calibration activations, four groups of
linears that share an input get per-input-channel scales ``s``:

- ``input_layernorm`` -> q/k/v (loss: the attention block's output, o_proj included),
- ``v_proj`` -> ``o_proj`` (only without GQA, as AutoAWQ: with GQA one v channel feeds
  several o channels, whose scales would have to be tied),
- ``post_attention_layernorm`` -> gate/up (loss: the MLP's output),
- ``up_proj`` -> ``down_proj`` (loss: down_proj's output).

``s = mean|x|^α / mean(|W| / max|W| of its group)^(1-α)``, normalised by
``sqrt(max s · min s)``, for α on a grid of ``n_grid`` steps in ``[0, 1)`` (plus
``s = 1``); the α whose quantized weights ``Q(W·s)/s`` give the smallest mean
squared block-output error wins. ``s`` is folded exactly: the preceding op's
output is divided by it (RMSNorm weight, or v_proj / up_proj rows) and the
linears' columns multiplied. Then (``clip``) each weight group's clipping
range ``±max|W|·(1 - k/n_grid)``, ``k < n_grid/2``, is chosen to minimise that
group's output error on sampled tokens (not for q/k, whose error the
softmax reshapes), and the weights are quantized asymmetrically per group.
"""

from __future__ import annotations

from typing import Literal

import torch
from lmplug_quant.quantizers.base import BaseQuantizer, GroupOptions, flat, prefix, split_windows
from lmplug_quant.quantizers.formats import awq_config, awq_tensors
from lmplug_quant.quantizers.grid import fake_quantize, quantize_groups
from lmplug_quant.quantizers.reference import FloatLlama
from pydantic import Field

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


class AWQQuantizerOptions(GroupOptions):
    bits: Literal[4] = Field(default=4, description="bits per weight (the GEMM format is 4-bit)")
    n_grid: int = Field(default=20, ge=2, description="steps of the alpha (and clipping) grid")
    clip: bool = Field(default=True, description="search each group's clipping range")
    search_windows: int = Field(default=4, ge=1, description="calibration windows the scale search "
                                "evaluates the block output on (the statistics use all)")
    clip_tokens: int = Field(default=512, ge=1, description="tokens sampled for the clipping search")


def fake_quantize_groups(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    out, n = w.shape
    g = n if group_size == -1 else group_size
    return fake_quantize(w.reshape(-1, g), bits, sym=False).reshape(out, n)


def weight_mean(ws: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel: mean over rows of ``|W| / max|W| of its group`` (AutoAWQ's w_mean)."""
    w = torch.cat(ws)
    n = w.shape[1]
    g = n if group_size == -1 else group_size
    grouped = w.abs().reshape(-1, g)
    return (grouped / grouped.amax(1, keepdim=True).clamp(min=1e-12)).reshape(-1, n).mean(0)


def search_scale(x_mean: torch.Tensor, ws: list[torch.Tensor], block, reference: torch.Tensor,
                 bits: int, group_size: int, n_grid: int) -> torch.Tensor:
    """The ``s [in]`` minimising ``|block(Q(W s) / s) - reference|²`` over the α grid.
    ``block(weights)`` runs the block with the given weights of ``ws``' linears."""
    w_mean = weight_mean(ws, group_size)
    best, best_s = float("inf"), torch.ones_like(x_mean)
    candidates = [None] + [k / n_grid for k in range(n_grid)]
    for alpha in candidates:
        if alpha is None:
            s = torch.ones_like(x_mean)
        else:
            s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha).clamp(min=1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
        trial = [fake_quantize_groups(w * s, bits, group_size) / s for w in ws]
        loss = (block(trial) - reference).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, n_grid: int) -> torch.Tensor:
    """Per (row, group) clipping bound ``[out, groups]`` minimising the group's output error on
    tokens ``x [t, in]``."""
    out, n = w.shape
    g = n if group_size == -1 else group_size
    wg = w.reshape(out, n // g, g)
    xg = x.reshape(x.shape[0], n // g, g)
    ref = torch.einsum("tgk,ogk->otg", xg, wg)
    org_max = wg.abs().amax(-1)  # [out, groups]
    best_max, best_err = org_max.clone(), torch.full_like(org_max, float("inf"))
    for k in range(n_grid // 2):
        max_val = org_max * (1 - k / n_grid)
        clipped = torch.maximum(torch.minimum(wg, max_val[..., None]), -max_val[..., None])
        qw = fake_quantize(clipped.reshape(-1, g), bits, sym=False).reshape(out, n // g, g)
        err = (torch.einsum("tgk,ogk->otg", xg, qw) - ref).pow(2).mean(1)  # [out, groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    out, n = w.shape
    g = n if group_size == -1 else group_size
    m = max_val[..., None]
    return torch.maximum(torch.minimum(w.reshape(out, n // g, g), m), -m).reshape(out, n)


def fold_scales(model: FloatLlama, i: int, s: torch.Tensor, before: str, linears: tuple[str, ...]) -> None:
    """Divide the output of ``before`` (a norm weight or a linear's rows) by ``s`` and multiply the
    input columns of ``linears`` by it: the float function is unchanged."""
    t = model.tensors
    key = f"model.layers.{i}.{before}"
    if before.endswith("layernorm"):
        t[f"{key}.weight"] = t[f"{key}.weight"] / s
    else:
        t[f"{key}.weight"] = t[f"{key}.weight"] / s[:, None]
        if f"{key}.bias" in t:
            t[f"{key}.bias"] = t[f"{key}.bias"] / s
    for linear in linears:
        model.set_weight(i, linear, model.weight(i, linear) * s)


class AWQQuantizer(BaseQuantizer):
    name = "awq"
    Options = AWQQuantizerOptions

    def scale_layer(self, model: FloatLlama, i: int, x: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Search and fold layer ``i``'s scales; returns each linear's (scaled) input tokens."""
        o, c = self.options, model.cfg
        k = max(1, -(-o.search_windows // len(x[0])))  # chunks holding search_windows windows
        a = [model.attn_input(i, xi) for xi in x]
        ctx = [model.attn_context(i, ai) for ai in a]
        x2 = [model.attn_output(i, xi, ci) for xi, ci in zip(x, ctx)]
        m = [model.mlp_input(i, xi) for xi in x2]
        d = [model.down_input(i, mi) for mi in m]
        inputs = {"a": flat(a), "ctx": flat(ctx), "m": flat(m), "d": flat(d)}
        w = lambda name: model.weight(i, name)

        def attn_block(ws):
            return torch.cat([model.linear(i, "self_attn.o_proj", model.attn_context(i, ai, dict(zip(QKV, ws))))
                              for ai in a[:k]])

        ref = attn_block([w(n) for n in QKV])
        s = search_scale(inputs["a"].abs().mean(0), [w(n) for n in QKV], attn_block, ref, o.bits,
                         o.group_size, o.n_grid)
        fold_scales(model, i, s, "input_layernorm", QKV)
        inputs["a"] /= s

        if c.num_heads == c.num_kv_heads and c.head_dim * c.num_heads == w("self_attn.v_proj").shape[0]:
            cs = flat(ctx[:k])
            s = search_scale(inputs["ctx"].abs().mean(0), [w("self_attn.o_proj")],
                             lambda ws: cs @ ws[0].T, cs @ w("self_attn.o_proj").T, o.bits, o.group_size, o.n_grid)
            fold_scales(model, i, s, "self_attn.v_proj", ("self_attn.o_proj",))
            inputs["ctx"] /= s

        ms = flat(m[:k])

        def mlp_block(ws):
            gate, up = ws
            return (torch.nn.functional.silu(ms @ gate.T) * (ms @ up.T)) @ w("mlp.down_proj").T

        s = search_scale(inputs["m"].abs().mean(0), [w(n) for n in GATE_UP], mlp_block,
                         mlp_block([w(n) for n in GATE_UP]), o.bits, o.group_size, o.n_grid)
        fold_scales(model, i, s, "post_attention_layernorm", GATE_UP)
        inputs["m"] /= s

        ds = flat(d[:k])
        s = search_scale(inputs["d"].abs().mean(0), [w("mlp.down_proj")], lambda ws: ds @ ws[0].T,
                         ds @ w("mlp.down_proj").T, o.bits, o.group_size, o.n_grid)
        fold_scales(model, i, s, "mlp.up_proj", ("mlp.down_proj",))
        inputs["d"] /= s
        return {"self_attn.q_proj": inputs["a"], "self_attn.k_proj": inputs["a"],
                "self_attn.v_proj": inputs["a"], "self_attn.o_proj": inputs["ctx"],
                "mlp.gate_proj": inputs["m"], "mlp.up_proj": inputs["m"], "mlp.down_proj": inputs["d"]}

    def quantize_model(self, model, windows, progress):
        o = self.options
        tensors: dict[str, torch.Tensor] = {}
        n = model.cfg.num_layers
        with torch.no_grad():
            xs = [model.embed(w) for w in split_windows(windows)]
            for i in range(n):
                nxt = [model.layer(i, x) for x in xs]  # float outputs feed the next layer (as AutoAWQ)
                inputs = self.scale_layer(model, i, xs)
                for linear, x in inputs.items():
                    wt = model.weight(i, linear)
                    if o.clip and linear not in ("self_attn.q_proj", "self_attn.k_proj"):
                        step = max(1, x.shape[0] // o.clip_tokens)
                        wt = apply_clip(wt, search_clip(wt, x[::step], o.bits, o.group_size, o.n_grid), o.group_size)
                    q, scales, zeros = quantize_groups(wt, o.bits, o.group_size, sym=False)
                    tensors.update(awq_tensors(prefix(i, linear), q, scales, zeros, o.dtype))
                xs = nxt
                progress("awq: layers", i + 1, n)
        return tensors, awq_config(o.group_size)
