"""EAGLE: heads in the published layout (written here by an independent writer built on
transformers' LlamaModel, no lmplug code), the drafter's proposals equal to a dense
reference EAGLE chain computed from transformers' own hidden states, greedy outputs
unchanged for every KV backend and scheduler (batch 3, prefix caching, preemption),
sampling keeps the target's distribution (chi-square) and a biased verifier is caught,
and ``lmplug train-drafter --method eagle`` on a tiny model."""

from __future__ import annotations

import functools
import json
from typing import ClassVar

import pytest
import torch
from lmplug_speculative.eagle_head import load_head
from lmplug_speculative.eagle_train import train_eagle
from support.hf_models import get_model, make_config, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import (
    SAMPLING,
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
from lmplug.train_host import LLMTrainingHost

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(6, 41), prompt_ids(25, 42), prompt_ids(3, 43)]


class RefEagle(torch.nn.Module):
    """EAGLE-1's ``Model`` written with transformers: fc over [embedding ‖ feature], then a
    Llama decoder layer without input_layernorm (and no final norm)."""

    def __init__(self, seed: int = 1):
        super().__init__()
        from transformers import LlamaModel

        torch.manual_seed(seed)
        cfg = make_config("llama", num_hidden_layers=1)
        self.model = LlamaModel(cfg)
        self.model.layers[0].input_layernorm = torch.nn.Identity()
        self.model.norm = torch.nn.Identity()
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        with torch.no_grad():
            self.model.layers[0].post_attention_layernorm.weight.copy_(1 + 0.2 * torch.randn(h))
            self.fc.weight.mul_(3)
        self.config = cfg

    @classmethod
    def from_folder(cls, folder, embed: torch.Tensor) -> RefEagle:
        """Read heads saved in the published layout; ``embed``: the target's, if they carry none."""
        from safetensors.torch import load_file

        ref = cls()
        state = load_file(folder / "model.safetensors")
        state.setdefault("embed_tokens.weight", embed)
        ref.fc.load_state_dict({"weight": state.pop("fc.weight"), "bias": state.pop("fc.bias")})
        missing, unexpected = ref.model.load_state_dict(state, strict=False)
        assert not unexpected and not missing
        return ref.eval()

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.model.embed_tokens(ids), feats], -1))
        return self.model(inputs_embeds=x[None]).last_hidden_state[0]

    def write(self, folder, fmt: str = "bin"):
        folder.mkdir(parents=True, exist_ok=True)
        state = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias, **self.model.state_dict()}
        state = {k: v.detach().clone().contiguous() for k, v in state.items()}
        assert "layers.0.input_layernorm.weight" not in state and "embed_tokens.weight" in state
        if fmt == "bin":
            torch.save(state, folder / "pytorch_model.bin")
        else:
            from safetensors.torch import save_file
            save_file(state, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(self.config.to_json_string())
        return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("eagle"), tokenizer=True)


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in run(make_engine(model.path), PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def ref_head(tmp_path_factory):
    ref = RefEagle().eval()
    return ref, ref.write(tmp_path_factory.mktemp("ref_heads"))


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    return train_eagle(LLMTrainingHost(), str(model.path), str(tmp_path_factory.mktemp("trained")), {
        "num_prompts": 32, "max_tokens": 32, "epochs": 6, "lr": 3e-3, "device": "cpu"})


# -- format ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_loads_the_published_layout(tmp_path, fmt):
    ref = RefEagle(seed=3).eval()
    head = load_head(ref.write(tmp_path, fmt))
    ids, feats = torch.randint(0, 512, (9,)), torch.randn(9, 64)
    with torch.no_grad():
        torch.testing.assert_close(head.forward_dense(head.embed_tokens(ids), feats), ref(ids, feats),
                                   atol=1e-5, rtol=1e-5)


def test_bad_heads_are_refused_at_load(tmp_path, model):
    with pytest.raises(ConfigError, match="train-drafter --method eagle"):
        load_head(tmp_path)
    folder = RefEagle().write(tmp_path / "two")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="num_hidden_layers=2"):
        load_head(folder)
    state = torch.load(folder / "pytorch_model.bin")
    state["layers.0.input_layernorm.weight"] = torch.ones(64)
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="input_layernorm"):
        load_head(folder)


# -- the drafter computes EAGLE ----------------------------------------------------------------------
def _reference_chain(model, ref: RefEagle, tokens: list[int], k: int, allowed=None) -> list[int]:
    """EAGLE chain drafting, dense, from transformers' features: position t sees (token t+1,
    feature t); each predicted feature feeds the next position with the token it chose
    (the argmax over ``allowed`` tokens when given)."""
    c = len(tokens) - 1
    with torch.no_grad():
        feats = model.hf.model(torch.tensor([tokens[:c]])).last_hidden_state[0]  # after the final norm
        ids, out = list(tokens[1:c + 1]), []
        for _ in range(k):
            g = ref(torch.tensor(ids), feats)[-1]
            logits = g @ model.hf.lm_head.weight.T
            if allowed is not None:
                logits = torch.full_like(logits, float("-inf")).index_copy(0, allowed, logits[allowed])
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            feats = torch.cat([feats, g[None]])
    return out


@pytest.mark.parametrize("kvcache", [{}, {"backend": "paged", "block_size": 4, "num_blocks": 200}],
                         ids=["contiguous", "paged"])
@pytest.mark.parametrize("heads", ["random", "trained"])
def test_proposals_equal_a_reference_eagle(model, ref_head, trained, kvcache, heads):
    """Random heads: nothing is accepted; trained ones: drafts are accepted, so the mirror must
    recompute the positions it drafted from its own predicted features."""
    allowed = None
    if heads == "random":
        ref, folder = ref_head
    else:
        from safetensors.torch import load_file

        folder = trained.folder
        ref = RefEagle.from_folder(folder, model.hf.model.embed_tokens.weight.detach())
        allowed = load_file(folder / "draft_vocab.safetensors")["token_ids"]
        assert 0 < len(allowed) < 512  # the tokens the answers used
    engine = make_engine(model.path, {"method": "eagle", "heads": str(folder), "num_tokens": 3},
                         **({"kvcache": kvcache} if kvcache else {}))
    drafter, seen = engine.speculator.drafter, []
    propose = drafter.propose

    def recording(seqs, k):
        proposal = propose(seqs, k)
        seen.extend((list(s.token_ids), ids, k) for s, ids in zip(seqs, proposal.token_ids))
        return proposal

    drafter.propose = recording
    run(engine, PROMPTS, GREEDY)
    assert len(seen) > 10
    assert (engine.speculator.num_accepted > 0) == (heads == "trained")
    for tokens, ids, k in seen[::2]:
        assert ids == _reference_chain(model, ref, tokens, k, allowed)


@pytest.mark.parametrize("kvcache", [{}, {"backend": "paged", "block_size": 4, "num_blocks": 200}],
                         ids=["contiguous", "paged"])
def test_sibling_tree_keeps_the_reference_chain_after_a_sibling_is_accepted(model, trained, kvcache):
    """``tree_width: 3``: the chain is EAGLE's, plus two runner-up leaves per depth. When the
    target accepts a leaf, its K/V and its feature move to the chain's position, so the next
    chain drafted must still equal the reference computed from transformers' features."""
    from safetensors.torch import load_file

    folder = trained.folder
    ref = RefEagle.from_folder(folder, model.hf.model.embed_tokens.weight.detach())
    allowed = load_file(folder / "draft_vocab.safetensors")["token_ids"]
    engine = make_engine(model.path, {"method": "eagle", "heads": str(folder), "num_tokens": 3, "tree_width": 3},
                         **({"kvcache": kvcache} if kvcache else {}))
    drafter, seen, moves = engine.speculator.drafter, [], []
    propose, kv_moved = drafter.propose, drafter.kv_moved

    def recording(seqs, k):
        proposal = propose(seqs, k)
        for i, s in enumerate(seqs):
            parents = proposal.parents_of(i) or list(range(-1, len(proposal.token_ids[i]) - 1))
            chain = next((j for j, p in enumerate(parents) if p != j - 1), len(parents))
            assert all(p < chain for p in parents[chain:]), "siblings hang off the chain"
            seen.append((list(s.token_ids), proposal.token_ids[i][:chain], k))
        return proposal

    drafter.propose = recording
    drafter.kv_moved = lambda seq, src, dst: (moves.append((seq.seq_id, src != dst)), kv_moved(seq, src, dst))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # long: leaves accepted mid-way
    assert [o.token_ids for o in run(engine, PROMPTS, params)] == [o.token_ids for o in run(make_engine(
        model.path, **({"kvcache": kvcache} if kvcache else {})), PROMPTS, params)]
    assert sum(moved for _, moved in moves) >= 3, "siblings were rarely accepted: the test checks little"
    for tokens, chain, k in seen:
        assert chain == _reference_chain(model, ref, tokens, k, allowed)


def _reference_eagle2(model, ref: RefEagle, tokens: list[int], depth: int, top_k: int, total: int,
                      allowed: torch.Tensor) -> set[tuple[int, ...]]:
    """EAGLE-2's tree, dense and written from the paper: every node's feature is the head's
    output at the end of its root-to-node path (computed as one causal sequence from
    transformers' features), its value the sum of the draft log-probabilities along the path
    (over the draft vocabulary). Expand the ``top_k`` best nodes of each depth by their
    ``top_k`` best children; keep the ``total`` best nodes. Returns the kept nodes' paths."""
    c = len(tokens) - 1
    head = model.hf.lm_head.weight.T[:, allowed]
    with torch.no_grad():
        real = model.hf.model(torch.tensor([tokens[:c]])).last_hidden_state[0]
        root = ref(torch.tensor(tokens[1:c + 1]), real)[-1]

        @functools.cache
        def output(path):  # the head's feature after ``path`` (tokens below the root)
            feats = torch.cat([real, torch.stack([root, *[output(path[:e]) for e in range(1, len(path))]])])
            return ref(torch.tensor(tokens[1:c + 1] + list(path)), feats)[-1]

        def children(path, value):
            lp = torch.log_softmax(output(path) @ head if path else root @ head, -1)
            best = lp.topk(top_k)
            return {path + (int(allowed[j]),): value + float(v) for v, j in zip(best.values, best.indices)}

        nodes = children((), 0.0)
        frontier = nodes
        for _ in range(depth - 1):
            frontier = dict(sorted(frontier.items(), key=lambda kv: (-kv[1], len(kv[0])))[:top_k])
            new = {}
            for path, value in frontier.items():
                new.update(children(path, value))
            nodes.update(new)
            frontier = new
    return {path for path, _ in sorted(nodes.items(), key=lambda kv: (-kv[1], len(kv[0])))[:total]}


@pytest.mark.parametrize("kvcache", [{}, {"backend": "paged", "block_size": 4, "num_blocks": 300}],
                         ids=["contiguous", "paged"])
def test_dynamic_tree_equals_a_reference_eagle2(model, trained, kvcache):
    """``dynamic_tree``: each proposed tree is the one a dense EAGLE-2 grows from transformers'
    features (same nodes, each under its own parent), and greedy output stays plain."""
    from safetensors.torch import load_file

    folder = trained.folder
    ref = RefEagle.from_folder(folder, model.hf.model.embed_tokens.weight.detach())
    allowed = load_file(folder / "draft_vocab.safetensors")["token_ids"]
    options = {"method": "eagle", "heads": str(folder), "num_tokens": 4, "dynamic_tree": True, "top_k": 2,
               "total_tokens": 10}  # 14 nodes drafted (2 + 3 x 4), 10 kept: deep ones among them
    engine = make_engine(model.path, options, **({"kvcache": kvcache} if kvcache else {}))
    drafter, seen = engine.speculator.drafter, []
    propose = drafter.propose

    def recording(seqs, k):
        proposal = propose(seqs, k)
        for i, s in enumerate(seqs):
            tokens, parents = proposal.token_ids[i], proposal.parents_of(i)
            paths = []
            for j, p in enumerate(parents):
                assert p < j
                paths.append((paths[p] if p >= 0 else ()) + (tokens[j],))
            seen.append((list(s.token_ids), set(paths), k))
        return proposal

    drafter.propose = recording
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in run(engine, PROMPTS[:2], params)] == [
        o.token_ids for o in run(make_engine(model.path, **({"kvcache": kvcache} if kvcache else {})), PROMPTS[:2],
                                 params)]
    assert engine.speculator.num_accepted > 0
    assert len(seen) > 6
    # depth 3 needs features predicted from predicted features: the trees must reach it
    assert sum(max(map(len, paths)) >= 3 for _, paths, _ in seen) > len(seen) // 2
    for tokens, paths, k in seen[::2]:
        assert paths == _reference_eagle2(model, ref, tokens, k, 2, 10, allowed)


def test_dynamic_tree_leaves_sampling_requests_a_chain(model, trained):
    """A sampling request beside greedy ones gets EAGLE's chain under ``dynamic_tree``: with the
    same seed it emits exactly what it emits with the chain drafter; the greedy ones get trees."""
    sampled = SamplingParams(**{**SAMPLING, "max_tokens": 16}, seed=7)
    params = [GREEDY, sampled, GREEDY]
    chain = make_engine(model.path, {"method": "eagle", "heads": str(trained.folder), "num_tokens": 3})
    tree = make_engine(model.path, {"method": "eagle", "heads": str(trained.folder), "num_tokens": 3,
                                    "dynamic_tree": True, "top_k": 3})
    drafter, shapes = tree.speculator.drafter, []
    propose = drafter.propose
    drafter.propose = lambda seqs, k: (p := propose(seqs, k), shapes.extend(
        (s.params.is_greedy, p.parents_of(i) is not None) for i, s in enumerate(seqs) if p.token_ids[i]))[0]
    outs = run(tree, PROMPTS, params)
    assert outs[1].token_ids == run(chain, PROMPTS, params)[1].token_ids
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [r for i, r in enumerate(
        [o.token_ids for o in run(make_engine(model.path), PROMPTS, GREEDY)]) if i != 1]
    assert {greedy for greedy, is_tree in shapes if is_tree} == {True}
    assert (False, False) in shapes


def test_dynamic_tree_options_are_checked_at_load(model, trained):
    with pytest.raises(ConfigError, match="dynamic_tree and tree_width"):
        make_engine(model.path, {"method": "eagle", "heads": str(trained.folder), "dynamic_tree": True,
                                 "tree_width": 2})
    with pytest.raises(ConfigError, match="tree"):
        make_engine(model.path, {"method": "eagle", "heads": str(trained.folder), "dynamic_tree": True},
                    attention="flash")


def test_draft_vocab_limits_the_drafts(model, trained, tmp_path):
    import shutil

    from lmplug_speculative.eagle_head import save_draft_vocab

    folder = shutil.copytree(trained.folder, tmp_path / "h")
    allowed = torch.tensor([5, 17, 300])
    save_draft_vocab(allowed, folder)
    engine = make_engine(model.path, {"method": "eagle", "heads": str(folder), "num_tokens": 3})
    drafter, drafted = engine.speculator.drafter, []
    propose = drafter.propose
    drafter.propose = lambda seqs, k: (p := propose(seqs, k), drafted.extend(t for ids in p.token_ids for t in ids))[0]
    run(engine, PROMPTS, GREEDY)
    assert drafted and set(drafted) <= {5, 17, 300}
    save_draft_vocab(torch.tensor([3, 512]), folder)
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, 512\)"):
        make_engine(model.path, {"method": "eagle", "heads": str(folder)})


# -- exactness in the engine ---------------------------------------------------------------------
PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}
CASES = {
    "contiguous-static": {"scheduler": "static"},
    "contiguous-continuous": {"scheduler": {"backend": "continuous", "max_num_seqs": 8}},
    "paged-static": {"kvcache": PAGED, "scheduler": "static"},
    "paged-continuous": {"kvcache": PAGED, "scheduler": {"backend": "continuous", "max_num_seqs": 8}},
    "paged-prefix": {"kvcache": {**PAGED, "prefix_caching": True}},
    "paged-preempting": {"kvcache": {**PAGED, "num_blocks": 30}},
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_greedy_outputs_unchanged_random_heads(model, reference, ref_head, case):
    engine = make_engine(model.path, {"method": "eagle", "heads": str(ref_head[1]), "num_tokens": 3}, **case)
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert engine.speculator.num_drafted > 0


TREES = {"chain": {}, "siblings": {"tree_width": 3},
         "dynamic": {"dynamic_tree": True, "top_k": 3, "total_tokens": 8}}


@pytest.mark.parametrize("tree", TREES.values(), ids=TREES.keys())
@pytest.mark.parametrize("case", ["contiguous-continuous", "paged-prefix", "paged-preempting"])
def test_greedy_outputs_unchanged_trained_heads(model, reference, trained, case, tree):
    engine = make_engine(model.path, {"method": "eagle", "heads": str(trained.folder), "num_tokens": 3,
                                      **tree}, **CASES[case])
    outs = run(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.speculator.num_accepted > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == engine.speculator.num_accepted


def test_per_request_stats(model, trained):
    """Every target forward that produced a request's tokens emitted its accepted drafts + 1."""
    plain = run(make_engine(model.path), PROMPTS, GREEDY)
    assert [o.metrics.num_target_forwards for o in plain] == [len(o.token_ids) for o in plain]
    assert all(o.metrics.acceptance_rate is None for o in plain)
    engine = make_engine(model.path, {"method": "eagle", "heads": str(trained.folder), "num_tokens": 3})
    outs = run(engine, PROMPTS, GREEDY)
    for o in outs:
        m = o.metrics
        assert m.num_target_forwards + m.num_accepted_tokens == len(o.token_ids)
        assert m.num_target_forwards < len(o.token_ids) or m.num_accepted_tokens == 0
        assert m.acceptance_rate == m.num_accepted_tokens / m.num_drafted_tokens
        assert f"target forwards {m.num_target_forwards}" in m.spec_summary(len(o.token_ids))
    assert sum(o.metrics.num_target_forwards for o in outs) < sum(len(o.token_ids) for o in outs)


def test_training_improves_the_head(trained):
    assert trained.accuracy_after > trained.accuracy_before


# -- sampling ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_distribution(model):
    return pair_distribution_of(model.hf)


def _pair_counts(model, heads, expected: dict, num: int):
    engine = make_engine(model.path, {"method": "eagle", "heads": str(heads), "num_tokens": 2},
                         kvcache=PAGED, scheduler={"backend": "continuous", "max_num_seqs": 64})
    return pair_counts(engine, expected, num)


def test_sampled_continuations_follow_the_target(model, trained, pair_distribution):
    counts, probs = _pair_counts(model, trained.folder, pair_distribution, 1000)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_biased_verifier_is_caught(model, trained, pair_distribution, monkeypatch):
    monkeypatch.setattr(kit_sampling, "residual_distribution", lambda p, q: p)
    counts, probs = _pair_counts(model, trained.folder, pair_distribution, 1000)
    assert chi_square_pvalue(counts, probs) < 1e-3


# -- training from the command line ------------------------------------------------------------------
def test_train_drafter_cli_output_runs_exactly(model, reference, tmp_path):
    out = tmp_path / "h"
    assert main(["train-drafter", "--method", "eagle", str(model.path), str(out),
                 "-o", "num_prompts=4", "-o", "max_tokens=8", "-o", "epochs=1"]) == 0
    assert set(json.loads((out / "config.json").read_text())) >= {"hidden_size", "num_hidden_layers"}
    from safetensors.torch import load_file
    names = set(load_file(out / "model.safetensors"))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("input_layernorm" in n for n in names)
    engine = make_engine(model.path, {"method": "eagle", "heads": str(out), "num_tokens": 2})
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference


# -- the conformance suite -------------------------------------------------------------------------
class TestEagleConformance(DrafterConformance):
    backend = "eagle"
    options: ClassVar[dict] = {"heads": "set-in-make_drafter"}
    vocab_size = 512  # the target's
    decode_steps = 12

    @pytest.fixture(autouse=True)
    def _target(self, tmp_path_factory, model):
        type(self)._model = model
        type(self)._heads = RefEagle(seed=5).write(tmp_path_factory.mktemp("conf_heads"))

    def make_drafter(self, backend_class, options):
        return drafter_on_token_features(self._model.path, backend_class,
                                         {**options.model_dump(), "heads": str(self._heads)})


# -- a target whose LM head stays packed (GGUF blocks held by the quant method) -------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_drafters_read_a_packed_head(tmp_path, tied):
    """The demo model's case: a GGUF read without dequantizing keeps the (tied) head in packed
    blocks, which have no float ``weight``; the head's rows are read back exactly, and an EAGLE head
    with a draft vocabulary runs over it."""
    import numpy as np
    from lmplug_speculative.head_matrix import head_matrix, plain_head
    from safetensors.torch import save_file as save
    from support.gguf_fixtures import write_tiny_gguf
    
    path = tmp_path / "m.gguf"
    expected = write_tiny_gguf(path, tied=tied)
    engine = make_engine(path)
    model = engine.parts.model
    assert plain_head(model) is None  # packed: no float matrix to share
    rows = expected["token_embd.weight" if tied else "output.weight"]
    torch.testing.assert_close(head_matrix(model), torch.from_numpy(np.ascontiguousarray(rows)), atol=1e-5, rtol=1e-5)
    heads = RefEagle(seed=2).write(tmp_path / "heads")
    save({"token_ids": torch.arange(3, 60)}, str(heads / "draft_vocab.safetensors"))
    prompts = [[5, 9, 13, 7, 22, 31], [40, 2 + 1, 17]]
    plain = [o.token_ids for o in run(engine, prompts, GREEDY)]
    eagle = make_engine(path, {"method": "eagle", "heads": str(heads), "num_tokens": 2})
    assert [o.token_ids for o in run(eagle, prompts, GREEDY)] == plain
