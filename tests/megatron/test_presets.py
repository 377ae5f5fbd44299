"""Qwen3-MoE presets: architecture flags, the HF Qwen3MoeConfig twin, CPU support module."""

import pytest
import torch
import torch.nn.functional as F

from quads_megatron.megatron import cpu
from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_config, qwen3_moe_model_args


def test_tiny_preset_is_qwen3_moe_shaped():
    c = qwen3_moe_config("tiny")
    assert c.normalization == "RMSNorm" and c.gated_linear_unit and c.activation_func is F.silu
    assert c.qk_layernorm and not c.add_bias_linear and not c.add_qkv_bias
    assert c.num_query_groups < c.num_attention_heads  # GQA
    assert (c.moe_router_score_function, c.moe_router_pre_softmax) == ("softmax", False)
    assert 4 <= c.num_moe_experts <= 8 and c.moe_router_topk == 2 and c.num_layers == 2
    assert 64 <= c.hidden_size <= 128
    if not torch.cuda.is_available():
        assert c.use_cpu_initialization and not c.gradient_accumulation_fusion
    assert not c.sequence_parallel
    assert qwen3_moe_config("tiny", tensor_model_parallel_size=2).sequence_parallel


def test_qwen3_30b_a3b_shape_and_hf_twin():
    from transformers import Qwen3MoeConfig

    c = qwen3_moe_config("qwen3-30b-a3b")
    assert (c.num_layers, c.hidden_size, c.num_moe_experts, c.moe_router_topk) == (48, 2048, 128, 8)
    assert (c.moe_ffn_hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (768, 32, 4, 128)
    args = qwen3_moe_model_args("qwen3-30b-a3b")
    hf = Qwen3MoeConfig(**hf_qwen3_moe_config_dict(c, args["vocab_size"], args["max_seq_len"],
                                                   args["rotary_base"]))
    assert (hf.num_hidden_layers, hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok) == (48, 768, 128, 8)
    assert hf.head_dim == 128 and hf.num_key_value_heads == 4 and hf.norm_topk_prob
    assert hf.vocab_size == 151936 and hf.rope_parameters["rope_theta"] == 1_000_000


def test_bad_preset_or_override():
    with pytest.raises(ValueError, match="unknown Qwen3-MoE preset 'huge'"):
        qwen3_moe_config("huge")
    with pytest.raises(ValueError, match=r"\['hidden'\] are not TransformerConfig fields"):
        qwen3_moe_config("tiny", hidden=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU support is a no-op with CUDA")
def test_cpu_support_patches_and_maps_cuda_to_cpu():
    assert cpu.setup_megatron_cpu() and cpu.setup_megatron_cpu()  # idempotent
    assert torch.cuda.current_device() == torch.device("cpu")
    with cpu.cuda_to_cpu():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t and t.type() == "torch.cuda.FloatTensor"


def test_hf_config_keeps_the_router_normalisation():
    """norm_topk_prob=False maps to pre_softmax routing and back (it was hard-coded True)."""
    from quads_megatron.models import qwen3_moe
    from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_config

    for norm in (True, False):
        hf = hf_qwen3_moe_config_dict(qwen3_moe_config("tiny"), 256, 64)
        hf["norm_topk_prob"] = norm
        cfg = qwen3_moe_config("tiny", **qwen3_moe.megatron_config_kwargs(hf))
        assert hf_qwen3_moe_config_dict(cfg, 256, 64)["norm_topk_prob"] is norm
