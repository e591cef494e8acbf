"""EAGLE heads' and MTP modules' own decoder layer through the native decode step
(``lmplug.kit.native_step``; ``eagle_native.py``, ``lmplug.kit.mtp``).

References: the same forward through the drafter's Python layer (whose parity with
transformers' layer and the published equations ``test_spec_eagle`` / ``test_spec_mtp`` hold:
those tests now run the native path where it fits, at one thread), at float32 tolerances, on
every forward the native step takes: decodes, the catch-up of a chain's accepted tokens
(several rows) and EAGLE-2's tree steps (an ancestor mask); and plain decoding's greedy tokens
through ``LLM.generate`` with the native step on and off. Counting the plan's runs proves which
path ran.
"""

from __future__ import annotations

import pytest
import torch
from lmplug_speculative.eagle_train import train_eagle
from lmplug_speculative.mtp_train import train_mtp
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import make_engine, run

from lmplug import LLM
from lmplug.interfaces.params import SamplingParams
from lmplug.kit import fused_cpu
from lmplug.kit.mtp import MTPModule
from lmplug.kit.native_step import NativeDecodeStep
from lmplug.train_host import LLMTrainingHost

pytestmark = pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(6, 61), prompt_ids(25, 62), prompt_ids(3, 63)]
PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}
TRAIN = {"num_prompts": 32, "max_tokens": 32, "epochs": 6, "lr": 3e-3, "device": "cpu"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("native_heads"), tokenizer=True)


@pytest.fixture(scope="module")
def eagle(model, tmp_path_factory):
    """Trained heads: they draft accepted tokens, so chains catch up several rows at once."""
    trained = train_eagle(LLMTrainingHost(), str(model.path), str(tmp_path_factory.mktemp("eagle")), TRAIN)
    return {"method": "eagle", "heads": str(trained.folder)}


@pytest.fixture(scope="module")
def mtp(model, tmp_path_factory):
    trained = train_mtp(LLMTrainingHost(), str(model.path), str(tmp_path_factory.mktemp("mtp")), TRAIN)
    return {"method": "mtp", "path": str(trained.folder)}


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in run(make_engine(model.path), PROMPTS, GREEDY)]


@pytest.fixture
def drafter_runs(monkeypatch):
    """How many forwards a drafter's own plan (no model: a layers' plan) ran natively."""
    seen = {"native": 0, "declined": 0}
    run_step = NativeDecodeStep.run

    def counting(self, x, positions, ctx, *rest):
        out = run_step(self, x, positions, ctx, *rest)
        if self.model is None:
            seen["native" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting)
    return seen


def _kind(ctx) -> str:
    if ctx.query_masks:
        return "tree"
    return "decode" if max(ctx.query_lens_cpu) == 1 else "rows"


def _compare_eagle(drafter, compared: dict):
    """Every forward the native plan takes, run again through the Python layer and compared."""
    compute = drafter._compute

    def both(input_ids, features, ctx):
        plan = drafter._native
        if not plan.fits(torch.empty(ctx.num_tokens, 1), ctx):  # a prompt's catch-up: the Python layer only
            return compute(input_ids, features, ctx)
        native = compute(input_ids, features, ctx)
        drafter._native = None
        try:
            python = compute(input_ids, features, ctx)  # rewrites the same K/V slots, ~same values
        finally:
            drafter._native = plan
        torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
        compared[_kind(ctx)] += 1
        return native

    drafter._compute = both


def _compare_mtp(module: MTPModule, compared: dict, monkeypatch):
    forward = MTPModule.forward

    def both(self, input_ids, features, ctx):
        plan = self._native_step
        if not plan or not plan.fits(torch.empty(ctx.num_tokens, 1), ctx):
            return forward(self, input_ids, features, ctx)
        native = forward(self, input_ids, features, ctx)
        self._native_step = False
        try:
            python = forward(self, input_ids, features, ctx)
        finally:
            self._native_step = plan
        torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
        compared[_kind(ctx)] += 1
        return native

    monkeypatch.setattr(MTPModule, "forward", both)


@pytest.mark.parametrize("kvcache", [{}, PAGED], ids=["contiguous", "paged"])
@pytest.mark.parametrize("tree", [{}, {"dynamic_tree": True, "top_k": 2, "total_tokens": 6}], ids=["chain", "tree"])
def test_eagle_native_forward_equals_the_python_layer(model, eagle, reference, drafter_runs, kvcache, tree):
    engine = make_engine(model.path, {**eagle, "num_tokens": 3, **tree}, **({"kvcache": kvcache} if kvcache else {}))
    drafter = engine.speculator.drafter
    assert isinstance(drafter._native, NativeDecodeStep)
    compared = dict.fromkeys(("decode", "rows", "tree"), 0)
    _compare_eagle(drafter, compared)
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert engine.speculator.num_accepted > 0
    assert compared["decode"] > 0 and compared["rows"] > 0, compared
    assert compared["tree"] > 0 if tree else compared["tree"] == 0, compared
    assert drafter_runs["declined"] == 0 and drafter_runs["native"] >= sum(compared.values())


@pytest.mark.parametrize("kvcache", [{}, PAGED], ids=["contiguous", "paged"])
@pytest.mark.parametrize("tree", [{}, {"dynamic_tree": True, "top_k": 2, "total_tokens": 6}], ids=["chain", "tree"])
def test_mtp_native_forward_equals_the_python_layer(model, mtp, reference, drafter_runs, monkeypatch, kvcache,
                                                    tree):
    engine = make_engine(model.path, {**mtp, "num_tokens": 3, **tree}, **({"kvcache": kvcache} if kvcache else {}))
    module = engine.speculator.drafter.mtp
    compared = dict.fromkeys(("decode", "rows", "tree"), 0)
    _compare_mtp(module, compared, monkeypatch)
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert isinstance(module._native_step, NativeDecodeStep)
    assert engine.speculator.num_accepted > 0
    assert compared["decode"] > 0 and compared["rows"] > 0, compared
    assert compared["tree"] > 0 if tree else compared["tree"] == 0, compared
    assert drafter_runs["declined"] == 0 and drafter_runs["native"] >= sum(compared.values())


def _generate(path, speculative: dict, native: bool, monkeypatch) -> tuple[list, LLM]:
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1" if native else "0")
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256,
              speculative={**speculative, "num_tokens": 3, "draft_length": "fixed"})
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_greedy_output_equals_plain_decoding_native_on_and_off(request, model, reference, drafter_runs, monkeypatch,
                                                               method):
    speculative = request.getfixturevalue(method)
    tokens, llm = _generate(model.path, speculative, True, monkeypatch)
    assert tokens == reference
    assert drafter_runs["native"] > 0  # the drafter's layer ran natively
    runs = drafter_runs["native"]
    tokens, llm = _generate(model.path, speculative, False, monkeypatch)
    assert tokens == reference
    assert drafter_runs["native"] == runs  # LMPLUG_NATIVE_STEP=0: the drafter's layer in Python too
    drafter = llm.engine.speculator.drafter
    assert (drafter.mtp._native_step is False) if method == "mtp" else drafter._native is None
    assert llm.engine.speculator.num_accepted > 0


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_config_switch_and_threads_keep_the_python_layer(model, eagle, mtp, drafter_runs, method):
    """``cpu.native_step: false`` in the config reaches the drafter; so does a second compute
    thread (the kit's float32 product runs on one)."""
    speculative = {"eagle": eagle, "mtp": mtp}[method]
    engine = make_engine(model.path, {**speculative, "num_tokens": 3}, cpu={"native_step": False})
    run(engine, PROMPTS[:1], GREEDY)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threaded = make_engine(model.path, {**speculative, "num_tokens": 3})
        run(threaded, PROMPTS[:1], GREEDY)
    finally:
        torch.set_num_threads(saved)
    assert drafter_runs["native"] == 0
    for e in (engine, threaded):
        drafter = e.speculator.drafter
        assert (drafter.mtp._native_step is False) if method == "mtp" else drafter._native is None
