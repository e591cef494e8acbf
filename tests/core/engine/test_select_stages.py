"""The select stages behind one ``SelectStage``: every engine stage declares the protocol, and the
router gives each stage its own sequences and logits rows and maps the rows it returns back."""

from __future__ import annotations

import torch

from lmplug.beam.stage import BeamStage
from lmplug.engine.select import Sampler
from lmplug.engine.stages import SelectStages
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.select import SelectStage
from lmplug.interfaces.sequence import Sequence
from lmplug.speculative import Speculator


class Recording:
    """A stage that claims requests by ``beam_width`` and emits the argmax of its last row."""

    def __init__(self, wants_beam: bool) -> None:
        self.wants_beam = wants_beam
        self.calls: list[tuple[str, object]] = []

    def claims(self, params: SamplingParams) -> bool:
        return (params.beam_width > 0) == self.wants_beam

    def admit(self, params): self.calls.append(("admit", params))
    def propose(self, seqs): self.calls.append(("propose", [s.seq_id for s in seqs])); return {s.seq_id: 1 for s in seqs}
    def plan(self, scheduled): self.calls.append(("plan", scheduled))
    def settle(self, seqs): self.calls.append(("settle", [s.seq_id for s in seqs]))
    def release(self, seq): self.calls.append(("release", seq.seq_id))
    def stats(self): return {f"beam={self.wants_beam}": 1}
    def annotate(self, outputs): self.calls.append(("annotate", outputs))

    def select(self, logits, num_rows, seqs, hidden=None, on_error=None):
        self.calls.append(("select", logits.clone()))
        ends = torch.cumsum(torch.tensor(num_rows), 0) - 1
        return [[int(logits[e].argmax())] for e in ends], [[int(e)] for e in ends]


def test_every_engine_stage_declares_the_protocol():
    for cls in (Sampler, Speculator, BeamStage, SelectStages):
        missing = [m for m in ("claims", "admit", "propose", "plan", "select", "settle", "release", "stats",
                               "annotate") if not callable(getattr(cls, m, None))]
        assert not missing, (cls.__name__, missing)
    assert isinstance(Sampler(), SelectStage)


def test_the_router_splits_rows_by_stage_and_maps_them_back():
    beam, rest = Recording(True), Recording(False)
    router = SelectStages([beam, rest])
    plain, beamed = SamplingParams(), SamplingParams(n=2, beam_width=2)
    seqs = [Sequence("a", [1], plain), Sequence("b", [1], beamed), Sequence("c", [1], plain)]
    num_rows = [2, 1, 3]  # rows 0-1: a, row 2: b, rows 3-5: c
    logits = torch.zeros(6, 8)
    for row, token in enumerate([4, 5, 6, 7, 1, 2]):
        logits[row, token] = 1.0
    tokens, rows = router.select(logits, num_rows, seqs)
    assert tokens == [[5], [6], [2]] and rows == [[1], [2], [5]]
    beam_logits = next(v for k, v in beam.calls if k == "select")
    rest_logits = next(v for k, v in rest.calls if k == "select")
    assert torch.equal(beam_logits, logits[[2]]) and torch.equal(rest_logits, logits[[0, 1, 3, 4, 5]])
    assert router.propose(seqs) == {seqs[0].seq_id: 1, seqs[1].seq_id: 1, seqs[2].seq_id: 1}
    assert ("propose", [seqs[1].seq_id]) in beam.calls and ("propose", [seqs[0].seq_id, seqs[2].seq_id]) in rest.calls
    router.admit(beamed)
    router.release(seqs[2])
    assert ("admit", beamed) in beam.calls and ("release", seqs[2].seq_id) in rest.calls
    assert router.stats() == {"beam=True": 1, "beam=False": 1}


def test_every_stage_proposes_and_settles_each_step_even_with_no_sequences():
    """(a speculator resets its step's counts in propose and drops stale hidden states in settle)"""
    beam, rest = Recording(True), Recording(False)
    router = SelectStages([beam, rest])
    router.propose([])
    router.settle([])
    for stage in (beam, rest):
        assert ("propose", []) in stage.calls and ("settle", []) in stage.calls
