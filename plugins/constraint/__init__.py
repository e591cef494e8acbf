"""lmplug_constraint: grammar engines for structured output (xgrammar, llguidance).

Registered through the ``lmplug.plugins`` entry point. The engines are imported when a backend
compiles its first constraint, not here: importing xgrammar takes seconds.
"""

from __future__ import annotations

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_constraint_backends() -> list[type]:
    from lmplug_constraint.llguidance_backend import LLGuidanceBackend
    from lmplug_constraint.xgrammar_backend import XGrammarBackend

    return [XGrammarBackend, LLGuidanceBackend]
