"""Prefix-cache hits never change greedy outputs (issue 45, item 9).

A hit turns a prompt's prefill into a short query (the suffix) over a long cache. On CPU the
paged backend read short queries as rows of its C decode kernel and long ones through the
varlen prefill's matmuls: the two round floats differently, and the packed GGUF path's 8-bit
activations amplify that (a last-bit difference moves an int8 value by one step), so with a
shared system prompt a hit changed the demo model's logprobs by up to 0.25 and flipped greedy
tokens (suffix lengths 1 and 2 of 16). Now every query is read as rows (``cpu_rows: all``):
each token's attention depends on its own context only.

Each case compares an engine with prefix caching (warmed with the system prompt) against one
without, for every suffix length 1-16 and for a step where a hit and a miss run together:
the packed path must give the same tokens and bit-identical logprobs; dense float32 weights
the same tokens with logprobs within float rounding (torch's matmuls are not batch invariant:
1e-5 measured on the demo model). The demo model, 2 threads and the server are slow."""

from __future__ import annotations

import contextlib

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from support.gguf_fixtures import write_tiny_gguf
from support.serve_util import running_server

from lmplug import LLM, SamplingParams
from lmplug.serve import ServeSettings

MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def engine(path, packed: bool, prefix: bool) -> LLM:
    quant = {} if packed else {"quant": {"method": "gguf", "dequantize_at_load": True}}
    return LLM(str(path), dtype="float32", max_model_len=256, **quant,
               kvcache={"backend": "paged", "block_size": 16, "prefix_caching": prefix})


def greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's tokens and their logprobs (all prompts in one call: one step for their prefills)."""
    out = []
    for result in llm.generate(prompts, GREEDY):
        o = result.outputs[0]
        out.append((list(o.token_ids), [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]))
    return out


def same(got, want, packed: bool, what: str) -> None:
    assert got[0] == want[0], f"{what}: greedy tokens changed by a prefix hit"
    if packed:
        assert got[1] == want[1], f"{what}: logprobs changed by a prefix hit ({got[1]} vs {want[1]})"
    else:
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=0, atol=1e-4, msg=what)


def prompts_for(vocab: int, seed: int = 0) -> tuple[list[int], list[int], list[int]]:
    """A 40-token system prompt (two full blocks and more: a miss prefills more than 32 tokens),
    16 suffix tokens, and an unrelated 50-token prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (106,), generator=g).tolist()
    return ids[:40], ids[40:56], ids[56:]


def check_llm(path, packed: bool, vocab: int) -> None:
    system, suffix, other = prompts_for(vocab)
    ref, hit = engine(path, packed, prefix=False), engine(path, packed, prefix=True)
    hit.generate([system + suffix[-1:]], GREEDY)  # the system prompt's blocks are cached now
    for n in range(1, 17):
        prompt = system + suffix[:n]
        same(greedy(hit, [prompt])[0], greedy(ref, [prompt])[0], packed, f"suffix of {n}")
    # a hit (the system prompt) and a miss (a new prompt) in one step, each as when alone
    fresh = other[:45] + suffix[:3]
    both = greedy(hit, [system + suffix[5:9], fresh])
    same(both[0], greedy(ref, [system + suffix[5:9]])[0], packed, "a hit beside a miss")
    same(both[1], greedy(ref, [fresh])[0], packed, "a miss beside a hit")
    ref.close()
    hit.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    # every product packed and quantized (a float product's rounding depends on the batch, as
    # the dense path's does)
    write_tiny_gguf(path, seed=3, types={"attn_v": Q.Q8_0, "ffn_down": Q.Q8_0})
    return path


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
def test_hits_keep_greedy_outputs_tiny(tiny_gguf, packed):
    with threads(1):
        check_llm(tiny_gguf, packed, vocab=250)  # its byte-level vocabulary has 400 tokens


@pytest.mark.slow
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
def test_hits_keep_greedy_outputs_demo_model(demo_gguf, packed, n_threads):
    with threads(n_threads):
        check_llm(demo_gguf, packed, vocab=20000)


@pytest.mark.slow
@pytest.mark.parametrize("n_threads", [1, 2])
def test_hits_keep_greedy_outputs_through_the_server(demo_gguf, n_threads):
    """The official openai client against ``lmplug serve`` with prefix caching: every suffix
    length and a hit beside a miss in one step (concurrent requests) answer as an engine
    without prefix caching does (the packed path: the same tokens and logprobs)."""
    import concurrent.futures

    import openai

    system, suffix, other = prompts_for(20000, seed=1)
    with threads(n_threads):
        ref = engine(demo_gguf, True, prefix=False)
        want = {n: greedy(ref, [system + suffix[:n]])[0] for n in range(1, 17)}
        fresh = other[:45] + suffix[:3]
        want_fresh = greedy(ref, [fresh])[0]
        ref.close()
        with running_server(engine(demo_gguf, True, prefix=True), ServeSettings(api_key="")) as server:
            client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)

            def ask(prompt: list[int]) -> list[float]:
                r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                              extra_body={"ignore_eos": True})
                return r.choices[0].logprobs.token_logprobs

            ask(system + suffix[-1:])  # warm: the system prompt's blocks are cached
            for n in range(1, 17):
                assert ask(system + suffix[:n]) == want[n][1], f"suffix of {n}"
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                hit, miss = pool.map(ask, [system + suffix[:4], fresh])
            assert hit == want[4][1] and miss == want_fresh[1]
