"""load_gguf on tiny GGUF files written with gguf.GGUFWriter.

Values are checked against ``gguf.quants.dequantize`` of the bytes we wrote, and
the renamed, un-permuted tensors against transformers loading the same file
(its GGUF code is the independent reference for the Q/K permutation).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from support.gguf_fixtures import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    head_dim_for,
    write_tiny_gguf,
)

from lmplug.errors import ModelLoadError
from lmplug.interfaces.gguf_header import decoder_tensor_name as hf_tensor_name
from lmplug.loading.gguf import load_gguf


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
    folder = tmp_path_factory.mktemp("gguf")
    expected = {
        arch: write_tiny_gguf(folder / f"{arch}.gguf", arch) for arch in ("llama", "qwen2", "qwen3")
    }
    expected["tied"] = write_tiny_gguf(folder / "tied.gguf", tied=True, rope_scaling=True)
    return folder, expected


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute, written as transformers' GGUF loader does it."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def test_llama_config(gguf_dir):
    folder, _ = gguf_dir
    config = load_gguf(folder / "llama.gguf").hf_config
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert {
        k: config[k]
        for k in (
            "model_type",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rope_theta",
            "max_position_embeddings",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "torch_dtype",
        )
    } == {
        "model_type": "llama",
        "vocab_size": 400,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rope_theta": 50000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert "rope_scaling" not in config


def test_tied_model_and_rope_scaling(gguf_dir):
    folder, _ = gguf_dir
    source = load_gguf(folder / "tied.gguf")
    assert source.hf_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in source.tensor_names
    assert source.hf_config["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
    }


def test_qwen_configs(gguf_dir):
    folder, _ = gguf_dir
    qwen2 = load_gguf(folder / "qwen2.gguf")
    assert qwen2.hf_config["model_type"] == "qwen2"
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2.tensor_names
    qwen3 = load_gguf(folder / "qwen3.gguf")
    assert qwen3.hf_config["model_type"] == "qwen3"
    assert qwen3.hf_config["head_dim"] == head_dim_for("qwen3")
    assert "model.layers.1.self_attn.k_norm.weight" in qwen3.tensor_names


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_names_shapes_and_values(gguf_dir, arch):
    folder, expected = gguf_dir
    source = load_gguf(folder / f"{arch}.gguf")
    tensors = dict(source.iter_tensors())
    assert list(tensors) == source.tensor_names
    by_hf_name = {hf_tensor_name(name): values for name, values in expected[arch].items()}
    assert set(tensors) == set(by_hf_name)
    for gguf_name, values in expected[arch].items():
        kind = gguf_name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            values = reverse_permute(values, HEADS if kind == "attn_q" else KV_HEADS)
        ours = tensors[hf_tensor_name(gguf_name)]
        assert ours.dtype == torch.float32
        assert ours.shape == values.shape, gguf_name
        torch.testing.assert_close(ours, torch.from_numpy(values), atol=0, rtol=0, msg=gguf_name)


def test_every_quant_type_is_exercised(gguf_dir):
    folder, _ = gguf_dir
    from gguf import GGUFReader

    types = {t.tensor_type for t in GGUFReader(folder / "llama.gguf").tensors}
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= types


def test_iter_tensors_is_lazy_and_repeatable(gguf_dir):
    folder, _ = gguf_dir
    source = load_gguf(folder / "llama.gguf")
    first = next(source.iter_tensors())
    again = next(source.iter_tensors())
    assert first[0] == again[0] and torch.equal(first[1], again[1])


@pytest.mark.hf
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_matches_transformers_gguf_loading(gguf_dir, arch):
    transformers = pytest.importorskip("transformers")
    folder, _ = gguf_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder),
        gguf_file=f"{arch}.gguf",
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    reference = model.state_dict()
    source = load_gguf(folder / f"{arch}.gguf")
    assert set(source.tensor_names) == set(reference)
    for name, tensor in source.iter_tensors():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0, msg=name)
    assert source.hf_config["model_type"] == model.config.model_type


# -- bad files ---------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_bad_magic(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"fake\.gguf.*not a GGUF file.*magic"):
        load_gguf(path)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.99])
def test_truncated_file(gguf_dir, tmp_path, keep):
    folder, _ = gguf_dir
    data = (folder / "llama.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|corrupt)"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, arch="phi2")
    with pytest.raises(
        ModelLoadError, match=r"architecture 'phi2' is not supported; supported: ([\w-]+, )*llama, "
    ):
        load_gguf(path)


def test_unsupported_quant_type_names_tensor(tmp_path):
    path = tmp_path / "k.gguf"
    # Q8_K: llama.cpp's intermediate type for dot products, never a stored weight
    write_tiny_gguf(path, extra_tensor=("blk.0.attn_extra.weight", Q.Q8_K))
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_extra\.weight' has type Q8_K"):
        load_gguf(path)


def test_unknown_tensor_name():
    with pytest.raises(ModelLoadError, match="rope_freqs.*llama3-style"):
        hf_tensor_name("rope_freqs.weight")
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
