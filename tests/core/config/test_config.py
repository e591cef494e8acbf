"""``EngineConfig``: construction, overrides, and errors at load time (file, key, value, what is
allowed). Choosing backends: test_config_resolve.py.

No model is needed: ``resolve`` only chooses backends and validates their options.
"""

from __future__ import annotations

import pytest
from support.configs import cfg, write

import lmplug
from lmplug import ConfigError, EngineConfig
from lmplug.config import DEFAULT_CONFIG, merge, resolve

# -- construction ------------------------------------------------------------------------------


def test_from_yaml(tmp_path):
    path = write(
        tmp_path,
        """
        model: tiny
        dtype: float32
        device: cpu
        max_model_len: 128
        attention: {backend: sdpa}
        scheduler: {backend: static, max_num_seqs: 4}
    """,
    )
    c = EngineConfig.from_yaml(path)
    assert (
        c.model == "tiny" and c.dtype == "float32" and c.device == "cpu" and c.max_model_len == 128
    )
    assert c.attention == {"backend": "sdpa"}
    assert c.kvcache == {"backend": "auto"}  # default
    assert c.scheduler == {"backend": "static", "max_num_seqs": 4}
    assert c.quant is None and c.speculative is None and c.moe is None


def test_from_dict_and_kwargs():
    a = EngineConfig.from_dict(
        {"model": "tiny", "dtype": "bfloat16", "scheduler": {"max_num_seqs": 2}}
    )
    b = EngineConfig(model="tiny", dtype="bfloat16", scheduler={"max_num_seqs": 2})
    assert a == b
    assert a.scheduler == {"max_num_seqs": 2}


def test_default_config_and_overrides():
    c = EngineConfig.default()
    assert c.model == "smollm2-135m-instruct"
    d = EngineConfig.default(model="other", dtype="float32", scheduler={"max_num_seqs": 2})
    assert d.model == "other"
    # a section override merges into the default's section
    assert d.scheduler == {"backend": "auto", "max_num_seqs": 2, "max_num_batched_tokens": 4096}
    r = resolve(d, device="cpu", dtype="float32")
    assert r.backends["scheduler"].options.max_num_seqs == 2
    assert r.backends["scheduler"].options.max_num_batched_tokens == 4096
    assert DEFAULT_CONFIG.exists()


def test_empty_yaml_file_reports_missing_model(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg and "model" in msg


# -- errors at load time: file, key, value, what is allowed ---------------------------------


def test_unknown_top_level_key(tmp_path):
    path = write(
        tmp_path,
        """
        model: tiny
        max_num_seqs: 4
    """,
    )
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg
    assert "max_num_seqs" in msg and "unknown option" in msg
    # the keys that are allowed at the top level are listed
    for key in ("model", "dtype", "attention", "kvcache", "scheduler"):
        assert key in msg.split("unknown option", 1)[1], msg


def test_bad_dtype(tmp_path):
    path = write(tmp_path, "model: tiny\ndtype: fp8\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg and "dtype" in msg and "'fp8'" in msg
    for allowed in ("auto", "float32", "bfloat16", "float16"):
        assert allowed in msg


def test_bad_top_level_type(tmp_path):
    path = write(tmp_path, "model: tiny\nmax_model_len: 0\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert (
        str(path) in msg
        and "max_model_len" in msg
        and "got 0" in msg
        and ">= 1" in msg.replace("greater than or equal to 1", ">= 1")
    )


def test_unknown_option_in_plugin_section(tmp_path):
    path = write(
        tmp_path,
        """
        model: tiny
        scheduler: {backend: static, max_num_seq: 4}
    """,
    )
    c = EngineConfig.from_yaml(path)  # plugin sections are checked by the backend's Options
    with pytest.raises(ConfigError) as exc:
        resolve(c, device="cpu", dtype="float32", source=str(path))
    msg = str(exc.value)
    assert str(path) in msg
    assert "scheduler.max_num_seq" in msg and "unknown option" in msg
    assert "'static'" in msg
    assert "allowed: max_num_seqs, max_num_batched_tokens" in msg


def test_unknown_option_for_auto_chosen_backend():
    chosen = resolve(cfg(), device="cpu", dtype="float32").backends["kvcache"]
    c = cfg(kvcache={"no_such_option": 16})
    with pytest.raises(ConfigError) as exc:
        resolve(c, device="cpu", dtype="float32")
    msg = str(exc.value)
    allowed = ", ".join(chosen.cls.Options.model_fields) or "none"
    assert (
        "kvcache.no_such_option" in msg
        and f"{chosen.name!r}" in msg
        and f"allowed: {allowed}" in msg
    )


@pytest.mark.parametrize(
    "value, expect", [(-1, "greater than or equal to 1"), ("lots", "valid integer")]
)
def test_bad_option_value(tmp_path, value, expect):
    path = write(tmp_path, f"model: tiny\nscheduler: {{max_num_seqs: {value}}}\n")
    c = EngineConfig.from_yaml(path)
    with pytest.raises(ConfigError) as exc:
        resolve(c, device="cpu", dtype="float32", source=str(path))
    msg = str(exc.value)
    assert str(path) in msg and "scheduler.max_num_seqs" in msg and expect in msg
    assert f"got {value!r}" in msg


def test_plugin_section_errors_reach_llm_before_any_model_load(tmp_path):
    path = write(
        tmp_path, "model: /nonexistent/model\ndevice: cpu\nscheduler: {max_num_seqs: -1}\n"
    )
    with pytest.raises(ConfigError) as exc:
        lmplug.LLM(config=path)
    msg = str(exc.value)
    assert str(path) in msg and "scheduler.max_num_seqs" in msg and "got -1" in msg


def test_section_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "model: tiny\nscheduler: [static]\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg and "scheduler" in msg and "['static']" in msg


def test_yaml_syntax_error(tmp_path):
    path = write(tmp_path, "model: tiny\nattention: {backend: sdpa\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg and "not valid YAML" in msg and "line" in msg


@pytest.mark.parametrize(
    "text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("3\n", "int")]
)
def test_non_mapping_yaml(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg and "mapping" in msg and kind in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path)
    msg = str(exc.value)
    assert str(path) in msg and "No such file" in msg


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        cfg(dtype="fp8")


# -- overrides ---------------------------------------------------------------------------------


def test_override_section_as_string_picks_backend(tmp_path):
    path = write(
        tmp_path,
        """
        model: tiny
        attention: {backend: mid, window: 8}
        scheduler: {backend: static, max_num_seqs: 4}
    """,
    )
    c = EngineConfig.from_yaml(path, attention="sdpa")
    # a new backend name drops the old backend's options
    assert c.attention == {"backend": "sdpa"}
    # the same name keeps them
    c = EngineConfig.from_yaml(path, attention="mid")
    assert c.attention == {"backend": "mid", "window": 8}
    c = EngineConfig.from_yaml(path, scheduler={"max_num_batched_tokens": 64})
    assert c.scheduler == {"backend": "static", "max_num_seqs": 4, "max_num_batched_tokens": 64}
    c = EngineConfig.from_yaml(path, scheduler={"backend": "other", "max_num_batched_tokens": 64})
    assert c.scheduler == {"backend": "other", "max_num_batched_tokens": 64}


def test_override_top_level_and_none(tmp_path):
    path = write(tmp_path, "model: tiny\ndtype: float32\nquant: {method: int8}\n")
    c = EngineConfig.from_yaml(path, model="big", dtype=None, quant=None)
    assert c.model == "big"
    assert c.dtype == "float32"  # None means "not given" for ordinary keys
    assert c.quant is None  # ... but turns an optional feature off
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_yaml(path, dtype="fp4")
    assert "dtype" in str(exc.value) and "'fp4'" in str(exc.value)


def test_merge_does_not_mutate():
    base = {"model": "a", "scheduler": {"backend": "static", "max_num_seqs": 4}}
    out = merge(base, {"scheduler": {"max_num_seqs": 2}})
    assert out["scheduler"] == {"backend": "static", "max_num_seqs": 2}
    assert base["scheduler"] == {"backend": "static", "max_num_seqs": 4}


def test_method_key_for_quant_and_speculative():
    out = merge({"quant": {"method": "int8", "group": 32}}, {"quant": "fp8"})
    assert out["quant"] == {"method": "fp8"}
    out = merge({"speculative": {"method": "ngram", "k": 4}}, {"speculative": {"k": 2}})
    assert out["speculative"] == {"method": "ngram", "k": 2}


def test_old_section_name_loads_the_same_config_and_warns_once(tmp_path, caplog, monkeypatch):
    """`structured_output:` is the constraint family's old section name: the same config as
    `constraint:`, one deprecation warning per process; both at once is refused."""
    from lmplug import config as config_module

    monkeypatch.setattr(config_module, "_warned_aliases", set())
    new = EngineConfig.from_dict({"model": "m", "constraint": {"backend": "llguidance", "max_compile_s": 5}})
    with caplog.at_level("WARNING", logger="lmplug.config"):
        old = EngineConfig.from_dict({"model": "m", "structured_output": {"backend": "llguidance",
                                                                          "max_compile_s": 5}})
        from_yaml = EngineConfig.from_yaml(write(tmp_path, "model: m\nstructured_output: llguidance\n"))
    assert old == new and old.constraint == {"backend": "llguidance", "max_compile_s": 5}
    assert from_yaml.constraint == {"backend": "llguidance"}
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and "`structured_output`" in warnings[0] and "`constraint`" in warnings[0]
    resolved = resolve(old, device="cpu", dtype="float32")
    assert resolved.backends["constraint"].name == "llguidance"
    assert resolved == resolve(new, device="cpu", dtype="float32")
    # an override in either name merges into the section
    assert merge({"constraint": {"backend": "xgrammar"}}, {"structured_output": {"max_compile_s": 2}}) == {
        "constraint": {"backend": "xgrammar", "max_compile_s": 2}}
    with pytest.raises(ConfigError, match="`structured_output` is the old name of the section `constraint`"):
        EngineConfig.from_dict({"model": "m", "constraint": "xgrammar", "structured_output": "xgrammar"})
