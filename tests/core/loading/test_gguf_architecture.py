"""A GGUF file is read by the architecture chosen for its ``general.architecture`` (before its
metadata is translated): that architecture's config translation, tensor names and Q/K permutation."""

from __future__ import annotations

import types

import pytest
import torch
from lmplug_models.architectures import LlamaArchitecture
from support.gguf_fixtures import HEADS, write_tiny_gguf

from lmplug.engine.architecture import open_checkpoint
from lmplug.errors import ModelLoadError
from lmplug.hookspecs import hookimpl
from lmplug.interfaces.common import Capabilities
from lmplug.loading.gguf import unpermute_rows
from lmplug.plugins import Registry

Q = "model.layers.0.self_attn.q_proj.weight"


class Tagged(LlamaArchitecture):
    """A plugin's reader of llama GGUFs that outranks the first-party one, marks the config it
    translates and (wrongly, on purpose) says the Q/K rows are not permuted."""

    name = "tagged"
    gguf_architectures = ("llama",)
    gguf_permuted = frozenset()
    capabilities = Capabilities(devices=frozenset({"cpu"}), features=LlamaArchitecture.capabilities.features,
                                priority=20)

    @classmethod
    def gguf_config(cls, header):
        return {**super().gguf_config(header), "tagged_by": cls.name}


@pytest.fixture
def registry() -> Registry:
    reg = Registry()
    plugin = types.ModuleType("tagged")
    plugin.LMPLUG_API_VERSION = 3
    plugin.lmplug_register_architectures = hookimpl(lambda: [Tagged])
    assert reg.register(plugin, name="tagged", distribution="tagged-archs 1.0")
    return reg


def test_the_chosen_architecture_translates_names_and_permutation(tmp_path, registry):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    source, (info, why) = open_checkpoint(path, "auto", registry)
    assert info.name == "tagged" and "GGUF architecture 'llama'" in why and "also serving: 'llama'" in why
    assert source.hf_config["tagged_by"] == "tagged" and source.hf_config["model_type"] == "llama"
    plain, (first_party, _) = open_checkpoint(path, "llama", registry)
    assert first_party.name == "llama" and "tagged_by" not in plain.hf_config
    q_tagged = dict(source.iter_tensors())[Q]
    q_llama = dict(plain.iter_tensors())[Q]
    # the first-party reader undoes llama.cpp's row permutation; the tagged one declared none
    assert not torch.equal(q_tagged, q_llama)
    assert torch.equal(unpermute_rows(q_tagged, HEADS), q_llama)


def test_a_gguf_no_architecture_reads_names_the_ones_installed(tmp_path, registry):
    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, arch="phi2")
    with pytest.raises(ModelLoadError, match=r"phi\.gguf: GGUF architecture 'phi2' is not supported; "
                       r"the installed architectures that read GGUF files: ") as err:
        open_checkpoint(path, "auto", registry)
    readers = str(err.value).partition("read GGUF files: ")[2].split("), ")
    for reader in ("gemma (gemma2, gemma3", "llama (llama, qwen2, qwen3", "phi3 (phi3", "tagged (llama)"):
        assert reader in readers, readers
    with pytest.raises(ModelLoadError, match=r"model_impl: 'transformers' does not read GGUF architecture 'phi2'"):
        open_checkpoint(path, "transformers", registry)
