"""A checkpoint's multi-token-prediction (MTP) module, run as a draft head over the target's features.

DeepSeek-V3 (arXiv:2412.19437, section 2.2) trains D sequential modules beside the model;
module k at position i combines the representation of the depth before (the model's final
hidden state for k = 1) with the embedding of the token k positions ahead:

    h'_i = M [RMSNorm(h_i) ; RMSNorm(Emb(t_{i+1}))]        (the paper's eq. 21)
    h''_i = TRM(h'_i)                                      (one decoder layer of the model's kind)
    p_{i+2} = OutHead(RMSNorm(h''_i))                      (the model's output head, shared)

The released weights take the concatenation embedding first, ``[enorm(Emb) ; hnorm(h)]``, which
is how vLLM and SGLang read them and how this module does. The hidden state h_i is the
target's final hidden state after its final norm (the input of its ``lm_head``). Drafting k > 1
tokens with one module chains it on its own output h''_i (before the head's norm), as vLLM and
SGLang do with DeepSeek-V3's single module.

Checkpoint layouts (HF names; L = ``num_hidden_layers``, module j of
``num_nextn_predict_layers``):

- DeepSeek-V3 / GLM-4.5: ``model.layers.{L+j}.`` + ``enorm.weight``, ``hnorm.weight``,
  ``eh_proj.weight`` [h, 2h], ``shared_head.norm.weight``, optional ``shared_head.head.weight``
  [V, h] and ``embed_tokens.weight`` (else the target's), and a decoder layer's tensors named as
  the target's layers name theirs (attention, MLP or MoE, both norms);
- Qwen3-Next: ``mtp.pre_fc_norm_embedding.weight`` (enorm), ``mtp.pre_fc_norm_hidden.weight``
  (hnorm), ``mtp.fc.weight`` (eh_proj), ``mtp.norm.weight`` (the head's norm) shared by the
  modules, and ``mtp.layers.{j}.*`` (the decoder layer); embedding and head are the target's.

``MTPModule`` holds one module j; its decoder layer is the target architecture's layer
``L + j`` (``new_layer``), attending through layer 0 of a cache of its own. Where the target
lets steps run natively (``native_step_allowed``) and the layer has a native form, a step that
fits runs it through a one-layer native decode step (``lmplug.kit.native_step``), as the
target runs its own layers; other steps (a prompt's catch-up) keep the Python layer.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from lmplug.interfaces.attention import AttentionBackend, KVLayerView
from lmplug.interfaces.quant import QuantMethod
from lmplug.interfaces.step import StepContext
from lmplug.kit.layers import RMSNorm
from lmplug.kit.native_step import NativeDecodeStep

_DEEPSEEK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_QWEN_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
# (DeepSeek tail, Qwen3-Next name) -> our parameter
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj",
        "shared_head.norm.weight": "head_norm.weight", "shared_head.head.weight": "head",
        "embed_tokens.weight": "embed.weight"}
_QWEN_OWN = {"mtp.pre_fc_norm_embedding.weight": "enorm.weight", "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
             "mtp.fc.weight": "eh_proj", "mtp.norm.weight": "head_norm.weight"}


def mtp_layout(names: list[str], num_layers: int) -> tuple[str, list[int]] | None:
    """("deepseek" | "qwen3_next", the module numbers present) of a checkpoint's tensor names, or
    None when it holds no MTP module (transformers drops them when it saves a model)."""
    deepseek = sorted({int(m[1]) - num_layers for n in names if (m := _DEEPSEEK.fullmatch(n))
                       and int(m[1]) >= num_layers and m[2] == "eh_proj.weight"})
    if deepseek:
        return "deepseek", deepseek
    if "mtp.fc.weight" in names:
        return "qwen3_next", sorted({int(m[1]) for n in names if (m := _QWEN_LAYER.fullmatch(n))})
    return None


class MTPModule(torch.nn.Module):
    """Module ``index`` of ``layout`` over ``target`` (a built target model: its ``new_layer``,
    ``rope``, ``embed_tokens``, ``compute_logits`` and weight names). ``forward(input_ids,
    features, ctx) -> hidden`` computes the module's output at each position (the pair
    (token t+1, feature t) at position t); ``compute_logits(hidden)`` the draft logits."""

    def __init__(self, target: torch.nn.Module, layout: str, index: int, names: list[str],
                 dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend) -> None:
        super().__init__()
        cfg = target.config
        self.config = _OneLayer()
        self.layout, self.index = layout, index
        self._target = (target,)  # not a submodule: its weights are the target's
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = torch.nn.Parameter(torch.empty(h, 2 * h, dtype=dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList([target.new_layer(cfg.num_layers + index, dtype, quant, attention,
                                                            kv_layer=0)])
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        own = {self.own_name(n) for n in names}
        self.head = (torch.nn.Parameter(torch.empty(cfg.vocab_size, h, dtype=dtype), requires_grad=False)
                     if "head" in own else None)
        self.embed = torch.nn.Embedding(cfg.vocab_size, h, dtype=dtype) if "embed.weight" in own else None
        if self.embed is not None:
            self.embed.weight.requires_grad_(False)
        self.views: list[KVLayerView] = []
        # the layer's one-layer native plan, on the first forward (after loading); False: none
        self._native_step: NativeDecodeStep | bool | None = None

    # -- compute ---------------------------------------------------------------------------------
    def bind_kv(self, views: list[KVLayerView]) -> None:
        self.views = views

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        target = self._target[0]
        embeds = (target.embed_tokens if self.embed is None else self.embed)(input_ids)
        x = F.linear(torch.cat([self.enorm(embeds), self.hnorm(features.to(embeds.dtype))], dim=-1), self.eh_proj)
        step = self._native_step
        if step is None:
            step = self._native_step = self._plan()
        if step and step.fits(x, ctx):
            out = step.run(x, ctx.positions, ctx, self.views)  # None: the attention declined this step
            if out is not None:
                return out
        return self.layers[0](x, ctx.positions, target.rope, self.views[0], ctx)

    def _plan(self) -> NativeDecodeStep | bool:
        """The layer's native plan, or False: the target keeps its steps in Python
        (``cpu.native_step: false``), not on the CPU, or the layer has no native form."""
        target = self._target[0]
        describe = getattr(self.layers[0], "native_form", None)
        if not getattr(target, "native_step_allowed", False) or describe is None or not self.eh_proj.is_cpu:
            return False
        return NativeDecodeStep.for_layers([describe(target.rope)], target.config.hidden_size) or False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.head_norm(hidden)
        if self.head is not None:
            return F.linear(normed, self.head)
        return self._target[0].compute_logits(normed)

    # -- checkpoint names ------------------------------------------------------------------------
    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this module."""
        return self.own_name(name) is not None or self._layer_tail(name) is not None

    def own_name(self, name: str) -> str | None:
        """Our parameter for one of this module's own (non-layer) tensors, else None."""
        if self.layout == "qwen3_next":
            return _QWEN_OWN.get(name)
        m = _DEEPSEEK.fullmatch(name)
        if m is None or int(m[1]) != self._target[0].config.num_layers + self.index:
            return None
        return _OWN.get(m[2])

    def _layer_tail(self, name: str) -> str | None:
        """The name inside the decoder layer of a tensor of this module's layer, else None."""
        cfg = self._target[0].config
        pattern, number = ((_QWEN_LAYER, self.index) if self.layout == "qwen3_next"
                           else (_DEEPSEEK, cfg.num_layers + self.index))
        m = pattern.fullmatch(name)
        return m[2] if m is not None and int(m[1]) == number else None

    def weight_target(self, name: str):
        """As the target model's ``weight_target``, for this module's tensors (None: another's)."""
        own = self.own_name(name)
        if own is not None:
            return own, None
        tail = self._layer_tail(name)
        if tail is None or tail in _OWN:
            return None
        # the target names layer 0's tensors "layers.0...": this module's one layer
        return self._target[0].weight_target(f"model.layers.0.{tail}")

    def split_tensor(self, name: str, tensor) -> list[tuple[str, torch.Tensor]]:
        """Stacked expert tensors split as the target splits its own (names kept in our layout)."""
        split = getattr(self._target[0], "split_tensor", None)
        tail = self._layer_tail(name)
        if split is None or tail is None:
            return [(name, tensor)]
        prefix = name[:-len(tail)]
        return [(prefix + n.removeprefix("model.layers.0."), t)
                for n, t in split(f"model.layers.0.{tail}", tensor, layers=self.layers)]

    def checkpoint_name(self, path: str, shard: str | None, *expert) -> str:
        """The checkpoint name of parameter ``path`` (for errors about missing tensors)."""
        number = self._target[0].config.num_layers + self.index
        own = _QWEN_OWN if self.layout == "qwen3_next" else {f"model.layers.{number}.{k}": v for k, v in _OWN.items()}
        for hf, ours in own.items():
            if ours in (path, path.removesuffix(".weight")):
                return hf
        name = self._target[0].checkpoint_name(path, shard, *expert)
        prefix = f"mtp.layers.{self.index}." if self.layout == "qwen3_next" else f"model.layers.{number}."
        return prefix + name.removeprefix("model.layers.0.")


class _OneLayer:
    """What the core's runner reads of a model's config: one cache layer."""

    num_layers = 1
