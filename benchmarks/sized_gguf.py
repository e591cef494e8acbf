"""Random-weight GGUF files of the shapes people run, with the demo model's tokenizer, for
speed measurements (not quality: the weights are random bytes with small sane scales).

    python benchmarks/sized_gguf.py --shape 1b --type Q4_0     # prints the path, writes once

Shapes: ``135m`` (SmolLM2-135M), ``1b`` (Llama-3.2-1B: 16 layers, hidden 2048, FFN 8192, 32/8
heads), ``3b`` (Llama-3.2-3B: 28 layers, 3072, 8192, 24/8), all with the demo's 49,152-token
vocabulary and a tied head. Types: Q4_0, Q8_0, and ``Q4_K_M``: with ``--llama-quantize PATH``
(or ``sized_file(..., quantize=PATH)``) llama.cpp's own Q4_K_M, requantized from the Q8_0 file
(``llama-quantize --allow-requantize``: its exact tensor-type choices); without it, an
approximation written here (Q4_K with Q6_K for attn_v and ffn_down of every other layer and
for the embedding), which needs a hidden size that is a multiple of 256 (not the 135M shape).
Files go to ``<cache>/bench-gguf/<shape>-<type>.gguf`` (the approximation:
``<shape>-Q4_K_M-approx.gguf``).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

SHAPES = {"135m": (30, 576, 1536, 9, 3), "1b": (16, 2048, 8192, 32, 8), "3b": (28, 3072, 8192, 24, 8)}
BLOCK = {T.Q4_0: (32, 18), T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
DEMO = "smollm2-135m-instruct"


def random_rows(kind: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k values as random blocks of ``kind``: random quants, small fp16 scales."""
    elems, size = BLOCK[kind]
    w = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    scale = {T.Q4_0: 0.004, T.Q8_0: 0.0003, T.Q4_K: 0.0005, T.Q6_K: 0.00005}[kind]
    d = np.full((n, k // elems, 1), scale, dtype=np.float16).view(np.uint8)
    if kind == T.Q6_K:
        w[..., 208:210] = d
    else:
        w[..., 0:2] = d
        if kind == T.Q4_K:
            w[..., 2:4] = np.full((n, k // elems, 1), scale * 8, dtype=np.float16).view(np.uint8)
    return w.reshape(n, -1)


def tensor_types(kind: str, layer: int) -> dict[str, T]:
    if kind != "Q4_K_M":
        return dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), T[kind])
    more = T.Q6_K if layer % 2 == 0 else T.Q4_K
    return {"q": T.Q4_K, "k": T.Q4_K, "v": more, "o": T.Q4_K, "gate": T.Q4_K, "up": T.Q4_K, "down": more}


def copy_tokenizer(writer: gguf.GGUFWriter, demo: Path) -> None:
    reader = gguf.GGUFReader(str(demo))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, main, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, main)


def write(shape: str, kind: str, path: Path, demo: Path, seed: int = 0) -> Path:
    layers, hidden, ffn, heads, kv_heads = SHAPES[shape]
    head_dim, vocab = hidden // heads, 49152
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in (("block_count", layers), ("context_length", 8192), ("embedding_length", hidden),
                        ("feed_forward_length", ffn), ("attention.head_count", heads),
                        ("attention.head_count_kv", kv_heads), ("vocab_size", vocab),
                        ("rope.dimension_count", head_dim)):
        writer.add_uint32(f"llama.{name}", value)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    copy_tokenizer(writer, demo)
    embed = T.Q6_K if kind == "Q4_K_M" else T[kind]
    writer.add_tensor("token_embd.weight", random_rows(embed, vocab, hidden, rng), raw_dtype=embed)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        types = tensor_types(kind, i)
        rows = {"q": (hidden, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden),
                "o": (hidden, hidden), "gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
        names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
                 "up": "ffn_up", "down": "ffn_down"}
        for part, (n, k) in rows.items():
            writer.add_tensor(f"blk.{i}.{names[part]}.weight", random_rows(types[part], n, k, rng),
                              raw_dtype=types[part])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    tmp = path.with_suffix(".tmp")
    writer.path = tmp
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def sized_file(shape: str, kind: str, quantize: str | None = None) -> Path:
    """The file of this shape and type in the cache, written first when absent (Q4_K_M:
    requantized by ``quantize``, llama-quantize's path, when given)."""
    from lmplug.kit.paths import cache_dir

    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: one of {', '.join(SHAPES)}")
    if kind not in ("Q4_0", "Q8_0", "Q4_K_M"):
        raise SystemExit(f"--type {kind!r}: one of Q4_0, Q8_0, Q4_K_M")
    approx = kind == "Q4_K_M" and not quantize
    if approx and SHAPES[shape][1] % 256:
        raise SystemExit(f"the {shape} shape's hidden size {SHAPES[shape][1]} is not a multiple of 256: its "
                         "Q4_K_M file needs llama-quantize (build it with benchmarks/build_llamacpp.sh)")
    path = cache_dir() / "bench-gguf" / f"{shape}-{kind}{'-approx' if approx else ''}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "Q4_K_M" and quantize:
        source, tmp = sized_file(shape, "Q8_0"), path.with_suffix(".tmp")
        done = subprocess.run([quantize, "--allow-requantize", str(source), str(tmp), "Q4_K_M"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{quantize} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        tmp.replace(path)
        return path
    demos = sorted((cache_dir() / "models" / DEMO).glob("*.gguf"))
    if not demos:
        raise SystemExit(f"the demo model is not in the cache: lmplug models pull {DEMO}")
    write(shape, kind, path, demos[0])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--type", default="Q4_0")
    parser.add_argument("--llama-quantize", help="llama-quantize's path: Q4_K_M as llama.cpp makes it")
    args = parser.parse_args()
    print(sized_file(args.shape, args.type, args.llama_quantize))


if __name__ == "__main__":
    main()
