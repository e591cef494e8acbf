"""The native decode step: every decoder layer of a decode step in one C call.

At batch 1 on a CPU a small model's token is ~30 layers of ~12 ops each, and the Python and
dispatch between the ops cost about as much as the matrix products. Where every plugin on a
layer's path hands the core a C function (``lmplug.kit.native``: the quant method a
product per linear layer, the attention backend a decode attention per step), the core runs
all the layers in ``decode_step_f32`` (``csrc/fused_cpu_ops.c``): the norms, residual adds,
RoPE and SiLU / tanh-GELU * mul are the fused CPU ops' own functions, so those give the Python
path's bits, and the products and attention are the plugins'.

It is planned once per model, on its first forward (after loading): ``NativeDecodeStep.build``
returns None, and the model keeps the Python path, unless the model is one process (no tensor
parallelism), float32, with the fused CPU ops built, and every layer describes itself as a
``LayerForm`` (its ``native_form``: the kit's dense ``DecoderLayer``, the Gemma 2/3, Phi-3,
SmolLM3, OLMo 2 and Granite layers of ``lmplug_models.blocks``) of one geometry, each with its
RoPE (plain rotate-half tables, any width, or none) and linear layers that all have a native
product (the quant method's, or for the core's plain float32 weights on one thread the kit's own:
``native_dense``). Each
step then asks ``fits`` (every sequence's query short: a decode, or a speculative verify's
``k + 1`` rows or draft tree; no state layers) and the attention backend's ``native_decode``
(None: this step takes the Python path). A verify's rows go through the same products (the
quant method's small-M kernels read each weight once for all of them) and each row's attention
is a decode row of its own: on the demo model a verify of 4 drafts costs about 1.3-1.5 decode
steps instead of 2.4-2.7 through the Python layers (``benchmarks/bench_speculative.py``).
The engine plan decides whether it runs (``cpu.native_step``, overridden by ``LMPLUG_NATIVE_STEP``; benchmarks compare the two).
A drafter's own layers run through a plan of their own (``for_layers``, over the drafter's cache
views): an MTP module's layer (its ``native_form``), an EAGLE head's (``LayerForm.products``: the
head's own products; no input norm), following the target's decision (``native_step_allowed``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from lmplug.interfaces.step import StepContext
from lmplug.kit import extras, fused_cpu, native_dense
from lmplug.kit.native import NativeCall
from lmplug.kit.rope import RotaryEmbedding
from lmplug.kit.threads import compute_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# the longest query per sequence a step may have to run natively: a verify's k + 1 rows or a
# draft tree's nodes (the small-M products read each weight block once for up to 8 rows); longer
# queries are prefills, whose attention the Python path's matmuls do better
MAX_QUERY_TOKENS = 16
# decode_step_f32's stages, as it reports a failure (layer * 8 + stage)
STAGES = {1: "qkv_proj", 2: "rope", 3: "attention", 4: "o_proj", 5: "gate_up_proj", 6: "down_proj"}


class _Product(ctypes.Structure):
    _fields_ = [("fn", _P), ("ctx", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _Product),
                ("o", _Product), ("gate_up", _Product), ("down", _Product), ("kv_layer", _I64),
                ("pre_ff_norm", _P), ("post_ff_norm", _P), ("cos", _P), ("sin", _P), ("max_position", _I64),
                ("rotary_dim", _I64), ("style", ctypes.c_int32), ("act", ctypes.c_int32),
                ("qk_norm", ctypes.c_int32), ("multiplier", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("eps", ctypes.c_float), ("positions", _P), ("attention", _P),
                ("attention_ctx", _P), ("threads", ctypes.c_int), ("scratch", _P)]


# decode_step_f32's codes for a layer's norm placement, activation and q/k norms
STYLES, ACTS, QK_NORMS = ("pre", "sandwich", "post"), ("silu", "gelu_tanh"), (None, "head", "full")


@dataclass(frozen=True)
class LayerForm:
    """A decoder layer as ``decode_step_f32`` runs it, which the layer describes itself
    (``native_form(rope)``, None where it has no native form): where its norms sit (``style``:
    "pre", "sandwich" or "post", ``decode_step_f32``'s comment has the formulas), its four
    norms (input, post-attention, pre-feed-forward, post-feed-forward; None where absent), its
    attention block (``qkv_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ``backend``, ``layer``: the
    kit's ``Attention``'s attributes), its gated MLP (``gate_up_proj``, ``down_proj``,
    ``intermediate``), the gate's activation, the q/k norms (per "head" or over all heads: "full"),
    its RoPE (None: none) and rotated width (None: the whole head), and the residual multiplier.
    ``products``: the four products (qkv, o, gate_up, down) as ``NativeCall``s where the layer
    hands them itself (an EAGLE head's copies of its separate weights; then ``attn`` needs only
    the geometry, ``backend``, ``layer`` and q/k norms, ``mlp`` only ``intermediate``); None:
    each linear layer's, asked of its quant method."""

    style: str
    norms: tuple
    attn: torch.nn.Module
    mlp: torch.nn.Module
    act: str = "silu"
    qk_norm: str | None = None
    rope: RotaryEmbedding | None = None
    rotary_dim: int | None = None
    multiplier: float = 1.0
    products: tuple | None = None


def _f32(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def _ptr(norm: torch.nn.Module | None) -> int | None:
    return None if norm is None else norm._parameters["weight"].data_ptr()


class NativeDecodeStep:
    """One plan: a model's layers (or a drafter's own) as ``decode_step_f32`` reads them, and the
    plugins' calls."""

    def __init__(self, model: torch.nn.Module | None, lib: ctypes.CDLL, layers: ctypes.Array, calls: list[list],
                 eps: float, first: LayerForm, hidden: int) -> None:
        self.model = model  # whose kv_views a run without views reads (None: a layers' plan)
        self.lib = lib
        self.layers = layers
        self.calls = calls  # per layer: the four products (NativeCall), kept alive and named on errors
        self.eps = eps
        attn = first.attn
        self.backend = attn.backend
        self.shape = (hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim, first.mlp.intermediate)
        self._scratch = torch.empty(0, dtype=torch.float32)

    @classmethod
    def build(cls, model: torch.nn.Module) -> NativeDecodeStep | None:
        """The plan, or None where some part of the model has no native form (module docstring)."""
        if model.tp.is_parallel or not len(model.layers):
            return None
        forms = []
        for layer in model.layers:
            describe = getattr(layer, "native_form", None)
            forms.append(describe(model.rope) if describe is not None else None)
        return cls.for_layers(forms, model.config.hidden_size, model)

    @classmethod
    def for_layers(cls, forms: list[LayerForm | None], hidden: int,
                   model: torch.nn.Module | None = None) -> NativeDecodeStep | None:
        """The plan of ``forms`` over hidden size ``hidden``, or None where some layer has no
        native form (None in ``forms``) or one differs from the first's geometry. Without
        ``model``, every ``run`` names its cache views (a drafter's own layers: an MTP module's,
        an EAGLE head's, over a one-layer cache)."""
        if not forms or any(form is None for form in forms):
            return None
        lib = fused_cpu.library()
        if lib is None:
            return None
        first = forms[0]
        eps = next(n for n in first.norms if n is not None).eps
        geometry = (first.attn.backend, first.attn.num_heads, first.attn.num_kv_heads, first.attn.head_dim,
                    first.mlp.intermediate)
        table, calls = (_Layer * len(forms))(), []
        for i, form in enumerate(forms):
            attn, mlp = form.attn, form.mlp
            if (attn.backend, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate) != geometry:
                return None
            norms = [n for n in (*form.norms, attn.q_norm, attn.k_norm) if n is not None]
            if any(n.eps != eps or not _f32(n._parameters["weight"]) for n in norms):
                return None
            if (form.qk_norm is None) != (attn.q_norm is None) or form.style not in STYLES or form.act not in ACTS \
                    or form.qk_norm not in QK_NORMS:
                return None
            rope, rotary_dim = form.rope, form.rotary_dim or attn.head_dim
            cos = sin = None
            if rope is not None:
                cos, sin = rope._buffers.get("cos"), rope._buffers.get("sin")
                if type(rope).forward is not RotaryEmbedding.forward or not (_f32(cos) and _f32(sin)) \
                        or cos.shape[1] != rotary_dim or rotary_dim > attn.head_dim or rotary_dim % 2:
                    return None
            products = list(form.products) if form.products is not None else _products(attn, mlp)
            if products is None or len(products) != 4 or any(call is None for call in products):
                return None
            n1, n2, n3, n4 = form.norms
            table[i] = _Layer(_ptr(n1), _ptr(n2), _ptr(attn.q_norm), _ptr(attn.k_norm),
                              *(_Product(c.fn, c.ctx) for c in products), attn.layer, _ptr(n3), _ptr(n4),
                              None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                              0 if cos is None else cos.shape[0], rotary_dim, STYLES.index(form.style),
                              ACTS.index(form.act), QK_NORMS.index(form.qk_norm),
                              form.multiplier if form.style == "pre" else 1.0)
            calls.append(products)
        return cls(model, lib, table, calls, eps, first, hidden)

    @staticmethod
    def fits(x: torch.Tensor, ctx: StepContext) -> bool:
        """This step can run natively: float32 CPU rows, each sequence's query at most
        ``MAX_QUERY_TOKENS`` after some cached context (decodes, a speculative verify's chain or
        draft tree; a prompt's first chunk keeps the Python path's prefill attention), no state
        layers, eager (not traced). The attention backend may still decline it (``run``)."""
        short = ctx.num_decodes == x.shape[0] or (ctx.max_query_len <= MAX_QUERY_TOKENS and all(
            q < s for q, s in zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)))
        return (short and ctx.state_slots is None and x.dtype == torch.float32 and x.is_cpu and not x.requires_grad
                and not torch.compiler.is_compiling())

    def run(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext, views: list | None = None,
            num_layers: int | None = None) -> torch.Tensor | None:
        """The hidden states after the last layer (``x`` [T, hidden], changed in place), or None
        when the attention backend has no native form for this step (the caller runs the layers).
        ``views`` and ``num_layers``: only the first layers, attending through other cache views
        (a layer-skip drafter's: the model's own layers over a cache of its own)."""
        count = len(self.layers) if num_layers is None else num_layers
        if views is None:
            if self.model is None:
                raise ValueError("native decode step: a plan of a drafter's own layers runs over the views "
                                 "its caller names")
            views = self.model.kv_views
        elif not 0 < count <= len(self.layers) or any(self.layers[i].kv_layer >= len(views) for i in range(count)):
            return None
        attention: NativeCall | None = extras.native_decode(self.backend, ctx, views)
        if attention is None:
            return None
        rows = x.shape[0]
        hidden, heads, kv_heads, head_dim, inter = self.shape
        need = rows * (3 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * inter)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        # the runner's rows and positions are contiguous int64 already: the checks, not the ops (each
        # op costs some 10 us in a decode step, once the weights have swept the caches)
        if not x.is_contiguous():
            x = x.contiguous()
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        step = _Step(rows, hidden, heads, kv_heads, head_dim, inter, self.eps, positions.data_ptr(),
                     attention.fn, attention.ctx, compute_threads(), self._scratch.data_ptr())
        failed = ctypes.c_int64(0)
        status = self.lib.decode_step_f32(self.layers, count, ctypes.byref(step), x.data_ptr(),
                                          ctypes.byref(failed))
        if status:
            self._fail(status, failed.value, attention, positions)
        return x

    def _fail(self, status: int, where: int, attention: NativeCall, positions: torch.Tensor) -> None:
        layer, stage = divmod(where, 8)
        name = STAGES.get(stage, f"stage {stage}")
        if name == "rope":
            raise IndexError(f"native decode step: layer {layer}: a position of {positions.tolist()} is outside "
                             f"the RoPE table [0, {self.layers[layer].max_position})")
        call = attention if name == "attention" else \
            self.calls[layer][("qkv_proj", "o_proj", "gate_up_proj", "down_proj").index(name)]
        raise RuntimeError(f"native decode step: layer {layer} {name}: {call.describe(status)}")


def _products(attn: torch.nn.Module, mlp: torch.nn.Module) -> list[NativeCall] | None:
    """A layer's four products, each its quant method's (or the kit's for plain float32 weights),
    wrapped by the adapter plugin's where the layer has LoRA slots; None where one has none."""
    products = []
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        call = extras.native_product(linear.quant, linear) or native_dense.product(linear)
        if call is not None and linear.lora is not None:  # LoRA slots: the adapter plugin's product
            call = linear.lora.native_product(call)
        if call is None:
            return None
        products.append(call)
    return products
