"""MTP: multi-token-prediction modules in DeepSeek-V3's and Qwen3-Next's published layouts, written
here by an independent writer (transformers' own decoder layer of the target's kind, random
weights, saved beside the model with safetensors; no lmplug code), the drafter's draft
distributions equal to a float64 re-implementation of the published equations (DeepSeek-V3,
eq. 21-23, with transformers' layer as the block and transformers' features), greedy outputs
unchanged under contiguous and paged KV, sampling keeps the target's distribution (chi-square),
a model without MTP weights is refused naming `train-drafter --method mtp`, and
``lmplug train-drafter --method mtp`` trains a module that the drafter loads and that drafts
accepted tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from lmplug_speculative.mtp_train import train_mtp
from safetensors.torch import save_file
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.moe_models import TinyDeepseek
from support.spec_helpers import chi_square_pvalue, make_engine, pair_counts, run
from support.spec_helpers import pair_distribution as pair_distribution_of

from lmplug.cli import main
from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.kit import sampling as kit_sampling
from lmplug.train_host import LLMTrainingHost

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [prompt_ids(6, 51), prompt_ids(21, 52), prompt_ids(3, 53)]
PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}


class RefMTP(torch.nn.Module):
    """One MTP module from the published equations, in float64: ``out_t = TRM(eh_proj([enorm(E(t+1)) ;
    hnorm(f_t)]))`` with TRM transformers' decoder layer of the target's kind at index L (so a
    DeepSeek-V3 one is an MoE layer), logits = lm_head(norm(out_t)) with the target's embedding and
    lm_head."""

    def __init__(self, hf_target, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        cfg = hf_target.config
        self.num_layers, h = cfg.num_hidden_layers, cfg.hidden_size
        self.target = copy.deepcopy(hf_target).double().eval()
        cfg = copy.deepcopy(cfg)
        cfg._experts_implementation = "eager"  # transformers' grouped matmul has no float64
        self.target.config._experts_implementation = "eager"
        layer = type(hf_target.model.layers[-1])(cfg, layer_idx=self.num_layers)
        self.enorm, self.hnorm, self.head_norm = (torch.nn.Parameter(1 + 0.2 * torch.randn(h)) for _ in range(3))
        self.eh_proj = torch.nn.Parameter(0.3 * torch.randn(h, 2 * h) / (2 * h) ** 0.5)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif p.dim() >= 2:
                    p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
                else:
                    p.copy_(0.1 * torch.randn_like(p))
        self.layer = layer.double().eval()
        self.eps = cfg.rms_norm_eps

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def features(self, ids: list[int]) -> torch.Tensor:
        """The target's final hidden states after its final norm (transformers', float64)."""
        return self.target.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def forward(self, ids: list[int], feats: torch.Tensor) -> torch.Tensor:
        e = self.target.model.embed_tokens(torch.tensor(ids))
        x = torch.cat([self._norm(e, self.enorm), self._norm(feats, self.hnorm)], -1) @ self.eh_proj.double().T
        t = x.shape[0]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        pe = self.target.model.rotary_emb(x[None], pos)
        return self.layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=pe)[0]

    @torch.no_grad()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._norm(out, self.head_norm) @ self.target.lm_head.weight.T

    def tensors(self, layout: str) -> dict[str, torch.Tensor]:
        """This module's tensors under the layout's published names (float32)."""
        layer = {k: v for k, v in self.layer.state_dict().items() if "rotary" not in k}
        if layout == "qwen3_next":
            own = {"mtp.pre_fc_norm_embedding.weight": self.enorm, "mtp.pre_fc_norm_hidden.weight": self.hnorm,
                   "mtp.fc.weight": self.eh_proj, "mtp.norm.weight": self.head_norm}
            named = {**own, **{f"mtp.layers.0.{k}": v for k, v in layer.items()}}
        else:
            p = f"model.layers.{self.num_layers}."
            own = {"enorm.weight": self.enorm, "hnorm.weight": self.hnorm, "eh_proj.weight": self.eh_proj,
                   "shared_head.norm.weight": self.head_norm}
            named = {p + k: v for k, v in {**own, **layer}.items()}
        return {k: v.detach().float().contiguous() for k, v in named.items()}

    def write_into(self, folder, layout: str = "deepseek") -> None:
        """Add the module to a saved model folder: a second safetensors file and the config key."""
        tensors = self.tensors(layout)
        save_file(tensors, str(folder / "mtp.safetensors"))
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
        with torch.no_grad():  # the reference computes with exactly the saved (float32) values
            for p in self.parameters():
                p.copy_(p.float().double())


def _chain(ref: RefMTP, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """Draft logits at each depth, dense: position t sees (token t+1, f_t); depth d > 1 feeds the
    module's own output at the position before and the token drafted there."""
    c = len(tokens) - 1
    feats, ids, out = ref.features(tokens[:c]), list(tokens[1:c + 1]), []
    for token in [None, *drafts[:-1]]:
        if token is not None:
            ids.append(token)
        g = ref(ids, feats)[-1]
        out.append(ref.logits(g))
        feats = torch.cat([feats, g[None]])
    return out


def _recording(engine) -> list:
    drafter, seen = engine.speculator.drafter, []
    propose = drafter.propose

    def recording(seqs, k):
        proposal = propose(seqs, k)
        for i, s in enumerate(seqs):
            seen.append((list(s.token_ids), proposal.token_ids[i], proposal.probs_of(i)))
        return proposal

    drafter.propose = recording
    return seen


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama with a DeepSeek-layout MTP module written beside it."""
    model = get_model("llama", tmp_path_factory.mktemp("mtp"), tokenizer=True)
    folder = tmp_path_factory.mktemp("mtp_llama") / "m"
    import shutil

    shutil.copytree(model.path, folder)
    ref = RefMTP(model.hf)
    ref.write_into(folder)
    return model, folder, ref


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA, MoE) with its MTP layer (an MoE layer) after the last one."""
    model = TinyDeepseek("v3", tmp_path_factory.mktemp("mtp_v3"))
    ref = RefMTP(model.hf, seed=11)
    ref.write_into(model.path)
    return model, model.path, ref


@pytest.fixture(scope="module")
def reference(llama):
    return [o.token_ids for o in run(make_engine(llama[0].path), PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def trained(llama, tmp_path_factory):
    return train_mtp(LLMTrainingHost(), str(llama[0].path), str(tmp_path_factory.mktemp("mtp_trained")), {
        "num_prompts": 32, "max_tokens": 32, "epochs": 6, "lr": 3e-3, "device": "cpu"})


# -- the module computes the published equations ------------------------------------------------------
@pytest.mark.parametrize("target", ["llama", "deepseek"])
@pytest.mark.parametrize("kvcache", [{}, PAGED], ids=["contiguous", "paged"])
def test_draft_distributions_equal_a_float64_reference(request, target, kvcache):
    _, folder, ref = request.getfixturevalue(target)
    if target == "deepseek" and kvcache:
        kvcache = {**kvcache, "block_size": 16}
    engine = make_engine(folder, {"method": "mtp", "num_tokens": 2}, **({"kvcache": kvcache} if kvcache else {}))
    seen = _recording(engine)
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=s) for s in range(3)]
    run(engine, PROMPTS, params)
    checked = 0
    for tokens, drafts, probs in seen:
        if not drafts:
            continue
        for depth, logits in enumerate(_chain(ref, tokens, drafts)):
            torch.testing.assert_close(probs[depth].double(), logits.softmax(-1), atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked >= 8


def test_greedy_drafts_equal_the_reference_chain(llama, reference):
    _, folder, ref = llama
    engine = make_engine(folder, {"method": "mtp", "num_tokens": 3}, kvcache=PAGED)
    seen = _recording(engine)
    outs = run(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference  # the target decides every token
    for tokens, drafts, _ in seen[::2]:
        expected = []
        for logits in _chain(ref, tokens, drafts):
            expected.append(int(logits.argmax()))
        assert drafts == expected


def test_qwen3_next_layout_loads(llama, tmp_path):
    """The same module under Qwen3-Next's names (``mtp.fc``, ``mtp.layers.0``, shared norms)."""
    import shutil

    model, _, ref = llama
    folder = tmp_path / "q"
    shutil.copytree(model.path, folder)
    ref.write_into(folder, layout="qwen3_next")
    engine = make_engine(folder, {"method": "mtp", "num_tokens": 2})
    seen = _recording(engine)
    run(engine, PROMPTS[:1], [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0)])
    tokens, drafts, probs = next(s for s in seen if s[1])
    torch.testing.assert_close(probs[0].double(), _chain(ref, tokens, drafts)[0].softmax(-1), atol=2e-5, rtol=1e-4)


# -- bad input --------------------------------------------------------------------------------------
def test_a_model_without_mtp_weights_is_refused(llama, tmp_path):
    model = llama[0]
    with pytest.raises(ConfigError, match=r"holds no multi-token-prediction weights.*train-drafter --method mtp"):
        make_engine(model.path, {"method": "mtp"})
    folder = tmp_path / "declared"
    import shutil

    shutil.copytree(model.path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(ConfigError, match="transformers drops them"):
        make_engine(folder, {"method": "mtp"})
    with pytest.raises(ConfigError, match=r"module=1, but .* holds MTP module\(s\) \[0\]"):
        make_engine(llama[1], {"method": "mtp", "module": 1})


def test_a_module_missing_a_tensor_is_named(llama, tmp_path):
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "partial"
    shutil.copytree(llama[1], folder)
    tensors = load_file(folder / "mtp.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "mtp.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.2\.mlp\.down_proj\.weight"):
        make_engine(folder, {"method": "mtp"})


def test_a_folder_for_another_model_is_refused(llama, trained, tmp_path):
    import shutil

    folder = tmp_path / "other"
    shutil.copytree(trained.folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    with pytest.raises(ConfigError, match="hidden_size=128, the target 64"):
        make_engine(llama[0].path, {"method": "mtp", "path": str(folder)})


# -- training -------------------------------------------------------------------------------------
def test_trained_module_drafts_accepted_tokens_exactly(llama, reference, trained):
    assert trained.accuracy_after > trained.accuracy_before
    from safetensors.torch import load_file

    names = set(load_file(trained.folder / "model.safetensors"))
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.input_layernorm.weight",
            "model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"} <= names
    engine = make_engine(llama[0].path, {"method": "mtp", "path": str(trained.folder), "num_tokens": 3})
    outs = run(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.speculator.num_accepted > 0
    assert sum(o.metrics.num_target_forwards for o in outs) < sum(len(o.token_ids) for o in outs)


def test_train_drafter_cli(llama, reference, tmp_path):
    out = tmp_path / "m"
    assert main(["train-drafter", "--method", "mtp", str(llama[0].path), str(out),
                 "-o", "num_prompts=4", "-o", "max_tokens=8", "-o", "epochs=1"]) == 0
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    engine = make_engine(llama[0].path, {"method": "mtp", "path": str(out), "num_tokens": 2})
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference


# -- sampling keeps the target's distribution ---------------------------------------------------------
@pytest.fixture(scope="module")
def pair_distribution(llama):
    return pair_distribution_of(llama[0].hf)


def _pair_counts(llama, trained, expected: dict, num: int):
    engine = make_engine(llama[0].path, {"method": "mtp", "path": str(trained.folder), "num_tokens": 2},
                         kvcache=PAGED, scheduler={"backend": "continuous", "max_num_seqs": 64})
    return pair_counts(engine, expected, num)


def test_sampled_continuations_follow_the_target(llama, trained, pair_distribution):
    counts, probs = _pair_counts(llama, trained, pair_distribution, 1000)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_biased_verifier_is_caught(llama, trained, pair_distribution, monkeypatch):
    monkeypatch.setattr(kit_sampling, "residual_distribution", lambda p, q: p)
    counts, probs = _pair_counts(llama, trained, pair_distribution, 1000)
    assert chi_square_pvalue(counts, probs) < 1e-3



# -- a target whose LM head stays packed (GGUF blocks held by the quant method) -------------------------
def test_mtp_trains_and_drafts_over_a_packed_head(tmp_path):
    """The demo model's case (a GGUF read without dequantizing: the tied head stays packed)."""
    from support.gguf_fixtures import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tied=True)
    prompts = [[5, 9, 13, 7, 22, 31], [40, 3, 17]]
    plain = [o.token_ids for o in run(make_engine(path), prompts, GREEDY)]
    out = train_mtp(LLMTrainingHost(), str(path), str(tmp_path / "mtp"),
                    {"num_prompts": 4, "max_tokens": 8, "epochs": 1, "device": "cpu"})
    engine = make_engine(path, {"method": "mtp", "path": str(out.folder), "num_tokens": 2})
    assert [o.token_ids for o in run(engine, prompts, GREEDY)] == plain
    assert engine.speculator.num_drafted > 0
