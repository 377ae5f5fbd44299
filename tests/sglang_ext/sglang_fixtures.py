"""Tiny NVFP4 tensors and checkpoints for the SGLang plugin tests (all numerics from quads_megatron.nvfp4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import save_file

from quads_megatron.nvfp4 import quantize, quantize_with_shared_scale
from sglang_ext.checkpoint_format import QuadsSettings

# The tiny Qwen3-MoE: 1 decoder layer, hidden 64, 4 experts of width 32.
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, moe_ffn=32, vocab=128)


def nvfp4_linear(n: int, k: int, seed: int, scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """ModelOpt tensors of a random [n, k] BF16 weight."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale / k ** 0.5).to(torch.bfloat16)
    return quantize(w).to_modelopt()


def nvfp4_gate_up(f: int, h: int, seed: int) -> tuple:
    """Gate and up of one expert quantized with one shared global scale."""
    g = torch.Generator().manual_seed(seed)
    gate, up = ((torch.randn(f, h, generator=g) / h ** 0.5).to(torch.bfloat16) for _ in range(2))
    return tuple(q.to_modelopt() for q in quantize_with_shared_scale([gate, up]))


def comp_index(k_in: int, k: int, seed: int) -> torch.Tensor:
    """A sorted int32 set of k distinct channels of k_in (what calibration would pick)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(k_in, generator=g)[:k].sort().values.to(torch.int32)


def input_scale(seed: int) -> torch.Tensor:
    """A static per-tensor activation decode scale (amax / 2688) for activations ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.tensor((4.0 + torch.rand((), generator=g).item()) / 2688.0, dtype=torch.float32)


def hf_config(quantization_config: Optional[dict]) -> dict:
    """config.json of the tiny Qwen3-MoE (transformers' qwen3_moe model type)."""
    t = TINY
    cfg = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
               vocab_size=t["vocab"], hidden_size=t["hidden"], intermediate_size=64,
               moe_intermediate_size=t["moe_ffn"], num_hidden_layers=1,
               num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
               head_dim=t["head_dim"], hidden_act="silu", max_position_embeddings=256,
               rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
               attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
               num_experts=t["experts"], num_experts_per_tok=t["topk"], norm_topk_prob=True,
               torch_dtype="bfloat16")
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    return cfg


def tiny_tensors(rac_k: int = 0, static: bool = False) -> Dict[str, torch.Tensor]:
    """HF-named tensors of the tiny model: NVFP4 attention and experts, BF16 router/norms/embeddings."""
    t = TINY
    h, f, hd = t["hidden"], t["moe_ffn"], t["head_dim"]
    g = torch.Generator().manual_seed(0)
    out = {
        "model.embed_tokens.weight": torch.randn(t["vocab"], h, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(t["vocab"], h, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    pre = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        out[f"{pre}{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for n in ("q_norm", "k_norm"):
        out[f"{pre}self_attn.{n}.weight"] = torch.ones(hd, dtype=torch.bfloat16)
    out[f"{pre}mlp.gate.weight"] = torch.randn(t["experts"], h, generator=g).to(torch.bfloat16)
    seed = 10

    def linear(name, n, k_in, tensors=None):
        nonlocal seed
        seed += 1
        for key, v in (tensors or nvfp4_linear(n, k_in, seed)).items():
            out[f"{name}.{key}"] = v
        out[f"{name}.input_scale"] = input_scale(seed)
        if rac_k:
            out[f"{name}.input_comp_index"] = comp_index(k_in, rac_k, seed)

    shared_comp = comp_index(h, rac_k, 99) if rac_k else None
    linear(f"{pre}self_attn.q_proj", t["heads"] * hd, h)
    linear(f"{pre}self_attn.k_proj", t["kv_heads"] * hd, h)
    linear(f"{pre}self_attn.v_proj", t["kv_heads"] * hd, h)
    linear(f"{pre}self_attn.o_proj", h, t["heads"] * hd)
    for e in range(t["experts"]):
        gate, up = nvfp4_gate_up(f, h, 100 + e)
        ex = f"{pre}mlp.experts.{e}."
        linear(ex + "gate_proj", f, h, gate)
        linear(ex + "up_proj", f, h, up)
        linear(ex + "down_proj", h, f)
        if rac_k:  # fc1 reads the same hidden states for every expert: one set per layer
            out[ex + "gate_proj.input_comp_index"] = shared_comp.clone()
            out[ex + "up_proj.input_comp_index"] = shared_comp.clone()
        if static:  # gate and up read the same activation: one static scale
            out[ex + "up_proj.input_scale"] = out[ex + "gate_proj.input_scale"].clone()
    return out


EXCLUDE = ["lm_head", "model.layers.*.mlp.gate"]


def write_checkpoint(path: Path, *, kind: str = "quads", activation_mode: str = "w4a4_rac",
                     rac_k: int = 16, activation_scaling: str = "per_token") -> Path:
    """A tiny checkpoint on disk: kind "quads", "modelopt" (config.json) or "modelopt_file"
    (ModelOpt's hf_quant_config.json next to a config.json without quantization_config)."""
    path.mkdir(parents=True, exist_ok=True)
    if kind == "quads":
        settings = QuadsSettings(activation_mode=activation_mode, activation_scaling=activation_scaling,
                                 rac_num_channels=rac_k if activation_mode == "w4a4_rac" else 0,
                                 exclude_modules=list(EXCLUDE))
        qcfg = settings.to_quantization_config()
        tensors = tiny_tensors(settings.rac_num_channels, settings.static_activation_scale)
    else:
        tensors = tiny_tensors(0, True)
        modelopt = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": list(EXCLUDE),
                    "kv_cache_quant_algo": None}
        if kind == "modelopt":
            qcfg = {"quant_method": "modelopt", **modelopt}
        else:
            qcfg = None
            (path / "hf_quant_config.json").write_text(json.dumps(
                {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": modelopt}))
    (path / "config.json").write_text(json.dumps(hf_config(qcfg), indent=1))
    save_file(tensors, str(path / "model.safetensors"))
    return path
