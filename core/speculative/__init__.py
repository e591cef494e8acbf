"""Speculative decoding: the engine's select stage when a drafter is configured.

``Speculator`` (``speculator.py``) proposes drafts through the drafter, tells the scheduler each
sequence's lookahead, puts the scheduled drafts into the step (positions and masks for trees),
verifies them (``verifier.py``, trees: ``tree.py``), rolls back rejected K/V and keeps the stats.
It never imports the engine: the engine drives it.
"""

from lmplug.speculative.speculator import Draft, Speculator

__all__ = ["Draft", "Speculator"]
