"""What the new families need of attention, checked at plan time: a backend without a feature a
checkpoint's layers need is refused naming the backend, the model, the feature and one that has
it; the native architectures are chosen over the transformers fallback for their model types."""

from __future__ import annotations

import pytest

from lmplug.errors import ConfigError
from lmplug.interfaces.attention import (
    LAYER_SCALES,
    LAYER_WINDOWS,
    LOGIT_SOFTCAP,
    SLIDING_WINDOW,
    LayerAttention,
    needed_features,
)

pytestmark = pytest.mark.hf

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}


def test_needed_features_of_layers():
    assert needed_features([LayerAttention(0.1), LayerAttention(0.1)]) == {}
    assert set(needed_features([LayerAttention(0.1, 8), LayerAttention(0.1, 8)])) == {SLIDING_WINDOW}
    assert set(needed_features([LayerAttention(0.1, 8), LayerAttention(0.1)])) == {LAYER_WINDOWS}
    assert set(needed_features([LayerAttention(0.1), LayerAttention(0.2, softcap=50.0)])) == {
        LAYER_SCALES, LOGIT_SOFTCAP}


@pytest.mark.parametrize("model_type, native", [
    ("gemma2", "gemma"), ("gemma3_text", "gemma"), ("smollm3", "smollm3"), ("olmo2", "olmo2"),
    ("granite", "granite"), ("phi3", "phi3")])
def test_native_architecture_is_chosen_over_the_fallback(model_type, native):
    from lmplug.engine.architecture import choose_architecture
    from lmplug.plugins import get_registry

    info, reason = choose_architecture({**TINY, "model_type": model_type}, "auto", "config.json", get_registry())
    assert info.name == native, reason
    assert model_type in reason


def _tiny(tmp_path, **config):
    from lmplug.testing.architecture import build_tiny

    build_tiny({**TINY, **config}, tmp_path)
    return str(tmp_path)


@pytest.fixture
def plain_attention(request):
    """A third-party attention backend, ``plain_attn``, registered in-process, with the features
    the test's parameter names (default: one window per model, none of the per-layer ones)."""
    import types

    from lmplug_attention.sdpa import SdpaAttention

    from lmplug.api import Capabilities, hookimpl
    from lmplug.plugins import get_registry, reset_registry

    class PlainAttention(SdpaAttention):
        name = "plain_attn"
        capabilities = Capabilities(devices=frozenset({"cpu"}), kv_layouts=frozenset({"contiguous", "paged"}),
                                    features=frozenset(getattr(request, "param", {"sliding_window"})),
                                    priority=1)

    plugin = types.SimpleNamespace(LMPLUG_API_VERSION=3)
    plugin.lmplug_register_attention_backends = hookimpl(specname="lmplug_register_attention_backends")(
        lambda: [PlainAttention])
    assert get_registry().register(plugin, name="plain-attention", distribution="plain-attn 0.1")
    yield "plain_attn"
    reset_registry()  # forget it: the cached backend tables included it


@pytest.mark.parametrize("plain_attention", [{"sliding_window", LAYER_WINDOWS, LAYER_SCALES}], indirect=True)

def test_softcapped_gemma2_on_a_backend_without_softcap_is_refused_naming_feature_and_alternative(
        tmp_path, plain_attention):
    from lmplug import LLM

    path = _tiny(tmp_path, model_type="gemma2", sliding_window=8, attn_logit_softcapping=50.0)
    with pytest.raises(ConfigError) as err:
        LLM(path, device="cpu", dtype="float32", attention={"backend": plain_attention}, kvcache={"backend": "paged"})
    msg = str(err.value)
    for part in ("'plain_attn'", "plain-attention", "'logit_softcap'", "gemma2",
                 "attention-logit soft-capping at 50.0", "e.g. `attention: ", "paged", "sdpa"):
        assert part in msg, msg


def test_gemma3_windows_per_layer_refused_by_a_backend_without_them(tmp_path, plain_attention):
    from lmplug import LLM

    path = _tiny(tmp_path, model_type="gemma3_text", sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ConfigError) as err:
        LLM(path, device="cpu", dtype="float32", attention={"backend": plain_attention})
    msg = str(err.value)
    for part in ("'plain_attn'", "'layer_windows'", "gemma3_text", "flash", "paged", "sdpa"):
        assert part in msg, msg


@pytest.mark.parametrize("options", [{"kernels": "torch"}, {"kernels": "torch", "cpu_kernel": "torch"},
                                     {"kernels": "triton"}], ids=["native", "torch", "triton"])
def test_softcapped_gemma2_runs_on_every_paged_path(tmp_path, options):
    """Soft-caps and windows per layer on each path of ``paged`` (the C decode kernel, the PyTorch
    decode, the Triton kernels under the interpreter): greedy tokens equal sdpa's."""
    import os

    from lmplug import LLM, SamplingParams

    if options["kernels"] == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
    path = _tiny(tmp_path, model_type="gemma2", sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=8)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9, 10, 11]]
    want = LLM(path, device="cpu", dtype="float32", max_model_len=64, attention={"backend": "sdpa"},
               kvcache={"backend": "paged", "block_size": 2}).generate(prompt, greedy)[0].token_ids
    got = LLM(path, device="cpu", dtype="float32", max_model_len=64, attention={"backend": "paged", **options},
              kvcache={"backend": "paged", "block_size": 2}).generate(prompt, greedy)[0].token_ids
    assert got == want


def test_auto_attention_picks_a_backend_with_the_features(tmp_path, caplog):
    from lmplug import LLM, SamplingParams

    path = _tiny(tmp_path, model_type="gemma2", sliding_window=8, attn_logit_softcapping=50.0)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


def test_an_unsupported_activation_is_named_at_load(tmp_path):
    import json

    from lmplug import LLM
    from lmplug.errors import ModelLoadError

    path = _tiny(tmp_path, model_type="olmo2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu2"}))
    with pytest.raises(ModelLoadError, match="hidden_act 'relu2'"):
        LLM(path, device="cpu", dtype="float32", max_model_len=64)
