"""The ``disk`` KV connector on its own: damaged, truncated and foreign files are refused with a
warning naming the file, the folder stays under ``max_gb`` (least recently used go first), a
folder that cannot be written is a ``ConfigError`` naming ``kvconnector.path``, failed writes
never raise, and several writers on one folder leave only whole files."""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest
import torch
from lmplug_kvconnector.disk import STALE_TMP_S, DiskConnector
from support.disk_tier import FMT, opened, stored

from lmplug.api import KVBlockFormat
from lmplug.errors import ConfigError
from lmplug.testing.kvconnector import block_payload, same_bits


@pytest.mark.parametrize("fsync", [False, True])
def test_files_are_named_by_format_and_key(tmp_path, monkeypatch, fsync):
    monkeypatch.setenv("HOME", str(tmp_path))
    connector, blocks = stored("~/kv", 3, fsync=fsync)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert names == sorted(f"kv/{FMT.digest}/{key:032x}.kvb" for key in blocks)
    assert connector.stats()["files"] == 3 and connector.stats()["writes"] == 3
    connector.close()
    again = opened(tmp_path / "kv")
    assert all(same_bits(payload, again.get(key)) is None for key, payload in blocks.items())
    again.close()


def test_open_removes_stale_temporary_files_only(tmp_path):
    folder = tmp_path / FMT.digest
    folder.mkdir()
    # the names the tier writes: <32 hex>.kvb.tmp.<pid>.<8 hex>; other names are never its own
    stale, fresh = folder / f"{'ab' * 16}.kvb.tmp.1.0000abcd", folder / f"{'cd' * 16}.kvb.tmp.2.0000abcd"
    foreign = folder / "notes.tmp.1.00"
    foreign.write_bytes(b"someone else's")
    os.utime(foreign, (time.time() - 2 * STALE_TMP_S,) * 2)
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 2 * STALE_TMP_S,) * 2)
    opened(tmp_path).close()
    assert not stale.exists() and fresh.exists() and foreign.exists()


def damage_flip(path):
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x40  # a bit in the tensor data
    path.write_bytes(bytes(blob))


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def damage_header(path):
    path.write_bytes(path.read_bytes().replace(b'"tensors"', b'"tensorz"'))


def damage_empty(path):
    path.write_bytes(b"")


def damage_magic(path):
    path.write_bytes(b"PK" + path.read_bytes()[2:])


@pytest.mark.parametrize("damage, reason", [
    (damage_flip, "checksum"), (damage_truncate, "truncated"), (damage_header, "header"),
    (damage_empty, "truncated"), (damage_magic, "not a block file"),
])
def test_a_bad_file_is_refused_with_a_warning_and_removed(tmp_path, caplog, damage, reason):
    connector, blocks = stored(tmp_path, 2)
    bad, good = list(blocks)
    damage(connector.file(bad))
    with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.disk"):
        assert connector.get(bad) is None
    [record] = caplog.records
    assert str(connector.file(bad)) in record.message and reason in record.message
    assert not connector.file(bad).exists() and not connector.contains(bad)
    assert same_bits(blocks[good], connector.get(good)) is None
    assert connector.stats()["bad_files"] == 1
    connector.close()


@pytest.mark.parametrize("other", [
    KVBlockFormat("other-model:def", FMT.layout),
    KVBlockFormat(FMT.model, FMT.layout.replace("bs=4", "bs=8")),
])
def test_a_file_written_for_another_format_is_refused(tmp_path, caplog, other):
    """A file copied into this format's folder from another model's or layout's is foreign."""
    theirs, blocks = stored(tmp_path, 1, fmt=other)
    [key] = blocks
    ours = opened(tmp_path)
    ours.file(key).write_bytes(theirs.file(key).read_bytes())
    with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.disk"):
        assert ours.get(key) is None
    assert "another" in caplog.text and str(ours.file(key)) in caplog.text
    assert same_bits(blocks[key], theirs.get(key)) is None, "the other format's own file is untouched"
    theirs.close()
    ours.close()


def test_a_file_under_another_key_is_refused(tmp_path, caplog):
    connector, blocks = stored(tmp_path, 2)
    a, b = list(blocks)
    connector.file(b).write_bytes(connector.file(a).read_bytes())
    with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.disk"):
        assert connector.get(b) is None
    assert f"holds block {a:032x}" in caplog.text
    connector.close()


def test_size_limit_evicts_least_recently_used(tmp_path):
    probe, _ = stored(tmp_path / "probe", 1)
    size = probe.stats()["bytes"]
    probe.close()
    limit_files = 5
    connector = opened(tmp_path / "tier", max_gb=(limit_files + 0.5) * size / 2**30)
    rng = random.Random(1)
    keys = [rng.getrandbits(128) for _ in range(12)]
    payloads = {k: block_payload("float32", rng) for k in keys}
    for i, key in enumerate(keys):
        connector.put(key, payloads[key])
        connector.flush()
        if i >= 1:
            assert connector.get(keys[0]) is not None, "a block in use must stay (least recently used goes)"
    on_disk = [p for p in (tmp_path / "tier").rglob("*.kvb")]
    assert len(on_disk) == limit_files and sum(p.stat().st_size for p in on_disk) <= connector.limit
    kept = {k for k in keys if connector.contains(k)}
    assert kept == {keys[0], *keys[-(limit_files - 1):]}
    assert connector.stats()["evictions"] == len(keys) - limit_files
    connector.close()


def test_open_indexes_the_folder_and_enforces_the_limit(tmp_path):
    first, blocks = stored(tmp_path, 6)
    size = first.stats()["bytes"] // 6
    first.close()
    second = opened(tmp_path, max_gb=3.5 * size / 2**30)
    assert second.stats()["files"] == 3 and len(list(tmp_path.rglob("*.kvb"))) == 3
    assert sum(second.contains(k) for k in blocks) == 3
    second.close()


def test_a_folder_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"kvconnector\.path"):
        opened(blocker / "tier")


def test_a_failed_write_is_logged_once_and_never_raised(tmp_path, caplog):
    connector = opened(tmp_path)
    bad = {"kv": torch.zeros(2, dtype=torch.complex64)}  # a dtype the file format does not hold
    with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.disk"):
        for key in range(3):
            connector.put(key, bad)
        connector.flush()
    assert len(caplog.records) == 1 and "could not store" in caplog.text
    assert connector.stats()["write_errors"] == 3
    assert not any(connector.contains(k) for k in range(3))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "no temporary file may be left"
    connector.close()


def test_writers_sharing_a_folder_leave_whole_files(tmp_path):
    """Four connectors (as four engines would) put overlapping blocks at once; every file then
    reads back as one of the blocks put under its key."""
    rng = random.Random(7)
    blocks = {rng.getrandbits(128): block_payload("bfloat16", rng, block_size=16) for _ in range(40)}
    keys = list(blocks)
    writers = [opened(tmp_path) for _ in range(4)]

    def write(connector: DiskConnector, seed: int) -> None:
        for key in random.Random(seed).sample(keys, 30):
            connector.put(key, blocks[key])
        connector.flush()

    threads = [threading.Thread(target=write, args=(w, i)) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        w.close()
    reader = opened(tmp_path)
    files = list(tmp_path.rglob("*"))
    assert all(p.suffix == ".kvb" for p in files if p.is_file()), "temporary files left behind"
    assert {int(p.stem, 16) for p in files if p.is_file()} <= set(keys)
    for p in files:
        if p.is_file():
            assert same_bits(blocks[int(p.stem, 16)], reader.get(int(p.stem, 16))) is None, p
    reader.close()
