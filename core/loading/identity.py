"""A model's identity for data that outlives the engine (a KV tier on disk): what must match for
stored K/V to be valid again.

The digest covers the model's config (``config.json`` or the GGUF's metadata as read), the
compute dtype, the quant method, and each weight file's name, size and the SHA-256 of its first
and last MiB (headers, and weights that differ between two fine-tunes of one architecture),
so a changed checkpoint never reuses old K/V, without reading gigabytes at start-up.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
EDGE = 1 << 20  # bytes hashed at each end of a weight file


def model_identity(path: str | Path, hf_config: dict, dtype: str, quant: str | None) -> str:
    path = Path(path)
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir())
                   if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    h = hashlib.sha256()
    h.update(json.dumps(hf_config, sort_keys=True, default=str).encode())
    h.update(f"\ndtype={dtype} quant={quant}\n".encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name} {size}\n".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(EDGE))
            if size > EDGE:
                fh.seek(max(EDGE, size - EDGE))
                h.update(fh.read(EDGE))
    return f"{path.name}:{h.hexdigest()}"
