"""An EAGLE head's decoder layer through the native decode step (``lmplug.kit.native_step``).

The head's layer is a Llama layer without ``input_layernorm`` (``decode_step_f32``'s pre style
with no input norm: the attention reads x itself) whose projections are separate ``nn.Linear``
modules, not the core's fused linear layers with a quant method. Its products are the kit's C
product over fused float32 ``W^T`` copies made once here (qkv = cat(q, k, v), gate_up =
cat(gate, up); biases where the head has them): on one compute thread only, as the core's own
float32 products (``lmplug.kit.native_dense``). The module's weights move into those copies
(views of their rows, same values), so the Python layer (CUDA, more threads, a prompt's
catch-up) runs on the same memory and no second copy of the layer is kept.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lmplug_speculative.eagle_head import EagleHead

from lmplug.kit import native_dense
from lmplug.kit.native_step import LayerForm, NativeDecodeStep


def native_layer(head: EagleHead, attention) -> NativeDecodeStep | None:
    """The head's layer as a one-layer native plan attending through ``attention`` (the head's
    backend, cache layer 0), or None: not float32 on the CPU, more than one compute thread, no
    fused library. (A step the attention backend has no native form for keeps the Python layer.)"""
    layer, cfg = head.layers[0], head.config
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_proj.weight.dtype != torch.float32 or not attn.q_proj.weight.is_cpu:
        return None
    products = (_product("qkv_proj", attn.q_proj, attn.k_proj, attn.v_proj), _product("o_proj", attn.o_proj),
                _product("gate_up_proj", mlp.gate_proj, mlp.up_proj), _product("down_proj", mlp.down_proj))
    if any(p is None for p in products):
        return None
    geometry = SimpleNamespace(backend=attention, layer=0, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, q_norm=None, k_norm=None)
    form = LayerForm("pre", (None, layer.post_attention_layernorm, None, None), geometry,
                     SimpleNamespace(intermediate=cfg.intermediate_size), rope=head.rope, products=products)
    return NativeDecodeStep.for_layers([form], cfg.hidden_size)


def _product(name: str, *linears: torch.nn.Linear):
    return native_dense.stacked([m.weight for m in linears], [m.bias for m in linears],
                                f"eagle head {name} (the core's C product)")
