"""Tiny NVFP4 tensors and checkpoints for the SGLang plugin tests (all numerics from quads_megatron.nvfp4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict

import torch

from quads_megatron.nvfp4 import NVFP4Tensor, dequantize, quantize, quantize_with_shared_scale

# The tiny Qwen3-MoE: 1 decoder layer, hidden 64, 4 experts of width 32 (transformers config).
TINY_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
               tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
RAC_K = 16


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


# --- the layers' definition, one token at a time, from the NVFP4 format only ---------------------
# (independent of quads_megatron.kernels and quads_megatron.rac: what the tests check the layers against)
def dequantized_weight(t: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Wq in fp32 from one matrix's ModelOpt tensors (`weight`, `weight_scale`, `weight_scale_2`)."""
    q = NVFP4Tensor.from_modelopt(t["weight"], t["weight_scale"], t["weight_scale_2"])
    return dequantize(q, torch.float32)


def fake_quant_rows(v: torch.Tensor, static_scale=None) -> torch.Tensor:
    """dq(q(v)) of rows v [n, K]: a per-row global scale, or the static decode scale (amax = 2688 * scale)."""
    if static_scale is None:
        return dequantize(quantize(v, per_row=True), torch.float32)
    amax = torch.as_tensor(static_scale, dtype=torch.float32).reshape(()) * 2688
    return dequantize(quantize(v, amax=amax), torch.float32)


def nvfp4_row(v: torch.Tensor, w: torch.Tensor, mode: str, comp=None, static_scale=None) -> torch.Tensor:
    """One token through one NVFP4 linear: v [K] (fp32) @ w [N, K]^T, the activation as `mode` says:
    w4a16 as is; w4a4 quantized; w4a4_rac plus the residual on the channels `comp`, quantized again
    with its own per-row scale, times those weight columns."""
    if mode == "w4a16":
        return v @ w.t()
    vq = fake_quant_rows(v[None], static_scale)[0]
    y = vq @ w.t()
    if mode == "w4a4_rac":
        s = comp.long()
        y = y + fake_quant_rows((v[s] - vq[s])[None])[0] @ w[:, s].t()
    return y


def moe_checkpoint(num_experts: int, hidden: int, ffn: int, k: int, seed: int) -> Dict[str, torch.Tensor]:
    """HF-named tensors of one RAC MoE layer (`experts.{e}.{gate,up,down}_proj.*`), k channels per set."""
    out = {}
    fc1_comp, fc1_scale = comp_index(hidden, k, seed), input_scale(seed)
    for e in range(num_experts):
        gate, up = nvfp4_gate_up(ffn, hidden, seed + e)
        down = nvfp4_linear(hidden, ffn, seed + 50 + e)
        for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            for key, v in t.items():
                out[f"experts.{e}.{proj}.{key}"] = v
        for proj in ("gate_proj", "up_proj"):
            out[f"experts.{e}.{proj}.input_scale"] = fc1_scale.clone()
            out[f"experts.{e}.{proj}.input_comp_index"] = fc1_comp.clone()
        out[f"experts.{e}.down_proj.input_scale"] = input_scale(seed + 50 + e)
        out[f"experts.{e}.down_proj.input_comp_index"] = comp_index(ffn, k, seed + 50 + e)
    return out


def init_sglang_runtime():
    """What SGLang's scheduler does at start-up (load_plugins, init_distributed_environment, publish the
    server args, initialize_model_parallel), on CPU with gloo and TP = EP = 1; returns parallel_state."""
    import socket

    from sglang.srt.distributed import parallel_state
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    if not parallel_state.model_parallel_is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}")
        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        parallel_state.initialize_model_parallel(backend="gloo")
    return parallel_state


def save_tiny_hf(path: Path, seed: int = 0) -> Path:
    """A BF16 transformers Qwen3MoeForCausalLM of TINY_HF with weights of a realistic spread."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_HF))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.empty_like(p).uniform_(0.7, 1.3) if p.ndim == 1 else torch.randn_like(p) * 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def export_rollout_checkpoints(root: Path) -> Dict[str, Path]:
    """The project's exporter (`quads-export-rollout`) on a tiny HF model: quads (RAC) and ModelOpt
    checkpoints, plus copies of both with their metadata only in hf_quant_config.json."""
    from quads_megatron.convert import rollout_export

    hf = save_tiny_hf(root / "hf")
    calib = ["--calib-size", "2", "--calib-seq-len", "16", "--no-progress"]
    out = {"quads": root / "quads", "modelopt": root / "modelopt"}
    rollout_export.main(["--load-dir", str(hf), "--save-dir", str(out["quads"]),
                         "--rac-channels", str(RAC_K), *calib])
    rollout_export.main(["--load-dir", str(hf), "--save-dir", str(out["modelopt"]),
                         "--format", "modelopt", *calib])
    for src in ("modelopt", "quads"):  # the same with metadata only in hf_quant_config.json
        out[f"{src}_file"] = root / f"{src}_file"
        shutil.copytree(out[src], out[f"{src}_file"])
        cfg_path = out[f"{src}_file"] / "config.json"
        cfg = json.loads(cfg_path.read_text())
        del cfg["quantization_config"]
        cfg_path.write_text(json.dumps(cfg))
    return out


def load_experts(layer, ckpt: Dict[str, torch.Tensor], num_experts: int) -> None:
    """Route HF-named expert tensors (`experts.{e}.{gate,up,down}_proj.*`) into a FusedMoE as the expert
    branch of SGLang's Qwen3MoeForCausalLM.load_weights does."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)
    params = dict(layer.named_parameters(prefix="experts"))
    for name, t in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)
            if name in params:
                p = params[name]
                p.weight_loader(p, t, name, shard_id=shard_id, expert_id=expert_id)
            break
