"""Hostile LoRA adapters: each refused when it loads with an error naming the adapter and the
field or module, and the engine goes on serving the good ones (PEFT's greedy output)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from support.hf_models import get_model, hf_greedy, one_torch_thread, prompt_ids  # noqa: F401
from support.lora_adapters import make_adapter

from lmplug import LLM, ConfigError, EngineConfig, LmplugError, LoRARequest, SamplingParams
from lmplug.config import resolve

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bad")
    tiny = get_model("llama", root)
    good = make_adapter(tiny.hf, root / "good", rank=4, seed=1).get_base_model()
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64,
              lora={"max_loras": 2, "max_lora_rank": 8})
    yield tiny, root, good, llm
    llm.close()


def _copy(root, name):
    dst = root / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(root / "good", dst)
    return dst


def _edit_weights(folder, edit):
    tensors = load_file(str(folder / WEIGHTS))
    save_file(edit(tensors), str(folder / WEIGHTS))


def _edit_config(folder, **fields):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(fields)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def _bad_cases(tiny, root):
    cases = {}
    folder = root / "dora"
    make_adapter(tiny.hf, folder, rank=4, seed=2, use_dora=True)
    cases["dora"] = (folder, "use_dora")
    folder = root / "head"
    make_adapter(tiny.hf, folder, rank=4, seed=2, targets=["q_proj", "lm_head"])
    cases["head"] = (folder, "lm_head")
    folder = root / "embed"
    make_adapter(tiny.hf, folder, rank=4, seed=2, targets=["q_proj", "embed_tokens"])
    cases["embed"] = (folder, "embed_tokens")
    folder = _copy(root, "shapes")  # an adapter for a narrower base model
    _edit_weights(folder, lambda t: {k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in t.items()})
    cases["shapes"] = (folder, "do not fit the base layer")
    folder = _copy(root, "target")  # a module this model does not have
    _edit_weights(folder, lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()})
    cases["target"] = (folder, "model.layers.7")
    folder = root / "rank"
    make_adapter(tiny.hf, folder, rank=16, seed=2)
    cases["rank"] = (folder, "max_lora_rank=8")
    folder = _copy(root, "corrupt")
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:200])
    cases["corrupt"] = (folder, "not a readable safetensors file")
    folder = _copy(root, "nan")
    _edit_weights(folder, lambda t: {k: v.fill_(float("nan")) if "lora_B" in k else v for k, v in t.items()})
    cases["nan"] = (folder, "NaN")
    folder = _copy(root, "config")
    (folder / "adapter_config.json").write_text("{not json")
    cases["config"] = (folder, "adapter_config.json is not valid JSON")
    folder = _copy(root, "alpha")
    _edit_config(folder, lora_alpha="big")
    cases["alpha"] = (folder, "lora_alpha")
    folder = _copy(root, "bias")
    _edit_config(folder, bias="all")
    cases["bias"] = (folder, "bias")
    cases["missing"] = (root / "nowhere", "not a folder")
    return cases


def test_bad_adapters_are_refused_by_name_and_the_engine_keeps_serving(setup):
    tiny, root, good, llm = setup
    prompt = prompt_ids(12, seed=5)
    for k, (name, (folder, field)) in enumerate(_bad_cases(tiny, root).items()):
        with pytest.raises(LmplugError) as info:
            llm.generate([prompt], GREEDY, lora=LoRARequest(f"bad-{name}", 100 + k, str(folder)))
        assert f"'bad-{name}'" in str(info.value) and field in str(info.value), (name, str(info.value))
        assert f"bad-{name}" not in llm.engine.adapters.known
        out = llm.generate([prompt], GREEDY, lora=LoRARequest("good", 1, str(root / "good")))[0]
        assert out.token_ids == hf_greedy(good, prompt, 6), f"after {name}"


def test_names_and_ids_are_unique(setup):
    _, root, _, llm = setup
    llm.engine.adapters.add(LoRARequest("good", 1, str(root / "good")))
    with pytest.raises(ConfigError, match="already loaded"):
        llm.engine.adapters.add(LoRARequest("good", 1, str(root / "dora")))
    with pytest.raises(ConfigError, match="lora_int_id 1 is already used"):
        llm.engine.adapters.add(LoRARequest("other", 1, str(root / "good")))
    for bad in ({"lora_name": ""}, {"lora_int_id": 0}, {"lora_int_id": True}, {"lora_path": ""}):
        with pytest.raises(ConfigError):
            LoRARequest(**{"lora_name": "x", "lora_int_id": 3, "lora_path": "p", **bad})


def test_an_engine_without_a_lora_section_says_so(setup):
    tiny, root, _, _ = setup
    with LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64) as plain, \
            pytest.raises(ConfigError, match="lora:"):
        plain.generate([[5, 6, 7]], GREEDY, lora=LoRARequest("good", 1, str(root / "good")))


def test_bad_lora_options_name_the_field():
    for key, value in (("max_loras", 0), ("max_lora_rank", -1), ("max_cpu_loras", "x"), ("slots", 3)):
        with pytest.raises(ConfigError, match=key):
            resolve(EngineConfig.from_dict({"model": "m", "lora": {key: value}}), device="cpu", dtype="float32")
