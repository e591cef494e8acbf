"""One name per concept (speculative, compression): the old family names, hooks and config load the
same way, and ``tools/rename_concepts.py`` is idempotent (a second run, or a run on this tree,
changes nothing)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from support.fake_plugins import plugin_module as _plugin

from lmplug.config import EngineConfig, resolve
from lmplug.hookspecs import hookimpl
from lmplug.plugins import Registry

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "rename_concepts.py"


def _backend(base: type, name: str) -> type:
    from lmplug.interfaces.common import Capabilities

    return type(name.capitalize(), (base,), {"name": name, "capabilities": Capabilities()})


def test_configs_of_both_families_load_and_resolve_as_before():
    """The sections users type (vLLM's ``speculative``; ``compression``, also the request field)
    kept their names: the same config, the same backends, keyed by section."""
    cfg = EngineConfig.from_dict({"model": "m", "speculative": {"method": "ngram", "num_tokens": 3},
                                  "compression": {"method": "truncate", "rate": 0.5}})
    resolved = resolve(cfg, device="cpu", dtype="float32")
    assert resolved.backends["speculative"].name == "ngram"
    assert resolved.backends["speculative"].options.num_tokens == 3
    assert resolved.backends["compression"].name == "truncate"
    assert resolved.backends["compression"].options.rate == 0.5


def test_a_plugin_on_the_old_hooks_registers_in_the_renamed_families():
    """A plugin written for the old hook names still registers (pluggy warns it), and the old
    family names still look its classes up (a DeprecationWarning)."""
    from lmplug.interfaces.compressor import Compressor
    from lmplug.interfaces.drafter import Drafter

    drafter, compressor = _backend(Drafter, "olddraft"), _backend(Compressor, "oldsqueeze")
    reg = Registry(autoload=False)
    with (pytest.warns(DeprecationWarning, match="lmplug_register_drafters is now"),  # rename_concepts: keep
          pytest.warns(DeprecationWarning, match="lmplug_register_compressors is now")):  # rename_concepts: keep
        assert reg.register(_plugin(
            lmplug_register_drafters=hookimpl(lambda: [drafter]),  # rename_concepts: keep
            lmplug_register_compressors=hookimpl(lambda: [compressor])),  # rename_concepts: keep
            name="old")
    assert reg.backends("speculative")["olddraft"].cls is drafter
    assert reg.backends("compression")["oldsqueeze"].cls is compressor
    assert not reg.failures
    with pytest.warns(DeprecationWarning, match="'drafter' is now 'speculative'"):  # rename_concepts: keep
        assert reg.backends("drafter") is reg.backends("speculative")  # rename_concepts: keep
    with pytest.warns(DeprecationWarning, match="'compressor' is now 'compression'"):  # rename_concepts: keep
        assert reg.get("compressor", "oldsqueeze").cls is compressor  # rename_concepts: keep


def test_a_plugin_on_the_new_hooks_registers_without_a_warning():
    from lmplug.interfaces.drafter import Drafter

    drafter = _backend(Drafter, "newdraft")
    reg = Registry(autoload=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert reg.register(_plugin(lmplug_register_speculative_methods=hookimpl(lambda: [drafter])), name="new")
        assert reg.backends("speculative")["newdraft"].family == "speculative"


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "tools" / "rename_concepts.py"), *args], check=False, cwd=repo,
                          capture_output=True, text=True, timeout=600)


def test_this_tree_needs_no_rename():
    out = _run(ROOT, "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_rename_script_moves_rewrites_and_is_idempotent(tmp_path):
    """A branch written under the old names (a file another branch added under an old folder
    included) comes out under the new ones; a second run changes nothing; kept lines stay."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "rename_concepts.py")
    files = {
        "core/speculation/new_stage.py": "from lmplug.speculation.verifier import x\n",  # rename_concepts: keep
        "core/speculative/verifier.py": "x = 1\n",
        "plugins/compressor/__init__.py": (  # rename_concepts: keep
            "import lmplug_compressor.units\n"  # rename_concepts: keep
            "@hookimpl\ndef lmplug_register_compressors():\n    return []\n"),  # rename_concepts: keep
        "core/cli/x.py": 'info = registry.get("drafter", m)\nold = ("drafter",)  # rename_concepts: keep\n',
        "pyproject.toml": 'compressor = "lmplug_compressor"\n',  # rename_concepts: keep
        "CHANGELOG.md": "- lmplug_compressor was added\n",  # rename_concepts: keep
    }
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "old names"], cwd=repo, check=True)

    assert _run(repo, "--check").returncode == 1
    assert _run(repo).returncode == 0
    assert (repo / "core/speculative/new_stage.py").read_text() == "from lmplug.speculative.verifier import x\n"
    assert not any((repo / "core/speculation").rglob("*.py"))  # rename_concepts: keep
    assert (repo / "plugins/compression/__init__.py").read_text() == (
        "import lmplug_compression.units\n@hookimpl\ndef lmplug_register_compression_methods():\n    return []\n")
    assert (repo / "core/cli/x.py").read_text() == (
        'info = registry.get("speculative", m)\nold = ("drafter",)  # rename_concepts: keep\n')
    assert (repo / "pyproject.toml").read_text() == 'compression = "lmplug_compression"\n'
    assert (repo / "CHANGELOG.md").read_text() == files["CHANGELOG.md"]
    snapshot = {p: p.read_text() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    second = _run(repo)
    assert second.returncode == 0 and "nothing to change" in second.stdout
    assert _run(repo, "--check").returncode == 0
    assert {p: p.read_text() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts} == snapshot
