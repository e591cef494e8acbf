"""``lmplug quantize`` and ``lmplug eval`` on GPT-OSS: ``rtn`` (GPTQ format) and ``fp8``
(compressed-tensors) quantize the attention projections and every expert (transformers' stacked
``[E, in, out]`` experts written one linear layer per expert), keep the router, sinks, norms and
biases float; the folder loads with the native architecture, its experts held by the method, and
its KL to the float model is small and positive. An MXFP4 checkpoint is refused, naming why."""

from __future__ import annotations

import json

import pytest
from support.cli_eval import assert_eval_close, cli

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float GPT-OSS folder (random expert biases) with the tests' tokenizer."""
    from support.hf_models import VOCAB, write_tokenizer

    from tests.plugins.models.test_gpt_oss import BASE, build_gpt_oss

    path = tmp_path_factory.mktemp("gpt_oss_quantize")
    build_gpt_oss({**BASE, "vocab_size": VOCAB}, path)
    write_tokenizer(path)
    return path


@pytest.mark.parametrize("method, quant_method, expert_tensor, holder", [
    ("rtn", "gptq", "qweight", "gptq"), ("fp8", "compressed-tensors", "weight_scale", "w8a8")])
def test_quantize_and_eval(tiny, tmp_path, capsys, method, quant_method, expert_tensor, holder):
    from safetensors import safe_open

    from lmplug import LLM

    out = tmp_path / method
    extra = ("--group-size", "32") if method == "rtn" else ()
    rc, _, err = cli(capsys, "quantize", tiny, out, "--method", method, *extra)
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["quantization_config"]["quant_method"] == quant_method
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        experts = 6  # BASE's num_local_experts
        for e in range(experts):
            for proj in ("gate_up_proj", "down_proj"):
                assert f"model.layers.1.mlp.experts.{proj}.{e}.{expert_tensor}" in names
        assert f.get_tensor("model.layers.0.mlp.router.weight").is_floating_point()
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias").shape == (experts, 128)
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)  # no float copy
    llm = LLM(str(out), dtype="float32", device="cpu", max_model_len=128)
    model = llm.engine.runner.model
    assert type(model).__name__ == "GptOssForCausalLM"
    assert {linear.quant.name for layer in model.layers
            for linear in (*layer.mlp.gate_up_proj, *layer.mlp.down_proj)} == {holder}
    assert_eval_close(capsys, out, tiny, tmp_path)


def test_an_mxfp4_checkpoint_is_refused_by_name(tiny, tmp_path, capsys):
    source = tmp_path / "mxfp4"
    source.mkdir()
    for f in tiny.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    config = json.loads((tiny / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    rc, _, err = cli(capsys, "quantize", source, tmp_path / "out", "--method", "rtn")
    assert rc != 0 and "gpt_oss" in err and "already 4-bit MXFP4" in err
