"""Weights that do not match the architecture the fallback built: the load error names the tensor."""

from __future__ import annotations

import pytest

from lmplug.errors import LmplugError


def test_fallback_weights_that_do_not_match_name_the_tensor(tmp_path):
    """An OLMo 2 checkpoint (no native architecture: the fallback serves it) whose k_proj was cut:
    the load error names the tensor, its shape and the one transformers' module expects."""
    from safetensors.torch import load_file, save_file
    from support.fallback_configs import config
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmplug import LLM

    cfg = config("olmo2")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.self_attn.k_proj.weight"
    expected = tuple(tensors[name].shape)
    tensors[name] = tensors[name][: expected[0] // 2].clone()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(LmplugError) as err:
        LLM(str(tmp_path), dtype="float32", device="cpu")
    text = str(err.value)
    assert name in text and str(tuple(tensors[name].shape)) in text and str(expected) in text
