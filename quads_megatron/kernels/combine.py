"""The MoE layer's last step in one Triton launch: each token's top-k expert rows summed in fp32.

fc2 writes one row per (token, slot), already scaled by its routing weight and rounded to the
activation dtype (SGLang's intermediate cache); out[t] = sum_j rows[t * topk + j] in fp32, rounded
once (round to nearest even). One launch instead of the cast / sum / cast of the torch form.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from quads_megatron.nvfp4.triton_kernels import bf16_round

from .pdl import pdl_options, pdl_prologue


@triton.jit
def _topk_sum_kernel(rows_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
                     OUT_BF16: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    # left to right in slot order: one fixed order for the top-k rows and the split-K partials
    s = tl.load(rows_ptr + t * TOPK * H + cols, mask=cmask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        s = s + tl.load(rows_ptr + (t * TOPK + j) * H + cols, mask=cmask, other=0.0).to(tl.float32)
    if OUT_BF16:
        tl.store(out_ptr + t * H + cols, bf16_round(s).to(tl.uint16), mask=cmask)
    else:
        tl.store(out_ptr + t * H + cols, s.to(out_ptr.dtype.element_ty), mask=cmask)


def topk_sum(rows: torch.Tensor, topk: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rows [T * topk, H] (row t * topk + j: token t's slot j) -> [T, H] summed in fp32 in slot
    order, rounded to out's dtype (default rows.dtype). The split-K GEMM sums its fp32 partials
    with it too."""
    if rows.ndim != 2 or not rows.is_contiguous() or rows.shape[0] % topk:
        raise ValueError(f"rows: expected a contiguous [T * {topk}, H] tensor, got {tuple(rows.shape)}")
    t, h = rows.shape[0] // topk, rows.shape[1]
    if out is None:
        out = torch.empty(t, h, dtype=rows.dtype, device=rows.device)
    elif out.shape != (t, h) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{t}, {h}] tensor, got {tuple(out.shape)}")
    if t == 0:
        return out
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.uint16) if bf16 else out
    block_h = min(1024, triton.next_power_of_2(h))
    _topk_sum_kernel[(t, triton.cdiv(h, block_h))](rows, dst, h, TOPK=topk, BLOCK_H=block_h,
                                                   OUT_BF16=bf16, num_warps=4, **pdl_options(rows.device))
    return out
