"""Tiny GGUF files written with ``gguf.GGUFWriter`` (a helper module, not a test file).

``write_tiny_gguf`` writes a 2-layer model (hidden 64, 4 query / 2 KV heads) whose
tensors mix F32/F16/BF16/Q8_0/Q4_0/Q4_1, and returns what each tensor should
dequantize to (in GGUF row order). Q/K rows are permuted the way llama.cpp's
``convert_hf_to_gguf.py`` does for llama, so loaders must undo it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
# Qwen3 states head_dim apart from hidden / heads; transformers' GGUF reader ignores
# that key and assumes Qwen3's usual 128, so the qwen3 fixture uses 128 too.
QWEN3_HEAD_DIM = 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def tokenize(text):\n    return [t for t in text.split()]\n",
    "Numbers: 123 4567 89, 3.14 and 2,718; x² + ½ = ¾",
    "Unicode: héllo wörld ñandú façade naïve café 日本語 中文 한국어 🎉🚀",
    "don't you'll I'm they've we'd it's",
    "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nhi!<|im_end|>",
]

LLAMA_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.F16,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.F16,
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: HF rotate-half rows -> interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def train_byte_level(vocab_size: int = 400) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained on CORPUS, digits kept single."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS * 5, trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def train_sentencepiece_like(vocab_size: int = 200) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) shaped like a llama.cpp SentencePiece vocabulary."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size)
    tk.train_from_iterator([c.replace("<|", "<").replace("|>", ">") for c in CORPUS] * 5, trainer)
    pieces = [t for t, _ in sorted(tk.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # UNKNOWN, CONTROL, BYTE, NORMAL
    return tokens, scores, types


def add_byte_level_vocab(
    writer: GGUFWriter, pre: str = "smollm", template: str | None = CHATML, add_bos: bool = False
) -> int:
    tokens, merges = train_byte_level()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    if template:
        writer.add_chat_template(template)
    return len(tokens)


def add_spm_vocab(writer: GGUFWriter) -> int:
    tokens, scores, types = train_sentencepiece_like()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return len(tokens)


def head_dim_for(arch: str) -> int:
    return QWEN3_HEAD_DIM if arch == "qwen3" else HEAD_DIM


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = False,
    vocab: str = "byte",
    pre: str = "smollm",
    rope_scaling: bool = False,
    extra_tensor: tuple[str, Q] | None = None,
    seed: int = 0,
    types: dict[str, Q] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny model; return {gguf tensor name: expected dequantized float32 values}.
    ``types``: each tensor kind's type (default ``LLAMA_TYPES``, and layer 1's attn_v in BF16)."""
    mixed = types is None
    types = {**LLAMA_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    n_vocab = add_spm_vocab(writer) if vocab == "spm" else add_byte_level_vocab(writer, pre)
    _add_hparams(writer, arch, n_vocab, rope_scaling)
    expected: dict[str, np.ndarray] = {}

    def put(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.5) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        kind = name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            values = llama_cpp_permute(values, HEADS if kind == "attn_q" else KV_HEADS)
        data = quantize(values, qtype)
        raw_dtype = qtype if qtype not in (Q.F32, Q.F16) else None
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        expected[name] = dequantize(data, qtype).reshape(shape).astype(np.float32)

    put("token_embd.weight", (n_vocab, HIDDEN), types["token_embd"])
    put("output_norm.weight", (HIDDEN,), Q.F32)
    if not tied:
        put("output.weight", (n_vocab, HIDDEN), types["output"])
    head_dim = head_dim_for(arch)
    q_out, kv_out = HEADS * head_dim, KV_HEADS * head_dim
    for i in range(LAYERS):
        b = f"blk.{i}"
        put(f"{b}.attn_norm.weight", (HIDDEN,), Q.F32)
        put(f"{b}.ffn_norm.weight", (HIDDEN,), Q.F32)
        put(f"{b}.attn_q.weight", (q_out, HIDDEN), types["attn_q"])
        put(f"{b}.attn_k.weight", (kv_out, HIDDEN), types["attn_k"])
        put(f"{b}.attn_v.weight", (kv_out, HIDDEN), Q.BF16 if i == 1 and mixed else types["attn_v"])
        put(f"{b}.attn_output.weight", (HIDDEN, q_out), types["attn_output"])
        put(f"{b}.ffn_gate.weight", (FFN, HIDDEN), types["ffn_gate"])
        put(f"{b}.ffn_up.weight", (FFN, HIDDEN), types["ffn_up"])
        put(f"{b}.ffn_down.weight", (HIDDEN, FFN), types["ffn_down"])
        if arch == "qwen2":
            for kind, rows in (("attn_q", q_out), ("attn_k", kv_out), ("attn_v", kv_out)):
                put(f"{b}.{kind}.bias", (rows,), Q.F32)
        if arch == "qwen3":
            put(f"{b}.attn_q_norm.weight", (head_dim,), Q.F32)
            put(f"{b}.attn_k_norm.weight", (head_dim,), Q.F32)
    if extra_tensor is not None:
        name, qtype = extra_tensor
        _add_raw(writer, name, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _add_hparams(writer: GGUFWriter, arch: str, n_vocab: int, rope_scaling: bool) -> None:
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim_for(arch))
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(n_vocab)
    if arch == "qwen3":
        writer.add_key_length(QWEN3_HEAD_DIM)
        writer.add_value_length(QWEN3_HEAD_DIM)
    if rope_scaling:
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_rope_scaling_orig_ctx_len(128)


def _add_raw(writer: GGUFWriter, name: str, qtype: Q) -> None:
    """A tensor of ``qtype`` filled with zero bytes (enough to test type checks)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    writer.add_tensor(
        name, np.zeros((HIDDEN, 256 // block * size), dtype=np.uint8), raw_dtype=qtype
    )
