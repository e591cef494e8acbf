"""When a sequence ends: EOS, stop tokens, stop strings, max_tokens, the context limit."""

from __future__ import annotations

from lmplug.interfaces.sequence import Sequence

# characters before the new text that are searched again: the detokenizer may rewrite the last few
# (an incomplete UTF-8 sequence becomes its character)
_REWRITE_MARGIN = 16


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int,
               new_text_from: int = 0) -> bool:
    """Set ``finish_reason`` (and trim a stop string from the text); True if ``seq`` ends.

    ``new_text_from``: where the text added since the last check starts; stop strings are
    searched only where they could newly end (so the cost per token does not grow with the
    text), 0 searches it all."""
    params = seq.params
    if not params.ignore_eos and token in eos_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", None
        return True
    if token in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        return True
    for stop in params.stop:
        at = seq.text.find(stop, max(0, new_text_from - len(stop) - _REWRITE_MARGIN))
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
