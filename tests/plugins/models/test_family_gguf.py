"""GGUF files of Gemma 2/3, SmolLM3, OLMo 2, Granite and Phi-3 as llama.cpp writes them, read by the
native architectures.

Tiny random transformers models are written to GGUF by ``support.gguf_families`` (the converter's
metadata, gguf-py's tensor names, the converter's tensor changes) and loaded by lmplug:

- F32 files match transformers on the model itself (prompt logprobs at 1e-4, greedy tokens);
- F16, Q8_0 and Q4_0 files match transformers on the model whose 2-D weights are what the file
  holds, dequantized; Q8_0 / Q4_0 both kept packed (the ``gguf`` method's PyTorch matmul) and
  dequantized at load;
- the config translation's rules and refusals on headers (llama.cpp's defaults where the
  converter writes nothing);
- ``slow``: llama.cpp's own ``convert_hf_to_gguf.py`` on a tiny model, loaded and matched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from support.gguf_families import FAMILIES
from support.gguf_families import family_configs as configs

pytestmark = pytest.mark.hf

PROMPT_LEN, NEW_TOKENS, ATOL = 24, 12, 1e-4
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128}
PACKED = {"method": "gguf", "kernel": "torch"}
DENSE = {"method": "gguf", "dequantize_at_load": True}




@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> transformers model (built once per module)."""
    from support.gguf_families import vocab_size

    from lmplug.testing.architecture import build_tiny

    root, all_configs, built = tmp_path_factory.mktemp("family_gguf"), configs(vocab_size()), {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny(all_configs[name], root / name)
        return built[name]

    return get


def _gguf(tmp_path: Path, hf, qtype: Q) -> Path:
    from support.gguf_families import write_family_gguf

    return write_family_gguf(hf, tmp_path / f"{qtype.name}.gguf", qtype)


def _run(llm, ids: list[int]):
    from lmplug import SamplingParams

    return llm.generate([ids], SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=NEW_TOKENS,
                                              ignore_eos=True))[0]


def _assert_matches(out, hf, ids: list[int], what: str) -> None:
    from lmplug.testing.architecture import hf_greedy, hf_prompt_logprobs, our_prompt_logprobs

    torch.testing.assert_close(our_prompt_logprobs(out, ids), hf_prompt_logprobs(hf, ids), atol=ATOL, rtol=0,
                               msg=lambda m: f"{what}: {m}")
    assert out.token_ids == hf_greedy(hf, ids, NEW_TOKENS), f"{what}: greedy tokens differ"


SLOW_F32 = ("gemma2", "gemma3-scaled-rope", "phi4mini-partial")  # over ~20 s on a loaded machine


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_F32 else n
                                  for n in configs(400)])
def test_f32_file_matches_transformers(tiny, tmp_path, name):
    from lmplug import LLM
    from lmplug.testing.architecture import prompt

    hf = tiny(name)
    llm = LLM(str(_gguf(tmp_path, hf, Q.F32)), **ENGINE)
    family = "gemma" if hf.config.model_type.startswith("gemma") else hf.config.model_type
    assert llm.engine.parts.plan.architecture.name == family
    ids = prompt(PROMPT_LEN, 1, hf.config.vocab_size)
    _assert_matches(_run(llm, ids), hf, ids, name)


@pytest.mark.parametrize("name", FAMILIES)
def test_f16_file_matches_transformers_on_its_weights(tiny, tmp_path, name):
    """F16 is dense (no quant method): the file against transformers on its rounded weights."""
    from support.gguf_families import quantized_reference

    from lmplug import LLM
    from lmplug.testing.architecture import prompt

    hf = tiny(name)
    llm = LLM(str(_gguf(tmp_path, hf, Q.F16)), **ENGINE)
    ids = prompt(PROMPT_LEN, 2, hf.config.vocab_size)
    _assert_matches(_run(llm, ids), quantized_reference(hf, Q.F16), ids, f"{name} F16")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_file_matches_dequantized_and_transformers(tiny, tmp_path, name, qtype):
    """Packed blocks (no float 2-D weight left) = dequantized at load = transformers on the
    dequantized weights."""
    from support.gguf_families import quantized_reference

    from lmplug import LLM
    from lmplug.kit.packed_embedding import QuantEmbedding
    from lmplug.testing.architecture import our_prompt_logprobs, prompt

    hf = tiny(name)
    path = _gguf(tmp_path, hf, qtype)
    packed, dense = LLM(str(path), **ENGINE, quant=PACKED), LLM(str(path), **ENGINE, quant=DENSE)
    model = packed.engine.parts.model
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert not any(p.is_floating_point() and p.dim() == 2 for p in model.parameters())
    ids = prompt(PROMPT_LEN, 3, hf.config.vocab_size)
    out_dense, out_packed = _run(dense, ids), _run(packed, ids)
    _assert_matches(out_dense, quantized_reference(hf, qtype), ids, f"{name} {qtype.name} dequantized")
    torch.testing.assert_close(our_prompt_logprobs(out_packed, ids), our_prompt_logprobs(out_dense, ids),
                               atol=ATOL, rtol=0)
    assert out_packed.token_ids == out_dense.token_ids


# -- the translation's rules and refusals, on headers ---------------------------------------------

def _header(arch: str, layers: int = 2, **keys: Any):
    from lmplug.api import GGUFHeader

    vectors = keys.pop("vectors", {})
    metadata = {f"{arch}.{k}": v for k, v in {
        "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2, "feed_forward_length": 96,
        "block_count": layers, "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 256, **keys}.items()}
    return GGUFHeader("m.gguf", arch, metadata, {"token_embd.weight": (64, 400)}, False, vectors)


def _config(arch: str, layers: int = 2, **keys: Any) -> dict[str, Any]:
    from lmplug.engine.architecture import choose_architecture

    info, _ = choose_architecture({}, "auto", "m.gguf", gguf_arch=arch)
    return info.cls.gguf_config(_header(arch, layers, **keys))


def test_gemma_scale_windows_and_caps_follow_llama_cpp():
    # the softmax scale from the size: 27B (46 / 62 layers) hidden / heads, else head_dim
    assert _config("gemma2", **{"attention.key_length": 32})["query_pre_attn_scalar"] == 32
    assert _config("gemma2", 46, **{"attention.key_length": 32})["query_pre_attn_scalar"] == 16
    assert _config("gemma3", 62, **{"attention.key_length": 32})["query_pre_attn_scalar"] == 16
    # Gemma 2: window 4096, 1:1, caps 50 / 30 where the file says nothing
    g2 = _config("gemma2", 4)
    assert (g2["sliding_window"], g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2
    # Gemma 3: no window key -> every layer global; a window -> 5:1, or the file's own list
    assert set(_config("gemma3", 6)["layer_types"]) == {"full_attention"}
    assert _config("gemma3", 7, **{"attention.sliding_window": 8})["layer_types"].count("full_attention") == 1
    listed = _config("gemma3", 3, **{"attention.sliding_window": 8,
                                     "attention.sliding_window_pattern": [True, False, True]})
    assert listed["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    g3 = _config("gemma3", 2, **{"rope.freq_base": 1e6, "rope.freq_base_swa": 1e4})
    assert (g3["rope_theta"], g3["rope_local_base_freq"], g3["final_logit_softcapping"]) == (1e6, 1e4, None)


def test_family_headers_it_cannot_serve_are_refused_naming_the_key():
    from lmplug.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"m\.gguf: GGUF metadata lacks required key 'granite\.logit_scale'"):
        _config("granite")
    with pytest.raises(ModelLoadError, match=r"'granite\.rope\.scaling\.finetuned' is false"):
        _config("granite", **{"logit_scale": 1.0, "rope.scaling.finetuned": False})
    with pytest.raises(ModelLoadError, match=r"'olmo2\.attention\.sliding_window' is 8: OLMo 3"):
        _config("olmo2", **{"attention.sliding_window": 8})
    with pytest.raises(ModelLoadError, match=r"'gemma3\.attention\.sliding_window_pattern' lists 2 layers; "
                                             r"the model has 3"):
        _config("gemma3", 3, **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False]})
    with pytest.raises(ModelLoadError, match=r"LongRoPE needs both rope_factors_long\.weight and "
                                             r"rope_factors_short\.weight"):
        _config("phi3", **{"rope.scaling.original_context_length": 16, "vectors": {
            "rope_factors_long.weight": (1.0,) * 8}})


def test_granite_multipliers_and_smollm3_nope_interval():
    granite = _config("granite", **{"logit_scale": 2.5, "embedding_scale": 4.0, "attention.scale": 0.0})
    assert granite["logits_scaling"] == 2.5 and granite["embedding_multiplier"] == 4.0
    assert "attention_multiplier" not in granite and "residual_multiplier" not in granite  # 0 / missing: none
    assert _config("smollm3")["no_rope_layer_interval"] == 4


# -- llama.cpp's own converter ---------------------------------------------------------------------

def _converter() -> Path | None:
    cache = Path(os.environ.get("LMPLUG_CACHE", Path.home() / ".cache" / "lmplug")) / "llamacpp" / "src"
    found = sorted(cache.glob("*/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


# the converter run with two changes for tiny models: their tokenizer's pre-tokenizer hash is in no
# table of its (``get_vocab_base_pre`` refuses unknown ones), so it is named "default"; and without
# the sentencepiece package a stand-in lets ``_create_vocab_sentencepiece`` reach its own check for
# ``tokenizer.model`` (absent: the converter falls back to the byte-level BPE vocabulary)
_RUN_CONVERTER = """
import runpy, sys, types
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
try:
    import sentencepiece
except ImportError:
    sys.modules["sentencepiece"] = types.SimpleNamespace(SentencePieceProcessor=None)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _write_bpe_tokenizer(path: Path, tokenizer_class: str) -> int:
    """A byte-level BPE ``tokenizer.json`` (with merges, which a GGUF of this kind must carry)."""
    import json

    from support.gguf_fixtures import train_byte_level
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = train_byte_level()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return len(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "smollm3", "olmo2", "granite", "phi3-longrope"])
def test_llama_cpp_converter_output_matches_transformers(tmp_path, name):
    converter = _converter()
    if converter is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not in the cache (benchmarks/build_llamacpp.sh fetches it)")
    if name == "gemma2":
        pytest.skip("Gemma2Model.set_vocab reads a SentencePiece tokenizer.model (and the sentencepiece "
                    "package), which the tiny models have not")
    from support.gguf_families import vocab_size

    from lmplug import LLM
    from lmplug.testing.architecture import build_tiny, prompt

    config = configs(vocab_size())[name]
    hf = build_tiny(config, tmp_path / "hf")
    # Phi3MiniModel.set_vocab takes a GPT-2 style vocabulary by the tokenizer's class name
    _write_bpe_tokenizer(tmp_path / "hf", "GPT2Tokenizer" if config["model_type"] == "phi3" else
                         "PreTrainedTokenizerFast")
    out = tmp_path / "model.gguf"
    done = subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(converter.parent), str(tmp_path / "hf"),
                           "--outfile", str(out), "--outtype", "f32"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = prompt(PROMPT_LEN, 4, vocab_size())
    _assert_matches(_run(LLM(str(out), **ENGINE), ids), hf, ids, f"{name} via convert_hf_to_gguf.py")


def test_quantize_from_a_gemma_gguf_writes_the_checkpoint_convention(tiny, tmp_path, capsys):
    """``lmplug quantize`` reads a GGUF through the same translation: the folder it writes holds
    Gemma's norm weights as transformers does (``w``, not the file's ``1 + w``) and loads natively."""
    import json

    from safetensors.torch import load_file

    from lmplug import LLM
    from lmplug.cli import main

    hf = tiny("gemma2")
    out = tmp_path / "rtn"
    capsys.readouterr()
    path = _gguf(tmp_path, hf, Q.F32)
    rc = main(["quantize", str(path), str(out), "--method", "rtn", "--group-size", "32", "-o", "dtype=float32"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma2"
    written = load_file(str(out / "model.safetensors"))
    norms = {k: v for k, v in hf.state_dict().items() if k.endswith("norm.weight")}
    assert len(norms) == 1 + 4 * hf.config.num_hidden_layers
    for name, weight in norms.items():
        torch.testing.assert_close(written[name], weight, atol=1e-6, rtol=0, msg=name)
    assert LLM(str(out), **ENGINE).engine.parts.plan.architecture.name == "gemma"
