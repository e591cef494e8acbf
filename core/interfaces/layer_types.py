"""Which layers of a hybrid model are softmax attention and which carry a state, from config.json.

Readers an architecture's ``parse_config`` passes to ``ModelConfig.from_hf(layer_types=...)``:

- ``hybrid_layer_types``: ``layer_types`` ("full_attention" / "linear_attention", transformers 5),
  or the older ``attn_type_list`` (1 = full, 0 = linear; MiniMax), or else every
  ``full_attention_interval``-th layer is full (Qwen3-Next, default 4); "linear" is the
  architecture's state layer (lightning attention, gated DeltaNet).
- ``mamba2_fields``: a Mamba2 config has no attention fields; its keys map onto ``ModelConfig``'s
  (heads = SSM heads), every layer a Mamba2 (SSD) mixer.

A dense model has no state layers (``()``: every layer is attention). A list whose length differs
from ``num_hidden_layers``, or with an unknown entry, is a ``ModelLoadError``.
"""

from __future__ import annotations

from typing import Any

from lmplug.interfaces.config_fields import ConfigReader
from lmplug.interfaces.state import ATTENTION


def hybrid_layer_types(r: ConfigReader, num_layers: int, linear: str, *, attn_type_list: bool = False,
                       interval: int | None = None) -> tuple[str, ...]:
    """Each layer's kind: ``ATTENTION`` or ``linear``. ``attn_type_list``: the older key is read
    too; ``interval``: the default of ``full_attention_interval`` when the config lists no
    layers (None: the list is required)."""
    names: dict[Any, str] = {"full_attention": ATTENTION, "linear_attention": linear}
    raw = r.cfg.get("layer_types")
    key = "layer_types"
    if raw is None and attn_type_list and r.cfg.get("attn_type_list") is not None:
        key, raw = "attn_type_list", r.cfg["attn_type_list"]
        names = {1: ATTENTION, 0: linear}
    if raw is None:
        if interval is None:
            r.fail("layer_types", "is missing: this model's config lists each layer's attention type")
        every = r.int("full_attention_interval", interval)
        return tuple(ATTENTION if (i + 1) % every == 0 else linear for i in range(num_layers))
    if not isinstance(raw, list) or len(raw) != num_layers:
        r.fail(key, f"must list one entry per layer ({num_layers}, num_hidden_layers), got {_size(raw)}")
    out = []
    for i, entry in enumerate(raw):
        if isinstance(entry, bool) or entry not in names:
            r.fail(key, f"entry {i} is {entry!r}; expected one of {sorted(names, key=str)}")
        out.append(names[entry])
    return tuple(out)


def mamba2_fields(r: ConfigReader) -> dict[str, Any]:
    """``ModelConfig`` fields of a Mamba2 config: heads and head_dim are the SSM's, the MLP-less
    block's "intermediate" width is ``expand * hidden_size``; no RoPE and no position limit of
    its own (32k unless the config gives ``max_position_embeddings``)."""
    hidden, heads, head_dim = r.int("hidden_size"), r.int("num_heads"), r.int("head_dim")
    expand = r.int("expand", 2)
    if heads * head_dim != expand * hidden:
        r.fail("num_heads", f"x head_dim ({heads} x {head_dim}) must equal expand x hidden_size "
               f"({expand} x {hidden}), the SSM's inner width")
    return {"hidden_size": hidden, "intermediate_size": expand * hidden, "num_heads": heads,
            "num_kv_heads": heads, "head_dim": head_dim, "rms_norm_eps": r.number("layer_norm_epsilon", 1e-5),
            "max_position_embeddings": r.int("max_position_embeddings", 32768)}


def _size(raw: Any) -> str:
    return f"{len(raw)} entries" if isinstance(raw, list) else type(raw).__name__
