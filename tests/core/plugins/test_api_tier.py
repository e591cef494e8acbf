"""The two tiers plugins build on: ``lmplug.api`` (versioned, its ``__all__`` the whole API)
and ``lmplug.kit``. Adding a public name to the API module without listing it in ``__all__``
and in docs/plugins.md's table fails here; so does a listed name that is not there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from lmplug import api

ROOT = Path(__file__).resolve().parents[3]
API_SOURCE = ROOT / "core" / "api.py"


def bound_and_declared(source: str) -> tuple[set[str], list[str]]:
    """The public names a module's top level binds (imports, definitions, assignments) and its
    ``__all__``."""
    bound: set[str] = set()
    declared: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            bound.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if "__all__" in names:
                declared = ast.literal_eval(node.value)
            bound.update(names)
    return {n for n in bound if not n.startswith("_")}, declared


def test_every_public_name_bound_in_the_api_module_is_in_all():
    bound, declared = bound_and_declared(API_SOURCE.read_text())
    assert bound - set(declared) == set(), "public names of lmplug.api missing from __all__"
    assert set(declared) - bound == set(), "names in lmplug.api.__all__ that it does not bind"
    assert len(declared) == len(set(declared)) and declared == api.__all__


def test_a_name_added_to_the_api_module_without_all_is_caught():
    for addition in ("\n\ndef helper():\n    pass\n", "\nfrom lmplug.kit.sampling import draw\n",
                     "\nLIMIT = 3\n"):
        bound, declared = bound_and_declared(API_SOURCE.read_text() + addition)
        assert len(bound - set(declared)) == 1, addition


def _documented() -> set[str]:
    text = (ROOT / "docs" / "plugins.md").read_text()
    table = re.search(r"<!-- api:begin -->(.*?)<!-- api:end -->", text, re.DOTALL)
    assert table, "docs/plugins.md lost its table of the API's names (<!-- api:begin --> ... end)"
    return {name for cell in re.findall(r"^\|[^|]*\|([^|]*)\|", table.group(1), re.MULTILINE)
            for name in re.findall(r"`(\w+)`", cell)}


def test_docs_list_exactly_the_api():
    assert _documented() == set(api.__all__)


def test_api_version_is_the_one_the_manager_checks():
    from lmplug import plugins

    assert plugins.API_VERSION == api.API_VERSION == 3
