"""Hostile or broken weight files (GGUF, safetensors) fail with a ModelLoadError naming the file
and the tensor or key; each case takes a valid tiny file and corrupts one thing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file, save_file
from support.gguf_fixtures import write_tiny_gguf
from support.hf_models import get_model, one_torch_thread  # noqa: F401

from lmplug import LLM, ModelLoadError
from lmplug.loading import open_source

WEIGHTS = "model.safetensors"


def load(path):
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=64)


def error_of(fn, *args) -> str:
    with pytest.raises(ModelLoadError) as info:
        fn(*args)
    return str(info.value)


# -- GGUF -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def gguf_file(good_gguf, tmp_path):
    dest = tmp_path / "tiny.gguf"
    shutil.copy(good_gguf, dest)
    return dest


def set_tensor_info(path, name: str, *, offset: int | None = None, dim0: int | None = None) -> None:
    """Rewrite one tensor info in place (the reader's fields are views of the mapping)."""
    reader = GGUFReader(path, mode="r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    parts = tensor.field.parts
    if offset is not None:
        parts[5][0] = np.uint64(offset)
    if dim0 is not None:
        parts[3][0] = np.uint64(dim0)
    reader.data.flush()
    del reader


def offset_of(path, name: str) -> int:
    return next(int(t.field.parts[5][0]) for t in GGUFReader(path).tensors if t.name == name)


def test_good_gguf_opens(gguf_file):
    assert "model.norm.weight" in open_source(gguf_file).tensor_names


@pytest.mark.parametrize("offset", [2**64 - 1, 2**64 - 32, 2**64 - 4096])
def test_gguf_offset_wrapping_around(gguf_file, offset):
    # before: 2**64-32 wrapped to 32 bytes before the data section and loaded header bytes
    set_tensor_info(gguf_file, "output_norm.weight", offset=offset)
    msg = error_of(open_source, gguf_file)
    assert str(gguf_file) in msg and "'output_norm.weight'" in msg


def test_gguf_overlapping_tensors(gguf_file):
    set_tensor_info(gguf_file, "blk.0.attn_norm.weight", offset=offset_of(gguf_file, "output_norm.weight"))
    msg = error_of(open_source, gguf_file)
    assert str(gguf_file) in msg and "overlap" in msg and "'blk.0.attn_norm.weight'" in msg


def test_gguf_misaligned_offset(gguf_file):
    set_tensor_info(gguf_file, "output_norm.weight", offset=offset_of(gguf_file, "output_norm.weight") + 4)
    msg = error_of(open_source, gguf_file)
    assert "'output_norm.weight'" in msg and "alignment 32" in msg


def test_gguf_offset_past_the_end(gguf_file):
    set_tensor_info(gguf_file, "output_norm.weight", offset=gguf_file.stat().st_size // 32 * 32)
    msg = error_of(open_source, gguf_file)
    assert "'output_norm.weight'" in msg and "truncated" in msg


def test_gguf_truncated_names_the_tensor(gguf_file):
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[:-100])
    msg = error_of(open_source, gguf_file)
    assert str(gguf_file) in msg and "truncated" in msg and "tensor '" in msg


def test_gguf_shape_not_whole_blocks(gguf_file):
    quantized = next(t for t in GGUFReader(gguf_file).tensors if t.tensor_type.name == "Q8_0")
    set_tensor_info(gguf_file, quantized.name, dim0=31)
    msg = error_of(open_source, gguf_file)
    assert f"'{quantized.name}'" in msg and "blocks" in msg


# -- safetensors ------------------------------------------------------------------------------------

def rewrite_header(model_dir, edit) -> None:
    """Replace the safetensors header by ``edit(header)`` (keeping the data bytes)."""
    f = model_dir / WEIGHTS
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8:8 + n]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("header", [[1, 2], 7, "x", None])
def test_header_not_an_object(model_dir, header):
    rewrite_header(model_dir, lambda h: header)  # before: AttributeError: 'list' has no 'items'
    msg = error_of(load, model_dir)
    assert WEIGHTS in msg and "JSON object" in msg


@pytest.mark.parametrize("key, value, expect", [
    ("data_offsets", None, "'data_offsets'"),  # before: TypeError without the file
    ("data_offsets", [5], "'data_offsets'"),
    ("data_offsets", ["0", "8"], "'data_offsets'"),
    ("data_offsets", [8, 0], "'data_offsets'"),
    ("dtype", "F33", "'dtype'"),
    ("shape", "64", "'shape'"),
    ("shape", [64.5], "'shape'"),
    ("shape", [1, 1], "needs"),  # shape x dtype disagrees with the byte span
])
def test_bad_entry(model_dir, key, value, expect):
    names = []

    def edit(h):
        names.append(first_tensor(h))
        if value is None:
            h[names[0]].pop(key)
        else:
            h[names[0]][key] = value
        return h

    rewrite_header(model_dir, edit)
    msg = error_of(load, model_dir)
    assert WEIGHTS in msg and f"tensor {names[0]!r}" in msg and expect in msg


def test_entry_not_an_object(model_dir):
    rewrite_header(model_dir, lambda h: {**h, first_tensor(h): [1, 2]})
    msg = error_of(load, model_dir)
    assert WEIGHTS in msg and "entry must be an object" in msg


def test_metadata_not_strings(model_dir):
    rewrite_header(model_dir, lambda h: {**h, "__metadata__": {"format": 3}})
    msg = error_of(load, model_dir)
    assert WEIGHTS in msg and "__metadata__" in msg


def test_offsets_past_the_end(model_dir):
    def edit(h):
        entry = h[first_tensor(h)]
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [begin + 10**12, end + 10**12]
        return h

    rewrite_header(model_dir, edit)
    msg = error_of(load, model_dir)
    assert WEIGHTS in msg and "truncated" in msg


def test_overlapping_tensors(model_dir):
    def edit(h):
        a, b = [k for k in h if k != "__metadata__" and h[k]["dtype"] == "F32"
                and h[k]["shape"] == [64]][:2]
        h[b]["data_offsets"] = list(h[a]["data_offsets"])
        return h

    rewrite_header(model_dir, edit)
    msg = error_of(load, model_dir)
    assert WEIGHTS in msg and "overlap" in msg


# -- weights ----------------------------------------------------------------------------------------

def replace_tensor(model_dir, name: str, make) -> None:
    f = model_dir / WEIGHTS
    tensors = load_file(str(f))
    tensors[name] = make(tensors[name])
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"])
def test_integer_weight_refused(model_dir, name):
    replace_tensor(model_dir, name, lambda t: t.to(torch.int32))  # before: loaded, truncated to ints
    msg = error_of(load, model_dir)
    assert str(model_dir) in msg and repr(name) in msg and "integer" in msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_refused(model_dir, bad):
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(t):
        t = t.clone()
        t[3, 5] = bad
        return t

    replace_tensor(model_dir, name, poison)  # before: loaded; every output NaN
    msg = error_of(load, model_dir)
    assert str(model_dir) in msg and repr(name) in msg and "NaN or infinite" in msg
