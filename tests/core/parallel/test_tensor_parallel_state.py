"""Tensor parallelism for state layers on gloo (CPU): Mamba2, MiniMax (lightning attention) and
Qwen3-Next (gated DeltaNet) at TP=2 give what TP=1 gives, with each rank holding its heads' state.

The tiny random checkpoints are the parity tests' (tests/plugins/models/test_*_parity.py), whose TP=1
runs match transformers. Runs use the paged KV cache and the continuous scheduler with a small
token budget (``support.tensor_parallel.ENGINE``), so prompts are prefilled in chunks and decodes
share steps with them: every state carries across steps on both ranks. The expected per-rank state
sizes are written from the configs here, and a rank's slices of the checkpoint are compared with
slices of transformers' own parameters.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import _BASE, build_hf_model, one_torch_thread  # noqa: F401
from support.tensor_parallel import ENGINE, assert_same, children, run, tp

from lmplug import LLM
from lmplug.errors import ModelLoadError

pytestmark = pytest.mark.hf

F32 = 4  # bytes of a float32 state element (the engine runs float32 here)

_MAMBA2_BASE = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "expand": 2, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.1}
MAMBA2 = {
    # one group of B/C: both ranks keep it, and the gated norm's one group spans both ranks;
    # tied head: the vocabulary-split embedding is the LM head
    "mamba2_one_group": {"num_heads": 4, "head_dim": 32, "state_size": 8, "n_groups": 1, "conv_kernel": 3,
                         "use_conv_bias": False, "chunk_size": 5, "num_hidden_layers": 3,
                         "tie_word_embeddings": True},
    # 8 heads over 2 groups: one group (and one norm group) per rank
    "mamba2_groups_split": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "conv_kernel": 4,
                            "chunk_size": 8, "tie_word_embeddings": False},
}
# layer 0 lightning, 4 heads of 16 (2 KV heads in the softmax layer), 4 experts top-2, residual factors
MINIMAX = {"num_hidden_layers": 3, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
           "block_size": 8, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
           "full_attn_alpha_factor": 0.7, "full_attn_beta_factor": 1.3, "linear_attn_alpha_factor": 1.1,
           "linear_attn_beta_factor": 0.8, "mlp_alpha_factor": 0.9, "mlp_beta_factor": 1.2}
_QWEN3_NEXT_BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 256,
                    "rms_norm_eps": 1e-6, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2,
                    "pad_token_id": 0, "tie_word_embeddings": False, "linear_conv_kernel_dim": 4,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts_per_tok": 2}
QWEN3_NEXT = {
    # 2 key heads of 16 over 4 value heads of 8 (one key head and its two value heads per rank), GQA
    # attention with q/k/v/o biases and half of each head rotated, MoE with a gated shared expert
    "qwen3_next": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
                   "num_experts": 4, "mlp_only_layers": [1], "norm_topk_prob": True, "attention_bias": True,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # 3 key heads: two ranks cannot share them
    "qwen3_next_odd": {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"],
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
                       "linear_num_key_heads": 3, "linear_num_value_heads": 3, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 16, "num_experts": 0,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 1.0}},
}


def mamba2_hf(name: str):
    from transformers import AutoModelForCausalLM, Mamba2Config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Mamba2Config(**{**_MAMBA2_BASE, **MAMBA2[name]}), dtype=torch.float32)
    with torch.no_grad():  # norms and conv biases random too, so a mix-up shows
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("conv1d.bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return hf.eval()


def save_model(root, name: str):
    """Build (once per session) and save model ``name``; its folder."""
    from transformers import AutoConfig

    path = root / name
    if path.exists():
        return path
    if name in MAMBA2:
        hf = mamba2_hf(name)
    elif name == "minimax":
        hf = build_hf_model(AutoConfig.for_model("minimax", **{**_BASE, **MINIMAX}))
    else:
        cfg = AutoConfig.for_model("qwen3_next", **{**_QWEN3_NEXT_BASE, **QWEN3_NEXT[name]})
        cfg._attn_implementation = "eager"
        hf = build_hf_model(cfg)
    hf.save_pretrained(path)
    return path


def local_state_bytes(name: str, world: int) -> int:
    """One sequence's state bytes on a rank of ``world``: the configs' sizes, heads split."""
    if name in MAMBA2:
        c = {**_MAMBA2_BASE, **MAMBA2[name]}
        inner, groups, n = c["expand"] * c["hidden_size"], c["n_groups"], c["state_size"]
        local_groups = groups // world if groups % world == 0 else 1
        conv = (inner // world + 2 * local_groups * n) * (c["conv_kernel"] - 1)
        ssm = c["num_heads"] // world * c["head_dim"] * n
        return c["num_hidden_layers"] * (conv + ssm) * F32
    if name == "minimax":
        layers = MINIMAX["layer_types"].count("linear_attention")
        return layers * (_BASE["num_attention_heads"] // world) * MINIMAX["head_dim"] ** 2 * F32
    c = {**_QWEN3_NEXT_BASE, **QWEN3_NEXT[name]}
    hk, hv = c["linear_num_key_heads"] // world, c["linear_num_value_heads"] // world
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = (2 * hk * dk + hv * dv) * (c["linear_conv_kernel_dim"] - 1)
    return c["layer_types"].count("linear_attention") * (conv + hv * dk * dv) * F32


@pytest.fixture(scope="class", params=[
    "mamba2_one_group",
    pytest.param("mamba2_groups_split", marks=pytest.mark.slow),
    pytest.param("minimax", marks=pytest.mark.slow),
    pytest.param("qwen3_next", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """(name, TP=1 outputs, TP=2 engine, TP=1 engine) for one tiny model."""
    path = save_model(tmp_path_factory.getbasetemp(), request.param)
    single = LLM(str(path), **ENGINE)
    parallel = LLM(str(path), **ENGINE, **tp(2))
    yield request.param, run(single), parallel, single
    parallel.close()


class TestStateTP2:
    """One TP=2 engine per model, shared by the checks below (a process runs one tensor-parallel
    group at a time)."""

    def test_tp2_matches_tp1(self, pair):
        _, expected, parallel, _ = pair
        assert_same(expected, run(parallel))

    def test_each_rank_holds_its_heads_state(self, pair):
        name, _, parallel, single = pair
        whole, mine = single.engine.kv.spec.state_bytes_per_seq, parallel.engine.kv.spec.state_bytes_per_seq
        assert whole == local_state_bytes(name, 1)
        assert mine == local_state_bytes(name, 2)
        assert 0.45 * whole <= mine <= 0.6 * whole


def mixer_backend():
    from lmplug_mixer.mixers import TorchMixer

    from lmplug.api import BackendOptions

    return TorchMixer(BackendOptions())


def _load_rank(path, rank: int, world: int):
    """Rank ``rank`` of ``world``'s shard of the checkpoint at ``path``, read lazily, in process."""
    from lmplug_models.mamba2 import Mamba2ForCausalLM

    from lmplug.engine.architecture import model_config_of
    from lmplug.interfaces.quant import Unquantized
    from lmplug.loading import open_source
    from lmplug.loading.weights import load_weights
    from lmplug.parallel import ParallelState
    source = open_source(path)
    source.iter_tensors = None  # the whole-tensor reader must not be used
    state = ParallelState(rank=rank, world_size=world)
    model = Mamba2ForCausalLM(model_config_of(source.hf_config), torch.float32, Unquantized(), None, 128,
                              parallel=state, mixer=mixer_backend())
    load_weights(model, source, parallel=state)
    return model


@pytest.mark.parametrize("name", list(MAMBA2))
def test_mamba2_rank_reads_its_ranges(name, tmp_path):
    """Rank 1 of 2 holds, of in_proj [z | x | B | C | dt] and the conv's [x | B | C] rows, its heads'
    channels and its B/C group (the one group, when there is one), read as ranges of the checkpoint."""
    hf = mamba2_hf(name)
    hf.save_pretrained(tmp_path)
    c = hf.config
    mixer = _load_rank(tmp_path, 1, 2).layers[1].mixer
    ref = {k.removeprefix("backbone.layers.1.mixer."): v for k, v in hf.named_parameters()}
    inner, heads, gn = c.expand * c.hidden_size, c.num_heads, c.n_groups * c.state_size
    mine = slice(inner // 2, inner)  # the second half of the channels, heads, and groups (or all of one)
    my_heads = slice(heads // 2, heads)
    bc = slice(gn // 2, gn) if c.n_groups > 1 else slice(0, gn)
    w = ref["in_proj.weight"]
    z, x, B, C, dt = w.split([inner, inner, gn, gn, heads])
    torch.testing.assert_close(mixer.in_proj.weight, torch.cat([z[mine], x[mine], B[bc], C[bc], dt[my_heads]]),
                               rtol=0, atol=0)
    cx, cB, cC = ref["conv1d.weight"].split([inner, gn, gn])
    torch.testing.assert_close(mixer.conv_weight, torch.cat([cx[mine], cB[bc], cC[bc]]), rtol=0, atol=0)
    if c.use_conv_bias:
        bx, bB, bC = ref["conv1d.bias"].split([inner, gn, gn])
        torch.testing.assert_close(mixer.conv_bias, torch.cat([bx[mine], bB[bc], bC[bc]]), rtol=0, atol=0)
    for param in ("A_log", "D", "dt_bias"):
        torch.testing.assert_close(getattr(mixer, param), ref[param][my_heads], rtol=0, atol=0)
    torch.testing.assert_close(mixer.norm_weight, ref["norm.weight"][mine], rtol=0, atol=0)
    torch.testing.assert_close(mixer.out_proj.weight, ref["out_proj.weight"][:, mine], rtol=0, atol=0)


def test_mamba2_groups_the_ranks_cannot_share():
    from lmplug_models.mamba2 import Mamba2ForCausalLM
    from transformers import Mamba2Config

    from lmplug.engine.architecture import model_config_of
    from lmplug.interfaces.quant import Unquantized
    from lmplug.parallel import ParallelState

    # 6 heads over 3 groups: 2 ranks would split a group's heads between them
    cfg = Mamba2Config(**{**_MAMBA2_BASE, "hidden_size": 48, "num_heads": 6, "head_dim": 16, "n_groups": 3})
    with pytest.raises(ModelLoadError, match=r"'n_groups' \(3\) must divide parallel.tensor_parallel_size \(2\)"):
        Mamba2ForCausalLM(model_config_of(cfg.to_dict()), torch.float32, Unquantized(), None, 128,
                          parallel=ParallelState(rank=0, world_size=2), mixer=mixer_backend())


def test_key_heads_the_ranks_cannot_share(tmp_path):
    path = save_model(tmp_path, "qwen3_next_odd")
    with pytest.raises(ModelLoadError, match=r"'linear_num_key_heads' \(3\) must be divisible by "
                                             r"parallel.tensor_parallel_size \(2\)"):
        LLM(str(path), **ENGINE, **tp(2))
    assert children() == []  # the workers that started are gone


def test_range_shard_reads_each_range_whole_packed_elements():
    """``RangeShard``: a shard's ranges are read along the quant method's output axis, in packed
    elements, and concatenated; a plain parameter's along its rows; a range that would split a
    packed element is refused."""
    from types import SimpleNamespace

    from lmplug.kit.sharding import RangeShard, rank_piece

    class Owner(RangeShard):
        def __init__(self, ranges: dict) -> None:
            self.quant = SimpleNamespace(shard_layout=lambda owner, name: (1, 2))  # 2 output features a column
            self.tp_ranges = ranges

    owner = Owner({"proj": ((2, 4), (10, 2)), "conv": ((1, 2), (5, 1))})
    t = torch.arange(3 * 8).view(3, 8)  # 16 output features along dim 1, packed in pairs
    piece = rank_piece(None, "x.weight", owner, "weight", "proj", t)
    torch.testing.assert_close(piece, torch.cat([t[:, 1:3], t[:, 5:6]], dim=1), rtol=0, atol=0)
    rows = torch.arange(8 * 2).view(8, 2)
    torch.testing.assert_close(rank_piece(None, "x.conv", owner, "conv", None, rows),
                               torch.cat([rows[1:3], rows[5:6]]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="whole packed elements of 2"):
        rank_piece(None, "x.weight", Owner({"proj": ((3, 2),)}), "weight", "proj", t)


@pytest.mark.slow
def test_tp4_shares_each_group_between_two_ranks(tmp_path):
    """TP=4 over 2 B/C groups: each rank keeps the one group its heads read (ranks 0-1 group 0,
    ranks 2-3 group 1), and each norm group's sum of squares is taken over its two ranks."""
    path = save_model(tmp_path, "mamba2_groups_split")
    expected = run(LLM(str(path), **ENGINE), max_tokens=6)
    llm = LLM(str(path), **ENGINE, **tp(4))
    try:
        assert_same(expected, run(llm, max_tokens=6))
        assert llm.engine.kv.spec.state_bytes_per_seq == local_state_bytes("mamba2_groups_split", 4)
    finally:
        llm.close()
