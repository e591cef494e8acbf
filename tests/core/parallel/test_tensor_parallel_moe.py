"""Tensor and expert parallelism of MoE models on gloo (CPU): TP=2 (experts split by width, or
whole experts per rank with ``expert_parallel``) gives what TP=1 gives; each rank reads only its
slices / experts; the expert-parallel block's partial sums add up to the whole block.
Dense models, quantized checkpoints and failures: test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import one_torch_thread  # noqa: F401
from support.tensor_parallel import ENGINE, assert_same, children, run, tp

from lmplug import LLM, ModelLoadError


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "ep"])
@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_moe_tp2_matches_tp1(name, expert_parallel, tmp_path):
    """MoE at TP=2 gives TP=1's tokens and logprobs. ``width``: every expert split by its width
    across the ranks (gate/up rows, down columns; the routed output all-reduced). ``ep``
    (``parallel.expert_parallel``): each rank holds whole experts [rank*E/2, (rank+1)*E/2) and runs
    only the pairs routed to them. Either way the router is replicated and Qwen2-MoE's shared expert
    (behind its sigmoid gate) and its dense layer are split like any MLP. Each rank holds half of
    the routed experts' bytes."""
    from support.moe_models import TinyMoE

    path = TinyMoE(name, tmp_path).path
    llm = LLM(str(path), **ENGINE)
    single, one = run(llm, max_tokens=8), llm.engine.memory
    parallel_cfg = {"parallel": {"tensor_parallel_size": 2, "expert_parallel": expert_parallel}}
    with LLM(str(path), **ENGINE, **parallel_cfg) as parallel:
        moe = parallel.engine.model_config.moe
        experts = parallel.engine.parts.model.layers[0].mlp.experts  # rank 0's
        if expert_parallel:
            assert (experts.first_expert, experts.num_experts) == (0, moe.num_experts // 2)
            assert experts.intermediate == moe.intermediate_size
            assert experts.w_gate_up.shape == (moe.num_experts // 2, 2 * moe.intermediate_size, 64)
        else:
            assert experts.num_experts == moe.num_experts
            assert experts.intermediate == moe.intermediate_size // 2
        assert_same(single, run(parallel, max_tokens=8))
        mem = parallel.engine.memory
        assert mem["expert_parallel"] is expert_parallel
        # E x 3 x h x I fp32 weights per sparse layer in one process; half of them per rank
        sparse = sum(moe.is_sparse(i) for i in range(parallel.engine.model_config.num_layers))
        whole = sparse * moe.num_experts * 3 * 64 * moe.intermediate_size * 4
        assert one["expert_bytes_per_rank"] == [whole]
        assert mem["expert_bytes_per_rank"] == [whole // 2, whole // 2]
        assert max(mem["weight_bytes_per_rank"]) < 0.6 * one["weight_bytes_per_rank"][0]
    if name == "qwen2_moe" and not expert_parallel:
        # quantized experts are not split by width yet: a clear load error, no stray worker
        with pytest.raises(ModelLoadError, match="quantized MoE expert, which tensor parallelism does not split"):
            LLM(str(path), **ENGINE, **tp(2), quant={"method": "rtn", "group_size": 8})
        assert children() == []


def test_moe_ep_quantized_experts(tmp_path):
    """Expert parallel with RTN-quantized experts (whole experts need no re-slicing): TP=2 == TP=1
    with the same quant method, for experts dequantized at load and kept packed (reference
    backend, per-expert quantized Linears)."""
    from support.moe_models import TinyMoE

    path = TinyMoE("qwen2_moe", tmp_path).path
    ep = {"parallel": {"tensor_parallel_size": 2, "expert_parallel": True}}
    for quant in ({"method": "rtn", "group_size": 8},
                  {"method": "rtn", "group_size": 8, "dequantize_at_load": False}):
        single = run(LLM(str(path), **ENGINE, quant=quant), max_tokens=6)
        with LLM(str(path), **ENGINE, **ep, quant=quant) as parallel:
            experts = parallel.engine.parts.model.layers[0].mlp.experts
            assert experts.num_experts == 2 and experts.packed is (quant.get("dequantize_at_load") is False)
            assert_same(single, run(parallel, max_tokens=6))


class _LocalState:
    """A rank's ``ParallelState`` whose all-reduce is left to the test (it sums the ranks itself)."""

    @staticmethod
    def make(rank: int, world_size: int, expert_parallel: bool = True):
        from lmplug.parallel import ParallelState

        class NoReduce(ParallelState):
            def all_reduce(self, x):
                return x

        return NoReduce(rank=rank, world_size=world_size, expert_parallel=expert_parallel)


def _load_rank(path, state, read_log=None):
    """Rank ``state``'s MoE model, loaded (lazily) from ``path``; every indexed slice is logged."""
    from lmplug_models.moe import MoEForCausalLM
    from lmplug_moe.reference import ReferenceMoE

    from lmplug.api import BackendOptions
    from lmplug.engine.architecture import model_config_of
    from lmplug.interfaces.quant import Unquantized
    from lmplug.loading import open_source
    from lmplug.loading.weights import load_weights

    source = open_source(path)
    slices = source.iter_slices

    class Spy:
        def __init__(self, name, piece):
            self.name, self.piece = name, piece

        def get_shape(self):
            return self.piece.get_shape()

        def __getitem__(self, index):
            if read_log is not None:
                read_log.append((self.name, index))
            return self.piece[index]

    if state.is_parallel:
        source.iter_slices = lambda: ((n, Spy(n, t)) for n, t in slices())
        source.iter_tensors = None  # the whole-tensor reader must not be used
    model = MoEForCausalLM(model_config_of(source.hf_config), torch.float32, Unquantized(), None, 128,
                           moe=ReferenceMoE(BackendOptions()), parallel=state)
    load_weights(model, source, parallel=state)
    return model


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "tf5_stacked"])
def test_ep_rank_reads_only_its_experts(stacked, tmp_path):
    """In process: rank 1 of 2 (expert parallel) of tiny Mixtral (8 experts) loads experts 4..7
    only. Per-expert checkpoint names: the other experts' tensors are never read (skipped by
    name); transformers-5 stacked ``experts.gate_up_proj [E, 2I, h]``: only the rank's experts are
    read from it. The loaded experts equal HF's."""
    from support.moe_models import TinyMoE, save_stacked

    tiny = TinyMoE("mixtral", tmp_path)
    path = save_stacked(tiny.hf, tmp_path / "v5") if stacked else tiny.path
    log = []
    model = _load_rank(path, _LocalState.make(1, 2), log)
    expert_reads = [(n, i) for n, i in log if ".experts." in n]
    if stacked:
        assert expert_reads and all(i[0] == slice(e, e + 1) and 4 <= e < 8
                                    for _, i in expert_reads for e in [i[0].start])
    else:
        read = {int(n.split(".experts.")[1].split(".")[0]) for n, _ in expert_reads}
        assert read == {4, 5, 6, 7}
    hf = {n: p for n, p in tiny.hf.named_parameters()}
    for layer in range(2):
        experts = model.layers[layer].mlp.experts
        assert (experts.first_expert, experts.num_experts) == (4, 4)
        gate_up, down = (next(p for n, p in hf.items() if f"layers.{layer}." in n and n.endswith(f"experts.{proj}"))
                         for proj in ("gate_up_proj", "down_proj"))
        torch.testing.assert_close(experts.w_gate_up, gate_up[4:], rtol=0, atol=0)
        torch.testing.assert_close(experts.w_down, down[4:], rtol=0, atol=0)


def test_width_split_reads_stacked_experts_lazily(tmp_path):
    """Without expert parallelism, rank 1 of 2 reads from a transformers-5 stacked checkpoint only
    its half of every expert's width (gate rows [I/2, I), up rows [3I/2, 2I), down columns [I/2, I))."""
    from support.moe_models import TinyMoE, save_stacked

    tiny = TinyMoE("mixtral", tmp_path)
    log = []
    model = _load_rank(save_stacked(tiny.hf, tmp_path / "v5"), _LocalState.make(1, 2, expert_parallel=False), log)
    inter = 128 // 2
    rows = {(i[1].start, i[1].stop) for n, i in log if n.endswith("gate_up_proj")}
    assert rows == {(inter, 2 * inter), (3 * inter, 4 * inter)}
    assert {(i[2].start, i[2].stop) for n, i in log if n.endswith("down_proj")} == {(inter, 2 * inter)}
    hf = {n: p for n, p in tiny.hf.named_parameters()}
    gate_up, down = (next(p for n, p in hf.items() if "layers.1." in n and n.endswith(f"experts.{proj}"))
                     for proj in ("gate_up_proj", "down_proj"))
    experts = model.layers[1].mlp.experts
    torch.testing.assert_close(experts.w_gate_up, torch.cat([gate_up[:, inter:2 * inter], gate_up[:, 3 * inter:]], 1),
                               rtol=0, atol=0)
    torch.testing.assert_close(experts.w_down, down[:, :, inter:], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_ep_block_partial_sums(backend, tmp_path):
    """The two expert-parallel ranks' Qwen2-MoE blocks (2 of 4 experts each, shared expert split by
    width) sum to the one-process block, with either moe backend (the block hands each only the
    pairs routed to its experts; fused: the Triton kernels, interpreted)."""
    from lmplug_moe.fused import FusedMoE, FusedMoEOptions
    from support.moe_models import TinyMoE

    from lmplug.parallel import single

    path = TinyMoE("qwen2_moe", tmp_path).path
    blocks = [_load_rank(path, state).layers[0].mlp
              for state in (single(), _LocalState.make(0, 2), _LocalState.make(1, 2))]
    if backend == "fused":
        for block in blocks:
            block.backend = FusedMoE(FusedMoEOptions())
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, rank0, rank1 = (block(x) for block in blocks)
    assert blocks[1].experts.num_experts == 2 and blocks[2].experts.first_expert == 2
    assert rank0.abs().sum() > 0 and rank1.abs().sum() > 0
    torch.testing.assert_close(rank0 + rank1, want, atol=1e-5, rtol=1e-5)
