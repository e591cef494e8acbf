"""Broken model folders fail in ``LLM(...)`` with a ``ModelLoadError`` that says what is wrong.

Each case starts from a good checkpoint saved by transformers and damages one
thing; the message must name the file or tensor at fault and what was expected.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_models import get_model, one_torch_thread  # noqa: F401

from lmplug import LLM, ModelLoadError

WEIGHTS = "model.safetensors"


def load(path):
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=64)


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load(path)
    return str(info.value)


def test_good_folder_loads(model_dir):
    load(model_dir)  # the baseline every other case damages


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors(model_dir, keep):
    f = model_dir / WEIGHTS
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)])
    msg = load_error(model_dir)
    assert WEIGHTS in msg
    assert "truncated" in msg
    assert str(int(len(data) * keep)) in msg  # how big the file is ...
    assert str(len(data)) in msg  # ... and how big it had to be


def test_truncated_inside_header(model_dir):
    f = model_dir / WEIGHTS
    f.write_bytes(f.read_bytes()[:100])
    msg = load_error(model_dir)
    assert WEIGHTS in msg and "truncated" in msg


def test_not_a_safetensors_file(model_dir):
    (model_dir / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" + b"\0" * 64)
    msg = load_error(model_dir)
    assert WEIGHTS in msg and "header" in msg


def test_tensor_with_wrong_shape(model_dir):
    f = model_dir / WEIGHTS
    tensors = load_file(str(f))
    name = "model.layers.1.self_attn.k_proj.weight"
    expected = tuple(tensors[name].shape)
    tensors[name] = tensors[name][: expected[0] // 2].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})
    msg = load_error(model_dir)
    assert name in msg
    assert str(tuple(tensors[name].shape)) in msg  # what it has
    assert str(expected) in msg  # what the model expects
    assert WEIGHTS in msg or str(model_dir) in msg


def test_norm_with_wrong_shape(model_dir):
    f = model_dir / WEIGHTS
    tensors = load_file(str(f))
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(f), metadata={"format": "pt"})
    msg = load_error(model_dir)
    assert "model.norm.weight" in msg and "(63,)" in msg and "(64,)" in msg


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight",
                                  "lm_head.weight"])
def test_missing_tensor(model_dir, name):
    f = model_dir / WEIGHTS
    tensors = load_file(str(f))
    del tensors[name]
    save_file(tensors, str(f), metadata={"format": "pt"})
    msg = load_error(model_dir)
    assert "missing" in msg
    assert name in msg, "the message should name the checkpoint tensor that is absent"
    assert str(model_dir) in msg


def test_missing_shard(model_dir, good_dir):
    sharded = model_dir.parent / "sharded"
    get_model("llama", good_dir.parent).hf.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    msg = load_error(sharded)
    assert shards[-1].name in msg and "missing" in msg


def test_unknown_model_type_lists_supported(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    msg = load_error(model_dir)
    assert "'falcon'" in msg
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in msg


def test_unknown_model_type_with_foreign_config_keys(model_dir):
    """A GPT-2 config.json (n_embd, n_layer, no hidden_size): say the architecture is
    unsupported, not that hidden_size is missing."""
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2,
        "n_head": 4, "vocab_size": 512, "n_positions": 256}))
    msg = load_error(model_dir)
    assert "no native architecture serves model_type 'gpt2'" in msg
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in msg


def test_config_missing_a_required_key(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    msg = load_error(model_dir)
    assert "config.json" in msg and "num_hidden_layers" in msg


def test_missing_config_json(model_dir):
    (model_dir / "config.json").unlink()
    msg = load_error(model_dir)
    assert "config.json" in msg
    assert str(model_dir) in msg


def test_only_pytorch_model_bin(model_dir):
    tensors = load_file(str(model_dir / WEIGHTS))
    (model_dir / WEIGHTS).unlink()
    torch.save(tensors, model_dir / "pytorch_model.bin")
    msg = load_error(model_dir)
    assert ".bin" in msg and "safetensors" in msg
    assert str(model_dir) in msg


def test_no_weights_at_all(model_dir):
    (model_dir / WEIGHTS).unlink()
    msg = load_error(model_dir)
    assert "safetensors" in msg and str(model_dir) in msg


def test_malformed_config_json(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    msg = load_error(model_dir)
    assert "config.json" in msg and "JSON" in msg


def test_config_json_not_an_object(model_dir):
    (model_dir / "config.json").write_text("[1, 2, 3]")
    msg = load_error(model_dir)
    assert "config.json" in msg


def test_nonexistent_path(tmp_path):
    with pytest.raises(Exception) as info:
        load(tmp_path / "no_such_model")
    assert "no_such_model" in str(info.value)
