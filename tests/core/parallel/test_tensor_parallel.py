"""Tensor parallelism on gloo (CPU): TP=N gives what TP=1 gives, shards memory, fails cleanly.

Each TP engine spawns its workers (a few seconds of imports each), so one engine per model is
shared by the checks on it (module-scoped fixtures). References: the same model at TP=1 (itself
HF-parity tested in test_hf_parity.py) and, for the quantized checkpoints, HF transformers with the
dequantized weights. Runs use the paged KV cache and the continuous scheduler with a small token
budget, so prompts are prefilled in chunks and decodes share steps with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
from support.hf_models import get_model, hf_greedy, one_torch_thread  # noqa: F401
from support.quant_checkpoints import FORMATS, write_quantized
from support.tensor_parallel import ENGINE, PROMPTS, assert_same, children, run, save_model, tp

from lmplug import LLM, ConfigError, SamplingParams
from lmplug.parallel import TensorParallelError

# -- models -----------------------------------------------------------------------------------------


@pytest.fixture(scope="class", params=["llama_gqa", "llama_mqa_tied", "qwen2_bias"])
def pair(request, tmp_path_factory):
    """(TP=1 outputs, TP=2 engine, TP=1 engine) for one tiny model."""
    root = tmp_path_factory.getbasetemp() / "tp_models"
    if request.param == "llama_gqa":  # 4 query heads over 2 KV heads: one KV head per rank
        path = get_model("llama", root).path
    elif request.param == "qwen2_bias":  # q/k/v biases (column-parallel), o_proj without
        path = get_model("qwen2", root).path
    else:  # 1 KV head: replicated on both ranks; tied embeddings: the LM head is the vocab-split table
        path = save_model(root, "llama_mqa_tied", num_key_value_heads=1, tie_word_embeddings=True)
    single = LLM(str(path), **ENGINE)
    parallel = LLM(str(path), **ENGINE, **tp(2))
    yield run(single), parallel, single
    parallel.close()


class TestTP2:
    """One TP=2 engine per model, shared by the checks below (closed when the class ends: a process
    runs one tensor-parallel group at a time)."""

    def test_tp2_matches_tp1(self, pair):
        expected, parallel, _ = pair
        assert_same(expected, run(parallel))

    def test_seeded_samples_n2(self, pair):
        """n=2 seeded sampling: TP=2 runs the two sequences without forking the KV (a fork's block
        copies would happen in rank 0's pool only) and samples what TP=1 samples."""
        _, parallel, single = pair
        params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
        want = [[c.token_ids for c in o.outputs] for o in single.generate(PROMPTS[:2], params)]
        assert [[c.token_ids for c in o.outputs] for o in parallel.generate(PROMPTS[:2], params)] == want

    def test_memory_per_rank(self, pair):
        _, parallel, single = pair
        mem, one = parallel.engine.memory, single.engine.memory
        assert mem["tensor_parallel_size"] == 2 and len(mem["weight_bytes_per_rank"]) == 2
        model = single.engine.model_config
        local_kv = max(model.num_kv_heads // 2, 1)
        # q, o, gate/up/down, the embedding and the LM head are halved; K/V keep the rank's KV heads;
        # norms and the RoPE tables are whole on every rank
        h, q, kv, inter = model.hidden_size, model.num_heads * model.head_dim, local_kv * model.head_dim, \
            model.intermediate_size
        per_layer = h * q // 2 + 2 * h * kv + q // 2 * h + 3 * h * inter // 2 + 2 * h
        if model.attention_bias:
            per_layer += q // 2 + 2 * kv
        vocab = model.vocab_size // 2 * h * (1 if model.tie_word_embeddings else 2)
        buffers = sum(b.numel() * b.element_size() for b in single.engine.parts.model.buffers())
        expected = 4 * (model.num_layers * per_layer + h + vocab) + buffers
        assert mem["weight_bytes_per_rank"] == [expected, expected]
        assert expected < 0.6 * one["weight_bytes_per_rank"][0]
        expected_kv = one["kv_bytes_per_token_per_rank"][0] * local_kv // model.num_kv_heads
        assert mem["kv_bytes_per_token_per_rank"] == [expected_kv, expected_kv]
        # rank 0 really holds only its shard
        layer = parallel.engine.parts.model.layers[0]
        assert layer.self_attn.num_heads == model.num_heads // 2 and layer.self_attn.num_kv_heads == local_kv
        assert layer.mlp.gate_up_proj.weight.shape == (model.intermediate_size, model.hidden_size)


def test_rank_reads_its_slices(tmp_path):
    """In process, no group needed: rank 1 of 2 builds its shard and loads it lazily from the
    safetensors; every split tensor is the matching slice of the HF model's."""
    from lmplug_models import LlamaForCausalLM

    from lmplug.engine.architecture import model_config_of
    from lmplug.interfaces.quant import Unquantized
    from lmplug.loading import open_source
    from lmplug.loading.weights import load_weights
    from lmplug.parallel import ParallelState

    tm = get_model("qwen2", tmp_path)
    source = open_source(tm.path)
    read = []
    slices = source.iter_slices
    source.iter_slices = lambda: ((n, read.append(n) or t) for n, t in slices())
    source.iter_tensors = None  # the whole-tensor reader must not be used
    state = ParallelState(rank=1, world_size=2)
    model = LlamaForCausalLM(model_config_of(source.hf_config), torch.float32, Unquantized(), None, 128,
                             parallel=state)
    load_weights(model, source, parallel=state)
    assert len(read) == len(source.tensor_names)
    hf = dict(tm.hf.named_parameters())
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    ref = lambda name: hf[f"model.layers.1.{name}"]
    q, kv = attn.q_size, attn.kv_size  # 2 heads of 4, 1 KV head of 2
    torch.testing.assert_close(attn.qkv_proj.weight, torch.cat([
        ref("self_attn.q_proj.weight")[q:2 * q], ref("self_attn.k_proj.weight")[kv:2 * kv],
        ref("self_attn.v_proj.weight")[kv:2 * kv]]), rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat([
        ref("self_attn.q_proj.bias")[q:2 * q], ref("self_attn.k_proj.bias")[kv:2 * kv],
        ref("self_attn.v_proj.bias")[kv:2 * kv]]), rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.weight, ref("self_attn.o_proj.weight")[:, q:], rtol=0, atol=0)
    inter = mlp.intermediate
    torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat([
        ref("mlp.gate_proj.weight")[inter:], ref("mlp.up_proj.weight")[inter:]]), rtol=0, atol=0)
    torch.testing.assert_close(mlp.down_proj.weight, ref("mlp.down_proj.weight")[:, inter:], rtol=0, atol=0)
    torch.testing.assert_close(model.embed_tokens.weight, hf["model.embed_tokens.weight"][256:], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head, hf["lm_head.weight"][256:], rtol=0, atol=0)


def test_tp3_pads_the_vocabulary(tmp_path):
    """N=3 with a 500-token vocabulary: each rank holds 167 rows (the last one padding), 2 of 6
    heads, 1 of 3 KV heads; the gathered logits are trimmed to 500 and match TP=1."""
    path = save_model(tmp_path, "h6_v500", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                      intermediate_size=192, vocab_size=500)
    prompts = [[t % 500 for t in p] for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    single = LLM(str(path), **ENGINE).generate(prompts, params)
    with LLM(str(path), **ENGINE, **tp(3)) as parallel:
        model = parallel.engine.parts.model
        assert model.embed_tokens.weight.shape[0] == 167 and model.lm_head.shape[0] == 167
        got = parallel.generate(prompts, params)
    for a, b in zip(single, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        lp_a = [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lp_b = [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(lp_b), torch.tensor(lp_a), atol=1e-4, rtol=0)


# -- quantized checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [
    "gptq_v1_actorder_g32",
    pytest.param("gptq8_v1_g32", marks=pytest.mark.slow),
    pytest.param("awq_g32", marks=pytest.mark.slow),
])
def test_quantized_tp2(fmt, tmp_path):
    """Packed tensors split along the right axes (qweight along the input for o/down, group
    scales/zeros with it, act-order scales kept whole, g_idx sliced): TP=2 == TP=1 == HF with the
    dequantized weights; packed (not dequantized-at-load) on the workers as well."""
    hf = write_quantized(get_model("llama", tmp_path / "base"), tmp_path / "model", fmt)
    method = FORMATS[fmt][0]["quant_method"]
    packed = {"quant": {"method": method, "dequantize_at_load": False, "kernel": "torch"}}
    single = run(LLM(str(tmp_path / "model"), **ENGINE), max_tokens=8)
    with LLM(str(tmp_path / "model"), **ENGINE, **tp(2), **packed) as parallel:
        layer = parallel.engine.parts.model.layers[0].mlp.down_proj
        assert not hasattr(layer, "weight") and layer.in_features == 64  # a packed row-parallel shard
        assert_same(single, run(parallel, max_tokens=8), atol=2e-4)
    assert single[1][0] == hf_greedy(hf, PROMPTS[1], 8)


# -- configuration errors ---------------------------------------------------------------------------

def test_experts_not_divisible_by_ep(tmp_path):
    """Expert parallel needs N to divide the routed experts (Qwen2-MoE: 4), not their width."""
    from support.moe_models import TinyMoE

    path = TinyMoE("qwen2_moe", tmp_path).path
    with pytest.raises(ConfigError, match=r"parallel.expert_parallel: parallel.tensor_parallel_size=3 does not "
                                          r"divide the 4 routed experts"):
        LLM(str(path), **ENGINE, parallel={"tensor_parallel_size": 3, "expert_parallel": True})
    assert children() == []  # refused before any worker started


def test_heads_not_divisible(tmp_path):
    path = get_model("llama", tmp_path).path
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size=3 does not divide the 4 attention heads"):
        LLM(str(path), **ENGINE, **tp(3))
    assert children() == []  # refused before any worker started


def test_intermediate_not_divisible(tmp_path):
    path = save_model(tmp_path, "odd", intermediate_size=130)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the intermediate size 130"):
        LLM(str(path), **ENGINE, **tp(4))


def test_bad_size_and_speculative(tmp_path):
    path = get_model("llama", tmp_path).path
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(str(path), **ENGINE, **tp(0))
    with pytest.raises(ConfigError, match="speculative decoding is not supported"):
        LLM(str(path), **ENGINE, **tp(2), speculative={"method": "ngram", "num_tokens": 2})
    assert children() == []


# -- failures ---------------------------------------------------------------------------------------------

def test_killed_worker_stops_the_group(tmp_path):
    """TP=4 over 2 KV heads (each replicated on two ranks) matches TP=1; then a worker killed with
    SIGKILL mid-generation ends the run with an error naming it within seconds, the other workers
    are stopped, and no process is left behind."""
    path = get_model("llama", tmp_path).path
    single = run(LLM(str(path), **ENGINE), max_tokens=6)
    llm = LLM(str(path), **ENGINE, **tp(4))
    assert_same(single, run(llm, max_tokens=6))
    procs = dict(llm.engine.parallel.procs)
    assert sorted(procs) == [1, 2, 3] and all(p.is_alive() for p in procs.values())
    engine = llm.engine
    engine.add_request("long", PROMPTS[1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    killer = threading.Timer(0.3, os.kill, (procs[2].pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(TensorParallelError) as err:
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.monotonic() - started
    assert elapsed < 10, elapsed
    assert f"rank 2 (pid {procs[2].pid}) was killed by signal SIGKILL" in str(err.value)
    assert not any(p.is_alive() for p in procs.values())
    assert children() == []
    with pytest.raises(TensorParallelError):  # the engine stays stopped
        engine.step() if engine.has_unfinished_requests() else engine.runner.parallel.check()
    llm.close()


@pytest.mark.slow
def test_workers_exit_when_rank0_dies(tmp_path):
    """Rank 0 killed with SIGKILL: its workers notice and exit within seconds."""
    path = get_model("llama", tmp_path).path
    script = textwrap.dedent(f"""
        import sys, time
        from lmplug import LLM
        if __name__ == "__main__":
            llm = LLM({str(path)!r}, dtype="float32", device="cpu", parallel={{"tensor_parallel_size": 2}})
            print(*[p.pid for p in llm.engine.parallel.procs.values()], flush=True)
            time.sleep(60)
    """)
    (tmp_path / "rank0.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "rank0.py")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    assert workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


# -- the demo model --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_demo_gguf_tp3_matches_tp1(demo_gguf):
    """SmolLM2-135M (9 heads, 3 KV heads): TP=2 is refused (2 does not divide 9); TP=3 splits heads,
    KV heads, the 1536-wide MLP and the 49152-token vocabulary, and gives TP=1's 16 greedy tokens."""
    # dense weights on both sides: ranks slice float tensors, and one process would otherwise run the
    # packed GGUF path, whose 8-bit activations need not give the same greedy tokens
    engine = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kvcache": "paged",
              "scheduler": "continuous", "quant": {"method": "gguf", "dequantize_at_load": True}}
    with pytest.raises(ConfigError, match="does not divide the 9 attention heads"):
        LLM(str(demo_gguf), **engine, **tp(2))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    single = [o.outputs[0].token_ids for o in LLM(str(demo_gguf), **engine).generate(prompts, params)]
    with LLM(str(demo_gguf), **engine, **tp(3)) as parallel:
        assert [o.outputs[0].token_ids for o in parallel.generate(prompts, params)] == single
        mem = parallel.engine.memory
        assert len(set(mem["kv_bytes_per_token_per_rank"])) == 1
