"""When a sequence ends: EOS, stop tokens, stop strings, max_tokens, the context limit."""

from __future__ import annotations

from lmplug.interfaces.sequence import Sequence


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> bool:
    """Set ``finish_reason`` (and trim a stop string from the text); True if ``seq`` ends."""
    params = seq.params
    if not params.ignore_eos and token in eos_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", None
        return True
    if token in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        return True
    for stop in params.stop:
        at = seq.text.find(stop)
        if at >= 0:
            seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
            seq.finish_reason, seq.stop_reason = "stop", stop
            return True
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        seq.finish_reason = "length"
        return True
    if seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
        return True
    return False
