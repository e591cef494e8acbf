"""One owner per ``Sequence`` field: its tokens, computed count and status are written by its own
methods only (``advance``, ``rewind``, ``fork_from``, ``append_token``, ``truncate_tokens``,
``reset_tokens``, the status transitions); every other field by one package of the core.
Counted by ``tools/contract_names.py --sequence`` over the core and the first-party plugins."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lmplug.api import SamplingParams, Sequence, SequenceStatus

ROOT = Path(__file__).resolve().parents[3]


def _writers() -> dict[str, set[str]]:
    spec = importlib.util.spec_from_file_location("contract_names", ROOT / "tools" / "contract_names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sequence_writers()[1]


def test_tokens_computed_count_and_status_have_no_writer_outside_sequence():
    written = _writers()
    assert {"token_ids", "num_computed_tokens", "status"}.isdisjoint(written), written


def test_every_other_field_has_one_owning_package():
    owners = {f: {str(Path(m).parent) for m in mods} for f, mods in _writers().items()}
    assert all(len(o) == 1 for o in owners.values()), owners


def test_the_owner_methods_do_what_the_writes_they_replace_did():
    parent = Sequence("r", [1, 2, 3], SamplingParams())
    parent.extend_tokens([4, 5])
    parent.advance(4)
    parent.logprobs.append({4: None})
    child = Sequence("r", [1, 2, 3], SamplingParams(), index=1)
    child.fork_from(parent)
    assert (child.num_computed_tokens, child.token_ids) == (4, [1, 2, 3])
    child.fork_from(parent, outputs=True)
    assert child.token_ids == [1, 2, 3, 4, 5] and child.token_ids is not parent.token_ids
    assert child.logprobs == parent.logprobs and child.logprobs is not parent.logprobs
    parent.truncate_tokens(4)
    parent.rewind(3)
    assert (parent.token_ids, parent.num_computed_tokens, parent.num_output_tokens) == ([1, 2, 3, 4], 3, 1)
    parent.append_token(9)
    parent.reset_tokens((7, 8), 1)
    assert (parent.token_ids, parent.num_computed_tokens) == ([7, 8], 1)
    assert parent.status is SequenceStatus.WAITING and child.num_computed_tokens == 4
