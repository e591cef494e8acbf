"""Pack and unpack low-bit integers in int32 words, as GPTQ and AWQ checkpoints store them.

Written from the published layouts (``FORMATS.md``):

- GPTQ ``qweight [in * bits / 32, out]`` packs along the **input** axis: word
  ``r`` of a column holds rows ``r * p .. r * p + p - 1`` (``p = 32 / bits``),
  the lowest bits holding the lowest row. ``qzeros [groups, out * bits / 32]``
  packs along the **output** axis the same way.
- AWQ (GEMM) ``qweight [in, out / 8]`` and ``qzeros [groups, out / 8]`` pack
  along the output axis, but nibble ``k`` of a word holds column
  ``AWQ_ORDER[k]`` of its eight; unpacking places nibble ``k`` at
  ``AWQ_REVERSE_ORDER``'s inverse, i.e. column ``c`` is nibble ``AWQ_REVERSE_ORDER[c]``.

Values are unsigned ``0 .. 2**bits - 1``; words are int32 (their sign bit is
just the top value's top bit). Shifts are done in int64, so no step overflows.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k holds column AWQ_ORDER[k]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in nibble AWQ_REVERSE_ORDER[c]


def values_per_word(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit values into int32 words (2, 4 or 8 bits)")
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int64, device=device)  # [p]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32 unsigned bits -> the int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] unsigned values -> [..., n / p] int32, value j of a word at bits ``j * bits``."""
    p = values_per_word(bits)
    if values.shape[-1] % p:
        raise ValueError(f"{values.shape[-1]} values do not fill whole words of {p}")
    if int(values.min()) < 0 or int(values.max()) >= 2**bits:
        raise ValueError(f"values outside 0..{2**bits - 1} cannot be packed in {bits} bits")
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, p)  # [..., n/p, p]
    return _to_int32((grouped << _shifts(bits, values.device)).sum(-1))


def _unpack_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., m] int32 -> [..., m * p] int32 unsigned values."""
    p = values_per_word(bits)
    parts = (words.to(torch.int64)[..., None] >> _shifts(bits, words.device)) & (2**bits - 1)
    return parts.reshape(*words.shape[:-1], words.shape[-1] * p).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] -> [R * bits / 32, C], packed along rows (GPTQ ``qweight``)."""
    return _pack_last(values.T, bits).T.contiguous()


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[R / p, C] -> [R, C], the inverse of ``pack_rows``."""
    return _unpack_last(words.T, bits).T.contiguous()


def pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] -> [R, C * bits / 32], packed along columns; ``order``: AWQ's interleave."""
    if order is not None:
        p = values_per_word(bits)
        values = values.reshape(values.shape[0], -1, p)[..., list(order)].reshape(values.shape)
    return _pack_last(values, bits)


def unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C / p] -> [R, C], the inverse of ``pack_cols`` with the same ``order``."""
    values = _unpack_last(words, bits)
    if order is not None:
        p = values_per_word(bits)
        inverse = [order.index(c) for c in range(p)]  # column c was written into nibble inverse[c]
        values = values.reshape(values.shape[0], -1, p)[..., inverse].reshape(values.shape)
    return values.contiguous()
