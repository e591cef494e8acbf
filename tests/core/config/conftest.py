"""No plugin environment from the caller and a fresh process-wide registry around every config test."""

from __future__ import annotations

import pytest

from lmplug.plugins import ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD, reset_registry


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    monkeypatch.delenv(ENV_ALLOWLIST, raising=False)
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    reset_registry()
    yield
    reset_registry()
