"""Whole-layer expert tensors for `QuadsMoEMethod`: one `weight_loader(param, tensor)` call per layer parameter.

SGLang's Qwen3MoE `load_weights` hands a name that is not an expert-checkpoint name
(`model.layers.N.mlp.experts.w13_weight`, the FusedMoE parameter's own name) to
`params_dict[name].weight_loader(param, loaded_weight)` with two arguments. For a layer that holds
every expert unsharded on this rank (EP = 1, MoE TP = 1) the RL weight sync sends each layer's experts
that way: the tensor is checked once (dtype, the parameter's shape, value checks over the whole
layer), copied into the parameter in place (same storage: CUDA graphs keep replaying) and the whole
parameter is marked as written, so `process_weights_after_loading` converts it once. A BF16 weight
(`--sglang-weight-sync tensor-bf16`) is staged per expert as views, as the per-expert path stages it.
Sharded layers refuse: SGLang's per-expert loaders do the TP/EP slicing.
"""

from __future__ import annotations

import torch

from quads_megatron.errors import CheckpointError
from sglang_ext import bf16_sync
from sglang_ext.checkpoint_format import (FLOAT_SCALE_DTYPES, INDEX_DTYPES, check_block_scale_values,
                                          check_comp_index_values)


def holds_every_expert(layer: torch.nn.Module) -> bool:
    """True when this rank's FusedMoE holds all experts of the layer, unsharded (EP = 1, MoE TP = 1)."""
    return layer.moe_ep_size == 1 and layer.moe_tp_size == 1 and layer.num_local_experts == layer.num_experts


def _fail(name: str, want: str, t: torch.Tensor) -> CheckpointError:
    return CheckpointError(f"{name}: expected a whole-layer {want}, got {t.dtype} {tuple(t.shape)}")


def checked_stacked(name: str, pname: str, param: torch.Tensor, t: torch.Tensor, k_in: int) -> torch.Tensor:
    """`t` checked as the whole of parameter `pname` (named `name`): dtype, exact shape, values once."""
    shape = tuple(param.shape)
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{name}: expected a tensor of shape {shape}, got {type(t).__name__}")
    if pname.endswith("_weight"):
        want, ok = "uint8 (packed NVFP4 codes)", t.dtype == torch.uint8
    elif pname.endswith("_weight_scale"):
        want, ok = "float8_e4m3fn (or its bytes as uint8)", t.dtype in (torch.float8_e4m3fn, torch.uint8)
    elif pname.endswith("_comp_index"):
        want, ok = "int32 (RAC channel indices)", t.dtype in INDEX_DTYPES
    else:
        want, ok = "float32 (per-tensor scales)", t.dtype in FLOAT_SCALE_DTYPES
    if not ok or tuple(t.shape) != shape:
        raise _fail(name, f"{want} tensor of shape {shape}", t)
    if pname.endswith("_weight_scale"):
        t = check_block_scale_values(name, t.view(torch.float8_e4m3fn))
    elif pname.endswith("_comp_index"):
        t = check_comp_index_values(name, t, k_in)
    elif not pname.endswith("_weight"):
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            at = tuple(torch.nonzero(bad)[0].tolist())
            raise CheckpointError(f"{name}: per-tensor scales must be finite and positive; {int(bad.sum())} are "
                                  f"not, first at {at} ({float(t[at])})")
    return t


def stage_bf16(layer: torch.nn.Module, prefix: str, pname: str, t: torch.Tensor, fc1_shards: tuple) -> None:
    """A whole-layer BF16 `w13_weight` [E, 2F, H] / `w2_weight` [E, H, F]: each expert's views staged for
    `bf16_sync.quantize_staged`, which quantizes them at the end of the update (no copy here)."""
    h, f = layer.quads_dims
    e = layer.num_experts
    shape = (e, 2 * f, h) if pname == "w13_weight" else (e, h, f)
    if tuple(t.shape) != shape:
        raise _fail(f"{prefix}.{pname}", f"high-precision tensor of shape {shape}", t)
    projs = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for i in range(e):
        parts = ((fc1_shards[0], t[i, :f]), (fc1_shards[1], t[i, f:])) if pname == "w13_weight" else (("w2", t[i]),)
        for sid, view in parts:
            bf16_sync.stage(layer, f"{prefix}.{i}.{projs[sid]}.weight", view, sid, i)
