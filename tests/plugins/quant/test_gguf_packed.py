"""GGUF weights kept packed (the ``gguf`` quant method) compute what dequantizing them at load does.

Tiny llama GGUFs written with gguf-py's ``GGUFWriter``: the shared fixture (Q8_0/Q4_0/Q4_1 with
F16/BF16, tied and untied; and with the Q5_0 / Q5_1 that llama-quantize writes where a row is
not a multiple of 256), and a k-quant file written here whose fused layers mix types (Q4_K
q/k with Q6_K v, Q5_K gate with Q4_K up), one with Q3_K q/k/down (Q3_K_M's bulk), one of IQ4_XS
and IQ4_NL (an IQ4_XS file's types), and one holding a Q2_K weight no packed matmul reads.
The reference is the same file through ``quant: {method: gguf, dequantize_at_load: true}``:
every tensor dequantized by gguf-py's numpy ``dequantize`` and multiplied densely. The packed
side runs the PyTorch reference matmul (``kernel: torch``), which must agree to float rounding;
the native kernel (llama.cpp-style 8-bit activations) is held to a looser bound.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from lmplug_quant.gguf import GGUFQuant, native_kernel
from support.gguf_fixtures import add_byte_level_vocab, write_tiny_gguf

from lmplug import LLM, SamplingParams
from lmplug.errors import ModelLoadError
from lmplug.interfaces.packed import PackedTensor
from lmplug.kit.packed_embedding import QuantEmbedding
from lmplug.loading.gguf import load_gguf

K_HIDDEN, K_HEADS, K_KV_HEADS, K_FFN, K_LAYERS = 256, 4, 2, 512, 2
K_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
           "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "attention": "sdpa"}
DENSE = {"method": "gguf", "dequantize_at_load": True}
# the reference matmul (float32, like the dense path); the native kernel quantizes activations
REFERENCE = {"method": "gguf", "kernel": "torch"}
PROMPT = [5, 17, 42, 99, 123, 7, 250, 31]
# a Q4_K_M file's fallbacks at a hidden size that is not a multiple of 256 (q5_0 q/k/gate/up, q5_1 v/down)
Q5_TYPES = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_0,
            "ffn_up": Q.Q5_0, "ffn_down": Q.Q5_1, "token_embd": Q.Q5_0}
IQ4_TYPES = {"attn_q": Q.IQ4_XS, "attn_k": Q.IQ4_XS, "attn_v": Q.IQ4_NL, "attn_output": Q.IQ4_XS,
             "ffn_gate": Q.IQ4_XS, "ffn_up": Q.IQ4_XS, "ffn_down": Q.IQ4_NL}


def random_blocks(rng, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random bit fields with small float16 super-block scales (k-quants have no quantizer in gguf-py)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    offset = {Q.Q6_K: 208, Q.Q3_K: 108, Q.Q2_K: 80}.get(qtype, 0)  # where d (then dmin, if any) lies
    width = 2 if qtype in (Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS) else 4
    raw[:, offset:offset + width] = scales[:, :width]
    return raw.reshape(rows, -1)


def write_k_quant_gguf(path: Path, types: dict[str, Q] = K_TYPES, seed: int = 0,
                       rows_of: dict[str, int] | None = None) -> None:
    """A 2-layer llama (hidden 256: whole k-quant super-blocks), tied Q8_0 embedding;
    ``rows_of``: a weight (``blk.0.attn_output``) written with another number of rows."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    n_vocab = add_byte_level_vocab(writer)
    for add, value in ((writer.add_context_length, 256), (writer.add_embedding_length, K_HIDDEN),
                       (writer.add_block_count, K_LAYERS), (writer.add_feed_forward_length, K_FFN),
                       (writer.add_head_count, K_HEADS), (writer.add_head_count_kv, K_KV_HEADS),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    embed = (rng.standard_normal((n_vocab, K_HIDDEN)) * 0.5).astype(np.float32)
    writer.add_tensor("token_embd.weight", quantize(embed, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(K_HIDDEN, dtype=np.float32))
    head_dim = K_HIDDEN // K_HEADS
    shapes = {"attn_q": (K_HIDDEN, K_HIDDEN), "attn_k": (K_KV_HEADS * head_dim, K_HIDDEN),
              "attn_v": (K_KV_HEADS * head_dim, K_HIDDEN), "attn_output": (K_HIDDEN, K_HIDDEN),
              "ffn_gate": (K_FFN, K_HIDDEN), "ffn_up": (K_FFN, K_HIDDEN), "ffn_down": (K_HIDDEN, K_FFN)}
    for i in range(K_LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(K_HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(K_HIDDEN, dtype=np.float32))
        for kind, (rows, cols) in shapes.items():  # gate then up: back to back in the file
            rows = (rows_of or {}).get(f"blk.{i}.{kind}", rows)
            if types[kind] == Q.F16:
                writer.add_tensor(f"blk.{i}.{kind}.weight",
                                  (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16))
                continue
            writer.add_tensor(f"blk.{i}.{kind}.weight", random_blocks(rng, types[kind], rows, cols),
                              raw_dtype=types[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf_packed")
    paths = {name: folder / f"{name}.gguf" for name in ("untied", "tied", "kquant", "q3k", "q2k", "q5", "iq4")}
    write_tiny_gguf(paths["untied"])
    write_tiny_gguf(paths["tied"], tied=True)
    write_tiny_gguf(paths["q5"], tied=True, types=Q5_TYPES)
    write_k_quant_gguf(paths["kquant"])
    write_k_quant_gguf(paths["q3k"], {**K_TYPES, "attn_q": Q.Q3_K, "attn_k": Q.Q3_K, "ffn_down": Q.Q3_K}, seed=1)
    write_k_quant_gguf(paths["q2k"], {**K_TYPES, "ffn_down": Q.Q2_K}, seed=1)
    write_k_quant_gguf(paths["iq4"], IQ4_TYPES, seed=2)
    return paths


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.engine.parts.model


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0,
                                                ignore_eos=True))[0]
    return torch.tensor([out.prompt_logprobs[i + 1][PROMPT[i + 1]].logprob for i in range(len(PROMPT) - 1)])


# -- reading -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["untied", "kquant", "q5"])
def test_packed_reader_matches_dense_reader(files, name):
    """Every packed tensor dequantizes to exactly what ``iter_tensors`` yields (Q/K rows
    un-permuted as packed rows), and unpermuted weights are views of the file's mapping."""
    source = load_gguf(files[name])
    dense = dict(source.iter_tensors())
    packed = dict(source.iter_packed())
    assert list(packed) == source.tensor_names
    storages = set()
    for hf_name, tensor in packed.items():
        if isinstance(tensor, PackedTensor):
            torch.testing.assert_close(tensor.dequantize(), dense[hf_name], atol=0, rtol=0, msg=hf_name)
            if "q_proj" not in hf_name and "k_proj" not in hf_name:
                storages.add(tensor.data.untyped_storage().data_ptr())
        else:
            assert tensor.dim() == 1, hf_name
            torch.testing.assert_close(tensor, dense[hf_name], atol=0, rtol=0)
    assert len(storages) == 1  # one mapping of the file, no copies


def test_quant_method_from_the_file(files, tmp_path):
    assert load_gguf(files["untied"]).hf_config["quantization_config"] == {"quant_method": "gguf"}
    auto = LLM(str(files["tied"]), **ENGINE)
    assert auto.engine.resolved.backends["quant"].name == "gguf"
    assert "quantization_config" in auto.engine.resolved.reasons["quant"]
    assert isinstance(model_of(auto).embed_tokens, QuantEmbedding)
    dense_types = {kind: Q.F16 for kind in K_TYPES}
    write_k_quant_gguf(tmp_path / "f16.gguf", dense_types)
    assert "quantization_config" not in load_gguf(tmp_path / "f16.gguf").hf_config


# -- the packed model against the dequantize-at-load model ---------------------------------------

@pytest.mark.parametrize("name", ["untied", "tied", "kquant", "q3k", "q5", "iq4"])
def test_packed_logits_match_dequantized(files, name):
    packed = LLM(str(files[name]), **ENGINE, quant=REFERENCE)
    dense = LLM(str(files[name]), **ENGINE, quant=DENSE)
    pm, dm = model_of(packed), model_of(dense)
    assert isinstance(pm.embed_tokens, QuantEmbedding) and isinstance(dm.embed_tokens, torch.nn.Embedding)
    assert not any(p.is_floating_point() and p.dim() == 2 for p in pm.parameters())  # no float weight
    assert all(m.weight.dtype == torch.float32 for m in dm.modules() if hasattr(m, "gguf_runs"))
    ids = torch.tensor([0, 3, 17, 399 if name not in ("kquant", "iq4") else 200])
    torch.testing.assert_close(pm.embed_tokens(ids), dm.embed_tokens(ids), atol=0, rtol=0)
    hidden = torch.randn(3, pm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pm.compute_logits(hidden), dm.compute_logits(hidden), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prompt_logprobs(packed), prompt_logprobs(dense), atol=1e-4, rtol=0)


def test_fused_shards_of_different_types_run_by_type(files):
    model = model_of(LLM(str(files["kquant"]), **ENGINE, quant=REFERENCE))
    layer = model.layers[0]
    qkv = [(Q(kind).name, rows) for kind, _, rows in layer.self_attn.qkv_proj.gguf_runs]
    assert qkv == [("Q4_K", K_HIDDEN + K_HIDDEN // 2), ("Q6_K", K_HIDDEN // 2)]
    gate_up = layer.mlp.gate_up_proj
    assert [(Q(k).name, rows) for k, _, rows in gate_up.gguf_runs] == [("Q4_K", 2 * K_FFN)]
    # gate and up lie back to back in the file: one view of the mapping, like the embedding
    file_map = model.embed_tokens.gguf_w0.untyped_storage().data_ptr()
    assert gate_up.gguf_w0.untyped_storage().data_ptr() == file_map


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_iq4_weights_stay_packed_and_decode_as_dequantized(files, kernel):
    """IQ4_XS q/k/o/gate/up and IQ4_NL v/down stay the file's blocks (no float copy), run by type,
    and greedy decoding gives the dequantize-at-load model's tokens (the native kernel: logits
    within its 8-bit activations' bound, test_native_kernel_matches_reference)."""
    if kernel == "native" and native_kernel()[0] is None:
        pytest.skip(f"native GGUF kernel not built here: {native_kernel()[1]}")
    packed = LLM(str(files["iq4"]), **ENGINE, quant={"method": "gguf", "kernel": kernel})
    layer = model_of(packed).layers[0]
    assert [(Q(k).name, rows) for k, _, rows in layer.self_attn.qkv_proj.gguf_runs] == [
        ("IQ4_XS", K_HIDDEN + K_HIDDEN // 2), ("IQ4_NL", K_HIDDEN // 2)]
    for proj, kind in ((layer.self_attn.o_proj, "IQ4_XS"), (layer.mlp.gate_up_proj, "IQ4_XS"),
                       (layer.mlp.down_proj, "IQ4_NL")):
        assert [Q(k).name for k, _, _ in proj.gguf_runs] == [kind]
        assert proj.gguf_w0.dtype == torch.uint8
    assert (layer.mlp.down_proj.gguf_calls is not None) == (kernel == "native")  # the C kernel reads both types
    assert not any(p.is_floating_point() and p.dim() == 2 for p in model_of(packed).parameters())
    dense = LLM(str(files["iq4"]), **ENGINE, quant=DENSE)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [llm.generate([PROMPT], params)[0].outputs[0].token_ids for llm in (packed, dense)]
    assert tokens[0] == tokens[1]


def test_unsupported_type_is_dequantized_with_a_log_line(files, caplog):
    with caplog.at_level(logging.INFO, logger="lmplug_quant.gguf"):
        packed = LLM(str(files["q2k"]), **ENGINE, quant=REFERENCE)
    lines = [r.getMessage() for r in caplog.records if "Q2_K" in r.getMessage()]
    assert len(lines) == K_LAYERS and "'blk.0.ffn_down.weight' has type Q2_K" in lines[0]
    down = model_of(packed).layers[0].mlp.down_proj
    assert down.gguf_runs is None and down.weight.dtype == torch.float32
    dense = LLM(str(files["q2k"]), **ENGINE, quant=DENSE)
    torch.testing.assert_close(prompt_logprobs(packed), prompt_logprobs(dense), atol=1e-4, rtol=0)


def test_dequantize_at_load_and_other_methods_get_dense_weights(files):
    dense = model_of(LLM(str(files["untied"]), **ENGINE, quant=DENSE))
    assert isinstance(dense.lm_head, torch.nn.Parameter)
    rtn = LLM(str(files["untied"]), **ENGINE, quant={"method": "rtn", "bits": 8, "group_size": -1})
    assert rtn.engine.resolved.backends["quant"].name == "rtn"
    assert isinstance(model_of(rtn).embed_tokens, torch.nn.Embedding)
    out = rtn.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.slow
def test_tensor_parallel_takes_dense_slices(files):
    """Ranks slice dense tensors (the method accepts them); greedy tokens equal the packed model's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = LLM(str(files["untied"]), **ENGINE, quant=REFERENCE).generate([PROMPT], params)[0]
    with LLM(str(files["untied"]), **ENGINE, parallel={"tensor_parallel_size": 2}) as parallel:
        assert parallel.engine.resolved.backends["quant"].name == "gguf"
        assert parallel.generate([PROMPT], params)[0].outputs[0].token_ids == single.outputs[0].token_ids


# -- damaged files -------------------------------------------------------------------------------

def test_truncated_file_names_the_tensor(files, tmp_path):
    data = files["untied"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated: tensor '[\w.]+'"):
        LLM(str(cut), **ENGINE)


def test_block_bytes_that_do_not_match_the_shape(files, monkeypatch):
    """A packed tensor whose bytes are too few for its shape is refused, naming it."""
    from lmplug.loading import gguf as reader

    original = reader._packed_tensor

    def short(file_bytes, tensor, head_counts):
        packed = original(file_bytes, tensor, head_counts)
        if tensor.name == "blk.1.ffn_up.weight":
            return PackedTensor(packed.data[:, :-2], packed.ggml_type, packed.shape, packed.name)
        return packed

    monkeypatch.setattr(reader, "_packed_tensor", short)
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' holds .* "
                                             r"needs uint8 \(128, 40\)"):
        LLM(str(files["untied"]), **ENGINE)


def test_shape_the_model_does_not_expect(tmp_path):
    """A packed weight with fewer rows than the model's layer."""
    path = tmp_path / "short.gguf"
    write_k_quant_gguf(path, rows_of={"blk.0.attn_output": 128})
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.0\.self_attn\.o_proj\.weight' has shape "
                                             r"\(128, 256\) of type Q5_K, the model expects \(256, 256\)"):
        LLM(str(path), **ENGINE)


# -- the native kernel (another plugin file) against the reference --------------------------------

@pytest.mark.skipif(native_kernel()[0] is None, reason="native GGUF kernel not built here")
def test_native_kernel_matches_reference(files):
    """Logits of the same hidden states through every packed LM head / layer type: the kernel's
    8-bit activations keep them within a few percent of the float reference."""
    for name in ("untied", "kquant", "q3k", "q5", "iq4"):
        native = model_of(LLM(str(files[name]), **ENGINE, quant={"method": "gguf", "kernel": "native"}))
        reference = model_of(LLM(str(files[name]), **ENGINE, quant=REFERENCE))
        hidden = torch.randn(5, native.config.hidden_size, generator=torch.Generator().manual_seed(1))
        ref = reference.compute_logits(hidden)
        err = (native.compute_logits(hidden) - ref).abs().max() / ref.abs().max()
        assert err < 0.02, f"{name}: {err}"
        x = torch.randn(5, native.config.hidden_size, generator=torch.Generator().manual_seed(2))
        layer, ref_layer = native.layers[0].mlp.gate_up_proj, reference.layers[0].mlp.gate_up_proj
        ref = ref_layer(x)
        assert (layer(x) - ref).abs().max() / ref.abs().max() < 0.02, name


@pytest.mark.skipif(native_kernel()[0] is None, reason="native GGUF kernel not built here")
def test_small_steps_sample_with_torch_on_one_thread(files):
    """With the packed products on their own threads, a decode step's sampling (not only its
    forward) runs with torch on one thread, and torch's count is back after the step."""
    llm = LLM(str(files["kquant"]), **ENGINE, quant={"method": "gguf", "kernel": "native"})
    selector, seen = llm.engine.selector, []
    select = selector.select

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return select(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        selector.select = recording
        llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=4))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(native_kernel()[0] is None, reason="native GGUF kernel not built here")
def test_bound_products_match_the_registered_op(files):
    """Every packed layer (mixed-type q/k/v included) binds its runs once; the eager hot path
    through them gives the op path's bits, and a bfloat16 or 3-D input still takes the op."""
    llm = LLM(str(files["kquant"]), **ENGINE, quant={"method": "gguf", "kernel": "native"})
    model = model_of(llm)
    assert llm.engine.runner.small_step_tokens > 0  # the products keep their own threads
    layers = [m for m in model.modules() if getattr(m, "gguf_runs", None) is not None]
    assert layers and all(len(m.gguf_calls) == len(m.gguf_runs) for m in layers)
    qkv = model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(3))
    fast = qkv(x)
    calls, qkv.gguf_calls = qkv.gguf_calls, None
    try:
        assert torch.equal(fast, qkv(x))
    finally:
        qkv.gguf_calls = calls
    assert torch.equal(qkv(x[None])[0], fast)
    assert torch.equal(qkv(x.bfloat16()), qkv(x.bfloat16().float()).bfloat16())


@pytest.mark.skipif(native_kernel()[0] is None, reason="native GGUF kernel not built here")
@pytest.mark.parametrize("set_name", ["avx512", "avxvnni", "avx2", "rows"])  # panels; rows in huge pages (NEON's)
def test_panels_are_the_only_copy_of_permuted_rows(files, monkeypatch, set_name):
    """With the panels (or the other SIMD sets' rows copied into huge pages), llama's q/k
    rows (permuted at load: a copy, joined here) live in that copy only, and every path gives the
    bits of the same kernels over the rows kept whole: the bound products, the native step's
    layer product, and the op path, which gets the rows back byte for byte."""
    from lmplug.kit import hugemem
    from lmplug.kit.native import call_product

    gguf_native = native_kernel()[0]
    best = gguf_native.load().best_isa
    if set_name != "rows" and set_name not in gguf_native.ISAS:
        pytest.skip(f"no {set_name} set on {gguf_native.ISAS}")
    isa = 1 if set_name == "rows" else gguf_native.ISAS.index(set_name)  # rows: NEON
    if gguf_native.ISAS.index(best) < isa:
        pytest.skip(f"the {set_name} set does not run here: {gguf_native.describe_isa(best)}")
    monkeypatch.delenv("LMPLUG_HUGE_PAGES", raising=False)
    panels = set_name != "rows"
    loaded = gguf_native.load()
    if not panels and loaded.panel_types[gguf_native.ISAS[isa]]:  # x86: bind rows as NEON does
        monkeypatch.setattr(loaded, "panel_types", {name: frozenset() for name in loaded.panel_types})
    if not panels and not hugemem.enabled():
        pytest.skip("no huge-page memory here: the rows are read where they lie")
    native = {"method": "gguf", "kernel": "native"}
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic" if panels else gguf_native.ISAS[isa])
    monkeypatch.setenv("LMPLUG_HUGE_PAGES", "0")  # the rows where they are
    whole = model_of(LLM(str(files["kquant"]), **ENGINE, quant=native)).layers[0].self_attn.qkv_proj
    monkeypatch.delenv("LMPLUG_HUGE_PAGES")
    monkeypatch.setenv("LMPLUG_GGUF_ISA", gguf_native.ISAS[isa])
    model = model_of(LLM(str(files["kquant"]), **ENGINE, quant=native))
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.gguf_w0.numel() == 0 and whole.gguf_w0.numel() > 0  # q and k: in the copy only
    assert qkv.gguf_calls[0].w.data_ptr() != whole.gguf_calls[0].w.data_ptr()
    assert qkv.gguf_w1.numel() > 0  # v: a view of the file (its pages released), kept
    x = torch.randn(5, qkv.in_features, generator=torch.Generator().manual_seed(4))
    want = whole(x)
    assert torch.equal(qkv(x), want)
    step = qkv.quant.native_product(qkv)
    assert torch.equal(call_product(step, x, want.shape[1], 2), want)
    assert torch.equal(qkv(x.bfloat16()), whole(x.bfloat16()))  # another dtype: the bound products too
    qkv.gguf_calls = None  # the op path: the rows rebuilt from the panels (or the copy itself)
    assert torch.equal(qkv(x), want)
    assert torch.equal(qkv.gguf_w0, whole.gguf_w0)


def test_kernel_native_unavailable_is_a_clear_error(monkeypatch):
    from lmplug.errors import ConfigError

    monkeypatch.setattr("lmplug_quant.gguf.native_kernel", lambda: (None, "no compiler"))
    with pytest.raises(ConfigError, match="kernel 'native' is not available: no compiler"):
        GGUFQuant(GGUFQuant.Options(kernel="native"))


# -- the demo model ------------------------------------------------------------------------------

CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_demo_model_answers_paris_packed(demo_gguf, kernel):
    if kernel == "native" and native_kernel()[0] is None:
        pytest.skip(f"native GGUF kernel not built here: {native_kernel()[1]}")
    llm = LLM(str(demo_gguf), dtype="float32", max_model_len=256, quant={"method": "gguf", "kernel": kernel})
    assert isinstance(model_of(llm).embed_tokens, QuantEmbedding)
    out = llm.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.outputs[0].text


HELD_OUT = """The river had been rising for three days before anyone in the village thought to move the
grain. By the time the elders met in the long hall, the water stood a hand deep in the lower fields,
and the children who had been sent to watch the bridge came back soaked to the knees. Nobody argued
for long. The carts were brought round, the sacks were counted twice, and by nightfall the whole
harvest sat under canvas on the hill behind the mill, where the ground was dry and the wind was not."""


@pytest.mark.slow
def test_demo_model_packed_quality_against_dequantized(demo_gguf):
    """The native kernel quantizes activations to 8 bits per block, as llama.cpp does, so greedy
    tokens may differ from the dense path; what must hold is the distribution: perplexity within
    10% of the dequantized-float path's and a small KL (the demo file is Q4_1 with a Q8_0 head;
    measured 1.1% and KL 0.004 on 1k tokens of prose)."""
    if native_kernel()[0] is None:
        pytest.skip(f"native GGUF kernel not built here: {native_kernel()[1]}")
    from lmplug.evaluate import Scorer, evaluate

    dense = Scorer(str(demo_gguf), window=128, quant="gguf",
                   quant_options={"dequantize_at_load": True})
    packed = Scorer(str(demo_gguf), window=128)
    assert isinstance(model_of(packed.llm).embed_tokens, QuantEmbedding)
    tokens = dense.tokenizer.encode(HELD_OUT, add_special_tokens=False)
    ref = evaluate(dense, tokens, 128, 64)
    got = evaluate(packed, tokens, 128, 64, reference=dense)
    assert got["perplexity"] <= 1.10 * ref["perplexity"], (got, ref)
    assert got["kl"] <= 0.02, got
