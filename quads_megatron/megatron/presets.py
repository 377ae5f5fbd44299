"""Qwen3-MoE-shaped Megatron-Core TransformerConfig presets (tiny for CPU tests, Qwen3-30B-A3B) and the matching HF config."""

import dataclasses

import torch
import torch.nn.functional as F

from quads_megatron.megatron import cpu

# Architecture numbers per preset. "model" holds what GPTModel (not TransformerConfig) needs.
PRESETS = {
    # A few hundred thousand parameters: cheap enough for torchrun tests on 2 CPU cores.
    # head_dim 16 with 4 query heads / 2 KV groups (GQA); every expert K is a multiple of 16
    # even when split over 2 ranks (fc2 K = 64 / 2 = 32).
    "tiny": dict(
        transformer=dict(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, kv_channels=16, num_moe_experts=4, moe_router_topk=2,
            moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-3, layernorm_epsilon=1e-6,
        ),
        model=dict(vocab_size=256, max_seq_len=64, rotary_base=1_000_000),
    ),
    # GPU-sized (~240M parameters, ~41M active): big enough to show quantization effects, small enough to
    # pretrain in minutes on one H200. 32 experts top-4 (Qwen3-30B-A3B's 1/16 sparsity ratio is 8/128),
    # head_dim 64, GQA 12/4; vocab 128 rows (the character tokenizer) so all compute is in the blocks.
    "moe-240m": dict(
        transformer=dict(
            num_layers=8, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12,
            num_query_groups=4, kv_channels=64, num_moe_experts=32, moe_router_topk=4,
            moe_ffn_hidden_size=384, moe_aux_loss_coeff=1e-3, layernorm_epsilon=1e-6,
        ),
        model=dict(vocab_size=128, max_seq_len=1024, rotary_base=1_000_000),
    ),
    # Qwen/Qwen3-30B-A3B config.json.
    "qwen3-30b-a3b": dict(
        transformer=dict(
            num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
            num_query_groups=4, kv_channels=128, num_moe_experts=128, moe_router_topk=8,
            moe_ffn_hidden_size=768, moe_aux_loss_coeff=1e-3, layernorm_epsilon=1e-6,
        ),
        model=dict(vocab_size=151936, max_seq_len=40960, rotary_base=1_000_000),
    ),
}

# Fixed Qwen3-MoE architecture choices shared by every preset.
_QWEN3_MOE_COMMON = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,          # SwiGLU: linear_fc1 holds [gate; up]
    activation_func=F.silu,
    add_bias_linear=False,
    add_qkv_bias=False,
    qk_layernorm=True,               # Qwen3 q_norm / k_norm (RMSNorm over head_dim)
    # Qwen3 router: softmax over all experts, top-k, renormalise (norm_topk_prob=True).
    # Megatron's top-k-then-softmax (pre_softmax=False) is the same distribution.
    moe_router_score_function="softmax",
    moe_router_pre_softmax=False,
    moe_router_load_balancing_type="aux_loss",
    moe_router_dtype="fp32",         # router GEMM + softmax in fp32 (HF softmaxes in fp32 too)
    moe_token_dispatcher_type="alltoall",
    moe_grouped_gemm=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_method_std=0.02,
)


def _preset(preset: str) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown Qwen3-MoE preset {preset!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[preset]


def qwen3_moe_config(preset: str = "tiny", **overrides):
    """Megatron-Core TransformerConfig for a Qwen3-MoE model; overrides win over preset and CPU flags.

    On a machine without usable CUDA the fields from ``cpu.cpu_config_overrides()`` are set
    (CPU initialisation, no fused kernels).  ``sequence_parallel`` defaults to True when
    ``tensor_model_parallel_size > 1`` (Megatron requires it for MoE + TP).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"qwen3_moe_config: {unknown} are not TransformerConfig fields")
    kwargs = dict(_QWEN3_MOE_COMMON)
    kwargs.update(_preset(preset)["transformer"])
    if not cpu.cuda_usable():
        kwargs.update(cpu.cpu_config_overrides())
    kwargs.update(overrides)
    if "sequence_parallel" not in overrides:
        kwargs["sequence_parallel"] = kwargs.get("tensor_model_parallel_size", 1) > 1
    dtype = kwargs.get("params_dtype", torch.float32)
    kwargs.setdefault("bf16", dtype == torch.bfloat16)
    return TransformerConfig(**kwargs)


def qwen3_moe_model_args(preset: str = "tiny") -> dict:
    """GPTModel-level numbers of a preset: vocab_size, max_seq_len, rotary_base."""
    return dict(_preset(preset)["model"])


def hf_qwen3_moe_config_dict(config, vocab_size: int, max_seq_len: int,
                             rotary_base: float = 1_000_000, tie_word_embeddings: bool = False) -> dict:
    """HF ``Qwen3MoeConfig(**d)`` kwargs describing the same architecture as a Megatron config."""
    if not config.gated_linear_unit or config.normalization != "RMSNorm" or config.add_bias_linear:
        raise ValueError("hf_qwen3_moe_config_dict: config is not Qwen3-MoE shaped "
                         "(needs SwiGLU, RMSNorm, no linear biases)")
    if config.num_moe_experts is None:
        raise ValueError("hf_qwen3_moe_config_dict: config has no MoE experts (num_moe_experts=None)")
    if config.moe_layer_freq != 1:
        raise ValueError(f"hf_qwen3_moe_config_dict: moe_layer_freq={config.moe_layer_freq!r}; "
                         "only every-layer MoE (1) maps onto Qwen3MoeConfig here")
    return dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        hidden_act="silu",
        max_position_embeddings=max_seq_len,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(rotary_base)},
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        # Megatron's top-k-then-softmax renormalises (HF norm_topk_prob=True); pre_softmax keeps
        # the softmax over all experts (norm_topk_prob=False), as models.qwen3_moe maps it.
        norm_topk_prob=not config.moe_router_pre_softmax,
        router_aux_loss_coef=float(config.moe_aux_loss_coeff),
        initializer_range=config.init_method_std,
        dtype="bfloat16",
    )
