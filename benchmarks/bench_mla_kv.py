"""KV bytes per token: MLA's latent layout vs multi-head attention with the same heads and dims.

    python benchmarks/bench_mla_kv.py [--skip-model]

MLA caches, per token and layer, one row of kv_lora_rank + qk_rope_head_dim
numbers shared by all heads. An MHA model with the same head count and dims
caches every head's key (qk_nope + qk_rope) and value (v_head_dim). For each
config below the script prints both, from ``KVCacheSpec.bytes_per_token`` (MLA:
the latent spec the engine builds; MHA: the K/V spec, padding V to the key
width as one-``head_dim`` caches must, and the unpadded count), and checks the
latent figure against the bytes the real ``paged`` KV backend allocates (on the
``meta`` device: no memory is touched). Unless ``--skip-model``, it also builds
the tiny random DeepSeek-V2 of ``tests/plugins/models/test_deepseek_parity.py`` with
transformers and reads the bytes/token of the running engine.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass

import torch
from lmplug_kvcache.paged import PagedKVCache, PagedOptions

from lmplug.api import KVCacheSpec


@dataclass(frozen=True)
class MLAShape:
    name: str
    layers: int
    heads: int
    kv_lora_rank: int
    rope: int
    nope: int
    v: int
    dtype: torch.dtype


SHAPES = [
    # tests/plugins/models/test_deepseek_parity.py, fp32 as the tests run it
    MLAShape("tiny DeepSeek-V2 (tests)", 2, 4, 32, 8, 16, 12, torch.float32),
    # DeepSeek-V2 (236B) config.json, bf16
    MLAShape("DeepSeek-V2", 60, 128, 512, 64, 128, 128, torch.bfloat16),
]


def spec(shape: MLAShape, *, latent: bool, head_dim: int, kv_heads: int) -> KVCacheSpec:
    return KVCacheSpec(num_layers=shape.layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=shape.dtype,
                       device=torch.device("meta"), max_model_len=4096, max_num_seqs=1, latent=latent)


def measure(shape: MLAShape) -> dict[str, int]:
    elem = torch.empty((), dtype=shape.dtype).element_size()
    mla = spec(shape, latent=True, head_dim=shape.kv_lora_rank + shape.rope, kv_heads=1)
    mha_padded = spec(shape, latent=False, head_dim=shape.nope + shape.rope, kv_heads=shape.heads)
    pool = PagedKVCache(PagedOptions(num_blocks=8, block_size=16), mla)
    return {
        "mla": mla.bytes_per_token,
        "mla_paged_pool": pool.memory_bytes // pool.num_tokens,
        "mha": shape.layers * shape.heads * (shape.nope + shape.rope + shape.v) * elem,
        "mha_spec": mha_padded.bytes_per_token,
    }


def engine_bytes_per_token() -> int:
    """Build the tiny test model with transformers and read the engine's KV bytes/token."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.moe_models import TinyDeepseek

    from lmplug import LLM

    with tempfile.TemporaryDirectory() as root:
        tiny = TinyDeepseek("q_lora", Path(root))
        llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=256,
                  kvcache={"backend": "paged", "num_blocks": 16})
        return llm.engine.parts.kv.bytes_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-model", action="store_true", help="skip building the tiny model")
    args = parser.parse_args()
    header = f"{'config':28} {'dtype':9} {'MLA B/tok':>11} {'MHA B/tok':>12} {'MHA (V padded)':>15} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for shape in SHAPES:
        m = measure(shape)
        if m["mla"] != m["mla_paged_pool"]:
            raise SystemExit(f"{shape.name}: spec says {m['mla']} B/token, the paged pool holds "
                             f"{m['mla_paged_pool']}")
        print(f"{shape.name:28} {str(shape.dtype).removeprefix('torch.'):9} {m['mla']:>11,} "
              f"{m['mha']:>12,} {m['mha_spec']:>15,} {m['mha'] / m['mla']:>6.1f}x")
    print("\nMLA: layers x (kv_lora_rank + rope) x bytes; MHA: layers x heads x (nope + rope + v) x bytes.")
    if not args.skip_model:
        print(f"tiny DeepSeek-V2 engine (paged KV, fp32): {engine_bytes_per_token():,} bytes/token")


if __name__ == "__main__":
    main()
