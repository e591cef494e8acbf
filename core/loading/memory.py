"""Will the model fit? Its size estimated from its config, compared with free memory, before
any tensor is allocated.

The estimate is a lower bound (the weights only, plus a KV reservation when the caller knows
it; quantized linear weights counted at 4 bits, the smallest lmplug loads), so a refusal means
the model cannot fit, never that it might not.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmplug.errors import ModelLoadError
from lmplug.interfaces.model_config import ModelConfig

QUANT_LINEAR_BYTES = 0.5
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")


def parameter_counts(mc: ModelConfig) -> tuple[int, int]:
    """(linear weights in the decoder layers, everything else) in numbers, ignoring biases/norms
    (so the count never exceeds the real one)."""
    h = mc.hidden_size
    if mc.mla is not None:
        m = mc.mla
        q = h * m.q_lora_rank + m.q_lora_rank * mc.num_heads * m.qk_head_dim if m.q_lora_rank \
            else h * mc.num_heads * m.qk_head_dim
        attn = (q + h * m.latent_dim + m.kv_lora_rank * mc.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
                + mc.num_heads * m.v_head_dim * h)
    else:
        attn = h * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    dense_mlp = 3 * h * mc.intermediate_size
    linear = 0
    for layer in range(mc.num_layers):
        mlp = dense_mlp
        if mc.moe is not None and mc.moe.is_sparse(layer):
            mlp = 3 * h * (mc.moe.num_experts * mc.moe.intermediate_size + mc.moe.shared_intermediate_size)
        linear += attn + mlp
    embeddings = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return linear, embeddings


def estimated_bytes(mc: ModelConfig, dtype: torch.dtype, quantized: bool, world_size: int = 1) -> int:
    """Bytes of one tensor-parallel rank's weights (a lower bound)."""
    linear, other = parameter_counts(mc)
    size = torch.empty((), dtype=dtype).element_size()
    per_linear = QUANT_LINEAR_BYTES if quantized else size
    return int((linear * per_linear + other * size) / max(1, world_size))


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: free CUDA memory, or Linux MemAvailable; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(mc: ModelConfig, where: str, dtype: torch.dtype, device: torch.device, *,
               quantized: bool = False, world_size: int = 1, kv_bytes: int = 0) -> None:
    """Raise ``ModelLoadError`` naming ``where`` and the size-driving keys when the model's
    weights (plus ``kv_bytes``) cannot fit in the free memory of ``device``."""
    needed = estimated_bytes(mc, dtype, quantized, world_size) + kv_bytes
    free = available_bytes(device)
    if free is None or needed <= free:
        return
    keys = ", ".join(f"{k}={mc.raw.get(k)}" for k in SIZE_KEYS)
    extra = f" and {kv_bytes / 2**30:.2f} GiB of KV cache" if kv_bytes else ""
    raise ModelLoadError(
        f"{where}: the model needs at least {needed / 2**30:.2f} GiB of {device.type} memory "
        f"(weights in {str(dtype).removeprefix('torch.')}{extra}; driven by {keys}), "
        f"but only {free / 2**30:.2f} GiB is available")
