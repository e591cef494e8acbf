"""``lmplug.config.resolve``: choosing backends (``auto`` by priority, device, dtype and KV layout),
validating their options, and failing clearly at load time.

No model is needed: ``resolve`` only chooses backends and validates their options.
"""

from __future__ import annotations

import pytest
from support.configs import cfg

import lmplug
from lmplug import AttentionBackend, BackendOptions, Capabilities, ConfigError, hookimpl
from lmplug.config import resolve
from lmplug.plugins import Registry

# -- test backends, registered in-process ------------------------------------------------------


class _Attn(AttentionBackend):
    def forward(self, layer, q, k, v, kv, ctx):  # pragma: no cover - never run
        raise NotImplementedError


class MidOptions(BackendOptions):
    window: int = 4


class MidAttention(_Attn):
    """Beats sdpa (priority 10) on the CPU in fp32."""

    name = "mid"
    capabilities = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float32"}),
        kv_layouts=frozenset({"contiguous"}),
        priority=1000,
    )
    Options = MidOptions


class HalfOnlyAttention(_Attn):
    """Highest priority, but only for bfloat16."""

    name = "half_only"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"bfloat16"}),
        kv_layouts=frozenset({"contiguous"}),
        priority=2000,
    )


class ExoticOnlyAttention(_Attn):
    """Highest priority of all, but reads only a layout no installed kvcache provides."""

    name = "exotic_only"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}), kv_layouts=frozenset({"exotic"}), priority=5000
    )


class CudaOnlyAttention(_Attn):
    name = "cuda_only"
    capabilities = Capabilities(devices=frozenset({"cuda"}), kv_layouts=frozenset({"contiguous"}))


class ExtraAttentionPlugin:
    LMPLUG_API_VERSION = lmplug.API_VERSION

    @hookimpl
    def lmplug_register_attention_backends(self):
        return [MidAttention, HalfOnlyAttention, ExoticOnlyAttention, CudaOnlyAttention]


@pytest.fixture
def registry() -> Registry:
    reg = Registry()
    assert reg.register(ExtraAttentionPlugin(), name="extra-attention"), reg.failures
    return reg


KV = {"backend": "contiguous"}  # fixed, so `auto` attention choices don't depend on it


# -- resolve: choosing backends ----------------------------------------------------------------


def test_resolve_first_party_defaults():
    r = resolve(cfg(), device="cpu", dtype="float32")
    assert set(r.backends) == {"kvcache", "attention", "scheduler", "constraint"}  # optional ones are off
    for section, b in r.backends.items():
        assert b.info.distribution.startswith("lmplug "), (section, b.info)
        assert b.cls.capabilities.fits("cpu", "float32")
    assert r.backends["kvcache"].cls.capabilities.kv_layouts <= (
        r.backends["attention"].cls.capabilities.kv_layouts
    )
    assert r.device == "cpu" and r.dtype == "float32"
    r = resolve(
        cfg(
            kvcache={"backend": "contiguous"},
            attention={"backend": "sdpa"},
            scheduler={"backend": "static"},
        ),
        device="cpu",
        dtype="float32",
    )
    assert {s: b.name for s, b in r.backends.items()} == {
        "kvcache": "contiguous",
        "attention": "sdpa",
        "scheduler": "static",
        "constraint": "xgrammar",  # auto: the highest-priority grammar engine
    }


def test_auto_picks_highest_priority_that_fits(registry):
    r = resolve(cfg(kvcache=KV), device="cpu", dtype="float32", registry=registry)
    # exotic_only (5000) reads no layout a kvcache provides; half_only (2000) is bf16 only
    assert r.backends["attention"].name == "mid"
    assert r.backends["attention"].options == MidOptions()
    r = resolve(cfg(kvcache=KV), device="cpu", dtype="bfloat16", registry=registry)
    assert r.backends["attention"].name == "half_only"
    r = resolve(cfg(kvcache=KV), device="cuda", dtype="float32", registry=registry)
    assert r.backends["attention"].name not in ("mid", "half_only", "exotic_only")  # mid: CPU only
    assert r.backends["attention"].info.distribution.startswith("lmplug ")


def test_auto_options_are_validated_for_the_chosen_backend(registry):
    r = resolve(
        cfg(attention={"window": 16}, kvcache=KV), device="cpu", dtype="float32", registry=registry
    )
    assert r.backends["attention"].name == "mid" and r.backends["attention"].options.window == 16


def test_explicit_backend_with_options(registry):
    r = resolve(
        cfg(attention={"backend": "mid", "window": 2}),
        device="cpu",
        dtype="float32",
        registry=registry,
    )
    assert r.backends["attention"].options.window == 2
    with pytest.raises(ConfigError) as exc:
        resolve(
            cfg(attention={"backend": "mid", "window": "wide"}),
            device="cpu",
            dtype="float32",
            registry=registry,
        )
    assert "attention.window" in str(exc.value) and "'wide'" in str(exc.value)


def test_backend_not_supporting_device(registry):
    with pytest.raises(ConfigError) as exc:
        resolve(
            cfg(attention={"backend": "cuda_only"}),
            device="cpu",
            dtype="float32",
            registry=registry,
            source="my.yaml",
        )
    msg = str(exc.value)
    assert (
        "my.yaml" in msg
        and "'cuda_only'" in msg
        and "device 'cpu'" in msg
        and "devices=cuda" in msg
    )
    # it does on cuda
    r = resolve(
        cfg(attention={"backend": "cuda_only"}), device="cuda", dtype="float32", registry=registry
    )
    assert r.backends["attention"].name == "cuda_only"


def test_backend_not_supporting_dtype(registry):
    with pytest.raises(ConfigError) as exc:
        resolve(
            cfg(attention={"backend": "half_only"}),
            device="cpu",
            dtype="float32",
            registry=registry,
        )
    msg = str(exc.value)
    assert "'half_only'" in msg and "dtype 'float32'" in msg and "dtypes=bfloat16" in msg


def test_no_backend_fits_device():
    with pytest.raises(ConfigError) as exc:
        resolve(cfg(), device="tpu", dtype="float32")
    msg = str(exc.value)
    installed = ", ".join(sorted(Registry().backends("kvcache")))
    assert "no kvcache backend fits device 'tpu'" in msg and f"installed: {installed}" in msg


def test_unknown_backend_lists_available(registry):
    with pytest.raises(ConfigError) as exc:
        resolve(
            cfg(attention={"backend": "no_such_backend"}),
            device="cpu",
            dtype="float32",
            registry=registry,
            source="my.yaml",
        )
    msg = str(exc.value)
    assert "my.yaml" in msg and "attention" in msg and "'no_such_backend'" in msg
    assert f"available: {', '.join(sorted(registry.backends('attention')))}" in msg
    assert all(name in msg for name in ("cuda_only", "exotic_only", "half_only", "mid"))


def test_layout_mismatch(registry):
    with pytest.raises(ConfigError) as exc:
        resolve(
            cfg(attention={"backend": "exotic_only"}, kvcache={"backend": "contiguous"}),
            device="cpu",
            dtype="float32",
            registry=registry,
        )
    msg = str(exc.value)
    assert (
        "'exotic_only'" in msg
        and "'contiguous'" in msg
        and "['exotic']" in msg
        and "['contiguous']" in msg
    )


def test_missing_method_for_optional_section():
    with pytest.raises(ConfigError) as exc:
        resolve(cfg(quant={"bits": 4}), device="cpu", dtype="float32")
    assert "quant: missing `method`" in str(exc.value)


def test_optional_section_with_unknown_method():
    with pytest.raises(ConfigError) as exc:
        resolve(cfg(quant={"method": "hqq"}), device="cpu", dtype="float32")
    msg = str(exc.value)
    assert "unknown quant backend 'hqq'" in msg and "available: awq, compressed-tensors, fp8, gguf, gptq, int8, mxfp4, rtn" in msg


def test_resolving_for_the_model_chooses_by_feature_and_drops_moe(caplog):
    """With the model's facts (the engine build's one resolution): an MLA model's `auto` takes the
    backend with the "mla" feature (others never), an MoE model gets `moe: auto`, a dense one
    drops a `moe` section with a warning. Nothing is mutated: each call returns a new record."""
    from lmplug.config import EngineConfig, ModelFacts, resolve

    config = EngineConfig.from_dict({"model": "m", "moe": {"backend": "auto"}})
    mla = resolve(config, device="cpu", dtype="float32", model=ModelFacts("deepseek_v2", mla=True, moe=True))
    assert "mla" in mla.backends["attention"].cls.capabilities.features
    assert "MLA model deepseek_v2" in mla.reasons["attention"] and "moe" in mla.backends
    dense = resolve(config, device="cpu", dtype="float32", model=ModelFacts("llama"))
    assert "mla" not in dense.backends["attention"].cls.capabilities.features
    assert "moe" not in dense.backends and "moe: ignored" in caplog.text
    plain = resolve(EngineConfig.from_dict({"model": "m"}), device="cpu", dtype="float32",
                    model=ModelFacts("qwen2_moe", moe=True))
    assert plain.reasons["moe"].startswith("auto: ")
