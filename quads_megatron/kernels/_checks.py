"""Input checks shared by the Triton kernels and their torch references (clear errors, no syncs on the hot path)."""

from __future__ import annotations

from typing import Optional

import torch

from quads_megatron.rac import check_comp_index

ACT_MODES = ("w4a4", "w4a4_rac", "w4a16")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def value_checks_enabled(check_inputs: bool = True) -> bool:
    """Checks that read tensor values (comp_index range/order, expert ids) sync the host: they
    run when the caller asks (`check_inputs=True`, the default of the public ops) and no CUDA
    graph is being captured. Shape and dtype checks always run (no sync)."""
    if not check_inputs:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_act_mode(act_mode: str) -> None:
    """act_mode must be one of w4a4 (naive), w4a4_rac (QUADS) or w4a16 (weights only)."""
    if act_mode not in ACT_MODES:
        raise ValueError(f"act_mode: expected one of {ACT_MODES}, got {act_mode!r}")


def check_activation(x: torch.Tensor, k_in: int, name: str = "x") -> None:
    """x: a float tensor whose last dimension is the GEMM's K."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a bfloat16/float16/float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.shape[-1] != k_in:
        raise ValueError(f"{name}: last dimension {x.shape[-1]} does not match the weight's "
                         f"K = {k_in} (2 * packed columns)")


def check_packed_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor, *, ndim: int, name: str) -> tuple:
    """ModelOpt NVFP4 weight: uint8 [..., N, K//2], e4m3 scales [..., N, K//16]; returns (N, K)."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8:
        raise ValueError(f"{name}: expected packed NVFP4 codes as uint8 [..., N, K//2] (two "
                         f"E2M1 codes per byte), got {getattr(weight, 'dtype', type(weight))}; "
                         f"quantize the weight with quads_megatron.nvfp4.quantize first")
    if weight.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(weight.shape)}")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{name}_scale: expected float8_e4m3fn block scales, got "
                         f"{weight_scale.dtype}")
    n, k = weight.shape[-2], weight.shape[-1] * 2
    if k % 16:
        raise ValueError(f"{name}: K = {k} is not a multiple of 16")
    want = (*weight.shape[:-1], k // 16)
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"{name}_scale: expected shape {want} (one E4M3 scale per 16 inputs), "
                         f"got {tuple(weight_scale.shape)}")
    gs = torch.as_tensor(weight_scale_2)
    want_gs = weight.shape[0] if ndim == 3 else 1
    if gs.dtype != torch.float32 or gs.numel() != want_gs:
        raise ValueError(f"{name}_scale_2: expected {want_gs} float32 per-tensor scale(s), got "
                         f"{gs.dtype} with {gs.numel()} elements")
    return n, k


def check_comp(act_mode: str, comp_index: Optional[torch.Tensor], k_in: int,
               num_groups: Optional[int] = None, name: str = "comp_index",
               check_inputs: bool = True) -> Optional[torch.Tensor]:
    """The compensation index that applies in this mode (None unless w4a4_rac)."""
    if act_mode != "w4a4_rac":
        return None
    if comp_index is None:
        raise ValueError(f"{name}: act_mode 'w4a4_rac' needs compensation channel indices")
    if check_comp_index(comp_index, k_in, num_groups, name,
                        check_values=value_checks_enabled(check_inputs)) == 0:
        return None
    return comp_index


def check_comp_weight(comp_weight: Optional[torch.Tensor], comp: Optional[torch.Tensor],
                      shape: tuple, name: str) -> None:
    """RAC weight columns (`rac_columns.rac_weight_columns`): fp16 `shape` = (..., N, k), row-major.

    Shape and dtype only: that they were built from this weight and these channels is the
    caller's contract (no host sync)."""
    if comp is None or comp_weight is None:
        return
    want = (*shape, comp.shape[-1])
    if not isinstance(comp_weight, torch.Tensor) or comp_weight.dtype != torch.float16 or \
            tuple(comp_weight.shape) != want or comp_weight.stride(-1) != 1:
        raise ValueError(f"{name}: expected the RAC weight columns as fp16 {want} (row-major; "
                         f"quads_megatron.kernels.rac_columns.rac_weight_columns(weight, weight_scale, "
                         f"comp_index)), got {getattr(comp_weight, 'dtype', type(comp_weight))} "
                         f"{tuple(getattr(comp_weight, 'shape', ()))}")


def check_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, tokens: int,
                  num_experts: int, check_inputs: bool = True) -> None:
    """topk_ids int [T, topk] in [0, E); topk_weights float [T, topk]."""
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.ndim != 2 or \
            topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected int32/int64 [T={tokens}, topk], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: expected float {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if value_checks_enabled(check_inputs) and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids: expert id out of range [0, {num_experts}): min "
                         f"{int(topk_ids.min())}, max {int(topk_ids.max())}")


def check_moe_inputs(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights,
                     topk_ids, act_mode, w13_comp_index, w2_comp_index,
                     check_inputs: bool = True) -> tuple:
    """Validate the fused-MoE operands: (num_experts, hidden, ffn, fc1 comp index, fc2 comp index)."""
    check_act_mode(act_mode)
    num_experts = w13.shape[0]
    two_f, hidden = check_packed_weight(w13, w13_scale, w13_scale_2, ndim=3, name="w13")
    h_out, f = check_packed_weight(w2, w2_scale, w2_scale_2, ndim=3, name="w2")
    if x.ndim != 2:
        raise ValueError(f"x: expected [tokens, hidden], got {tuple(x.shape)}")
    check_activation(x, hidden)
    if two_f != 2 * f or h_out != hidden or w2.shape[0] != num_experts:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}: expected w13 "
                         f"[E, 2F, H//2] and w2 [E, H, F//2]")
    check_routing(topk_weights, topk_ids, x.shape[0], num_experts, check_inputs)
    c13 = check_comp(act_mode, w13_comp_index, hidden, name="w13_comp_index",
                     check_inputs=check_inputs)
    if c13 is not None and c13.ndim != 1:
        raise ValueError("w13_comp_index: fc1 reads the same hidden states for every expert; "
                         "expected one set per layer [k]")
    c2 = check_comp(act_mode, w2_comp_index, f, num_experts, name="w2_comp_index",
                    check_inputs=check_inputs)
    return num_experts, hidden, f, c13, c2
