"""Online NVFP4 activation quantization (+ RAC residual, + fused SiLU(gate)*up) in one Triton pass per row block.

Per-token amax needs the whole row before any block can be encoded, so this runs as a
small pre-pass ahead of the GEMM instead of inside its A-tile load: each GEMM program would
otherwise re-read and re-reduce the full row for every N tile and re-decode the A tile,
whereas this kernel reads x once (two sweeps over a row that stays in L1/L2) and writes the
packed NVFP4 activation (codes, E4M3 scales, per-row S_dec: what a native FP4 GEMM and the
checkpoint tools read) plus its exact fp16 values e2m1 * e4m3 * 2^-7 (what the Hopper GEMM
multiplies). Output is bit-identical to `quads_megatron.rac.quantize_compensated` (i.e.
`quantize(x, per_row=True)` / static `quantize(x, amax=...)`, and `quantize(r, per_row=True)`
for the residual): the block encode is nvfp4's `nvfp4_block_quantize`; decodes use
`e2m1_decode` / `e4m3_decode`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from quads_megatron.nvfp4.format import GLOBAL_SCALE_NUMERATOR
from quads_megatron.nvfp4.triton_kernels import (e2m1_decode, e4m3_decode, global_scales,
                                                 interpreter_rows, nvfp4_block_quantize)

from .pdl import pdl_options, pdl_prologue



@triton.jit
def _load_act(x_ptr, rows, cols, mask, stride_xm, K, SILU_MUL: tl.constexpr):
    """x[rows, cols] in fp32, or SiLU(x[:, cols]) * x[:, K + cols] (gate/up halves)."""
    base = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols
    if SILU_MUL:
        g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + K, mask=mask, other=0.0).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * u
    return tl.load(base, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_packed(q_ptr, s_ptr, codes, sf_bits, rows, rmask, col0, K, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Pack codes two per byte (element 2i low) and store them with the block scales."""
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_M, BLOCK_K // 2, 2)))
    pcols = col0 // 2 + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], lo | (hi << 4),
             mask=rmask[:, None] & (pcols < K // 2)[None, :])
    scols = col0 // 16 + tl.arange(0, BLOCK_K // 16)
    tl.store(s_ptr + rows[:, None].to(tl.int64) * (K // 16) + scols[None, :], sf_bits,
             mask=rmask[:, None] & (scols < K // 16)[None, :])


@triton.jit
def _store_tile_f16(v_ptr, codes, sf_val, rows, cols, mask, K, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr, FRAG: tl.constexpr = False):
    """Store e2m1 * e4m3 * 2^-7 as fp16 (exact: at most 6 significant bits, |v| <= 21).
    FRAG: column c goes to the fragment GEMM's K position 32 w + 8 j + 2 t + b of its 128-wide
    step (c = 32 w + 16 b + 4 t + j, `fragment_layout.fragment_columns`), permuted in registers
    so the store stays contiguous."""
    vals = tl.reshape(e2m1_decode(codes), (BLOCK_M, BLOCK_K // 16, 16)) * \
        (sf_val * 0.0078125)[:, :, None]
    if FRAG:
        vals = tl.permute(tl.reshape(vals, (BLOCK_M, BLOCK_K // 128, 4, 2, 4, 4)), (0, 1, 2, 5, 4, 3))
    tl.store(v_ptr + rows[:, None].to(tl.int64) * K + cols,
             tl.reshape(vals, (BLOCK_M, BLOCK_K)).to(tl.float16), mask=mask)


@triton.jit
def _act_quant_kernel(x_ptr, stride_xm, M, K, amax_ptr, q_ptr, qs_ptr, sdec_ptr, v_ptr,
                      comp_ptr, comp_stride_g, group_ptr, r_ptr, rs_ptr, rsdec_ptr, rv_ptr, KR,
                      WRITE_F16: tl.constexpr, FRAG: tl.constexpr, STATIC: tl.constexpr,
                      SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr,
                      HAS_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_KR: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    offs_k = tl.arange(0, BLOCK_K)
    # 1) global scales: per-row amax (dynamic) or the static per-tensor amax
    if STATIC:
        amax = tl.zeros((BLOCK_M,), tl.float32) + tl.load(amax_ptr)
    else:
        amax = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            m = rmask[:, None] & (cols < K)[None, :]
            v = _load_act(x_ptr, rows, cols[None, :], m, stride_xm, K, SILU_MUL)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    s_enc, s_dec = global_scales(amax)
    tl.store(sdec_ptr + rows, s_dec, mask=rmask)
    # 2) encode every 1x16 block of the row
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        m = rmask[:, None] & (cols < K)[None, :]
        v = _load_act(x_ptr, rows, cols[None, :], m, stride_xm, K, SILU_MUL)
        codes, sf_bits, sf_val = nvfp4_block_quantize(v, s_enc[:, None], s_dec[:, None],
                                                      BLOCK_K // 16, BLOCK_M)
        _store_packed(q_ptr, qs_ptr, codes, sf_bits, rows, rmask, k0, K, BLOCK_M, BLOCK_K)
        if WRITE_F16:
            _store_tile_f16(v_ptr, codes, sf_val, rows, cols, m, K, BLOCK_M, BLOCK_K, FRAG)
    if HAS_RES:
        # 3) residual on the compensation channels: r = x[S] - dq(q(x))[S], then q(r)
        tl.debug_barrier()  # codes and scales just stored are read back
        j = tl.arange(0, BLOCK_KR)
        jmask = j < KR
        if HAS_GROUP:
            grp = tl.load(group_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            grp = tl.zeros((BLOCK_M,), tl.int64)
        m = rmask[:, None] & jmask[None, :]
        idx = tl.load(comp_ptr + grp[:, None] * comp_stride_g + j[None, :], mask=m, other=0)
        xv = _load_act(x_ptr, rows, idx, m, stride_xm, K, SILU_MUL)
        rbase = rows[:, None].to(tl.int64)
        byte = tl.load(q_ptr + rbase * (K // 2) + idx // 2, mask=m, other=0)
        code = (byte >> ((idx & 1) * 4).to(tl.uint8)) & 0xF
        sf = e4m3_decode(tl.load(qs_ptr + rbase * (K // 16) + idx // 16, mask=m, other=0))
        xq = e2m1_decode(code) * sf * s_dec[:, None]
        r = tl.where(m, xv - xq, 0.0)
        r_enc, r_dec = global_scales(tl.max(tl.abs(r), axis=1))
        tl.store(rsdec_ptr + rows, r_dec, mask=rmask)
        rcodes, rsf_bits, rsf_val = nvfp4_block_quantize(r, r_enc[:, None], r_dec[:, None],
                                                         BLOCK_KR // 16, BLOCK_M)
        _store_packed(r_ptr, rs_ptr, rcodes, rsf_bits, rows, rmask, 0, KR, BLOCK_M, BLOCK_KR)
        if WRITE_F16:
            _store_tile_f16(rv_ptr, rcodes, rsf_val, rows, j[None, :], m, KR, BLOCK_M, BLOCK_KR)


class QuantizedActivation(NamedTuple):
    """Quantized activation: codes [M, K//2], e4m3 scale bits [M, K//16], S_dec [M], and (for the
    Hopper GEMM) `values` = e2m1 * e4m3 * 2^-7 as exact fp16 [M, K]; the RAC residual likewise
    on the k gathered channels (None when k == 0)."""
    data: torch.Tensor
    scale: torch.Tensor
    s_dec: torch.Tensor
    values: Optional[torch.Tensor]
    r_data: Optional[torch.Tensor]
    r_scale: Optional[torch.Tensor]
    r_s_dec: Optional[torch.Tensor]
    r_values: Optional[torch.Tensor]


def quantize_activation_rac(x: torch.Tensor, comp_index: Optional[torch.Tensor] = None,
                            input_scale=None, groups: Optional[torch.Tensor] = None,
                            silu_mul: bool = False, block_m: Optional[int] = None,
                            with_values: bool = True,
                            fragment_order: bool = False) -> QuantizedActivation:
    """x [M, K] (or [M, 2K] gate|up with silu_mul) -> QuantizedActivation (no host syncs).

    comp_index: [k] shared or [G, k] with groups [M] (the set of each row); input_scale:
    static per-tensor activation decode scale (the residual keeps a per-row scale);
    with_values: also write the exact fp16 tiles the Hopper GEMM reads (activation and residual);
    fragment_order: the activation's fp16 values in the fragment GEMM's K order
    (`fragment_layout.fragment_columns`: values[:, p] = x's value at column fragment_columns(K)[p]);
    block_m: rows per program (default: 1 row with 1024-wide tiles below 512 rows, where a few
    4-row programs would leave the GPU idle; else 4 rows with 256-wide tiles; in the CPU
    interpreter `interpreter_rows`, few large programs).
    Triton only (CUDA, or CPU tensors under TRITON_INTERPRET=1); its torch definition is
    `quads_megatron.rac.quantize_compensated`.
    """
    if x.ndim != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected a row-major 2-D activation, got shape {tuple(x.shape)}")
    m_rows, k_in = x.shape
    k = k_in // 2 if silu_mul else k_in
    if k % 16 or (silu_mul and k_in % 2):
        raise ValueError(f"x: K = {k} is not a multiple of 16")
    if fragment_order and k % 128:
        raise ValueError(f"x: K = {k} is not a multiple of 128 (fragment_order)")
    dev = x.device
    data = torch.empty(m_rows, k // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(m_rows, k // 16, dtype=torch.uint8, device=dev)
    s_dec = torch.empty(m_rows, dtype=torch.float32, device=dev)
    values = torch.empty(m_rows, k, dtype=torch.float16, device=dev) if with_values else None
    kr = 0 if comp_index is None else comp_index.shape[-1]
    if kr:
        r_data = torch.empty(m_rows, kr // 2, dtype=torch.uint8, device=dev)
        r_scale = torch.empty(m_rows, kr // 16, dtype=torch.uint8, device=dev)
        r_s_dec = torch.empty(m_rows, dtype=torch.float32, device=dev)
        r_values = (torch.empty(m_rows, kr, dtype=torch.float16, device=dev)
                    if with_values else None)
        comp = comp_index.to(torch.int32).contiguous()
        if comp.ndim == 2 and groups is None:
            raise ValueError("comp_index [G, k] (one set per expert) needs groups [M]")
        grp = groups.to(torch.int32).contiguous() if comp.ndim == 2 else s_dec
        comp_stride = comp.stride(0) if comp.ndim == 2 else 0
    else:
        r_data = r_scale = r_s_dec = r_values = None
        comp, grp, comp_stride = s_dec, s_dec, 0
    if input_scale is not None:
        amax = (torch.as_tensor(input_scale, dtype=torch.float32, device=dev).reshape(1)
                * GLOBAL_SCALE_NUMERATOR)
    else:
        amax = s_dec
    if m_rows == 0:
        return QuantizedActivation(data, scale, s_dec, values, r_data, r_scale, r_s_dec,
                                   r_values)
    if block_m is None:
        block_m = interpreter_rows(1 if m_rows < 512 else 4, 256, m_rows, dev)
    block_k = min(1024 if block_m == 1 else 256, triton.next_power_of_2(k))
    block_kr = max(16, triton.next_power_of_2(max(kr, 1)))
    grid = (triton.cdiv(m_rows, block_m),)
    _act_quant_kernel[grid](
        x, x.stride(0), m_rows, k, amax, data, scale, s_dec,
        values if with_values else s_dec, comp, comp_stride, grp,
        r_data if kr else data, r_scale if kr else scale, r_s_dec if kr else s_dec,
        r_values if r_values is not None else s_dec, kr, WRITE_F16=with_values, FRAG=fragment_order,
        STATIC=input_scale is not None, SILU_MUL=silu_mul, HAS_RES=kr > 0,
        HAS_GROUP=kr > 0 and comp.ndim == 2, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_KR=block_kr, num_warps=4, enable_fp_fusion=False, **pdl_options(x.device))
    return QuantizedActivation(data, scale, s_dec, values, r_data, r_scale, r_s_dec, r_values)
