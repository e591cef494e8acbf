"""Tiny models that can write JSON: a byte-level BPE tokenizer (every byte is a token, so braces,
brackets and quotes exist) over the tiny HF configs' 512-token vocabulary, and the schemas the
structured-output tests share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.hf_models import SPECIALS, VOCAB, TinyModel, build_hf_model, make_config, save_with_bos

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"]}',
    '{"city": "Paris", "country": "France", "population": 2148000}',
    '[{"id": 1, "ok": true}, {"id": 2, "ok": false}, {"id": 3, "ok": null}]',
    "The quick brown fox jumps over the lazy dog. 0123456789 -+.,:;!?",
    "name age city country title year value items tags id ok true false null",
]

# JSON schemas the tests decode under: nested objects, arrays, enums, bounded numbers,
# required and optional fields, $defs / $ref.
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "score": {"type": "number", "minimum": -1, "maximum": 1}},
            "required": ["city", "score"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"}},
        "required": ["person", "tags"], "additionalProperties": False},
    "defs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                              "path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                                       "minItems": 1, "maxItems": 2}},
             "required": ["a", "path"], "additionalProperties": False},
}


def write_byte_level_tokenizer(path: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json``: a GPT-2-style byte-level BPE of ``VOCAB``
    tokens (the specials at ids 0, 1, 2 as the tiny configs expect; all 256 bytes; merges from
    ``CORPUS``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    assert tok.get_vocab_size() <= VOCAB
    save_with_bos(tok, path)


_CACHE: dict[str, TinyModel] = {}


def json_model(root: Path, name: str = "llama", seed: int = 0) -> TinyModel:
    """A tiny random model ``name`` with the byte-level tokenizer (built once per process)."""
    key = f"{name}+bytes+{seed}"
    if key not in _CACHE:
        model = build_hf_model(make_config(name), seed=seed)
        path = root / key
        if path.exists():
            shutil.rmtree(path)
        model.save_pretrained(path)
        write_byte_level_tokenizer(path)
        _CACHE[key] = TinyModel(key, path, model, json.loads((path / "config.json").read_text()))
    return _CACHE[key]
