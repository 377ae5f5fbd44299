"""Plain-torch references of `w4a4_linear` and `w4a4_fused_moe`, built on `quads_megatron.nvfp4` and `quads_megatron.rac`.

They define what the Triton kernels compute (fp32 math on dequantized values; the kernels
accumulate the exact E2M1 x E4M3 products in fp32 and apply the fp32 global scales last):
- w4a4:     y = dq(q(x)) Wq^T                       (per-token or static activation scale)
- w4a4_rac: y = dq(q(x)) Wq^T + dq(q(r)) Wq[:, S]^T (see `quads_megatron.rac`)
- w4a16:    y = x Wq^T
Fused MoE: fc1 output is rounded to x.dtype (SGLang's intermediate cache), h = SiLU(gate) * up
in fp32, fc2 rows are scaled by the routing weight, rounded to x.dtype and summed over top-k.
"""

from __future__ import annotations

from typing import Optional

import torch

from quads_megatron.nvfp4 import NVFP4Tensor, dequantize
from quads_megatron.rac import compensated_activation

from ._checks import (check_act_mode, check_activation, check_comp, check_moe_inputs,
                      check_packed_weight)

__all__ = ["w4a4_linear", "w4a4_fused_moe", "dequantize_weight", "moe_align_block_size"]


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, backend=None) -> torch.Tensor:
    """Wq in fp32 from ModelOpt tensors ([N, K//2] with a scalar scale_2, or [E, N, K//2] with [E]).

    backend: passed to `quads_megatron.nvfp4.dequantize` (the references pass "torch")."""
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    gs = gs.reshape(-1, 1, 1) if weight.ndim == 3 else gs.reshape(())
    q = NVFP4Tensor.from_modelopt(weight, weight_scale, gs)
    return dequantize(q, torch.float32, backend=backend)


def _linear_fp32(x2d: torch.Tensor, w: torch.Tensor, act_mode: str,
                 comp_index: Optional[torch.Tensor], input_scale) -> torch.Tensor:
    """fp32 y for rows of x against the fp32 weight w [N, K] (comp_index: one set [k] or None)."""
    if act_mode == "w4a16":
        return x2d.to(torch.float32) @ w.t()
    xq, rq = compensated_activation(x2d, comp_index, input_scale)
    y = xq @ w.t()
    if rq.shape[-1]:
        y = y + rq @ w[:, comp_index.long()].t()
    return y


def w4a4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                weight_scale_2: torch.Tensor, *, act_mode: str,
                comp_index: Optional[torch.Tensor] = None, input_scale=None,
                bias: Optional[torch.Tensor] = None, check_inputs: bool = True) -> torch.Tensor:
    """Reference W4A4 / W4A4+RAC / W4A16 linear: x [..., K] -> [..., N] in x.dtype.

    check_inputs=False skips the value checks of comp_index (host syncs), as in `ops`."""
    check_act_mode(act_mode)
    n, k = check_packed_weight(weight, weight_scale, weight_scale_2, ndim=2, name="weight")
    check_activation(x, k)
    comp = check_comp(act_mode, comp_index, k, check_inputs=check_inputs)
    w = dequantize_weight(weight, weight_scale, weight_scale_2, backend="torch")
    x2d = x.reshape(-1, k)
    y = _linear_fp32(x2d, w, act_mode, comp, input_scale)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).view(*x.shape[:-1], n)


def w4a4_fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                   w2_scale_2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   *, act_mode: str, w13_comp_index: Optional[torch.Tensor] = None,
                   w2_comp_index: Optional[torch.Tensor] = None, w13_input_scale=None,
                   w2_input_scale=None, check_inputs: bool = True) -> torch.Tensor:
    """Reference NVFP4 MoE: sum_j w_j * fc2_e(SiLU(gate_e) * up_e), e = topk_ids[t, j]."""
    num_experts, hidden, f, c13, c2 = check_moe_inputs(
        x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids,
        act_mode, w13_comp_index, w2_comp_index, check_inputs)
    w13f = dequantize_weight(w13, w13_scale, w13_scale_2, backend="torch")
    w2f = dequantize_weight(w2, w2_scale, w2_scale_2, backend="torch")
    tokens, topk = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    out_rows = torch.zeros(tokens * topk, hidden, dtype=x.dtype, device=x.device)
    # fc1 activations are quantized once per token (all experts read the same rows)
    if act_mode == "w4a16":
        xq, rq = x.to(torch.float32), None
    else:
        xq, rq = compensated_activation(x, c13, w13_input_scale)
    for e in range(num_experts):
        rows = (flat_ids == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        tok = rows // topk
        gu = xq[tok] @ w13f[e].t()
        if rq is not None and rq.shape[-1]:
            gu = gu + rq[tok] @ w13f[e][:, c13.long()].t()
        gu = gu.to(x.dtype).to(torch.float32)
        h = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
        if act_mode == "w4a16":
            h = h.to(x.dtype)
        ce = None if c2 is None else (c2 if c2.ndim == 1 else c2[e])
        y = _linear_fp32(h, w2f[e], act_mode, ce, w2_input_scale)
        out_rows[rows] = (y * topk_weights.reshape(-1)[rows, None].to(torch.float32)).to(x.dtype)
    return out_rows.view(tokens, topk, hidden).to(torch.float32).sum(1).to(x.dtype)


def w4a4_moe_agreement(out: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple:
    """(ok, {median, max, flipped}) for an fp32 W4A4 MoE output against this reference, per token.

    W4A4 quantizes fc2's input h = SiLU(gate) * up, computed from fc1's fp32 sums: two correct
    summation orders give h a few ulps apart, and now and then (about once per 10^6 elements) that
    moves an element across an E2M1 boundary, changing its token's output by ~1e-2. So agreement
    at the fp32 level is asked of the median token, rare tokens may differ by one such code flip
    (< 5e-2), and a real fault (errors spread over many tokens) still fails. RAC quantizes the
    residual of h too (a second order-sensitive rounding), so it flips more tokens than W4A4;
    docs/benchmarks.md records the shares measured; fewer than 5% of the tokens is asked, or a single
    token (at 16 tokens one flip is already 6%)."""
    per_token = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-30)
    n_flipped = int((per_token > 1e-5).sum())
    rare = n_flipped <= 1 or n_flipped < 0.05 * per_token.numel()
    stats = {"median": float(per_token.median()), "max": float(per_token.max()),
             "flipped": n_flipped / per_token.numel()}
    return stats["median"] < tol and rare and stats["max"] < 5e-2, stats


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> tuple:
    """Torch definition of `routing.moe_align_block_size` (stable argsort by expert, each expert's
    rows padded to a multiple of block_m with the pad id T * topk): (sorted_ids, expert_ids,
    num_tokens_post_padded), int32."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel, dev = flat.numel(), flat.device
    max_padded = (numel + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_exp = flat[order]
    pos = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_exp]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids[(pad_end - padded)[sorted_exp] + pos] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_starts, right=True).clamp(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), pad_end[-1:].to(torch.int32)
