"""The native decode step (``lmplug.kit.native_step``): every decoder layer of a decode step
in one C call, through the plugins' C functions (``lmplug.kit.native``).

Reference: the same engine with ``LMPLUG_NATIVE_STEP=0`` (the Python layers, whose parity
with HF transformers the model tests hold). The native step's norms, RoPE and SiLU are the
fused ops' own functions; its products are the quant method's C kernel (the Python path
calls the same kernel) and its attention the family's C decode kernel, which sums in another
order than SDPA, so logprobs agree to float32 rounding, give or take the 8-bit activation
quantization's rare one-quantum jumps (``assert_same``), and greedy tokens are equal.
Tiny GGUF files (gguf-py's writer) in the three layouts the step handles: plain Llama, Qwen2
(q/k/v biases) and Qwen3 (per-head q/k norms); layer 1's V is BF16 (a dense run in a packed
layer).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from support.gguf_fixtures import write_tiny_gguf
from support.native_compare import assert_same, count_native_runs

from lmplug import LLM, SamplingParams
from lmplug.kit import fused_cpu, native_step
from lmplug.kit.native import NativeCall
from lmplug.kit.native_step import NativeDecodeStep

pytestmark = pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "quant": {"method": "gguf", "kernel": "native"}}
PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31], [9, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_step")
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        out[arch] = root / f"{arch}.gguf"
        write_tiny_gguf(out[arch], arch, tied=arch == "qwen3")
    return out


@pytest.fixture
def counted(monkeypatch):
    """How many steps ran natively, and how many the attention backend declined."""
    return count_native_runs(monkeypatch)


def generate(path, monkeypatch, native: bool, **engine):
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1" if native else "0")
    llm = LLM(str(path), **{**ENGINE, **engine})
    outs = llm.generate(PROMPTS, GREEDY)
    step = llm.engine.parts.model._native_step
    assert bool(step) == native, step
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_step_gives_the_python_layers_result(files, monkeypatch, counted, arch):
    """Three sequences decoding together (batched decode rows), every decode step native."""
    native = generate(files[arch], monkeypatch, True)
    assert counted["native"] >= GREEDY.max_tokens - 1 and counted["declined"] == 0
    assert_same(native, generate(files[arch], monkeypatch, False))


def test_native_step_through_paged_attention_and_cache(files, monkeypatch, counted):
    engine = {"attention": "paged", "kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 64}}
    native = generate(files["llama"], monkeypatch, True, **engine)
    assert counted["native"] >= GREEDY.max_tokens - 1
    assert_same(native, generate(files["llama"], monkeypatch, False, **engine))


def test_quantized_kv_keeps_the_python_layers(files, monkeypatch, counted):
    """An int8 cache has no native attention: every step is declined and runs in Python."""
    engine = {"kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 64, "dtype": "int8"},
              "attention": "sdpa"}
    native = generate(files["llama"], monkeypatch, True, **engine)
    assert counted["native"] == 0 and counted["declined"] > 0
    assert_same(native, generate(files["llama"], monkeypatch, False, **engine))


def test_no_plan_without_native_products(files, monkeypatch):
    """The PyTorch reference matmul has no C product: the model keeps the Python layers."""
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1")
    llm = LLM(str(files["llama"]), **{**ENGINE, "quant": {"method": "gguf", "kernel": "torch"}})
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.parts.model._native_step is False


def test_a_failing_product_is_an_error_naming_layer_and_plugin(files, monkeypatch):
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1")
    llm = LLM(str(files["llama"]), **ENGINE)
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2))
    step = llm.engine.parts.model._native_step
    assert isinstance(step, NativeDecodeStep)
    # layer 1's o_proj: a gguf layer description with no runs (the kernel answers -5)
    from lmplug_quant import gguf_native

    broken = gguf_native._Layer(k=1, n=1, n_runs=0)
    good = step.calls[1][1]
    step.calls[1][1] = NativeCall(good.fn, ctypes.addressof(broken), broken, "quant gguf")
    step.layers[1].o = native_step._Product(good.fn, ctypes.addressof(broken))
    with pytest.raises(RuntimeError, match=r"native decode step: layer 1 o_proj: quant gguf's native "
                                           r"function returned error -5"):
        llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3))


def test_fits_short_queries_only():
    from lmplug.interfaces.step import StepContext

    def ctx(query_lens, num_decodes, masks=None, states=None, seq_lens=None):
        z = torch.zeros(len(query_lens), dtype=torch.int32)
        t = sum(query_lens)
        return StepContext(positions=torch.zeros(t, dtype=torch.int64), query_lens=z, seq_lens=z, cu_query_lens=z,
                           slot_mapping=torch.zeros(t, dtype=torch.int64), block_tables=z[:, None],
                           query_lens_cpu=query_lens, seq_lens_cpu=seq_lens or [40] * len(query_lens),
                           num_decodes=num_decodes, query_masks=masks or {}, state_slots=states)

    x = torch.zeros(2, 8)
    assert NativeDecodeStep.fits(x, ctx([1, 1], 2))
    assert NativeDecodeStep.fits(torch.zeros(6, 8), ctx([1, 5], 1))  # a verify of 4 drafts
    assert NativeDecodeStep.fits(torch.zeros(4, 8), ctx([4], 0, {0: torch.ones(4, 4, dtype=torch.bool)}))  # a tree
    long = native_step.MAX_QUERY_TOKENS + 1
    assert not NativeDecodeStep.fits(torch.zeros(long + 1, 8), ctx([1, long], 1))  # a prefill
    assert not NativeDecodeStep.fits(torch.zeros(6, 8), ctx([1, 5], 1, seq_lens=[40, 5]))  # a short prompt
    assert not NativeDecodeStep.fits(x, ctx([1, 1], 2, states=torch.zeros(2, dtype=torch.int32)))
    assert not NativeDecodeStep.fits(x.bfloat16(), ctx([1, 1], 2))
