"""KV tiers in the engine (tiny Llama, paged cache with prefix caching).

``disk``: a new engine over the same model and folder serves a seen prompt's prefix from disk; damaged,
truncated and foreign files (another model's block under the same key) are warned about and
recomputed; two engines writing one folder at once leave only whole files; ``max_gb`` evicts; a
folder that cannot be made is a ``ConfigError`` at load. ``host``: a prefix evicted from the pool
comes back from host memory. In every case the greedy and seeded-sampling tokens equal those of
an engine without a tier (the contiguous cache: no prefix reuse at all).
"""

from __future__ import annotations

import logging
import random
import threading

import pytest
import torch
from lmplug_kvcache.block_manager import chain_hash
from lmplug_kvconnector.disk import DiskConnector, DiskOptions
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError

BS = 4
KV = {"backend": "paged", "block_size": BS, "num_blocks": 32, "prefix_caching": True}
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
Outputs = tuple[list[list[int]], torch.Tensor]
PROMPTS = [prompt_ids(n, seed) for n, seed in ((37, 1), (22, 2), (50, 3), (29, 4))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # llama_tied: the same KV shapes and prompt keys, another model
    return get_model("llama", root).path, get_model("llama_tied", root).path


@pytest.fixture(scope="module")
def reference(models) -> dict[tuple[int, ...], Outputs]:
    """What an engine without a tier gives for each prompt."""
    llm = LLM(str(models[0]), dtype="float32", device="cpu", max_model_len=128)
    return {tuple(p): run(llm, [p]) for p in PROMPTS}


def make(model, tier: dict | None = None, **kv) -> LLM:
    extra = {"kvconnector": tier} if tier else {}
    return LLM(str(model), dtype="float32", device="cpu", max_model_len=128, kvcache={**KV, **kv}, **extra)


def run(llm: LLM, prompts: list[list[int]]) -> Outputs:
    """Each prompt alone, greedy then sampled: the token ids, and the greedy tokens' logprobs
    (where a K/V block that came back changed shows first)."""
    tokens, lps = [], []
    for p in prompts:
        greedy = llm.generate([p], GREEDY)[0].outputs[0]
        tokens += [greedy.token_ids, llm.generate([p], SAMPLED)[0].token_ids]
        lps += [lp[t].logprob for t, lp in zip(greedy.token_ids, greedy.logprobs)]
    return tokens, torch.tensor(lps)


def expected(reference, prompts) -> Outputs:
    tokens = [t for p in prompts for t in reference[tuple(p)][0]]
    return tokens, torch.cat([reference[tuple(p)][1] for p in prompts])


def check(got: Outputs, want: Outputs) -> None:
    """Equal tokens; logprobs within float32 rounding of another attention path."""
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def keys(prompt: list[int], bs: int = BS) -> list[int]:
    """The prefix hashes of the prompt's full blocks (the tier's keys)."""
    out, prev = [], None
    for i in range(len(prompt) // bs):
        prev = chain_hash(prev, prompt[i * bs:(i + 1) * bs])
        out.append(prev)
    return out


def cacheable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS  # the last prompt token is always computed


def verify_folder(llm: LLM, caplog) -> int:
    """Read back every block file of the engine's format in its tier folder (no temporary file
    may be left anywhere in it); the number of files."""
    reader = DiskConnector(DiskOptions(path=str(llm.engine.kv.tier.connector.root)))
    reader.open(llm.engine.kv.tier.format)
    assert all(p.suffix == ".kvb" for p in reader.root.rglob("*") if p.is_file())
    files = list(reader.folder.iterdir())
    with caplog.at_level(logging.WARNING):
        assert all(reader.get(int(p.stem, 16)) is not None for p in files)
    assert "kvconnector" not in caplog.text
    reader.close()
    return len(files)


def test_a_restarted_engine_serves_prefixes_from_disk(models, reference, tmp_path):
    tier = {"backend": "disk", "path": str(tmp_path / "kv")}
    with make(models[0], tier) as first:
        check(run(first, PROMPTS), expected(reference, PROMPTS))
        assert first.engine.kv.tier.blocks_loaded == 0
    with make(models[0], tier) as second:
        check(run(second, PROMPTS), expected(reference, PROMPTS))
        assert second.engine.kv.tier.blocks_loaded == sum(cacheable(p) for p in PROMPTS)
        assert second.engine.kv.tier.blocks_saved == 0  # every block it computed is there already


def damage(path, how: str) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[:-7] if how == "truncated" else blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:])


def test_bad_files_are_warned_about_and_recomputed(models, reference, tmp_path, caplog):
    tier = {"backend": "disk", "path": str(tmp_path / "kv")}
    with make(models[0], tier) as first:
        run(first, PROMPTS)
        ours = first.engine.kv.tier.connector
    with make(models[1], tier) as other:  # another model's blocks, under the same keys
        other.generate([PROMPTS[2]], GREEDY)
        theirs = other.engine.kv.tier.connector
    assert ours.folder != theirs.folder
    bad = {ours.file(keys(PROMPTS[0])[0]): "checksum", ours.file(keys(PROMPTS[1])[0]): "truncated",
           ours.file(keys(PROMPTS[2])[0]): "another model", ours.file(keys(PROMPTS[3])[2]): "checksum"}
    damage(ours.file(keys(PROMPTS[0])[0]), "flipped")
    damage(ours.file(keys(PROMPTS[1])[0]), "truncated")
    ours.file(keys(PROMPTS[2])[0]).write_bytes(theirs.file(keys(PROMPTS[2])[0]).read_bytes())
    damage(ours.file(keys(PROMPTS[3])[2]), "flipped")
    with make(models[0], tier) as second, caplog.at_level(logging.WARNING):
        check(run(second, PROMPTS), expected(reference, PROMPTS))
        assert second.engine.kv.tier.blocks_loaded == 2  # the last prompt's blocks before the bad one
    for path, reason in bad.items():
        [line] = [r.message for r in caplog.records if str(path) in r.message]
        assert reason in line, line
    caplog.clear()
    assert verify_folder(second, caplog) > 0  # bad files were replaced by recomputed blocks


def test_two_engines_writing_one_folder(models, reference, tmp_path, caplog):
    tier = {"backend": "disk", "path": str(tmp_path / "kv")}
    a, b = make(models[0], tier), make(models[0], tier)
    results: dict[str, list] = {}

    def work(name: str, llm: LLM, prompts: list[list[int]]) -> None:
        results[name] = run(llm, prompts)

    jobs = [threading.Thread(target=work, args=("a", a, PROMPTS)),
            threading.Thread(target=work, args=("b", b, PROMPTS[::-1]))]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    a.close()
    b.close()
    check(results["a"], expected(reference, PROMPTS))
    check(results["b"], expected(reference, PROMPTS[::-1]))
    assert verify_folder(a, caplog) >= sum(cacheable(p) for p in PROMPTS)


def test_the_size_limit_evicts(models, reference, tmp_path, caplog):
    block_file = 2600  # bytes: 2 KiB of float32 K/V (2 layers, K and V, 4 tokens, 2 heads, 16 dims) + header
    tier = {"backend": "disk", "path": str(tmp_path / "kv"), "max_gb": 10 * block_file / 2**30}
    with make(models[0], tier) as first:
        check(run(first, PROMPTS), expected(reference, PROMPTS))
        assert first.engine.kv.tier.connector.stats()["evictions"] > 0
    files = list((tmp_path / "kv").rglob("*.kvb"))
    assert 0 < len(files) <= 10 and sum(p.stat().st_size for p in files) <= 10 * block_file
    with make(models[0], tier) as second:
        check(run(second, PROMPTS[::-1]), expected(reference, PROMPTS[::-1]))
    assert verify_folder(second, caplog) <= 10


def test_a_folder_that_cannot_be_made_fails_at_load(models, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"kvconnector\.path"):
        make(models[0], {"backend": "disk", "path": str(tmp_path / "a_file" / "kv")})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_tier_brings_evicted_prefixes_back(models, seed):
    rng = random.Random(seed)
    bs = rng.choice([4, 8])
    prompt = prompt_ids(rng.randint(2 * bs + 1, 70), 50 + seed)
    fillers = [prompt_ids(rng.randint(40, 80), 60 + seed * 10 + i) for i in range(3)]
    plain = LLM(str(models[0]), dtype="float32", device="cpu", max_model_len=96)
    want = run(plain, [prompt])
    llm = make(models[0], {"backend": "host", "memory_gb": 0.01}, block_size=bs, num_blocks=96 // bs)
    check(run(llm, [prompt]), want)
    for filler in fillers:  # push the prompt's blocks out of the 96-token pool
        llm.generate([filler], GREEDY)
    before = llm.engine.kv.tier.blocks_loaded
    check(run(llm, [prompt]), want)
    assert llm.engine.kv.tier.blocks_loaded - before == (len(prompt) - 1) // bs
