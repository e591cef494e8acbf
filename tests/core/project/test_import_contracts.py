"""The import-linter contracts in pyproject.toml cover the whole core.

`lint-imports` (run by `make test`) checks the contracts; these tests check that the contracts
leave nothing out: a new module or package under core/ that no layer names would be free of
every layer rule, and a plugin allowed to import it.
"""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = {"lmplug.interfaces", "lmplug.hookspecs", "lmplug.errors"}


def _contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return config["contracts"]


def _core_top_level() -> set[str]:
    core = ROOT / "core"
    names = {p.stem for p in core.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in core.iterdir() if (p / "__init__.py").exists()}
    return {f"lmplug.{n}" for n in names}


def _layered() -> set[str]:
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    return {name.strip() for layer in layers for name in layer.split("|")}


def test_every_core_module_is_in_a_layer():
    missing = _core_top_level() - _layered()
    assert not missing, f"add these to the layers contract in pyproject.toml: {sorted(missing)}"


def test_plugins_may_import_only_the_contract():
    forbidden = next(c for c in _contracts() if c["type"] == "forbidden"
                     and "lmplug_attention" in c["source_modules"])["forbidden_modules"]
    assert set(forbidden) == _core_top_level() - CONTRACT
