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
