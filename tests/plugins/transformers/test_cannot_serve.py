"""What the fallback refuses, and why (named in the load error when nothing serves a checkpoint)."""

from __future__ import annotations

import json

import pytest
from lmplug_transformers import architecture as arch_module
from lmplug_transformers.architecture import TransformersArchitecture

from lmplug.errors import LmplugError, ModelLoadError

pytestmark = pytest.mark.hf

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(("config", "words"), [
    ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
    ({"model_type": "vit"}, "not a causal LM"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "'BertForMaskedLM' is not a causal LM"),
    ({"model_type": "electra"}, "'electra' is an encoder (bidirectional attention"),
    ({"model_type": "roberta", "architectures": ["RobertaModel"]}, "embed it with sentence-transformers"),
    ({"model_type": "no_such_model"}, "does not know model_type 'no_such_model'"),
    ({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "remote code"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}, "state_layers"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 32}, "mla"),
])
def test_refusals_name_the_reason(config, words):
    reason = TransformersArchitecture.cannot_serve(config)
    assert reason is not None and words in reason


def test_serves_a_plain_decoder():
    assert TransformersArchitecture.cannot_serve({"model_type": "gemma2"}) is None
    assert TransformersArchitecture.serves({"model_type": "gemma2"}) == "fallback for model_type 'gemma2'"


def test_transformers_missing_is_said(monkeypatch):
    monkeypatch.setattr(arch_module, "_transformers_missing", lambda: True)
    assert (TransformersArchitecture.cannot_serve({"model_type": "gemma2"})
            == "transformers is not installed (pip install transformers)")


def test_parse_config_refuses_naming_the_file():
    with pytest.raises(ModelLoadError, match=r"c\.json: architecture 'transformers' cannot serve it: .*remote code"):
        TransformersArchitecture(None).parse_config({**TINY, "auto_map": {"a": "b"}}, "c.json")


def test_parse_config_reads_the_geometry():
    cfg = TransformersArchitecture(None).parse_config({**TINY, "head_dim": 8, "sliding_window": 16,
                                                        "layer_types": ["sliding_attention"] * 2}, "c.json")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (4, 2, 8, 16)
    mixed = TransformersArchitecture(None).parse_config(
        {**TINY, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}, "c.json")
    assert mixed.sliding_window is None  # global layers keep the whole context in the cache


def test_no_architecture_serves_an_encoder_decoder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True,
                                                      "architectures": ["T5ForConditionalGeneration"]}))
    import torch
    from safetensors.torch import save_file

    from lmplug import LLM

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))

    with pytest.raises(LmplugError) as err:
        LLM(str(tmp_path), dtype="float32", device="cpu")
    text = str(err.value)
    assert "T5ForConditionalGeneration" in text or "'t5'" in text
    assert "encoder-decoder" in text and "llama" in text


def test_an_encoder_checkpoint_is_refused_naming_what_works(tmp_path):
    """A real (tiny, random) ELECTRA folder (an encoder no native architecture serves): the load error
    names the folder, why, and what would work."""
    from transformers import ElectraConfig, ElectraModel

    from lmplug import LLM

    ElectraModel(ElectraConfig(vocab_size=64, hidden_size=32, embedding_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path), dtype="float32", device="cpu")
    text = str(err.value)
    assert str(tmp_path) in text and "'ElectraModel' is not a causal LM head" in text
    assert "is an encoder" in text and "SentenceTransformer(path).encode" in text and "last-token pooling" in text
