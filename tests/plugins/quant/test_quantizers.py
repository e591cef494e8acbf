"""Offline quantizers (``lmplug quantize``) and ``lmplug eval``.

The references are the math and the published formats, not this code: GPTQ
must beat round-to-nearest on the output error it minimises; the written
folders are dequantized here by a small reader written from FORMATS.md and run
in HF transformers, against lmplug's own loading of the same folder; AWQ and
SmoothQuant scale folding must leave the float model's function unchanged;
perplexity is recomputed with transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.hf_models import (  # noqa: F401
    build_hf_model,
    get_model,
    make_config,
    one_torch_thread,
    write_tokenizer,
)

from lmplug.cli import main as cli_main
from lmplug.interfaces.quantizer import CalibrationSpec
from lmplug.loading import open_source

SPEC = CalibrationSpec(num_samples=8, seq_len=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("quantizers"), tokenizer=True)


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory):
    """No GQA (4 query heads, 4 KV heads), so AWQ also scales v_proj -> o_proj."""
    path = tmp_path_factory.mktemp("quantizers_mha") / "mha"
    model = build_hf_model(make_config("llama", num_key_value_heads=4), seed=3)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path, model


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def quantize(capsys, model: Path, out: Path, method: str, *flags: str) -> dict:
    rc, stdout, stderr = cli(capsys, "quantize", model, out, "--method", method, "--calib-samples", "8",
                             "--calib-len", "64", *flags)
    assert rc == 0, stderr
    return json.loads(stdout)


# -- an independent reader of the published formats (FORMATS.md) ----------------------------------

def unpack(words: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """int32 words -> values, value k of a word at bits k*bits, along ``axis`` (0: rows, 1: cols)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    p = 32 // bits
    parts = torch.stack([(w >> (bits * k)) & (2**bits - 1) for k in range(p)], dim=axis + 1)
    shape = list(words.shape)
    shape[axis] *= p
    return parts.reshape(shape)


def dequantize_gptq_v1(t: dict, name: str, bits: int) -> torch.Tensor:
    q = unpack(t[f"{name}.qweight"], bits, 0)  # [in, out]
    z = (unpack(t[f"{name}.qzeros"], bits, 1) + 1) & (2**bits - 1)  # v1 stores zero - 1
    g = t[f"{name}.g_idx"].long()
    return ((q - z[g]).float() * t[f"{name}.scales"].float()[g]).T  # [out, in]


def dequantize_awq(t: dict, name: str, group: int) -> torch.Tensor:
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k holds column order[k]

    def cols(words):
        nib = unpack(words, 4, 1).reshape(words.shape[0], -1, 8)
        out = torch.empty_like(nib)
        out[..., order] = nib
        return out.reshape(words.shape[0], -1)

    q, z = cols(t[f"{name}.qweight"]), cols(t[f"{name}.qzeros"])
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * t[f"{name}.scales"].float()[g]).T


def dequantize_channel8(t: dict, name: str) -> torch.Tensor:
    return t[f"{name}.weight"].float() * t[f"{name}.weight_scale"].float()


def dense_state(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors with every quantized linear replaced by its dense weight."""
    t = load_file(str(folder / "model.safetensors"))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    out = {}
    for key, value in t.items():
        name, _, param = key.rpartition(".")
        if param == "qweight":
            if qc["quant_method"] == "gptq":
                out[f"{name}.weight"] = dequantize_gptq_v1(t, name, qc["bits"])
            else:
                out[f"{name}.weight"] = dequantize_awq(t, name, qc["group_size"])
        elif param == "weight_scale":
            out[f"{name}.weight"] = dequantize_channel8(t, name)
        elif param in ("qzeros", "scales", "g_idx") or (param == "weight" and f"{name}.weight_scale" in t):
            continue
        else:
            out[key] = value.float()
    return out


def hf_with(tiny_hf, state: dict[str, torch.Tensor]):
    import copy

    model = copy.deepcopy(tiny_hf)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


def lmplug_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from lmplug.evaluate import Scorer

    return Scorer(str(folder), window=len(ids)).log_probs(ids, range(len(ids)))


IDS = [5, 17, 99, 230, 31, 400, 8, 77, 150, 211, 9, 300, 12, 45, 500, 260]


# -- GPTQ: the property it exists for ---------------------------------------------------------------

def _correlated(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(d, d, generator=g) * torch.logspace(0, -2, d)[:, None]  # decaying spectrum
    x = torch.randn(n, d, generator=g) @ basis
    x[:, :4] *= 20  # a few outlier channels
    return x


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_lowers_output_error_vs_rtn(desc_act):
    from lmplug_quant.quantizers.gptq import gptq_quantize, hessian
    from lmplug_quant.quantizers.grid import dequantize_groups, quantize_groups

    x = _correlated(1024, 128, 0)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    q, s, z, g_idx = gptq_quantize(w, hessian(x), bits=4, group_size=32, desc_act=desc_act)
    w_gptq = dequantize_groups(q, s, z, g_idx)
    rq, rs, rz = quantize_groups(w, 4, 32, sym=True)
    w_rtn = dequantize_groups(rq, rs, rz, torch.arange(128) // 32)
    err_gptq = (x @ (w - w_gptq).T).norm()
    err_rtn = (x @ (w - w_rtn).T).norm()
    assert err_gptq < 0.7 * err_rtn, (err_gptq, err_rtn)
    # every group holds group_size columns, q is on the 4-bit grid
    assert torch.bincount(g_idx, minlength=4).tolist() == [32] * 4
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    if desc_act:
        # act-order: groups follow decreasing Hessian diagonal, so g_idx is not the identity layout
        order = torch.argsort(torch.diag(hessian(x)), descending=True)
        assert torch.equal(g_idx[order], torch.arange(128) // 32)
        assert not torch.equal(g_idx, torch.arange(128) // 32)


def test_gptq_dead_inputs_get_zero_weights():
    from lmplug_quant.quantizers.gptq import gptq_quantize, hessian
    from lmplug_quant.quantizers.grid import dequantize_groups

    x = _correlated(256, 64, 2)
    x[:, 10] = 0
    w = torch.randn(32, 64) * 0.1
    q, s, z, g_idx = gptq_quantize(w, hessian(x), bits=4, group_size=32)
    assert torch.all(dequantize_groups(q, s, z, g_idx)[:, 10].abs() <= s.max())  # quantized zero


# -- written folders: lmplug and an independent dequantizer agree --------------------------------

@pytest.mark.parametrize("method,flags", [("rtn", ["--group-size", "32"]),
                                          ("gptq", ["--group-size", "32"]),
                                          ("gptq", ["--group-size", "32", "--desc-act"]),
                                          ("awq", ["--group-size", "32"])])
def test_written_folder_loads_and_matches_independent_dequantizer(capsys, tmp_path, tiny, method, flags):
    out = tmp_path / method
    summary = quantize(capsys, tiny.path, out, method, *flags)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == ("awq" if method == "awq" else "gptq")
    assert qc["bits"] == 4 and qc["group_size"] == 32
    if method != "awq":
        assert qc["checkpoint_format"] == "gptq" and qc["sym"] is True
        assert qc["desc_act"] == ("--desc-act" in flags)
    else:
        assert qc["zero_point"] is True and qc["version"] == "gemm"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert summary["bytes_vs_fp16"] < 0.35
    state = dense_state(out)
    float_sd = tiny.hf.state_dict()
    for key, w in state.items():  # every quantized weight is close to its float original
        if key.endswith("_proj.weight") and method != "awq":
            rel = (w - float_sd[key]).norm() / float_sd[key].norm()
            assert rel < 0.2, (key, rel)
    g_idx = load_file(str(out / "model.safetensors")).get("model.layers.0.self_attn.q_proj.g_idx")
    if method != "awq":
        assert torch.bincount(g_idx.long()).tolist() == [32, 32]
    ref = torch.log_softmax(hf_with(tiny.hf, state)(torch.tensor([IDS])).logits[0].double(), -1)
    got = lmplug_logits(out, IDS)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    fl = torch.log_softmax(tiny.hf(torch.tensor([IDS])).logits[0].double(), -1)
    assert not torch.allclose(got, fl, atol=1e-4)  # the weights really are quantized


def test_awq_scale_folding_keeps_the_float_function(tiny_mha):
    from lmplug_quant.quantizers.awq import AWQQuantizer
    from lmplug_quant.quantizers.base import split_windows
    from lmplug_quant.quantizers.calibration import calibration_windows
    from lmplug_quant.quantizers.reference import FloatLlama

    path, hf = tiny_mha
    source = open_source(path)
    model = FloatLlama(source)
    windows = calibration_windows(source.tokenizer, SPEC)
    ids = windows[:2]
    before = model.forward(ids)
    # the float twin is the model: same logits as transformers
    torch.testing.assert_close(before, hf(ids).logits.detach(), atol=1e-4, rtol=1e-4)
    norms = model.tensors["model.layers.0.input_layernorm.weight"].clone()
    v = model.weight(0, "self_attn.v_proj").clone()
    q = AWQQuantizer(AWQQuantizer.Options(group_size=32))
    xs = [model.embed(w) for w in split_windows(windows)]
    with torch.no_grad():
        for i in range(model.cfg.num_layers):
            nxt = [model.layer(i, x) for x in xs]
            q.scale_layer(model, i, xs)
            xs = nxt
    assert not torch.allclose(norms, model.tensors["model.layers.0.input_layernorm.weight"])
    assert not torch.allclose(v, model.weight(0, "self_attn.v_proj"))  # v -> o scaled too (no GQA)
    torch.testing.assert_close(model.forward(ids), before, atol=1e-4, rtol=1e-4)


def test_smoothquant_folding_and_int8_weights(capsys, tmp_path, tiny):
    from lmplug_quant.quantizers.calibration import calibration_windows
    from lmplug_quant.quantizers.reference import FloatLlama
    from lmplug_quant.quantizers.smoothquant import activation_maxima, smooth

    source = open_source(tiny.path)
    model = FloatLlama(source)
    windows = calibration_windows(source.tokenizer, SPEC)
    before = model.forward(windows[:2])
    with torch.no_grad():
        smooth(model, activation_maxima(model, windows, lambda *a: None), 0.5)
    torch.testing.assert_close(model.forward(windows[:2]), before, atol=1e-4, rtol=1e-4)

    out = tmp_path / "sq"
    quantize(capsys, tiny.path, out, "smoothquant", "-o", "dtype=float32")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "dynamic": False}
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    t = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.gate_proj"
    assert t[f"{name}.weight"].dtype == torch.int8 and t[f"{name}.weight_scale"].shape == (128, 1)
    step = t[f"{name}.weight_scale"]
    smoothed = model.weight(1, "mlp.gate_proj")
    assert torch.all((dequantize_channel8(t, name) - smoothed).abs() <= step / 2 + 1e-6)
    torch.testing.assert_close(t["model.layers.1.post_attention_layernorm.weight"],
                               model.tensors["model.layers.1.post_attention_layernorm.weight"])


def test_fp8_weights_dequantize_to_the_originals(capsys, tmp_path, tiny):
    out = tmp_path / "fp8"
    quantize(capsys, tiny.path, out, "fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    t = load_file(str(out / "model.safetensors"))
    sd = tiny.hf.state_dict()
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        assert t[f"{name}.weight"].dtype == torch.float8_e4m3fn
        w = sd[f"{name}.weight"]
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 (plus subnormals near zero)
        err = (dequantize_channel8(t, name) - w).abs()
        assert torch.all(err <= w.abs() / 16 + t[f"{name}.weight_scale"] * 2**-9)


# -- lmplug eval ----------------------------------------------------------------------------------

def test_eval_self_kl_zero_and_perplexity_matches_transformers(capsys, tmp_path, tiny):
    from tokenizers import Tokenizer

    text = tmp_path / "held.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    rc, out, err = cli(capsys, "eval", tiny.path, "--text", text, "--reference", tiny.path,
                       "--window", "48", "--stride", "20", "--max-tokens", "150")
    assert rc == 0, err
    result = json.loads(out)
    assert result["kl"] == pytest.approx(0.0, abs=1e-12)
    # independently: HF's sliding-window perplexity recipe
    ids = Tokenizer.from_file(str(tiny.path / "tokenizer.json")).encode(text.read_text(),
                                                                       add_special_tokens=False).ids[:150]
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), 20):
        end = min(begin + 48, len(ids))
        trg_len = end - prev_end
        window = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            lp = torch.log_softmax(tiny.hf(window).logits[0].double(), -1)
        targets = window[0, 1:]
        token_nll = -lp[:-1].gather(1, targets[:, None])[:, 0]
        scored = token_nll[-trg_len:] if begin else token_nll
        nll += scored.sum().item()
        count += len(scored)
        prev_end = end
        if end == len(ids):
            break
    assert result["tokens_scored"] == count == len(ids) - 1
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-6)


def test_eval_kl_of_quantized_model_is_positive(capsys, tmp_path, tiny):
    out = tmp_path / "rtn"
    quantize(capsys, tiny.path, out, "rtn", "--group-size", "32")
    text = tmp_path / "t.txt"
    text.write_text("Some held-out text about the data model and statements. " * 4)
    rc, stdout, err = cli(capsys, "eval", out, "--text", text, "--reference", tiny.path, "--window", "64")
    assert rc == 0, err
    assert 0 < json.loads(stdout)["kl"] < 1


# -- CLI errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--method", "nope"], "--method 'nope'"),
    (["--method", "gptq", "--bits", "3"], "--bits 3"),
    (["--method", "gptq", "--alpha", "0.5"], "--alpha: method 'gptq' does not take this option"),
    (["--method", "fp8", "--bits", "4"], "--bits"),
    (["--method", "awq", "--bits", "8"], "--bits 8"),
    (["--method", "rtn", "--group-size", "48"], "--group-size 48 does not divide"),
    (["--method", "gptq", "-o", "percdamp=-1"], "-o percdamp"),
    (["--method", "smoothquant", "--alpha", "2"], "--alpha 2"),
])
def test_quantize_bad_options_are_clear_errors(capsys, tmp_path, tiny, flags, needle):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "quantize", tiny.path, out, *flags)
    assert rc == 2 and needle in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half-written


def test_quantize_refuses_nonempty_out_and_bad_model(capsys, tmp_path, tiny):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, _, err = cli(capsys, "quantize", tiny.path, out, "--method", "rtn", "--group-size", "32")
    assert rc == 2 and "OUT" in err and "not an empty folder" in err
    assert (out / "keep.txt").read_text() == "x"
    rc, _, err = cli(capsys, "quantize", tmp_path / "missing", tmp_path / "o2", "--method", "rtn")
    assert rc == 2 and "missing" in err
    rc, _, err = cli(capsys, "eval", tiny.path, "--text", tmp_path / "none.txt")
    assert rc == 2 and "--text" in err


def test_quantize_into_empty_existing_folder(capsys, tmp_path, tiny):
    out = tmp_path / "empty"
    out.mkdir()
    quantize(capsys, tiny.path, out, "fp8")
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_quantizers_are_registered_plugins():
    from lmplug.plugins import get_registry

    assert {"rtn", "gptq", "awq", "smoothquant", "fp8"} <= set(get_registry().backends("quantizer"))


def test_gguf_source_writes_a_self_contained_folder(capsys, tmp_path):
    from support.gguf_fixtures import write_tiny_gguf

    from lmplug.loading.tokenizer import Tokenizer

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama")
    out = tmp_path / "fp8"
    quantize(capsys, gguf, out, "fp8", "-o", "dtype=float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
    source = open_source(gguf)
    text = "def tokenize(text): return text.split()  # héllo"
    assert Tokenizer.from_hf_dir(out).encode(text) == source.tokenizer.encode(text)
    folder = open_source(out)
    assert folder.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    # tensors in HF names and layout (the GGUF q/k permutation undone): each dequantized weight is
    # its source tensor to e4m3 precision
    state = dense_state(out)
    for name, w in source.iter_tensors():
        if name.endswith("_proj.weight"):
            assert torch.all((state[name] - w).abs() <= w.abs() / 16 + w.abs().max() * 2**-9), name
        else:
            torch.testing.assert_close(state[name], w.float())
    got = lmplug_logits(out, source.tokenizer.encode(text))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("method", ["smoothquant", "fp8"])
def test_w8a8_folders_run_in_lmplug_as_the_pytorch_reference(capsys, tmp_path, tiny, method):
    """The compressed-tensors folders through lmplug's W8A8 loader agree with a plain-PyTorch W8A8
    forward (dequantized weights, activations fake-quantized per token)."""
    from lmplug_quant.quantizers.fakequant import W8A8Reference

    from lmplug.plugins import get_registry

    if "compressed-tensors" not in get_registry().backends("quant"):
        pytest.skip("no compressed-tensors quant method installed")
    out = tmp_path / method
    quantize(capsys, tiny.path, out, method)
    got = lmplug_logits(out, IDS)
    ref = W8A8Reference(open_source(out)).log_probs(IDS, range(len(IDS)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    fl = torch.log_softmax(tiny.hf(torch.tensor([IDS])).logits[0].double(), -1)
    assert (got - fl).abs().max() > 1e-3  # activations and weights really are 8-bit


@pytest.mark.parametrize("command", ["quantize", "eval"])
def test_help(capsys, command):
    with pytest.raises(SystemExit) as exc:
        cli_main([command, "--help"])
    assert exc.value.code == 0
    assert f"usage: lmplug {command}" in capsys.readouterr().out


def test_calibration_split_is_deterministic_and_disjoint(tiny):
    from lmplug_quant.quantizers.calibration import calibration_windows, pydoc_split

    calib, held = pydoc_split()
    assert pydoc_split() == (calib, held)
    assert 0.08 < len(held) / (len(calib) + len(held)) < 0.12
    blocks = held.split("\n\n")
    assert not any(b in calib for b in blocks if len(b) > 200)  # no held-out paragraph calibrates
    windows = calibration_windows(open_source(tiny.path).tokenizer, SPEC)
    assert windows.shape == (8, 64) and windows.dtype == torch.int64
    assert torch.equal(windows, calibration_windows(open_source(tiny.path).tokenizer, SPEC))
