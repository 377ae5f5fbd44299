"""Dense W4A4(+RAC) linear in one launch: the activation's NVFP4 quantization runs inside the GEMM.

At decode sizes the two-launch form (`act_quant` pre-pass, GEMM, split-K sum) pays three launches
for a few microseconds of work. Here each program reads the float activation itself: the per-token
global scale from its rows' amax over all of K (at M <= 64 the rows are small and stay in L2; every
program re-reads them, so the cost grows with M and the split), then
in the K loop it quantizes its A tile to the exact fp16 form e2m1 * e4m3 * 2^-7 the two-launch GEMM
reads from `act_quant` (same block scales, codes and S_dec: the same `triton_kernels` helpers), and
with RAC the split-0 programs build the residual of the k compensated channels (own per-row S_dec)
and run its K-steps against the stored weight columns, as `gemm.py` does. Split-K partials are
summed in the kernel by the last split to arrive at each tile (an atomic count per tile, no
waiting), in split order, as `combine.topk_sum` sums them: the output is bit-identical to the
two-launch path under the same `GemmConfig`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from quads_megatron.nvfp4.format import GLOBAL_SCALE_NUMERATOR
from quads_megatron.nvfp4.triton_kernels import (bf16_round, block_scales, e2m1_round,
                                                 global_scales)

from .fragment_layout import check_fragment_shape
from .gemm import (GemmConfig, _block_k, _mma, _num_sms, _words, decode_fragments, decode_words_f16,
                   dense_split_k, interpreting)

__all__ = ["FUSED_MAX_M", "fused_config", "w4a4_linear_fused", "nvfp4_values_f16"]

# Largest M the dense op runs fused (`ops.w4a4_linear`); above it the activation is quantized once
# by the pre-pass instead of once per N tile (tools/bench_w4a4_linear.py times both). Offline
# estimate for Qwen3-30B-A3B's projections: the per-tile quantization and amax re-reads cost
# ~0.15 us per row on an H200 against ~5 us for the pre-pass and split-K sum launches.
FUSED_MAX_M = 32


@triton.jit
def _signed_e2m1(v):
    """v already scaled and clamped to [-6, 6] -> its E2M1 value (sign from v, as `e2m1_encode`)."""
    _, mag = e2m1_round(tl.abs(v))
    return (mag.to(tl.int32, bitcast=True) | ((v < 0).to(tl.int32) << 31)).to(tl.float32,
                                                                            bitcast=True)


@triton.jit
def nvfp4_values_f16(x, s_enc, s_dec, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 tile [ROWS, COLS] with per-row global scales [ROWS] -> fp16 e2m1 * e4m3 * 2^-7, the
    values `act_quant` writes for it (`nvfp4_block_quantize` then the decodes; codes not kept)."""
    xb = tl.reshape(x, (ROWS, COLS // 16, 16))
    vmax = tl.max(tl.abs(xb), axis=2)
    _, sf_val, enc = block_scales(vmax, s_enc[:, None], s_dec[:, None])
    v = _signed_e2m1(tl.minimum(tl.maximum(xb * enc[:, :, None], -6.0), 6.0))
    return tl.reshape(v * (sf_val * 0.0078125)[:, :, None], (ROWS, COLS)).to(tl.float16)


@triton.jit
def _row_amax(x_ptr, a_rows, row_mask, stride_xm, K, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr,
              AMAX_STAGES: tl.constexpr, AMAX_EVEN: tl.constexpr, BF16_WORDS: tl.constexpr,
              PACKED_MAX: tl.constexpr):
    """max |x[row, :]| over all of K, per row of the tile (fp32; 0 on pad rows, which read nothing).
    BF16_WORDS: bf16 x read as int32 words of two; |bf16| bit patterns order as their values, so
    the max runs on the integer bits (PACKED_MAX: one `max.u16x2` per word; else one max per half)
    and the largest becomes the fp32 with the same bits in its high half (exact)."""
    if BF16_WORDS:
        xw = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        base = xw + a_rows[:, None] * (stride_xm // 2)
        run = tl.zeros((BLOCK_M, AMAX_K // 2), tl.int32)
        run_hi = tl.zeros((BLOCK_M, AMAX_K // 2), tl.int32)
        for k0 in tl.range(0, K // 2, AMAX_K // 2, num_stages=AMAX_STAGES):
            cols = k0 + tl.arange(0, AMAX_K // 2)
            if AMAX_EVEN:
                w = tl.load(base + cols[None, :], mask=row_mask[:, None], other=0)
            else:
                w = tl.load(base + cols[None, :],
                            mask=row_mask[:, None] & (cols < K // 2)[None, :], other=0)
            if PACKED_MAX:
                run = tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r",
                                                [run, w & 0x7FFF7FFF], dtype=tl.int32,
                                                is_pure=True, pack=1)
            else:
                run = tl.maximum(run, w & 0x7FFF)
                run_hi = tl.maximum(run_hi, (w >> 16) & 0x7FFF)
        bits = tl.max(tl.maximum(run & 0x7FFF, tl.maximum((run >> 16) & 0x7FFF, run_hi)), axis=1)
        return (bits << 16).to(tl.float32, bitcast=True)
    amax = tl.zeros((BLOCK_M,), tl.float32)
    base = x_ptr + a_rows[:, None] * stride_xm
    for k0 in tl.range(0, K, AMAX_K, num_stages=AMAX_STAGES):
        cols = k0 + tl.arange(0, AMAX_K)
        v = tl.load(base + cols[None, :], mask=row_mask[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    return amax


@triton.jit
def _mul_rn(a, b, NO_CONTRACT: tl.constexpr):
    """a * b rounded on its own: `x - a * b` must not become an FMA (act_quant runs without fp
    fusion; this kernel keeps it on so that its epilogue compiles as the GEMM's does). PTX
    `mul.rn` is never contracted (libdevice's mul_rn would flush subnormals here); the
    interpreter never fuses."""
    if NO_CONTRACT:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return a * b


@triton.jit
def _residual(x_ptr, a_rows, row_mask, stride_xm, comp_ptr, j0, KR, s_enc, s_dec, BLOCK_M: tl.constexpr,
              BLOCK_KR: tl.constexpr, NO_CONTRACT: tl.constexpr):
    """RAC residual r = x[:, S] - dq(q(x))[:, S] on channels S[j0 : j0 + BLOCK_KR] (0 past KR):
    each channel's NVFP4 block (its 16 neighbours' amax) is re-derived here, as `act_quant`
    reads it back from the codes it stored. Loads past KR and on pad rows are masked off."""
    j = j0 + tl.arange(0, BLOCK_KR)
    jmask = (j < KR)[None, :]
    lmask = row_mask[:, None] & jmask
    idx = tl.load(comp_ptr + j, mask=j < KR, other=0)
    base = x_ptr + a_rows[:, None] * stride_xm
    first = (idx // 16 * 16)[None, :]
    vmax = tl.zeros((BLOCK_M, BLOCK_KR), tl.float32)
    for t in tl.static_range(16):
        nb = tl.load(base + first + t, mask=lmask, other=0.0).to(tl.float32)
        vmax = tl.maximum(vmax, tl.abs(nb))
    xv = tl.load(base + idx[None, :], mask=lmask, other=0.0).to(tl.float32)
    _, sf_val, enc = block_scales(vmax, s_enc[:, None], s_dec[:, None])
    xq = _mul_rn(_signed_e2m1(tl.minimum(tl.maximum(xv * enc, -6.0), 6.0)) * sf_val,
                 s_dec[:, None], NO_CONTRACT)
    return tl.where(jmask, xv - xq, 0.0)


@triton.jit
def _fused_linear_kernel(
        x_ptr, stride_xm, amax_ptr,
        comp_ptr, KR, rw_ptr, stride_rwn,
        w32_ptr, ws_ptr, ws2_ptr, stride_wn, stride_wsn,
        c_ptr, stride_cm, part_ptr, count_ptr, bias_ptr,
        M, N, K, K_SPLIT, NUM_M_BLOCKS,
        SPLIT_K: tl.constexpr, STATIC: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr, RES_ONE_STEP: tl.constexpr, DOT_F32: tl.constexpr,
        NO_CONTRACT: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_KR: tl.constexpr, SWAP_AB: tl.constexpr,
        OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_KR: tl.constexpr, AMAX_K: tl.constexpr,
        AMAX_STAGES: tl.constexpr, AMAX_EVEN: tl.constexpr, BF16_WORDS: tl.constexpr,
        PACKED_MAX: tl.constexpr, FRAG: tl.constexpr, FRAG_ASM: tl.constexpr,
        GROUP_M: tl.constexpr):
    """C = q(X) Wq^T (+ q(R) Wq[:, S]^T) (+ bias) from the float X; the dense branch of
    `gemm._w4a4_gemm_kernel` with its A tile quantized here. SPLIT_K > 1: program axis 1 takes
    K_SPLIT of K, stores its fp32 partial (row m * SPLIT_K + split, bias and residual in split 0),
    and the last split to finish a tile sums the partials in split order into C."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(NUM_M_BLOCKS - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    pid_k = tl.program_id(1)
    if SPLIT_K == 1:
        k_start = 0
        k_end = K
    else:
        k_start = tl.multiple_of(pid_k * K_SPLIT, BLOCK_K)
        k_end = tl.minimum(K, k_start + K_SPLIT)

    c_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = c_rows < M
    a_rows = tl.where(row_mask, c_rows, 0).to(tl.int64)  # pad rows: loads masked, never stored
    c_rows = c_rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

    # per-token global scales: every program reduces its rows over all of K (or the static scale)
    if STATIC:
        amax = tl.zeros((BLOCK_M,), tl.float32) + tl.load(amax_ptr)
    else:
        amax = _row_amax(x_ptr, a_rows, row_mask, stride_xm, K, BLOCK_M, AMAX_K, AMAX_STAGES,
                         AMAX_EVEN, BF16_WORDS, PACKED_MAX)
    s_enc, sdec = global_scales(amax)

    offs_nl = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w32_ptr + offs_nl[:, None] * (stride_wn // 4) \
        + (tl.multiple_of(k_start // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :]
    s_ptrs = ws_ptr + offs_nl[:, None] * stride_wsn \
        + (tl.multiple_of(k_start // 16, BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16))[None, :]
    x_ptrs = x_ptr + a_rows[:, None] * stride_xm + (k_start + tl.arange(0, BLOCK_K))[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FRAG:  # codes in `fragment_layout`'s order: `gemm._fragment_main_loop` with the A tile made here
        NA: tl.constexpr = BLOCK_N // 64
        slot = tl.arange(0, 256 * NA)[:, None]
        ww4 = tl.arange(0, 4)[None, :]
        atom = tl.minimum(pid_n * NA + (slot // 128) % NA, N // 64 - 1)
        hh = slot // (128 * NA)
        qq = (slot // 32) % 4
        gg = (slot // 4) % 8
        fw_ptrs = w32_ptr + (atom * (K // 128) + k_start // 128) * 1024 + hh * 512 + qq * 128 \
            + gg * 16 + (slot % 4) * 4 + ww4
        frows = atom * 64 + qq * 16 + hh * 8 + gg
        fs_ptrs = ws_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) \
            + frows.to(tl.int64) * (stride_wsn // 2) + k_start // 32 + ww4
        for _ in range(k_start, k_end, 128):
            words = tl.load(fw_ptrs)
            sc = tl.load(fs_ptrs)
            xa = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            fw_ptrs += 1024
            fs_ptrs += 4
            x_ptrs += 128
            # quantized in column order, then moved to the K order of the fragment GEMM: position
            # 32 w + 8 j + 2 t + b holds column 32 w + 16 b + 4 t + j
            a = nvfp4_values_f16(xa.to(tl.float32), s_enc, sdec, BLOCK_M, 128)
            a = tl.reshape(tl.permute(tl.reshape(a, (BLOCK_M, 4, 2, 4, 4)), (0, 1, 4, 3, 2)),
                           (BLOCK_M, 128))
            wt = decode_fragments(words, sc, BLOCK_N, FRAG_ASM)
            acc = _mma(acc, a, wt, SWAP_AB, DOT_F32)
        acc = acc * 0.5  # the fragment decode is value * scale * 2^-6, twice the v2 tile (exact)
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                ww = tl.load(w_ptrs)
                wsb = tl.load(s_ptrs)
                xa = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            else:
                kw = (k0 // 8 + tl.arange(0, BLOCK_K // 8)) < K // 8
                ks = (k0 // 16 + tl.arange(0, BLOCK_K // 16)) < K // 16
                ka = (k0 + tl.arange(0, BLOCK_K)) < K
                ww = tl.load(w_ptrs, mask=kw[None, :], other=0)
                wsb = tl.load(s_ptrs, mask=ks[None, :], other=0)
                xa = tl.load(x_ptrs, mask=row_mask[:, None] & ka[None, :], other=0.0)
            w_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 16
            x_ptrs += BLOCK_K
            a = nvfp4_values_f16(xa.to(tl.float32), s_enc, sdec, BLOCK_M, BLOCK_K)
            wt = decode_words_f16(ww.to(tl.uint32, bitcast=True), wsb, BLOCK_N, BLOCK_K)
            acc = _mma(acc, a, wt, SWAP_AB, DOT_F32)

    ws2 = tl.load(ws2_ptr)
    if HAS_RES:
        # RAC (split 0 only): the residual's global scale needs all k channels first
        kr_run = KR
        if SPLIT_K > 1:
            kr_run = tl.where(pid_k == 0, KR, 0)
        if RES_ONE_STEP:  # k <= BLOCK_KR: one residual tile, built once (all-masked in splits > 0)
            r_one = _residual(x_ptr, a_rows, row_mask, stride_xm, comp_ptr, 0, kr_run, s_enc, sdec,
                              BLOCK_M, BLOCK_KR, NO_CONTRACT)
            ramax = tl.max(tl.abs(r_one), axis=1)
        else:
            ramax = tl.zeros((BLOCK_M,), tl.float32)
            for j0 in tl.range(0, kr_run, BLOCK_KR, num_stages=1):
                r = _residual(x_ptr, a_rows, row_mask, stride_xm, comp_ptr, j0, KR, s_enc, sdec,
                              BLOCK_M, BLOCK_KR, NO_CONTRACT)
                ramax = tl.maximum(ramax, tl.max(tl.abs(r), axis=1))
        r_enc, rdec = global_scales(ramax)
        if SPLIT_K > 1:
            rdec = tl.where(pid_k == 0, rdec, sdec)
        if SWAP_AB:
            acc = acc * tl.math.div_rn(sdec, rdec)[None, :]
        else:
            acc = acc * tl.math.div_rn(sdec, rdec)[:, None]
        rw_rows = rw_ptr + offs_n[:, None].to(tl.int64) * stride_rwn
        for j0 in tl.range(0, kr_run, BLOCK_KR, num_stages=1):
            j = j0 + tl.arange(0, BLOCK_KR)
            if EVEN_KR:
                wg = tl.load(rw_rows + j[None, :], mask=n_mask[:, None], other=0.0)
            else:
                wg = tl.load(rw_rows + j[None, :], mask=n_mask[:, None] & (j < KR)[None, :],
                             other=0.0)
            if RES_ONE_STEP:
                r = r_one
            else:
                r = _residual(x_ptr, a_rows, row_mask, stride_xm, comp_ptr, j0, KR, s_enc, sdec,
                              BLOCK_M, BLOCK_KR, NO_CONTRACT)
            rt = nvfp4_values_f16(r, r_enc, rdec, BLOCK_M, BLOCK_KR)
            acc = _mma(acc, rt, wg, SWAP_AB, DOT_F32)
        sdec = rdec
    if SWAP_AB:
        acc = tl.trans(acc)
    out = acc * sdec[:, None] * (ws2 * 16384.0)
    if HAS_BIAS:
        bias_mask = n_mask
        if SPLIT_K > 1:
            bias_mask = bias_mask & (pid_k == 0)
        out = out + tl.load(bias_ptr + offs_n, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
    c_mask = row_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        p_rows = part_ptr + (c_rows * SPLIT_K)[:, None] * N + offs_n[None, :]
        tl.store(p_rows + pid_k * N, out, mask=c_mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: sum in split order
            out = tl.load(p_rows, mask=c_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                out = out + tl.load(p_rows + s * N, mask=c_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            c_off = c_rows[:, None] * stride_cm + offs_n[None, :]
            if OUT_BF16:
                tl.store(c_ptr + c_off, bf16_round(out).to(tl.uint16), mask=c_mask)
            else:
                tl.store(c_ptr + c_off, out.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        c_off = c_rows[:, None] * stride_cm + offs_n[None, :]
        if OUT_BF16:
            tl.store(c_ptr + c_off, bf16_round(out).to(tl.uint16), mask=c_mask)
        else:
            tl.store(c_ptr + c_off, out.to(c_ptr.dtype.element_ty), mask=c_mask)


def fused_config(m: int, n: int, k: int, num_sms: int, fragment_layout: bool = False) -> GemmConfig:
    """Tile and split-K of the fused launch; num_sms 0: no split. At <= 16 rows `gemm.dense_config`'s
    decode tile and split, at <= 32 the same with 32 rows (spill-free). Above, the 64 x 64 tile
    takes 8 warps (with 4, quantizing a 64 x 128 A
    tile per step spills on sm_90; 64 x 128 spills too), which leaves one program per SM: K is split
    for about one wave only, since every split re-reads its rows for the amax. fragment_layout
    (the v3 codes): swap-AB 128-row weight tiles with 8 warps (16 x 128, above 16 rows 32 x 128;
    spill-free, and per weight ~1/3 fewer instructions than 64-row tiles). All from offline SASS;
    tools/bench_w4a4_linear.py --sweep times the alternatives."""
    bk = _block_k(k)
    k_steps = triton.cdiv(k, bk)
    if m <= 16 or (m <= 32 and not fragment_layout):
        if fragment_layout:
            tile = GemmConfig(16, 128, 128, 8, 3, 8, True)
        else:
            tile = GemmConfig(16 if m <= 16 else 32, 64, bk, 4, 4, 8, True)
        programs = triton.cdiv(n, tile.block_n)
        return tile._replace(split_k=dense_split_k(programs, k_steps, num_sms))
    tile = GemmConfig(32, 128, 128, 8, 3, 8, True) if fragment_layout else GemmConfig(64, 64, bk, 8, 3)
    programs = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    split = 1
    while programs * split * 2 <= num_sms * 5 // 4 and k_steps // (2 * split) >= 4 and split < 8:
        split *= 2
    return tile._replace(split_k=split)


@functools.lru_cache(maxsize=None)
def _counts(device: torch.device, stream: int, size: int) -> torch.Tensor:
    """Zeroed per-tile arrival counts, one buffer per (device, stream) so that launches on
    different streams never share one; every launch leaves it zeroed again."""
    return torch.zeros(size, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _has_u16x2_max(device: torch.device) -> bool:
    """PTX `max.u16x2` (sm_90+) for the bf16 row amax; the interpreter and older GPUs take the
    two-max form."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def _tile_counts(device: torch.device, tiles: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    size = max(1024, triton.next_power_of_2(tiles))
    return _counts(device, stream, size)


def w4a4_linear_fused(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, out: torch.Tensor, *,
                      comp_index: Optional[torch.Tensor] = None,
                      comp_weight: Optional[torch.Tensor] = None, input_scale=None,
                      bias: Optional[torch.Tensor] = None,
                      config: Optional[GemmConfig] = None, amax_k: Optional[int] = None,
                      fragment_layout: bool = False) -> torch.Tensor:
    """out [M, N] = W4A4(+RAC) linear of the float x [M, K] in one launch (inputs checked by the
    caller, `ops.w4a4_linear`). weight [N, K//2] uint8, weight_scale [N, K//16] e4m3,
    weight_scale_2 fp32 [1]; RAC: comp_index int32 [k] and comp_weight fp16 [N, k]
    (`rac_weight_columns`); bias fp32 [N]; config: `fused_config` by default; amax_k: columns
    per step of the row-amax sweep (default 8K elements per step, 3 steps in flight);
    fragment_layout: the codes are in `fragment_layout.to_fragment_order`'s order (the v3 main
    loop; N a multiple of 64, K of 128, block_k 128, block_n a multiple of 64)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        raise ValueError("x: expected a row-major activation")
    if fragment_layout:
        check_fragment_shape(weight, "weight")
        if weight_scale.stride(-1) != 1 or weight_scale.stride(0) % 2:
            raise ValueError(f"weight_scale: expected row-major E4M3 scales [N, K//16], got stride "
                             f"{weight_scale.stride()}")
    if config is None:
        config = fused_config(m, n, k, _num_sms(x.device) if x.is_cuda and not interpreting() else 0,
                              fragment_layout)
    if fragment_layout and (config.block_k != 128 or config.block_n % 64):
        raise ValueError(f"config: fragment-order weights need block_k 128 and block_n a multiple "
                         f"of 64, got {config}")
    bm, bn = config.block_m, config.block_n
    bk = min(config.block_k, max(16, triton.next_power_of_2(k)))
    split = config.split_k
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    num_m_blocks = triton.cdiv(m, bm)
    kr = 0 if comp_index is None else comp_index.shape[-1]
    if kr and (comp_weight is None or comp_weight.dtype != torch.float16
               or comp_weight.shape != (n, kr) or comp_weight.stride(-1) != 1):
        raise ValueError(f"comp_weight: expected fp16 [{n}, {kr}] (row-major), got "
                         f"{None if comp_weight is None else (comp_weight.dtype, tuple(comp_weight.shape))}")
    ws2 = weight_scale_2.reshape(1).to(torch.float32)
    bkr = min(bk, max(16, triton.next_power_of_2(max(kr, 1))))
    if input_scale is not None:
        amax = (torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(1)
                * GLOBAL_SCALE_NUMERATOR)
    else:
        amax = ws2
    if amax_k is None:
        amax_k = max(64, 8192 // bm)
    amax_k = min(amax_k, max(16, triton.next_power_of_2(k)))
    tiles = num_m_blocks * triton.cdiv(n, bn)
    if split > 1:
        part = torch.empty(m * split, n, dtype=torch.float32, device=x.device)
        counts = _tile_counts(x.device, tiles)
    else:
        part = counts = ws2
    c = out.view(torch.uint16) if out.dtype == torch.bfloat16 else out
    comp = comp_index if kr else ws2
    rw = comp_weight if kr else ws2
    ws = weight_scale.view(torch.uint8)
    _fused_linear_kernel[(tiles, split)](
        x, x.stride(0), amax, comp, kr, rw, rw.stride(0) if kr else 0,
        _words(weight, "weight"), ws, ws2, weight.stride(0), ws.stride(0),
        c, c.stride(0), part, counts, bias if bias is not None else ws2,
        m, n, k, k_split, num_m_blocks,
        SPLIT_K=split, STATIC=input_scale is not None, HAS_BIAS=bias is not None,
        HAS_RES=kr > 0, RES_ONE_STEP=kr <= bkr, DOT_F32=interpreting(),
        NO_CONTRACT=not interpreting(), EVEN_K=k % bk == 0,
        EVEN_KR=kr % bkr == 0, SWAP_AB=config.swap_ab, OUT_BF16=c.dtype == torch.uint16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_KR=bkr, AMAX_K=amax_k, AMAX_STAGES=3, AMAX_EVEN=k % amax_k == 0,
        BF16_WORDS=x.dtype == torch.bfloat16 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0,
        PACKED_MAX=_has_u16x2_max(x.device),
        FRAG=fragment_layout, FRAG_ASM=fragment_layout and not interpreting(),
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
