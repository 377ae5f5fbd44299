"""SiLU(gate) * up in one Triton launch: the W4A16 MoE layer's step between fc1 and fc2.

fc1 writes gate | up as one row [M, 2F] in the activation dtype; h = SiLU(gate) * up is computed
in fp32 and rounded once to that dtype (round to nearest even), as the torch reference does.
W4A4 does not need it: `act_quant` applies the same `_load_act` while it quantizes fc2's input.
One launch instead of the cast / split / silu / mul / cast of the torch form (five passes over
[M, 2F] at prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads_megatron.nvfp4.triton_kernels import bf16_round

from .act_quant import _load_act


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, M, F, stride_xm, BLOCK_M: tl.constexpr,
                     BLOCK_F: tl.constexpr, OUT_BF16: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    h = _load_act(x_ptr, rows, cols[None, :], mask, stride_xm, F, True)
    off = rows[:, None].to(tl.int64) * F + cols[None, :]
    if OUT_BF16:
        tl.store(out_ptr + off, bf16_round(h).to(tl.uint16), mask=mask)
    else:
        tl.store(out_ptr + off, h.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2F] (row-major rows) -> SiLU(gate_up[:, :F]) * gate_up[:, F:] [M, F], same dtype."""
    if gate_up.ndim != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected a row-major [M, 2F] tensor, got shape "
                         f"{tuple(gate_up.shape)} stride {gate_up.stride()}")
    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, f, dtype=gate_up.dtype, device=gate_up.device)
    if m == 0 or f == 0:
        return out
    bf16 = gate_up.dtype == torch.bfloat16
    block_f = min(1024, triton.next_power_of_2(f))
    block_m = max(1, 4096 // block_f)
    grid = (triton.cdiv(m, block_m), triton.cdiv(f, block_f))
    _silu_mul_kernel[grid](gate_up, out.view(torch.uint16) if bf16 else out, m, f,
                           gate_up.stride(0), BLOCK_M=block_m, BLOCK_F=block_f, OUT_BF16=bf16,
                           num_warps=4)
    return out
