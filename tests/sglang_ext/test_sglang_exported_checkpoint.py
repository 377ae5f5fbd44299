"""Checkpoints from the project's exporter (`quads-export-rollout`) served by the quads method.

Layer 0's experts are read from disk with SGLang's safetensors iterator, routed into a real
FusedMoE by the Qwen3-MoE expert mapping, and compared with the kernel reference built from
the same on-disk tensors (RAC for the quads export, static W4A4 for the ModelOpt one). The
whole SGLang model is not built here: its CPU path needs sgl_kernel or vllm ops.
"""

from __future__ import annotations

import pytest
import torch

from quads_megatron.kernels import reference

pytest.importorskip("sglang", reason="SGLang is not installed")

PREFIX = "model.layers.0.mlp."


@pytest.fixture(autouse=True)
def triton_kernels_on_cpu(monkeypatch):
    """Run the layers' apply through the Triton kernels (the interpreter on CPU), not the torch
    reference the ops fall back to on CPU, so the comparison below is kernel vs reference."""
    monkeypatch.setenv("QUADS_BACKEND", "triton")


def _disk_tensors(path) -> dict:
    """Layer 0's expert tensors as SGLang's loader streams them, names relative to `mlp.`."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in path.glob("*.safetensors"))
    return {n[len(PREFIX):]: t.clone() for n, t in safetensors_weights_iterator(files)
            if n.startswith(PREFIX + "experts.")}


def _reference(x, topk, disk, settings, e):
    def stack(key, projs):
        return torch.stack([torch.cat([disk[f"experts.{i}.{p}.{key}"] for p in projs])
                            for i in range(e)])

    def per_expert(key, proj):
        return torch.stack([disk[f"experts.{i}.{proj}.{key}"] for i in range(e)])

    gu, rac, static = ("gate_proj", "up_proj"), settings.uses_rac, settings.static_activation_scale
    return reference.w4a4_fused_moe(
        x, stack("weight", gu), stack("weight_scale", gu), per_expert("weight_scale_2", "gate_proj"),
        stack("weight", ["down_proj"]), stack("weight_scale", ["down_proj"]),
        per_expert("weight_scale_2", "down_proj"), topk.topk_weights, topk.topk_ids,
        act_mode=settings.precision.value,
        w13_comp_index=disk["experts.0.gate_proj.input_comp_index"] if rac else None,
        w2_comp_index=per_expert("input_comp_index", "down_proj") if rac else None,
        w13_input_scale=per_expert("input_scale", "gate_proj").max() if static else None,
        w2_input_scale=per_expert("input_scale", "down_proj").max() if static else None)


@pytest.mark.parametrize("kind", ["quads", "modelopt"])
def test_exported_experts_load_and_match_reference(sglang_runtime, checkpoints, kind):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.model_loader.weight_utils import get_quant_config

    mc = ModelConfig(model_path=str(checkpoints[kind]), quantization="quads")
    qc = get_quant_config(mc, LoadConfig(), {})
    hf = mc.hf_config
    e, h, topk_n = hf.num_experts, hf.hidden_size, hf.num_experts_per_tok
    layer = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=hf.moe_intermediate_size,
                     layer_id=0, top_k=topk_n, params_dtype=torch.bfloat16, quant_config=qc,
                     prefix=PREFIX + "experts")
    disk = _disk_tensors(checkpoints[kind])
    params = dict(layer.named_parameters(prefix="experts"))
    loaded = set()
    for name, t in disk.items():
        for param_name, weight_name, expert_id, shard_id in FusedMoE.make_expert_params_mapping(
                "gate_proj", "down_proj", "up_proj", e):
            if weight_name in name:
                target = name.replace(weight_name, param_name)
                p = params[target]  # every exported expert tensor has a home
                p.weight_loader(p, t, target, shard_id=shard_id, expert_id=expert_id)
                loaded.add(target)
                break
    assert loaded == set(params), set(params) ^ loaded
    layer.quant_method.process_weights_after_loading(layer)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, h, generator=g).to(torch.bfloat16)
    logits = torch.randn(7, e, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), topk_n, dim=-1)
    topk = StandardTopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), logits)
    want = _reference(x, topk, disk, qc.rollout, e)
    # bit-identical tokens, but for at most one moved by an E2M1 rounding of fc2's input: the kernel's
    # and the reference's fp32 sums of fc1 are summed in different orders (which BLAS and CPU decide);
    # a load fault (a wrong expert, shard or scale) spreads over every token and fails
    ok, stats = reference.w4a4_moe_agreement(layer(x, topk), want, tol=1e-30)
    assert ok, stats
    assert qc.rollout.uses_rac == (kind == "quads")
