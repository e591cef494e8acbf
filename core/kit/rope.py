"""Rotary position embeddings (HF "rotate half" pairing: dim i with i + d/2; DeepSeek's
interleaved pairs (2i, 2i+1) through ``RotaryEmbedding.rotate_pairs``)."""

from __future__ import annotations

import math

import torch

from lmplug.errors import ModelLoadError


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention factor applied to cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position)
    if kind == "proportional":  # Gemma 4's full layers: the first angles rotate, the others stay put
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq[angles:] = 0.0
        return inv_freq / float(scaling.get("factor", 1.0)), 1.0
    raise ModelLoadError(f"rope_scaling type {kind!r} is not supported; supported: linear, llama3, yarn, "
                         "proportional")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    old_len = int(s.get("original_max_position_embeddings") or max_position)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):  # GPT-OSS: truncate false, the correction range kept fractional
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attn_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to ``max_position``."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, attn_factor = inv_frequencies(head_dim, theta, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", (emb.cos() * attn_factor).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attn_factor).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D], positions: [T]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_pairs(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's interleaved RoPE: dims (2i, 2i+1) form a pair. x: [T, N, D] -> [T, N, D]."""
        half = x.shape[-1] // 2
        cos = self.cos[positions, :half].unsqueeze(1)  # [T, 1, D/2]; cos = cat(freqs, freqs)
        sin = self.sin[positions, :half].unsqueeze(1)
        x0, x1 = x[..., 0::2], x[..., 1::2]  # [T, N, D/2] each
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of one tensor. x: [T, N, D]."""
        return _rotate(x, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
