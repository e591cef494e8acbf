"""The native step on a speculative verify: each sequence's ``k + 1`` query rows (a chain) or
draft-tree nodes run every layer in one C call (``lmplug.kit.native_step``), each query token
a decode row of the C attention (``paged_rows``).

References nobody here wrote the numbers of: plain greedy decoding of the same file (tokens
and logprobs bit for bit: the products are batch invariant and a row's attention reads only
its own context, so a verified token gets what it gets decoded alone), and the Python layers
(``LMPLUG_NATIVE_STEP=0``: SDPA's masked attention over the same rows, to float32 rounding,
``test_native_step.assert_same``). Drafts come from an oracle that proposes plain decoding's
continuation, wrong every third token (accepts and rejections both), and from Medusa heads
with tree candidates (ancestor masks).
"""

from __future__ import annotations

import pytest
import torch
from support.gguf_fixtures import write_tiny_gguf
from support.native_compare import assert_same
from support.spec_helpers import REFERENCE, make_engine, run

from lmplug.interfaces.params import SamplingParams
from lmplug.kit import fused_cpu
from lmplug.kit.native_step import NativeDecodeStep

pytestmark = pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")

QUANT = {"method": "gguf", "kernel": "native"}
PAGED = {"kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 128}, "attention": "paged"}
CASES = {"contiguous-sdpa": {}, "paged-paged": PAGED,
         "paged-sdpa": {"kvcache": PAGED["kvcache"], "attention": "sdpa"}}
PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31], [9, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
ORACLE = {"method": "test_oracle", "num_tokens": 4, "wrong_every": 3}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("native_verify") / "llama.gguf"
    write_tiny_gguf(out, "llama")
    return out


@pytest.fixture
def steps(monkeypatch):
    """Per native step run: (a verify: some sequence has several new rows after cached ones,
    tree masks present, ran natively, the layers it ran: None for all)."""
    seen = []
    run_step = NativeDecodeStep.run

    def counting(self, x, positions, ctx, views=None, num_layers=None):
        out = run_step(self, x, positions, ctx, views, num_layers)
        verify = any(1 < q < s for q, s in zip(ctx.query_lens_cpu, ctx.seq_lens_cpu))
        seen.append((verify, bool(ctx.query_masks), out is not None, num_layers))
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting)
    return seen


def generate(path, monkeypatch, native: bool, speculative=None, **engine):
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1" if native else "0")
    outs = run(make_engine(path, speculative, quant=QUANT, **engine), PROMPTS, GREEDY)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def plain(path):
    """Plain native greedy decoding, per engine case (the oracle's continuations)."""
    with pytest.MonkeyPatch.context() as mp:
        return {name: generate(path, mp, True, **case) for name, case in CASES.items()}


def verify_rows(steps, trees=False) -> list:
    return [s for s in steps if s[0] and s[1] == trees]


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_verify_steps_run_natively_and_keep_plain_decodings_bits(path, monkeypatch, steps, plain, case):
    for prompt, out in zip(PROMPTS, plain[case]):
        REFERENCE[tuple(prompt)] = out.token_ids
    spec = generate(path, monkeypatch, True, ORACLE, **CASES[case])
    verifies = verify_rows(steps)
    assert verifies and all(s[2] for s in steps), steps  # every step native, verifies among them
    for a, b in zip(spec, plain[case]):
        assert a.token_ids == b.token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.logprobs] == \
               [{t: lp.logprob for t, lp in d.items()} for d in b.logprobs]


def test_verify_rows_match_the_python_layers(path, monkeypatch, steps, plain):
    for prompt, out in zip(PROMPTS, plain["paged-paged"]):
        REFERENCE[tuple(prompt)] = out.token_ids
    native = generate(path, monkeypatch, True, ORACLE, **PAGED)
    assert verify_rows(steps)
    assert_same(native, generate(path, monkeypatch, False, ORACLE, **PAGED))


@pytest.fixture(scope="module")
def heads(path, tmp_path_factory):
    """Medusa heads over the tiny model's hidden size: random, so trees get partly accepted."""
    from lmplug_speculative.medusa_heads import MedusaHeads, save_heads

    with pytest.MonkeyPatch.context():
        vocab = make_engine(path, quant=QUANT).parts.model.config.vocab_size
    torch.manual_seed(3)
    medusa = MedusaHeads(64, vocab, num_heads=3, num_layers=1)
    with torch.no_grad():
        for head in medusa:
            head[0].linear.weight.normal_(std=0.3)
            head[-1].weight.normal_(std=0.3)
    return save_heads(medusa, tmp_path_factory.mktemp("heads"), dtype=torch.float32)


@pytest.mark.parametrize("case", ["paged-paged", "contiguous-sdpa"])
def test_draft_trees_run_natively_and_keep_plain_decodings_tokens(path, monkeypatch, steps, plain, heads, case):
    tree = {"method": "medusa", "heads": str(heads), "num_tokens": 3, "tree": "default"}
    spec = generate(path, monkeypatch, True, tree, **CASES[case])
    trees = verify_rows(steps, trees=True)
    assert trees and all(s[2] for s in trees), steps
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain[case]]


def test_layer_skip_drafts_through_the_native_step(path, monkeypatch, steps, plain):
    """The layer-skip drafter's forwards (the target's first layer over its own cache) run
    natively too; greedy output stays plain decoding's."""
    spec = generate(path, monkeypatch, True, {"method": "layer_skip", "num_tokens": 3, "num_layers": 1}, **PAGED)
    drafts = [s for s in steps if s[3] == 1]
    assert drafts and all(s[2] for s in drafts) and verify_rows(steps), steps
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain["paged-paged"]]
