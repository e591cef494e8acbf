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
from support.native_compare import count_native_runs
from support.spec_helpers import make_engine, run

from lmplug import LLM
from lmplug.interfaces.params import SamplingParams
from lmplug.kit import fused_cpu
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
    return count_native_runs(monkeypatch, lambda plan: plan.model is None)


def _plan(drafter, method: str):
    """(the object holding the drafter's native plan, its attribute, its value for "none")."""
    return (drafter, "_native", None) if method == "eagle" else (drafter.mtp, "_native_step", False)


def _compare_paths(drafter, method: str, compared: dict) -> None:
    """Every forward the native plan takes, run again through the Python layer (the plan
    switched off) and compared; the Python run rewrites the same K/V slots with ~the same values."""
    owner, attr, off = _plan(drafter, method)
    name = "_compute" if method == "eagle" else "forward"  # the EAGLE drafter's head forward, the MTP module's
    inner = getattr(owner, name)

    def both(input_ids, features, ctx):
        plan = getattr(owner, attr)
        if not plan or not plan.fits(torch.empty(ctx.num_tokens, 1), ctx):  # e.g. a prompt's catch-up
            return inner(input_ids, features, ctx)
        native = inner(input_ids, features, ctx)
        setattr(owner, attr, off)
        try:
            python = inner(input_ids, features, ctx)
        finally:
            setattr(owner, attr, plan)
        torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
        kind = "tree" if ctx.query_masks else "decode" if max(ctx.query_lens_cpu) == 1 else "rows"
        compared[kind] += 1
        return native

    setattr(owner, name, both)


@pytest.mark.parametrize("kvcache", [{}, PAGED], ids=["contiguous", "paged"])
@pytest.mark.parametrize("tree", [{}, {"dynamic_tree": True, "top_k": 2, "total_tokens": 6}], ids=["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_native_forward_equals_the_python_layer(request, model, reference, drafter_runs, method, kvcache, tree):
    speculative = request.getfixturevalue(method)
    engine = make_engine(model.path, {**speculative, "num_tokens": 3, **tree},
                         **({"kvcache": kvcache} if kvcache else {}))
    drafter = engine.speculator.drafter
    compared = dict.fromkeys(("decode", "rows", "tree"), 0)
    _compare_paths(drafter, method, compared)
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    owner, attr, _ = _plan(drafter, method)
    assert isinstance(getattr(owner, attr), NativeDecodeStep)
    assert engine.speculator.num_accepted > 0
    assert compared["decode"] > 0 and compared["rows"] > 0, compared  # rows: a chain's accepted tokens
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
    owner, attr, off = _plan(llm.engine.speculator.drafter, method)
    assert getattr(owner, attr) is off
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
        owner, attr, off = _plan(e.speculator.drafter, method)
        assert getattr(owner, attr) is off
