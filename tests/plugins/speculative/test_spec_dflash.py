"""DFlash: block-diffusion heads written by transformers (``MuseGlimmerAssistantModel``, random
or distilled here) drafting for tiny transformers targets. The drafter's block logits equal the
ones transformers' own ``DFlashTokenCandidateGenerator`` computes inside ``generate`` (same
contexts, rejections included), greedy output stays plain decoding's for several targets and KV
backends, sampling keeps the target's distribution (chi-square), and bad heads or options are
refused at load time naming the option."""

from __future__ import annotations

import json
import shutil
import types
from typing import ClassVar

import pytest
import torch
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import (
    chi_square_pvalue,
    drafter_on_token_features,
    make_engine,
    pair_counts,
    run,
)
from support.spec_helpers import pair_distribution as pair_distribution_of

from lmplug.cli import main
from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.kit import sampling as kit_sampling
from lmplug.testing import DrafterConformance

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(6, 41), prompt_ids(25, 42), prompt_ids(3, 43)]
PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}
CASES = {
    "contiguous-continuous": {"scheduler": {"backend": "continuous", "max_num_seqs": 8}},
    "paged-static": {"kvcache": PAGED, "scheduler": "static"},
    "paged-prefix": {"kvcache": {**PAGED, "prefix_caching": True}},
    "paged-preempting": {"kvcache": {**PAGED, "num_blocks": 30}},
}


def write_head(folder, *, block_size: int = 4, target_layer_ids=(0, 1), num_layers: int = 2, seed: int = 0,
               **extra):
    """A random ``MuseGlimmerAssistantModel`` saved by transformers: a sliding layer (window 3,
    shorter than the contexts) and a full one, norms randomised."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = MuseGlimmerAssistantConfig(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "block_size": block_size, "mask_token_id": 5,
        "target_layer_ids": list(target_layer_ids), "sliding_window": 3, "max_position_embeddings": 256,
        "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2) + ["full_attention"] * (
            num_layers % 2), **extra})
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    return {name: get_model(name, root, tokenizer=name == "llama") for name in ("llama", "qwen3", "mistral")}


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("random_head"))


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    """A head distilled from the tiny llama (``lmplug train-drafter --method dflash``'s trainer),
    and the chat prompts it learned from (its answers: drafts there get accepted)."""
    from lmplug_speculative.dflash_train import train_dflash

    from lmplug.train_host import LLMTrainingHost

    root = tmp_path_factory.mktemp("trained")
    result = train_dflash(LLMTrainingHost(), str(models["llama"].path), str(root / "head"), {
        "num_prompts": 48, "max_tokens": 32, "temperature": 1.0, "epochs": 8, "block_size": 4, "device": "cpu",
        "answers": str(root / "answers.json")})
    answers = json.loads((root / "answers.json").read_text())
    return types.SimpleNamespace(folder=result.folder, accuracy_before=result.accuracy_before,
                                 accuracy_after=result.accuracy_after, prompts=[ids[:n] for ids, n in answers[:3]])


# -- the block logits equal transformers' --------------------------------------------------------------
def transformers_candidates(hf, folder, prompt: list[int], num: int, monkeypatch) -> tuple[list[int], dict]:
    """``hf.generate`` with the head as a DFlash assistant (greedy): its output and, per context
    (the tokens so far), the candidate logits [block_size - 1, V] its candidate generator made."""
    from transformers import MuseGlimmerAssistantModel
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    seen, original = {}, DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            seen[tuple(input_ids[0].tolist())] = logits[0]
        return ids, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", recording)
    assistant = MuseGlimmerAssistantModel.from_pretrained(folder).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), assistant_model=assistant, speculation_type="dflash",
                          do_sample=False, max_new_tokens=num, min_new_tokens=num)
    return out[0, len(prompt):].tolist(), seen


def lmplug_candidates(engine, prompts, num: int) -> tuple[list[list[int]], dict]:
    """Greedy outputs and, per context, the drafter's block logits, all prompts in one batch."""
    drafter, seen = engine.speculator.drafter, {}
    propose, compute = drafter.propose, drafter._compute_logits
    last = []

    def recording(seqs, k):
        proposal = propose(seqs, k)
        row = 0
        for seq, ids in zip(seqs, proposal.token_ids):
            if ids:
                seen[tuple(seq.token_ids)] = last[-1][row:row + len(ids)]
                row += len(ids)
        return proposal

    drafter._compute_logits = lambda hidden: (logits := compute(hidden), last.append(logits))[0]
    drafter.propose = recording
    outs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=num, ignore_eos=True))
    return [o.token_ids for o in outs], seen


def assert_same_logits(theirs: dict, ours: dict, eos: int) -> int:
    common = set(theirs) & set(ours)
    for key in common:
        ref, got = theirs[key], ours[key]
        assert got.shape == ref.shape
        finite = torch.isfinite(ref)  # min_new_tokens masks EOS in theirs
        assert set((~finite).nonzero()[:, 1].tolist()) <= {eos}
        torch.testing.assert_close(got[finite], ref[finite], atol=1e-4, rtol=1e-4)
    return len(common)


@pytest.mark.parametrize("kvcache", [None, PAGED], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target", ["llama", "qwen3", "mistral"])
def test_block_logits_equal_transformers_random_head(models, random_head, target, kvcache, monkeypatch):
    """Random head: nothing is accepted, so each context is one token longer than the last."""
    model = models[target]
    engine = make_engine(model.path, {"method": "dflash", "heads": str(random_head)},
                         **({"kvcache": kvcache} if kvcache else {}))
    outs, ours = lmplug_candidates(engine, PROMPTS, 16)
    for prompt, out in zip(PROMPTS, outs):
        hf_out, theirs = transformers_candidates(model.hf, random_head, prompt, 16, monkeypatch)
        assert out == hf_out
        assert assert_same_logits(theirs, ours, eos=2) == len(theirs) >= 10


@pytest.mark.parametrize("kvcache", [None, PAGED], ids=["contiguous", "paged"])
def test_block_logits_equal_transformers_trained_head(models, trained, kvcache, monkeypatch):
    """Distilled head: drafts are accepted and rejected, so the context grows by several tokens
    at a time and the drafter keeps only the context K/V of tokens the target kept."""
    model = models["llama"]
    engine = make_engine(model.path, {"method": "dflash", "heads": str(trained.folder)},
                         **({"kvcache": kvcache} if kvcache else {}))
    outs, ours = lmplug_candidates(engine, trained.prompts, 24)
    assert engine.speculator.num_accepted > 10
    for prompt, out in zip(trained.prompts, outs):
        hf_out, theirs = transformers_candidates(model.hf, trained.folder, prompt, 24, monkeypatch)
        assert out == hf_out
        assert assert_same_logits(theirs, ours, eos=2) == len(theirs) >= 5


# -- greedy output is plain decoding's -----------------------------------------------------------------
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("target", ["llama", "qwen3", "mistral"])
def test_greedy_outputs_unchanged_random_head(models, random_head, target, case):
    model = models[target]
    reference = [o.token_ids for o in run(make_engine(model.path, **case), PROMPTS, GREEDY)]
    engine = make_engine(model.path, {"method": "dflash", "heads": str(random_head), "num_tokens": 2}, **case)
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert engine.speculator.num_drafted > 0


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_greedy_outputs_unchanged_trained_head(models, trained, case):
    model = models["llama"]
    prompts = trained.prompts + PROMPTS[:1]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = [o.token_ids for o in run(make_engine(model.path, **case), prompts, params)]
    engine = make_engine(model.path, {"method": "dflash", "heads": str(trained.folder)}, **case)
    outs = run(engine, prompts, params)
    assert [o.token_ids for o in outs] == reference
    assert engine.speculator.num_accepted > 10
    assert sum(o.metrics.num_target_forwards for o in outs) < sum(len(o.token_ids) for o in outs)


def test_training_improves_the_head(trained):
    assert trained.accuracy_after > trained.accuracy_before + 0.1


# -- sampling keeps the target's distribution --------------------------------------------------------------
@pytest.fixture(scope="module")
def pair_distribution(models):
    return pair_distribution_of(models["llama"].hf)


def _pair_counts(models, heads, expected: dict, num: int):
    engine = make_engine(models["llama"].path, {"method": "dflash", "heads": str(heads), "num_tokens": 2},
                         kvcache=PAGED, scheduler={"backend": "continuous", "max_num_seqs": 64})
    return pair_counts(engine, expected, num)


def test_sampled_continuations_follow_the_target(models, trained, pair_distribution):
    counts, probs = _pair_counts(models, trained.folder, pair_distribution, 1000)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_biased_verifier_is_caught(models, trained, pair_distribution, monkeypatch):
    monkeypatch.setattr(kit_sampling, "residual_distribution", lambda p, q: p)
    counts, probs = _pair_counts(models, trained.folder, pair_distribution, 1000)
    assert chi_square_pvalue(counts, probs) < 1e-3


# -- bad input -------------------------------------------------------------------------------------------
def _refused(model, options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_engine(model.path, {"method": "dflash", **options})


def test_a_folder_that_is_not_a_dflash_head_is_refused(models, tmp_path):
    model = models["llama"]
    _refused(model, {"heads": str(tmp_path)}, r"heads: no config\.json .* muse_glimmer_assistant")
    _refused(model, {"heads": str(model.path)}, r"speculative: dflash: heads: .*'model_type' is 'llama'; a DFlash "
                                                r"head is 'muse_glimmer_assistant'")
    folder = write_head(tmp_path / "h")
    (folder / "model.safetensors").unlink()
    _refused(model, {"heads": str(folder)}, r"heads: no model\.safetensors")


def test_weights_that_do_not_match_the_config_are_refused(models, tmp_path):
    folder = write_head(tmp_path / "h", target_layer_ids=(0, 1))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "target_layer_ids": [1]}))
    _refused(models["llama"], {"heads": str(folder)}, r"encoder\.fc\.weight: \(64, 128\) != \(64, 64\)")


def test_a_head_that_does_not_fit_the_target_is_refused(models, tmp_path):
    model = models["llama"]  # 2 layers, hidden 64, vocabulary 512
    _refused(model, {"heads": str(write_head(tmp_path / "layers", target_layer_ids=(0, 3)))},
             r"target_layer_ids \[0, 3\] name layers \[3\] the target \(with 2 layers\) lacks")
    _refused(model, {"heads": str(write_head(tmp_path / "mask", mask_token_id=512))},
             r"mask_token_id 512 is outside the target's vocabulary of 512")
    _refused(model, {"heads": str(write_head(tmp_path / "wide", hidden_size=96))},
             r"hidden_size 96, the target 64")
    _refused(model, {"heads": str(write_head(tmp_path / "block", block_size=3)), "num_tokens": 3},
             r"num_tokens 3 is more than the heads' block_size 3 - 1 = 2")
    bad = write_head(tmp_path / "types")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention"]}))
    _refused(model, {"heads": str(bad)}, r"'layer_types' must list 2 of")
    _refused(model, {}, r"heads")


def test_num_tokens_defaults_to_the_block(models, random_head):
    engine = make_engine(models["llama"].path, {"method": "dflash", "heads": str(random_head)})
    assert engine.speculator.num_tokens == 3  # block_size 4: the anchor and 3 drafts


# -- training from the command line -----------------------------------------------------------------------
def test_train_drafter_cli_output_runs_exactly(models, tmp_path):
    model = models["llama"]
    out = tmp_path / "h"
    assert main(["train-drafter", "--method", "dflash", str(model.path), str(out), "-o", "num_prompts=4",
                 "-o", "max_tokens=8", "-o", "epochs=1", "-o", "block_size=3"]) == 0
    from transformers import MuseGlimmerAssistantModel

    assert MuseGlimmerAssistantModel.from_pretrained(out).config.block_size == 3  # transformers reads it
    reference = [o.token_ids for o in run(make_engine(model.path), PROMPTS, GREEDY)]
    engine = make_engine(model.path, {"method": "dflash", "heads": str(out)})
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    shutil.rmtree(out)


# -- the conformance suite -------------------------------------------------------------------------
class TestDFlashConformance(DrafterConformance):
    backend = "dflash"
    options: ClassVar[dict] = {"heads": "set-in-make_drafter"}
    vocab_size = 512  # the target's
    decode_steps = 12

    @pytest.fixture(autouse=True)
    def _target(self, tmp_path_factory, models):
        type(self)._model = models["llama"]
        type(self)._heads = write_head(tmp_path_factory.mktemp("conf_head"), block_size=6, seed=5)

    def make_drafter(self, backend_class, options):
        return drafter_on_token_features(self._model.path, backend_class,
                                         {**options.model_dump(), "heads": str(self._heads)})
