"""Medusa: the FasterDecoding head format (names, config, .pt and .safetensors), heads
trained by ``lmplug train-drafter`` on a tiny random Llama, and greedy outputs unchanged
with them in the engine."""

from __future__ import annotations

import json

import pytest
import torch
from lmplug_speculative.medusa_heads import MedusaHeads, load_heads, save_heads
from lmplug_speculative.medusa_train import train_medusa
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import check_observed_hidden, make_engine, run

from lmplug.cli import main
from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.train_host import LLMTrainingHost


class _ResBlock(torch.nn.Module):  # FasterDecoding's own layout, written out independently
    def __init__(self, h):
        super().__init__()
        self.linear = torch.nn.Linear(h, h)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def test_loads_the_fasterdecoding_layout(tmp_path):
    torch.manual_seed(0)
    h, vocab = 16, 40
    ref = torch.nn.ModuleList([torch.nn.Sequential(_ResBlock(h), _ResBlock(h), torch.nn.Linear(h, vocab, bias=False))
                               for _ in range(3)])
    state = ref.state_dict()
    assert "0.1.linear.bias" in state and "2.2.weight" in state
    torch.save(state, tmp_path / "medusa_lm_head.pt")  # no config.json: counts come from the names
    heads = load_heads(tmp_path)
    x = torch.randn(5, h)
    assert len(heads) == 3 and heads.num_layers == 2
    for i in range(3):
        torch.testing.assert_close(heads.blocks(x, 3)[i] @ heads.head_weights()[i].T, ref[i](x))


def test_save_round_trip(tmp_path):
    heads = MedusaHeads(16, 40, num_heads=2, num_layers=1)
    torch.nn.init.normal_(heads[1][0].linear.weight)
    save_heads(heads, tmp_path, dtype=torch.float32, extra_config={"base_model_name_or_path": "m"})
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "m"}
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "medusa_lm_head.safetensors")) == {
        "0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}
    again = load_heads(tmp_path)
    for a, b in zip(heads.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_missing_heads_name_the_trainer(tmp_path):
    with pytest.raises(ConfigError, match="train-drafter --method medusa"):
        load_heads(tmp_path)


# -- trained on a tiny model, used in the engine --------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("medusa"), tokenizer=True)


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads")
    return train_medusa(LLMTrainingHost(), str(model.path), str(out), {
        "num_heads": 2, "num_prompts": 64, "max_tokens": 32, "epochs": 6, "lr": 5e-3, "device": "cpu"})


def test_training_improves_the_heads(trained):
    assert trained.accuracy_after[0] > trained.accuracy_before[0]


@pytest.mark.parametrize("kvcache", [{}, {"backend": "paged", "block_size": 8, "num_blocks": 100}],
                         ids=["contiguous", "paged"])
def test_greedy_outputs_unchanged_with_medusa(model, trained, kvcache):
    prompts = [prompt_ids(6, 41), prompt_ids(25, 42)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run(make_engine(model.path), prompts, params)
    engine = make_engine(model.path, {"method": "medusa", "heads": str(trained.folder), "num_tokens": 2},
                         **({"kvcache": kvcache} if kvcache else {}))
    assert [o.token_ids for o in run(engine, prompts, params)] == [o.token_ids for o in plain]
    assert engine.speculator.num_accepted > 0
    assert engine.speculator.drafter._shares_lm_head  # heads trained here keep the target's lm_head


def test_sampling_with_medusa_returns_distributions(model, trained):
    engine = make_engine(model.path, {"method": "medusa", "heads": str(trained.folder), "num_tokens": 2})
    params = [SamplingParams(temperature=0.8, top_k=10, max_tokens=16, ignore_eos=True, seed=s) for s in range(4)]
    outs = run(engine, [prompt_ids(6, 50 + s) for s in range(4)], params)
    assert all(len(o.token_ids) == 16 for o in outs)
    assert engine.speculator.num_drafted > 0


def test_train_drafter_cli(model, tmp_path, capsys):
    assert main(["train-drafter", "--method", "medusa", str(model.path), str(tmp_path / "h"),
                 "-o", "num_heads=1", "-o", "num_prompts=2", "-o", "max_tokens=8", "-o", "epochs=1"]) == 0
    assert (tmp_path / "h" / "medusa_lm_head.safetensors").exists()
    assert main(["train-drafter", "--method", "ngram", str(model.path), str(tmp_path / "x")]) == 2
    assert "has nothing to train" in capsys.readouterr().err


def test_observed_hidden_state_is_the_one_behind_the_last_token(model, trained):
    """After every step the drafter holds, per sequence, the target's hidden state at the
    position whose logits chose the last token (checked against a fresh prefill)."""
    engine = make_engine(model.path, {"method": "medusa", "heads": str(trained.folder), "num_tokens": 2})
    checked = check_observed_hidden(engine, [prompt_ids(6, 41), prompt_ids(25, 42)],
                                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert checked > 10 and engine.speculator.num_accepted > 0
