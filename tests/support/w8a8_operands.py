"""Operands of the scaled 8-bit GEMM (``w8a8_gemm``, ``scaled_mm_reference``) and its definition.

``a [M, K]`` and ``w [N, K]`` (int8, or float8_e4m3fn) over their whole range, with positive
scales ``sa [M, KG]`` and ``sw [N, KG]``: one per ``group_k`` inputs (``KG = ceil(K / group_k)``),
or one per row (``group_k`` 0). ``definition`` is the product in float64, straight from the
formula, which the reference and every kernel are held to.
"""

from __future__ import annotations

import torch


def operands(kind: str, m: int, n: int, k: int, group_k: int, seed: int, *, spread: bool = False):
    """(a, sa, w, sw). ``spread``: scales over two decades (1e-3 .. 1e-1) rather than one narrow
    band, so that a K step applying a neighbouring group's scale shows in the result."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "int8":
        a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        a = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    kg = 1 if group_k == 0 else -(-k // group_k)
    if spread:
        sa, sw = (10 ** (torch.rand(rows, kg, generator=gen) * 2 - 3) for rows in (m, n))
    else:
        sa, sw = (torch.rand(rows, kg, generator=gen) * 0.01 + 1e-3 for rows in (m, n))
    return a, sa, w, sw


def definition(a, sa, w, sw, group_k: int) -> torch.Tensor:
    """float64 sum_k a[m,k] sa[m, k // g] w[n,k] sw[n, k // g] (g = group_k; 0: one scale a row)."""
    k = a.shape[1]
    g = torch.arange(k) // group_k if group_k else torch.zeros(k, dtype=torch.long)
    return (a.double() * sa.double()[:, g]) @ (w.double() * sw.double()[:, g]).T
