"""``Sequence.status`` changes through named transitions only (the core and first-party plugins
call them): run, requeue on preemption, finish with or without a reason."""

from __future__ import annotations

from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence, SequenceStatus


def test_transitions():
    seq = Sequence("r", [1, 2], SamplingParams())
    assert seq.status is SequenceStatus.WAITING
    seq.start_running()
    assert seq.status is SequenceStatus.RUNNING
    seq.requeue()
    assert seq.status is SequenceStatus.WAITING
    seq.finish_reason, seq.stop_reason = "stop", 7  # as a stop check leaves them
    seq.finish()
    assert seq.is_finished and (seq.finish_reason, seq.stop_reason) == ("stop", 7)
    seq.finish("error", clear_stop_reason=True)
    assert (seq.finish_reason, seq.stop_reason) == ("error", None)


def test_the_old_assignment_still_works_for_older_plugins():
    seq = Sequence("r", [1], SamplingParams())
    seq.status = SequenceStatus.RUNNING
    assert seq.status is SequenceStatus.RUNNING


def test_progress_changes_through_its_owner():
    """The computed count advances after a step, drops to 0 on a recomputing preemption and is
    kept on a swapping one; ``finish(at=...)`` records the finish time (else it stays unset)."""
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    seq.start_running()
    seq.advance(2)
    assert seq.num_computed_tokens == 2 and seq.is_prefill
    seq.advance(1)
    assert seq.num_computed_tokens == 3 and not seq.is_prefill
    seq.requeue()  # swapped out: its K/V comes back
    assert seq.num_computed_tokens == 3 and seq.status is SequenceStatus.WAITING
    seq.start_running()
    seq.requeue(recompute=True)  # its K/V was dropped
    assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
    seq.finish("abort")
    assert seq.finish_time is None
    seq.finish("stop", at=12.5)
    assert seq.finish_time == 12.5 and seq.finish_reason == "stop"
