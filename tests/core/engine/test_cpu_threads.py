"""torch's small ops on one thread during small CPU steps (``lmplug.kit.threads``), while
kernels with their own pool still see the thread count set before (``compute_threads``)."""

from __future__ import annotations

import threading

import pytest
import torch

from lmplug.engine.runner import ModelRunner
from lmplug.kit.pipeline import whole
from lmplug.kit.threads import compute_threads, small_ops_single_threaded


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_region_sets_one_thread_and_restores(two_threads):
    assert compute_threads() == 2
    with small_ops_single_threaded():
        assert torch.get_num_threads() == 1 and compute_threads() == 2
        with small_ops_single_threaded():  # nested: still one region
            assert torch.get_num_threads() == 1 and compute_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2 and compute_threads() == 2


def test_region_restores_after_an_exception(two_threads):
    with pytest.raises(RuntimeError, match="boom"), small_ops_single_threaded():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2 and compute_threads() == 2


def test_regions_are_per_thread(two_threads):
    """torch's thread count is the calling thread's: another thread's region leaves this one's."""
    inside, leave, seen = threading.Event(), threading.Event(), []

    def other():
        torch.set_num_threads(2)
        with small_ops_single_threaded():
            seen.append((torch.get_num_threads(), compute_threads()))
            inside.set()
            leave.wait(10)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(10)
        assert torch.get_num_threads() == 2 and compute_threads() == 2
        with small_ops_single_threaded():
            assert torch.get_num_threads() == 1 and compute_threads() == 2
        assert torch.get_num_threads() == 2
    finally:
        leave.set()
        t.join(10)
    assert seen == [(1, 2), 2]


class _Recorder(torch.nn.Module):
    """A model stand-in: records the thread counts its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def forward(self, input_ids, positions, ctx):
        self.seen.append((torch.get_num_threads(), compute_threads()))
        return torch.zeros(input_ids.shape[0], 4)

    def compute_logits(self, hidden):
        return hidden


@pytest.mark.parametrize("small_step_tokens,tokens,want", [(16, 1, (1, 2)), (16, 16, (1, 2)), (16, 17, (2, 2)),
                                                          (0, 1, (2, 2))])
def test_runner_runs_small_steps_single_threaded(two_threads, small_step_tokens, tokens, want):
    runner = ModelRunner.__new__(ModelRunner)  # only run() is exercised: no cache to bind
    runner.model, runner.small_step_tokens, runner.stage = _Recorder(), small_step_tokens, whole()
    ctx = type("Ctx", (), {"positions": torch.arange(tokens), "query_lens_cpu": [tokens],
                           "seq_lens_cpu": [100_000]})()  # attention past SMALL_ATTENTION: only the token rule
    logits, hidden = runner.run(torch.zeros(tokens, dtype=torch.int64), ctx, [[tokens - 1]])
    assert runner.model.seen == [want] and hidden.shape == (tokens, 4) and logits[0].shape == (1, 4)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("query_lens,seq_lens,want", [
    ([1] * 16, [300] * 16, 1),             # 16 decodes: few tokens, whatever their context
    ([1] * 8, [50_000] * 8, 1),
    ([512], [512], 1),                     # a 512-token prompt: 512 x 512 attended
    ([20] * 16 + [1], [20] * 16 + [91], 1),  # prompts joining a decode (a server's steps)
    ([513], [513], 2),                     # more attention than SMALL_ATTENTION: torch's threads
    ([100], [3100], 2),                    # a chunk late in a long prompt
])
def test_steps_threads_follow_the_attention_share(two_threads, query_lens, seq_lens, want):
    runner = ModelRunner.__new__(ModelRunner)
    runner.small_step_tokens = 16
    with runner.threads_for(query_lens, seq_lens):
        assert torch.get_num_threads() == want and compute_threads() == 2
    assert torch.get_num_threads() == 2
    runner.small_step_tokens = 0  # products without threads of their own: torch keeps its threads
    with runner.threads_for(query_lens, seq_lens):
        assert torch.get_num_threads() == 2


def test_build_gives_small_steps_only_to_methods_with_their_own_threads():
    from lmplug.engine.build import SMALL_STEP_TOKENS, small_step_tokens
    from lmplug.interfaces.quant import Unquantized
    from lmplug.kit import extras
    from lmplug.parallel import single

    class OwnThreads(Unquantized, extras.OwnThreads):
        def own_threads(self, device):
            return True

    cpu = torch.device("cpu")
    assert small_step_tokens(Unquantized(), cpu, single()) == 0
    assert small_step_tokens(OwnThreads(), cpu, single()) == SMALL_STEP_TOKENS
    assert small_step_tokens(OwnThreads(), torch.device("meta"), single()) == 0
