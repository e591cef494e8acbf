"""The disk KV tier in a hostile folder (issue 45, item 6): what is not the tier's own is never
read, waited on, touched or deleted. Links to FIFOs, devices, regular files and other folders,
FIFOs in place of blocks, someone else's temporary files: each case checks the bytes, names and
mtimes of everything outside the tier's own files, and that the engine keeps serving (its reads
run under a deadline, in a thread the test joins with a timeout)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time

import pytest
from lmplug_kvconnector.disk import STALE_TMP_S
from support.disk_tier import FMT, opened, stored
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError
from lmplug.testing.kvconnector import same_bits

OLD = time.time() - 3 * STALE_TMP_S
WAIT_S = 60.0  # a call that blocks on a FIFO never returns: the join fails the test instead


def snapshot(folder) -> dict[str, tuple[float, str]]:
    """Every entry under ``folder`` (links not followed): the mtime and a digest of the bytes of
    each file, link and FIFO (a folder: its name only)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), folder)] = (0, "folder")
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if os.path.islink(path):
                body = os.readlink(path).encode()
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    body = fh.read()
            else:
                body = b""
            out[os.path.relpath(path, folder)] = (st.st_mtime_ns, hashlib.sha256(body).hexdigest())
    return out


def in_time(fn, *args):
    """``fn(*args)`` in a thread that must finish within ``WAIT_S`` (a FIFO that blocked it is
    opened for writing afterwards, so that the thread can end)."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    worker.start()
    worker.join(WAIT_S)
    return worker.is_alive(), result.get("value")


def unblock(fifo) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_links_fifos_and_devices_in_place_of_blocks_are_never_read(tmp_path, caplog):
    """A block's name held by a link to a FIFO, to a device, to a valid block elsewhere, or by a
    FIFO itself: a miss (warned), never a wait and never a read of the target."""
    connector, blocks = stored(tmp_path / "kv", 5)
    keys = list(blocks)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fifo = elsewhere / "fifo"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "fifo_here")
    valid = elsewhere / "valid.kvb"  # a whole, correct block file of keys[2], reached through a link
    valid.write_bytes(connector.file(keys[2]).read_bytes())
    os.utime(valid, (OLD, OLD))
    placed = {keys[0]: fifo, keys[1]: "/dev/zero", keys[2]: valid, keys[3]: tmp_path / "fifo_here"}
    for key, target in placed.items():
        connector.file(key).unlink()
        if key == keys[3]:
            os.mkfifo(connector.file(key))  # a FIFO in the block's own place, no link
        else:
            connector.file(key).symlink_to(target)
    before = snapshot(elsewhere)
    restarted = opened(tmp_path / "kv")  # what it finds at start-up
    try:
        with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.disk"):
            for tier in (connector, restarted):  # planted while running, or found at open
                for key in placed:
                    stuck, value = in_time(tier.get, key)
                    assert not stuck, f"get of block {key:032x} blocked"
                    assert value is None
                assert same_bits(blocks[keys[4]], tier.get(keys[4])) is None
            assert not any(restarted.contains(key) for key in placed)
            assert restarted.stats()["files"] == 1
    finally:
        unblock(fifo)
        unblock(connector.file(keys[3]))
    assert snapshot(elsewhere) == before, "a link's target was read, touched or changed"
    assert all(os.path.lexists(connector.file(k)) for k in placed), "what is not the tier's own stays"
    for key in placed:
        assert str(connector.file(key)) in caplog.text
    # a put of those keys leaves them in place and writes nothing through them
    for key in placed:
        connector.put(key, blocks[key])
    connector.flush()
    assert snapshot(elsewhere) == before and os.path.islink(connector.file(keys[0]))
    connector.close()
    restarted.close()


def test_open_with_a_small_max_gb_deletes_nothing_outside_its_folders(tmp_path):
    """A link inside the tier's root to another folder of old ``*.kvb`` files, block links to
    old files elsewhere, someone else's files with block names: with a limit of one block, open
    evicts only the tier's own old files."""
    first, _ = stored(tmp_path / "other_tier", 4)  # real block files, of a valid format
    first.close()
    other = first.folder
    root = tmp_path / "kv"
    mine, own_blocks = stored(root, 3, seed=1)
    size = mine.stats()["bytes"] // 3
    mine.close()
    (root / "linked_folder").symlink_to(other, target_is_directory=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for i, path in enumerate(other.iterdir()):
        os.utime(path, (OLD - i, OLD - i))
        target = elsewhere / path.name
        target.write_bytes(path.read_bytes())
        os.utime(target, (OLD, OLD))
        (mine.folder / f"{i:032x}.kvb").symlink_to(target)  # a block name that links elsewhere
    before = {"other": snapshot(other), "elsewhere": snapshot(elsewhere)}
    again = opened(root, max_gb=1.5 * size / 2**30)
    assert again.stats()["files"] == 1 and again.stats()["evictions"] == 2
    assert {"other": snapshot(other), "elsewhere": snapshot(elsewhere)} == before
    assert len([p for p in mine.folder.iterdir() if p.is_symlink()]) == 4
    kept = [k for k in own_blocks if again.contains(k)]
    assert len(kept) == 1 and same_bits(own_blocks[kept[0]], again.get(kept[0])) is None
    for i in range(4):  # the links under block names: misses, never read
        assert again.get(i) is None
    assert {"other": snapshot(other), "elsewhere": snapshot(elsewhere)} == before
    again.close()


def test_a_format_folder_that_is_a_link_is_refused_at_open(tmp_path):
    """``<path>/<format digest>`` linked to another folder of old block files: a ConfigError
    naming ``kvconnector.path``; nothing in that folder read, touched or deleted."""
    first, _ = stored(tmp_path / "other_tier", 3)
    first.close()
    for path in first.folder.iterdir():
        os.utime(path, (OLD, OLD))
    root = tmp_path / "kv"
    root.mkdir()
    (root / FMT.digest).symlink_to(first.folder, target_is_directory=True)
    before = snapshot(first.folder)
    with pytest.raises(ConfigError, match=r"kvconnector\.path.*link"):
        opened(root, max_gb=1e-9)
    assert snapshot(first.folder) == before


def test_only_the_tiers_own_stale_temporary_files_are_removed(tmp_path):
    """Old files with ``.tmp.`` in their names written by someone else (other names, a link
    under the tier's own pattern, a FIFO) stay; only the tier's own pattern, a regular file, goes."""
    folder = tmp_path / FMT.digest
    folder.mkdir()
    ours = folder / f"{'ab' * 16}.kvb.tmp.{os.getpid()}.0123abcd"
    someone = [folder / "draft.tmp.123", folder / "x.kvb.tmp.1.0000abcd", folder / f"{'ab' * 16}.kvb.tmp.12",
               folder / f"{'ab' * 16}.kvb.tmp.1.0000abcd.bak", tmp_path / "notes.tmp.7.0123abcd"]
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    link = folder / f"{'cd' * 16}.kvb.tmp.1.0000abcd"
    link.symlink_to(target)
    fifo = folder / f"{'ef' * 16}.kvb.tmp.1.0000abcd"
    os.mkfifo(fifo)
    for path in [ours, *someone]:
        path.write_bytes(b"partial")
    for path in [ours, *someone, target, fifo]:
        os.utime(path, (OLD, OLD))
    os.utime(link, (OLD, OLD), follow_symlinks=False)
    before = snapshot(tmp_path)
    stuck, connector = in_time(opened, tmp_path)
    assert not stuck, "open blocked"
    after = snapshot(tmp_path)
    assert set(before) - set(after) == {os.path.relpath(ours, tmp_path)}
    assert all(after[name] == before[name] for name in after)
    connector.close()


def test_a_hung_read_blocks_the_engine_thread_at_most_io_timeout_s(tmp_path, monkeypatch, caplog):
    """A read that never returns (a hung mount; simulated) costs the caller ``io_timeout_s`` once,
    then the tier is off: every later get and contains answers at once, as a miss."""
    from lmplug_kvconnector import disk
    connector, blocks = stored(tmp_path, 3, io_timeout_s=0.5)
    release = threading.Event()
    real = disk.read_regular
    monkeypatch.setattr(disk, "read_regular", lambda *a: (release.wait(), real(*a))[1])
    key, *rest = list(blocks)
    with caplog.at_level(logging.WARNING, logger="lmplug_kvconnector.disk"):
        stuck, value = in_time(connector.get, key)
        assert not stuck and value is None
        assert "io_timeout_s" in caplog.text
        for other in rest:
            assert in_time(connector.get, other) == (False, None)
            assert in_time(connector.contains, other) == (False, False)
    assert connector.stats()["io_timeouts"] == 1
    release.set()
    connector.close()


# -- the engine ----------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_the_engine_keeps_serving_with_fifos_and_links_in_its_tier(tmp_path):
    """A restarted engine whose tier folder now holds a link to a FIFO, a link to a device and a
    FIFO under block names serves every prompt within a deadline, with the tokens of an engine
    without a tier, and loads nothing through them."""
    model = get_model("llama", tmp_path / "m").path
    kv = {"backend": "paged", "block_size": 4, "num_blocks": 32, "prefix_caching": True}
    tier = {"backend": "disk", "path": str(tmp_path / "kv")}
    prompts = [prompt_ids(n, seed) for n, seed in ((21, 1), (18, 2), (25, 3))]
    with LLM(str(model), dtype="float32", device="cpu", max_model_len=64) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(str(model), dtype="float32", device="cpu", max_model_len=64, kvcache=kv, kvconnector=tier) as first:
        first.generate(prompts, GREEDY)
        folder = first.engine.kv.tier.connector.folder
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    files = sorted(folder.iterdir())
    for i, path in enumerate(files):  # every block file replaced: nothing of the tier's own is left
        path.unlink()
        if i % 3 == 0:
            path.symlink_to(fifo)
        elif i % 3 == 1:
            path.symlink_to("/dev/zero")
        else:
            os.mkfifo(path)
    second = LLM(str(model), dtype="float32", device="cpu", max_model_len=64, kvcache=kv, kvconnector=tier)
    try:
        stuck, outputs = in_time(second.generate, prompts, GREEDY)
        assert not stuck, "the engine blocked on its tier folder"
        assert [o.outputs[0].token_ids for o in outputs] == want
        assert second.engine.kv.tier.blocks_loaded == 0
        assert all(os.path.lexists(p) for p in files)
    finally:
        unblock(fifo)
        for path in files:
            unblock(path)
        second.close()
