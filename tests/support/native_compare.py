"""Comparing the native step's outputs with the Python layers' (not a test module)."""

from __future__ import annotations


def assert_same(native, python):
    """The two paths differ by float32 rounding (the attention's summation order), and both
    quantize every product's input to 8 bits a block: now and then a rounding difference moves
    a value across a rounding boundary, one quantum in one activation, which moves that step's
    logprobs by up to ~1e-2 on these tiny random models. So logprobs agree within 1e-4 on nearly
    every entry and within 5e-2 on all, and the greedy tokens are equal up to a step whose top two
    logprobs are that close (a near tie the jump may reorder; the sequence is compared no further)."""
    close = total = 0
    for a, b in zip(native, python):
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            for tok in la.keys() & lb.keys():
                diff = abs(la[tok].logprob - lb[tok].logprob)
                assert diff < 5e-2, (tok, la[tok], lb[tok])
                total, close = total + 1, close + (diff < 1e-4)
            if ta != tb:
                top = sorted((lp.logprob for lp in lb.values()), reverse=True)
                assert top[0] - top[1] < 5e-2, (ta, tb, lb)
                break
    assert close >= 0.8 * total, (close, total)


def count_native_runs(monkeypatch, counted=lambda plan: True) -> dict:
    """How many of ``NativeDecodeStep.run``'s calls (on the plans ``counted`` picks) ran natively,
    and how many the attention backend declined (None: the caller's Python path ran)."""
    from lmplug.kit.native_step import NativeDecodeStep

    seen = {"native": 0, "declined": 0}
    run = NativeDecodeStep.run

    def counting(self, x, positions, ctx, *rest):
        out = run(self, x, positions, ctx, *rest)
        if counted(self):
            seen["native" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting)
    return seen
