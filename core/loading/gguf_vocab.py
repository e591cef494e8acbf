"""Build a ``tokenizers.Tokenizer`` from a GGUF file's vocabulary metadata.

A GGUF has no ``tokenizer.json``: it stores tokens, merges, token types and
scores under ``tokenizer.ggml.*``. We rebuild the same pipeline HF transformers
builds when it loads a GGUF (byte-level BPE for ``gpt2``, byte-fallback BPE with
Metaspace for ``llama``), choosing the pre-tokenizer split from
``tokenizer.ggml.pre`` the way llama.cpp does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from lmplug.errors import ModelLoadError

logger = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split regexes as llama.cpp applies them (src/llama-vocab.cpp), in HF syntax.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# These vocabularies were trained with every digit its own pre-token, then GPT-2's split.
_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
)
_PLAIN_GPT2 = frozenset({"default", "gpt2", "gpt-2"})


def build_backend(metadata: Mapping[str, Any], name: str) -> tuple[Backend, bool]:
    """``(backend tokenizer, add_bos_default)`` for a GGUF's ``tokenizer.ggml.*`` keys."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{name}: GGUF metadata has no 'tokenizer.ggml.tokens'")
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, types, name)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(metadata, tokens, name)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ModelLoadError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2', 'llama'"
        )
    _add_special_tokens(backend, tokens, types)
    return backend, add_bos_default


def _byte_level_bpe(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], name: str
) -> Backend:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(f"{name}: byte-level BPE GGUF has no 'tokenizer.ggml.merges'")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for index, (token, token_type) in enumerate(zip(tokens, types)):
        # Control/user-defined tokens are matched raw in text, so keep their spelling;
        # an ordinary token outside the byte alphabet is respelled, as transformers does.
        if (
            token_type not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
            and not set(token) <= spelled
        ):
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = Backend(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"), name)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str | None, name: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in _PLAIN_GPT2 and pre is not None:
        # Same fallback as transformers; tokenization may differ slightly from llama.cpp.
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using GPT-2's split", name, pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], name: str) -> Backend:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(
            f"{name}: SentencePiece GGUF needs one 'tokenizer.ggml.scores' per token"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = Backend(
        BPE(
            vocab=vocab,
            merges=_merges_from_scores(vocab, dict(zip(tokens, scores))),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # transformers' LlamaTokenizer (legacy=False): prefix a space to the first piece only.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece GGUFs carry no merges: rebuild them, best-scored token first.

    Same ordering as transformers' ``generate_merges`` so both tokenize alike.
    """
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    # Without this, "<|im_start|>" typed in text would be cut into byte pieces.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types)
        if kind == TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
