"""GPT-OSS from a GGUF written as llama.cpp's converter writes one (``conversion/gpt_oss.py``:
architecture ``gpt-oss``, gate and up split out of ``gate_up_proj`` and stored ``[E, I, h]``, the
experts in ggml's MXFP4 type, sinks as ``attn_sinks.weight``), with gguf's own writer and
quantizer, from a tiny transformers model whose experts then take the values the MXFP4 blocks
dequantize to (gguf-py's dequantizer): the experts load packed (ggml's blocks repacked for the
``mxfp4`` method), lmplug's logprobs and greedy tokens match transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmplug.testing.architecture import (
    build_tiny,
    hf_greedy,
    hf_prompt_logprobs,
    our_prompt_logprobs,
    prompt,
)

pytestmark = [pytest.mark.hf]

HIDDEN, INTER, EXPERTS, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 4, 2, 4, 2, 16
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def write_gpt_oss_gguf(path, seed: int = 0, matrices: str = "F32"):
    """(GGUF path, the transformers model it stands for); ``matrices``: the ggml type of the
    embedding, LM head and attention matrices (F32 or Q8_0, which transformers' model then takes)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, RopeScalingType
    from gguf.quants import dequantize, quantize

    from tests.support.gguf_fixtures import add_byte_level_vocab, train_byte_level

    vocab = len(train_byte_level()[0])
    config = {"model_type": "gpt_oss", "vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "sliding_window": 8,
              "max_position_embeddings": 256, "initializer_range": 0.1, "rms_norm_eps": 1e-5,
              "rope_parameters": YARN, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    hf = build_tiny(config, path / "hf", seed)
    writer = GGUFWriter(str(path / "model.gguf"), "gpt-oss")
    add_byte_level_vocab(writer, template=None)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(150000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(INTER)
    writer.add_sliding_window(8)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(64)

    def put(name, tensor):
        if matrices == "F32" or tensor.dim() != 2 or "exps" in name or "gate_inp" in name:
            writer.add_tensor(name, tensor.detach().float().numpy().astype(np.float32))
            return
        data = quantize(tensor.detach().float().numpy(), Q.Q8_0)
        writer.add_tensor(name, data, raw_dtype=Q.Q8_0)
        with torch.no_grad():  # the state dict's tensors are the model's parameters
            tensor.copy_(torch.from_numpy(dequantize(data, Q.Q8_0).reshape(tensor.shape)))

    def put_mxfp4(name, tensor) -> torch.Tensor:
        data = quantize(tensor.detach().float().numpy(), Q.MXFP4)
        writer.add_tensor(name, data, raw_dtype=Q.MXFP4)
        return torch.from_numpy(dequantize(data, Q.MXFP4).reshape(tensor.shape).astype(np.float32))

    sd = hf.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}
    names.update({f"self_attn.{p}_proj.{t}": f"attn_{g}.{t}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                          ("o", "output")) for t in ("weight", "bias")})
    with torch.no_grad():
        for i in range(LAYERS):
            pre = f"model.layers.{i}."
            for hf_name, gguf_name in names.items():
                put(f"blk.{i}.{gguf_name}", sd[pre + hf_name])
            experts = hf.model.layers[i].mlp.experts
            experts.gate_up_proj_bias.copy_(0.2 * torch.randn_like(experts.gate_up_proj_bias))
            gate_up = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, h]
            gate = put_mxfp4(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, ::2].contiguous())
            up = put_mxfp4(f"blk.{i}.ffn_up_exps.weight", gate_up[:, 1::2].contiguous())
            down = put_mxfp4(f"blk.{i}.ffn_down_exps.weight", experts.down_proj.transpose(1, 2).contiguous())
            put(f"blk.{i}.ffn_gate_exps.bias", experts.gate_up_proj_bias[:, ::2])
            put(f"blk.{i}.ffn_up_exps.bias", experts.gate_up_proj_bias[:, 1::2])
            put(f"blk.{i}.ffn_down_exps.bias", experts.down_proj_bias)
            # transformers' model takes the values the file's MXFP4 blocks hold
            experts.gate_up_proj.copy_(torch.stack([gate, up], 2).flatten(1, 2).transpose(1, 2))
            experts.down_proj.copy_(down.transpose(1, 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path / "model.gguf", hf


# the products exact to the float math (each block dequantized, then a float matmul): transformers'
# logprobs at 1e-4; the native kernels (the default) are checked against the dequantized load
EXACT = {"method": "gguf", "kernel": "torch"}
DENSE = {"method": "gguf", "dequantize_at_load": True}
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "attention": {"backend": "sdpa"}}


def _experts(llm):
    model = llm.engine.runner.model
    return [linear for layer in model.layers for proj in (layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for linear in proj]


@pytest.mark.parametrize("matrices", ["F32", "Q8_0"])
def test_gpt_oss_gguf_with_mxfp4_experts_matches_transformers(tmp_path, matrices):
    """The experts stay packed (the ``mxfp4`` method's blocks and scales, repacked from ggml's),
    and the exact products give transformers' logprobs on the file's values and its greedy tokens."""
    from lmplug import LLM, SamplingParams

    path, hf = write_gpt_oss_gguf(tmp_path, matrices=matrices)
    ids = prompt(24, 1, hf.config.vocab_size)
    llm = LLM(str(path), quant=EXACT, **ENGINE)
    assert llm.engine.runner.model.__class__.__name__ == "GptOssForCausalLM"
    for linear in _experts(llm):
        assert linear.blocks.dtype == torch.uint8 and linear.scales.dtype == torch.uint8
        assert linear.blocks.shape == (linear.out_features, linear.in_features // 32, 16)
        assert "weight" not in linear._parameters and linear.gguf_mxfp4 is not None
    out = llm.generate([ids], SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=16, ignore_eos=True))[0]
    torch.testing.assert_close(our_prompt_logprobs(out, ids), hf_prompt_logprobs(hf, ids), atol=1e-4, rtol=0)
    assert out.token_ids == hf_greedy(hf, ids, 16)


@pytest.mark.parametrize("matrices, atol", [("F32", 1e-4), ("Q8_0", 2e-2)])
def test_gpt_oss_gguf_native_kernels_match_the_dequantized_load(tmp_path, matrices, atol):
    """The default kernels (the MXFP4 C kernel on the packed experts; Q8_0's quantizes the
    activations to 8 bits, hence its tolerance) against every weight dequantized at load."""
    from lmplug import LLM, SamplingParams

    path, hf = write_gpt_oss_gguf(tmp_path, matrices=matrices)
    ids = prompt(24, 1, hf.config.vocab_size)
    params = SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=16, ignore_eos=True)
    packed = LLM(str(path), **ENGINE)
    assert all(linear.gguf_mxfp4 is not None for linear in _experts(packed))
    dense = LLM(str(path), quant=DENSE, **ENGINE)
    assert all(linear.weight.dtype == torch.float32 for linear in _experts(dense))
    out_packed, out_dense = packed.generate([ids], params)[0], dense.generate([ids], params)[0]
    torch.testing.assert_close(our_prompt_logprobs(out_packed, ids), our_prompt_logprobs(out_dense, ids),
                               atol=atol, rtol=0)
    assert out_packed.token_ids == out_dense.token_ids


def test_ggml_mxfp4_blocks_repack_bit_exactly():
    """``from_ggml`` against gguf-py's dequantizer (llama.cpp's formula), every nibble and scale
    byte ggml may hold but 255, which is refused (ggml reads it as 2^128, OCP as NaN)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    from lmplug_quant import mxfp4_ref

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(300, 5 * 17), dtype=np.uint8)
    raw.reshape(300, 5, 17)[..., 0] = rng.integers(0, 255, size=(300, 5), dtype=np.uint8)  # e: 0..254
    raw[0, 0] = 0  # the smallest scales (subnormal in float32)
    raw[1, 0] = 1
    blocks, scales = mxfp4_ref.from_ggml(torch.from_numpy(raw))
    want = torch.from_numpy(dequantize(raw, Q.MXFP4).astype(np.float32))
    assert torch.equal(mxfp4_ref.dequantize(blocks, scales), want)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    blocks, scales = mxfp4_ref.from_ggml(torch.from_numpy(quantize(weights, Q.MXFP4)))
    assert torch.equal(mxfp4_ref.dequantize(blocks, scales),
                       torch.from_numpy(dequantize(quantize(weights, Q.MXFP4), Q.MXFP4)))
    raw[7, 17] = 255
    with pytest.raises(ValueError, match="scale byte of 255"):
        mxfp4_ref.from_ggml(torch.from_numpy(raw))


def test_a_gguf_mxfp4_scale_of_255_is_refused_naming_the_file_and_tensor(tmp_path):
    """A scale byte ggml and the OCP format read differently (2^128 vs NaN): refused at load."""
    from gguf import GGUFReader

    from lmplug import LLM
    from lmplug.errors import ModelLoadError

    path, _ = write_gpt_oss_gguf(tmp_path)
    offset = next(int(t.data_offset) for t in GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    with path.open("r+b") as f:
        f.seek(offset + 17 * 3)  # the fourth block's E8M0 byte
        f.write(bytes([255]))
    with pytest.raises(ModelLoadError, match=r"model\.gguf: tensor 'model\.layers\.1\.mlp\.experts\.down_proj\.0"
                                             r"\.weight' holds an MXFP4 scale byte of 255"):
        LLM(str(path), **ENGINE)
