"""Which architecture (``model`` family) serves a checkpoint: ``model_impl``, priorities, errors."""

from __future__ import annotations

import types

import pytest

from lmplug.engine.architecture import choose_architecture
from lmplug.errors import ModelLoadError
from lmplug.hookspecs import hookimpl
from lmplug.interfaces.architecture import Architecture
from lmplug.interfaces.common import Capabilities
from lmplug.plugins import Registry

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}


def _arch(name: str, *, types_: tuple[str, ...] = (), priority: int = 0, fallback: bool = False,
          refuse: str | None = None) -> type[Architecture]:
    def cannot(cls, hf_config):  # a fallback that takes everything but what it refuses
        return refuse if hf_config.get("model_type") == "gpt2" else None

    return type(name.title(), (Architecture,), {
        "name": name, "model_types": types_, "fallback": fallback,
        "capabilities": Capabilities(priority=priority),
        "cannot_serve": classmethod(cannot) if fallback else Architecture.cannot_serve,
        "parse_config": lambda self, hf, where: None, "build": lambda self, *a, **k: None})


def _registry(*classes: type[Architecture]) -> Registry:
    reg = Registry(autoload=False)
    plugin = types.ModuleType("archs")  # a plugin module, as an entry point loads it
    plugin.LMPLUG_API_VERSION = 3
    plugin.lmplug_register_architectures = hookimpl(lambda: list(classes))
    assert reg.register(plugin, name="archs", distribution="test-archs 1.0")
    return reg


def test_native_wins_over_fallback_and_the_log_reason_says_why():
    reg = _registry(_arch("fake_llama", types_=("llama",), priority=10), _arch("tf", fallback=True))
    info, why = choose_architecture(LLAMA, "auto", "m", reg)
    assert info.name == "fake_llama" and "model_type 'llama'" in why and "fallback" not in why


def test_higher_priority_native_wins_and_the_other_is_named():
    reg = _registry(_arch("low", types_=("llama",), priority=1), _arch("high", types_=("llama",), priority=5))
    info, why = choose_architecture(LLAMA, "auto", "m", reg)
    assert info.name == "high" and "'low'" in why and "priority 1" in why


def test_fallback_serves_what_no_native_declares_and_native_refuses_it():
    reg = _registry(_arch("fake_llama", types_=("llama",), priority=10), _arch("tf", fallback=True))
    info, why = choose_architecture({"model_type": "phi3"}, "auto", "m", reg)
    assert info.name == "tf" and "no native architecture" in why
    with pytest.raises(ModelLoadError, match=r"no architecture serves model_type 'phi3'.*fake_llama.*'native'"):
        choose_architecture({"model_type": "phi3"}, "native", "m", reg)


def test_no_architecture_names_the_checkpoint_the_natives_and_the_fallbacks_reason():
    reg = _registry(_arch("fake_llama", types_=("llama",)), _arch("tf", fallback=True, refuse="not a causal LM"))
    with pytest.raises(ModelLoadError) as err:
        choose_architecture(GPT2, "auto", "/x", reg)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "fake_llama" in msg and "fallback 'tf' cannot take it: not a causal LM" in msg


def test_model_impl_names_an_architecture():
    reg = _registry(_arch("fake_llama", types_=("llama",), priority=10), _arch("tf", fallback=True))
    assert choose_architecture(LLAMA, "tf", "m", reg)[0].name == "tf"
    with pytest.raises(ModelLoadError, match="model_impl: 'nope' is not an installed architecture.*fake_llama"):
        choose_architecture(LLAMA, "nope", "m", reg)
    with pytest.raises(ModelLoadError, match="model_impl: 'fake_llama' cannot serve model_type 'gpt2'"):
        choose_architecture(GPT2, "fake_llama", "m", reg)


def test_first_party_architectures_come_from_the_entry_points():
    table = Registry().backends("model")
    served = {t: info.name for info in table.values() for t in info.cls.model_types}
    assert served["llama"] == "llama" and served["qwen3_moe"] == "moe" and served["mamba2"] == "mamba2"
    assert all(info.distribution.startswith("lmplug") for info in table.values() if not info.cls.fallback)


def _plugin_registry(*classes: type[Architecture], distribution: str) -> Registry:
    """The installed (first-party) plugins plus one more distribution's architectures."""
    reg = Registry()
    plugin = types.ModuleType("more_archs")
    plugin.LMPLUG_API_VERSION = 3
    plugin.lmplug_register_architectures = hookimpl(lambda: list(classes))
    assert reg.register(plugin, name="more_archs", distribution=distribution)
    return reg


@pytest.mark.parametrize("distribution, winner", [("aaa-archs 1.0", "other_llama"), ("zzz-archs 1.0", "llama")])
def test_a_tie_goes_to_the_distribution_sorted_first_and_the_plan_log_names_both(caplog, distribution, winner):
    from lmplug.config import EngineConfig, resolve
    from lmplug.engine.architecture import model_config_of
    from lmplug.engine.plan import make_plan
    from lmplug.parallel import single

    reg = _plugin_registry(_arch("other_llama", types_=("llama",), priority=10), distribution=distribution)
    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    resolved = resolve(EngineConfig(model="tiny", device="cpu", dtype="float32"), device="cpu", dtype="float32",
                       registry=reg)
    with caplog.at_level("INFO", logger="lmplug.engine.plan"):
        plan = make_plan(resolved, hf, model_config_of(hf), "tiny", single())
    loser = "llama" if winner == "other_llama" else "other_llama"
    assert plan.architecture.name == winner
    line = next(r.getMessage() for r in caplog.records if "model: architecture" in r.getMessage())
    assert f"architecture {winner!r}" in line and "priority 10" in line
    assert f"also serving: {loser!r}" in line, line


def test_a_gguf_architecture_no_one_reads_is_refused_before_its_metadata_is_read():
    reg = _registry(_arch("fake_llama", types_=("llama",), priority=10))
    with pytest.raises(ModelLoadError, match=r"f\.gguf: GGUF architecture 'phi2' is not supported.*none"):
        choose_architecture({}, "auto", "f.gguf", reg, gguf_arch="phi2")
    with pytest.raises(ModelLoadError, match=r"model_impl: 'fake_llama' does not read GGUF architecture 'llama'"):
        choose_architecture({}, "fake_llama", "f.gguf", reg, gguf_arch="llama")
