"""LoRA adapters under tensor parallelism (gloo, CPU): TP=2 gives what TP=1 gives.

Each rank holds its shard of every adapter (A whole and B's rows in the column-parallel q/k/v and
gate/up, A's columns and B whole in the row-parallel o and down); rank 0 picks the slots and each
step's message carries its fills. References: the same engine at TP=1, itself PEFT-parity tested
in ``tests/core/adapters/test_lora_parity.py``; and PEFT's own greedy for the adapter loaded at
run time. Rows mix three adapters of ranks 4, 8 and 16 and the base model in one batch.
"""

from __future__ import annotations

import pytest
from support.hf_models import get_model, hf_greedy, one_torch_thread, prompt_ids  # noqa: F401
from support.lora_adapters import ATTENTION, make_adapter
from support.tensor_parallel import ENGINE, assert_same, run, save_model, tp

from lmplug import LLM, LoRARequest, SamplingParams

LORA = {"lora": {"max_loras": 4, "max_lora_rank": 16}}


def _adapters(hf, root):
    out = []
    for k, rank in enumerate((4, 8, 16)):
        path = root / f"a{k}"
        # the second adapter only on the attention projections: its MLP slots stay zero
        peft = make_adapter(hf, path, rank=rank, seed=70 + k, targets=ATTENTION if k == 1 else None)
        out.append((LoRARequest(f"a{k}", k + 1, str(path)), peft))
    return out


@pytest.fixture(scope="module", params=["llama_gqa", pytest.param("llama_mqa", marks=pytest.mark.slow)])
def setup(request, tmp_path_factory):
    """(model path, its HF model, the adapters) for 2 KV heads (one per rank) or 1 (replicated)."""
    root = tmp_path_factory.getbasetemp() / "tp_lora" / request.param
    root.mkdir(parents=True, exist_ok=True)
    if request.param == "llama_gqa":
        tiny = get_model("llama", root)
        path, hf = tiny.path, tiny.hf
    else:
        from transformers import AutoModelForCausalLM

        path = save_model(root, "llama_mqa", num_key_value_heads=1)
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").eval()
    return path, hf, _adapters(hf, root)


def test_tp2_mixed_adapters_match_tp1(setup):
    path, _, adapters = setup
    a0, a1, a2 = (r for r, _ in adapters)
    loras = [a0, a1, None, a2, a0]  # three adapters and the base in every step
    with LLM(str(path), **ENGINE, **LORA) as single:
        expected = run(single, 8, loras)
    with LLM(str(path), **ENGINE, **LORA, **tp(2)) as parallel:
        assert_same(expected, run(parallel, 8, loras))


def test_tp2_load_and_unload_at_run_time(setup, tmp_path):
    """Adapters loaded after the workers started reach them; more adapters than slots evict;
    a name unloaded and loaded again from another folder is read again on every rank."""
    path, hf, adapters = setup
    (a0, p0), (a1, _), (a2, _) = adapters
    extra = [(LoRARequest(f"x{k}", 10 + k, str(tmp_path / f"x{k}")),
              make_adapter(hf, tmp_path / f"x{k}", rank=8, seed=90 + k)) for k in range(2)]
    reloaded = LoRARequest("a0", 20, str(tmp_path / "x1"))  # a0's name over x1's weights
    prompt = prompt_ids(9, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), **ENGINE, lora={"max_loras": 2, "max_lora_rank": 16}, **tp(2)) as llm:
        engine = llm.engine
        assert llm.generate([prompt], greedy, lora=a0)[0].outputs[0].token_ids == \
            hf_greedy(p0.get_base_model(), prompt, 8)
        for lora, _ in extra:
            engine.add_lora(lora)
        # 4 adapters and the base over 2 slots: groups, each filling slots on every rank
        loras = [a1, extra[0][0], a2, None, extra[1][0]]
        with LLM(str(path), **ENGINE, **LORA) as single:
            expected = [o.outputs[0].token_ids for o in single.generate([prompt] * 5, greedy, lora=loras)]
        assert [o.outputs[0].token_ids for o in llm.generate([prompt] * 5, greedy, lora=loras)] == expected
        assert expected[1] == hf_greedy(extra[0][1].get_base_model(), prompt, 8)
        engine.remove_lora("a0")
        engine.add_lora(reloaded)
        out = llm.generate([prompt], greedy, lora=reloaded)[0].outputs[0].token_ids
        assert out == hf_greedy(extra[1][1].get_base_model(), prompt, 8)
