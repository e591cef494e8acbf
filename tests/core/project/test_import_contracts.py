"""The import-linter contracts in pyproject.toml cover the whole core.

`lint-imports` (run by `make test`) checks the contracts; these tests check that the contracts
leave nothing out: a new module or package under core/ that no layer names would be free of
every layer rule, and a plugin allowed to import it.
"""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]
API = {"lmplug.api", "lmplug.errors"}  # the versioned API: what plugins import
API_MODULES = {"lmplug.interfaces", "lmplug.hookspecs"}  # its definitions: reached through lmplug.api only
KIT = {"lmplug.kit"}  # the building kit: plugins may import it beside the API


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


def test_plugins_may_import_only_the_api_and_the_kit():
    plugin_contracts = [c for c in _contracts() if c["type"] == "forbidden"
                        and "lmplug_attention" in c["source_modules"]]
    reached = next(c for c in plugin_contracts if not c.get("allow_indirect_imports"))
    direct = next(c for c in plugin_contracts if c.get("allow_indirect_imports"))
    assert set(reached["forbidden_modules"]) == _core_top_level() - API - KIT - API_MODULES
    assert set(direct["forbidden_modules"]) == API_MODULES


def test_the_kit_sits_just_above_the_api_and_the_api_above_its_modules():
    layers = [layer.strip() for layer in next(c for c in _contracts() if c["type"] == "layers")["layers"]]
    modules = layers.index("lmplug.interfaces | lmplug.hookspecs")
    assert layers.index("lmplug.api") == modules - 1
    assert layers.index("lmplug.kit") == modules - 2


def test_every_plugin_package_is_under_the_plugin_contracts():
    """A package under plugins/ must be a root package and under each plugin contract."""
    packages = {f"lmplug_{p.name}" for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists()}
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert packages <= set(config["root_packages"])
    for contract in config["contracts"]:
        if contract["type"] == "independence":
            assert packages == set(contract["modules"])
        elif contract["type"] == "forbidden" and contract["source_modules"] == ["lmplug"]:
            assert packages == set(contract["forbidden_modules"])
        elif contract["type"] == "forbidden":
            assert packages == set(contract["source_modules"])
