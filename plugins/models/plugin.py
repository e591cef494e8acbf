"""The first-party architectures' plugin: registered through the entry-point group
``lmplug.plugins`` (pyproject: ``models = "lmplug_models.plugin"``), like any other plugin."""

from __future__ import annotations

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_architectures() -> list[type]:
    from lmplug_models.architectures import FIRST_PARTY
    from lmplug_models.bert import BertArchitecture

    return [*FIRST_PARTY, BertArchitecture]
