"""What the tensor-parallel tests share (a helper module, not a test file): the engine settings,
prompts, greedy runs with log-probs and their comparison, worker processes, tiny models."""

from __future__ import annotations

import gc
import multiprocessing

import psutil
import torch

from lmplug import LLM, SamplingParams
from support.hf_models import build_hf_model, make_config, prompt_ids

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "kvcache": "paged",
          "scheduler": {"backend": "continuous", "max_num_batched_tokens": 24, "max_num_seqs": 3}}
PROMPTS = [prompt_ids(n, seed=n) for n in (5, 30, 11, 40, 3)]


def tp(n: int) -> dict:
    return {"parallel": {"tensor_parallel_size": n}}


def run(llm: LLM, max_tokens: int = 10, lora=None):
    """Greedy outputs of every prompt: (token ids, logprob of each, prompt logprobs of the first).
    ``lora``: a ``LoRARequest`` per prompt (None: the base model)."""
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i == 0 else None) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, lora=lora)
    result = []
    for out in outs:
        c = out.outputs[0]
        lps = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
        plp = None if out.prompt_logprobs is None else [
            None if e is None else e[t].logprob for e, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
        result.append((c.token_ids, lps, plp))
    return result


def assert_same(single, parallel, atol=1e-4):
    for (ids1, lp1, p1), (ids2, lp2, p2) in zip(single, parallel):
        assert ids2 == ids1
        torch.testing.assert_close(torch.tensor(lp2), torch.tensor(lp1), atol=atol, rtol=0)
        if p1 is not None:
            torch.testing.assert_close(torch.tensor(p2[1:]), torch.tensor(p1[1:]), atol=atol, rtol=0)


def children() -> list[psutil.Process]:
    """This process's live children but the constraint compile workers (``lmplug.constraint_pool``:
    an engine another test still holds keeps its worker; engines dropped without close() are
    collected first, which stops theirs)."""
    gc.collect()
    compile_workers = {p.pid for p in multiprocessing.active_children() if p.name.endswith("-compile")}
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in compile_workers and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())]


# -- models -----------------------------------------------------------------------------------------

def save_model(root, name: str, **config):
    path = root / name
    if not path.exists():
        build_hf_model(make_config("llama", **config)).save_pretrained(path)
    return path
