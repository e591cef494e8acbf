"""``MLAConfig``: the multi-head latent attention facts of a DeepSeek-V2/V3 ``config.json``.

MLA caches one latent vector per token and layer (``kv_lora_rank`` numbers,
after ``kv_a_layernorm``) plus one RoPE key shared by all heads
(``qk_rope_head_dim``); ``kv_b_proj`` expands the latent to per-head keys
(``qk_nope_head_dim``) and values (``v_head_dim``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmplug.interfaces.config_fields import ConfigReader

HF_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128}


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # (nope + rope)^-0.5, times yarn's mscale(factor, mscale_all_dim)^2
    rope_interleave: bool = True  # RoPE on pairs (2i, 2i+1), as DeepSeek's checkpoints expect

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token and layer: the latent, then the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_config_from_hf(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None,
                       where: str = "config.json") -> MLAConfig:
    """The MLA record of an HF config (an architecture with MLA asks: ``ModelConfig.from_hf(mla=True)``)."""
    # a missing key takes transformers' default (the same for V2 and V3), as HF's loader would
    r = ConfigReader(cfg, where)
    q_lora = r.int("q_lora_rank", None, low=0) or None if "q_lora_rank" in cfg else HF_DEFAULTS["q_lora_rank"]
    nope, rope = (r.int(k, HF_DEFAULTS[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim"))
    return MLAConfig(
        q_lora_rank=q_lora,
        kv_lora_rank=r.int("kv_lora_rank", HF_DEFAULTS["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=r.int("v_head_dim", HF_DEFAULTS["v_head_dim"]),
        softmax_scale=(nope + rope) ** -0.5 * _mscale_squared(rope_scaling),
        rope_interleave=r.flag("rope_interleave", True),
    )


def _mscale_squared(scaling: dict[str, Any] | None) -> float:
    # transformers' yarn_apply_mscale: any non-default rope type with mscale_all_dim set
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale
