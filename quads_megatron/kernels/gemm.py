"""Triton NVFP4 GEMM for Hopper: W4A4 (+RAC) and W4A16, dense or grouped over experts by sorted token ids.

Hopper has no FP4 tensor cores, so the weight stays packed in memory (0.5625 bytes per
weight) and each tile is decoded in registers to fp16 and fed to the fp16 tensor cores with
fp32 accumulation. Exactness: an E2M1 value times an E4M3 scale has at most 6 significant
bits and lies in [2^-10, 2688]; scaled by 2^-7 it stays an exact fp16 (subnormals included,
at most 21), so every tile element is exact and the products are exact in fp32. The fp32
global scales (per-row activation S_dec, per-expert weight_scale_2) and the 2^14 are applied
to the accumulator once at the end, as a native FP4 GEMM does.

Decode cost is what bounds a weight-streaming GEMM on Hopper (one SM gets ~16 weight bytes
per clock at HBM speed, 32 elements, against ~64 integer ops per clock), so the main loop
decodes 32-bit words: one shift-and-mask pair yields two fp16 bit patterns (E2M1 bits moved
into the fp16 exponent/mantissa, i.e. the value times 2^-14), the E4M3 scale is moved into
fp16 the same way, and one fp16 multiply gives value * scale * 2^-7. `decode_words_f16` is
tested bit-exact against `quads_megatron.nvfp4.triton_kernels`' `e2m1_decode`/`e4m3_decode` on every byte and every
finite scale. The activation tile is not decoded here: `act_quant` writes it as the same
exact fp16 (e2m1 * e4m3 * 2^-7) next to the packed codes, so the decode work per program is
the weight tile only.

RAC on Hopper, y = xq Wq^T + rq Wq[:, S]^T, runs as k extra K-steps of plain fp16 MMA into the
same accumulator (`r=` and `comp_weight=` in `launch_gemm`): the residual tile rq comes from
the act_quant pre-pass (exact fp16, its own per-row S_dec: the accumulator is rescaled by
S_dec(x) / S_dec(r) before these steps) and the weight columns Wq[:, S] are stored per expert
at load time in the same exact fp16 form (`rac_columns.rac_weight_columns`), so no single
columns are gathered from the packed weight here. (A form that folded the residual into the
fp16 activation tile was removed: it failed its GPU accuracy test; one that ran the residual as more MMA
rows of the main loop, reading no columns, was slower at every size: docs/benchmarks.md section 5.)

`GemmConfig.swap_ab` computes C^T = W A^T instead (same products, same fp32 accumulation): the
decoded weight tile becomes the MMA's A operand, which Hopper's wgmma reads from registers, and
the few routed rows of an expert become its N (>= 8), as OpenAI's triton_kernels does for MXFP4
on Hopper. The default configs use it at decode sizes, where it is the faster tile (the sweep
is in docs/benchmarks.md).

`GemmConfig.split_k` splits K over programs when a launch at decode M has too few tiles to fill the
GPU (a dense projection: `dense_config`; the grouped one at batch 1-2: `grouped_split_k`): each split
stores its scaled fp32 partial (bias, routing weight and the RAC residual in split 0's or every
split's, as they are linear) and `combine.topk_sum` adds them in a fixed order, rounding once, so
the output rows are rounded exactly where the unsplit launch rounds them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from quads_megatron.nvfp4.triton_kernels import bf16_round, inline_ptx

from .combine import topk_sum
from .fragment_layout import check_fragment_shape
from .pdl import pdl_options, pdl_prologue


@triton.jit
def _half_pair(f):
    """uint32 holding two fp16 bit patterns -> (low fp16, high fp16)."""
    lo = (f & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (f >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _e2m1_pair(w, SHL_M: tl.constexpr, SHL_S: tl.constexpr, SHR_M: tl.constexpr):
    """E2M1 nibbles q and q+4 of each uint32 word -> fp16 bits of value * 2^-14 (two per word)."""
    if SHR_M:
        mag = (w >> SHL_M) & 0x0E000E00
    else:
        mag = (w << SHL_M) & 0x0E000E00
    return mag | ((w << SHL_S) & 0x80008000)


@triton.jit
def _e4m3_f16_x128(sbits):
    """e4m3 scale bits (uint8) -> fp16 scale * 2^7: the bits shifted into fp16's fields are the
    value * 2^-8 (subnormals included), times 2^15. Exact (tested against `e4m3_decode`)."""
    b = sbits.to(tl.uint16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.float16, bitcast=True) * 32768.0


@triton.jit
def decode_words_f16(words, sbits, R: tl.constexpr, C: tl.constexpr):
    """Packed codes as uint32 words [R, C//8] + e4m3 bits [R, C//16] -> fp16 [R, C] = value * scale * 2^-7."""
    s = _e4m3_f16_x128(sbits)
    s = tl.reshape(tl.join(s, s), (R, C // 8))
    x0, x4 = _half_pair(_e2m1_pair(words, 9, 12, False))
    x1, x5 = _half_pair(_e2m1_pair(words, 5, 8, False))
    x2, x6 = _half_pair(_e2m1_pair(words, 1, 4, False))
    x3, x7 = _half_pair(_e2m1_pair(words, 3, 0, True))
    t = tl.join(tl.join(tl.join(x0 * s, x4 * s), tl.join(x2 * s, x6 * s)),
                tl.join(tl.join(x1 * s, x5 * s), tl.join(x3 * s, x7 * s)))
    return tl.reshape(t, (R, C))


# ---- fragment layout (`fragment_layout.py`): codes pre-permuted into wgmma's register fragments --
_FRAG_DECODE_ASM = tl.constexpr("""{
.reg .b32 x, y, t, u, sc, r0, r1, r2, r3;
.reg .b16 xl, xh, yl, yh;
cvt.rn.f16x2.e4m3x2 sc, $9;
and.b32 x, $8, 0x9C9C9C9C;
shl.b32 t, $8, 2;
shr.b32 u, $8, 2;
and.b32 t, t, 0x8C8C8C8C;
and.b32 u, u, 0x10101010;
or.b32 y, t, u;
mov.b32 {xl, xh}, x;
mov.b32 {yl, yh}, y;
cvt.rn.f16x2.e4m3x2 r0, xl;
cvt.rn.f16x2.e4m3x2 r1, xh;
cvt.rn.f16x2.e4m3x2 r2, yl;
cvt.rn.f16x2.e4m3x2 r3, yh;
mul.rn.f16x2 r0, r0, sc;
mul.rn.f16x2 r1, r1, sc;
mul.rn.f16x2 r2, r2, sc;
mul.rn.f16x2 r3, r3, sc;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}""")


@triton.jit
def _e4m3_byte_f16(b):
    """One E4M3 byte (in a uint32) -> its exact fp16 value: the bits moved into fp16's fields are
    the value * 2^-8 (subnormals included), times 2^8."""
    h = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.uint16)
    return h.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _fragment_word_portable(w, sc):
    """The inline-asm decode in plain Triton (the CPU interpreter): word -> 8 fp16, same values."""
    x = w & 0x9C9C9C9C
    y = ((w << 2) & 0x8C8C8C8C) | ((w >> 2) & 0x10101010)
    s = sc.to(tl.uint32)
    s0 = _e4m3_byte_f16(s & 0xFF)
    s1 = _e4m3_byte_f16(s >> 8)
    return (_e4m3_byte_f16(x & 0xFF) * s0, _e4m3_byte_f16((x >> 8) & 0xFF) * s1,
            _e4m3_byte_f16((x >> 16) & 0xFF) * s0, _e4m3_byte_f16(x >> 24) * s1,
            _e4m3_byte_f16(y & 0xFF) * s0, _e4m3_byte_f16((y >> 8) & 0xFF) * s1,
            _e4m3_byte_f16((y >> 16) & 0xFF) * s0, _e4m3_byte_f16(y >> 24) * s1)


@triton.jit
def decode_fragments(words, sc, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """Fragment-order words [slot, 4 w] (int32, `_fragment_main_loop`'s slots) and the matching scale
    pairs (uint16: blocks 2w, 2w + 1 of the row) -> fp16 tile [BLOCK_N, 128] = value * scale * 2^-6
    in the kernel's K order (column 32 w + 8 j + 2 t + b holds column 16 (2w + b) + 4t + j of the
    step; the activation comes in the same order, `fragment_layout.fragment_columns`). Every op
    is elementwise or a register-level join/permute, so the tile lands in wgmma's register-operand
    layout without a shuffle. ASM: the and/shift + cvt.e4m3x2 + mul.f16x2 decode (GPU); else the
    same values in plain Triton (the interpreter)."""
    w = words.to(tl.uint32, bitcast=True)
    if ASM:
        o00, o01, o10, o11, o20, o21, o30, o31 = tl.inline_asm_elementwise(
            _FRAG_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, sc],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        o00, o01, o10, o11, o20, o21, o30, o31 = _fragment_word_portable(w, sc)
    p01 = tl.join(tl.join(o00, o01), tl.join(o10, o11))   # [..., w, b, j = 0 / 1]
    p23 = tl.join(tl.join(o20, o21), tl.join(o30, o31))   # [..., w, b, j = 2 / 3]
    t = tl.join(p01, p23)                                  # [slot, w, b, jlo, jhi]
    t = tl.reshape(t, (2, BLOCK_N // 64, 4, 8, 4, 4, 2, 2, 2))  # [h, A, q, g, t, w, b, jlo, jhi]
    t = tl.permute(t, (1, 2, 0, 3, 5, 8, 7, 4, 6))         # [A, q, h, g, w, jhi, jlo, t, b]
    return tl.reshape(t, (BLOCK_N, 128))


@triton.jit
def _fragment_main_loop(acc, a_ptr, a_rows, stride_am, w32_ptr, ws_ptr, expert, stride_we,
                        stride_wse, pid_n, N, K, k_start, k_end,
                        SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr, ASM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The main loop over fragment-order codes: per 128-wide step, one [BLOCK_N/64] x 1024-word
    load (16 bytes per thread and row pair), the matching scale pairs, the activation tile (its
    columns already in the tile's K order), the register decode and one MMA."""
    NA: tl.constexpr = BLOCK_N // 64
    # a thread's 4 words are one 16-byte load; [slot, 4 words] with slot = t + 4 g + 32 q +
    # 128 (atom + NA h): lanes take (t, g), warps q (and the atom with 8 warps), registers the rest
    slot = tl.arange(0, 256 * NA)[:, None]
    ww = tl.arange(0, 4)[None, :]
    tt = slot % 4
    gg = (slot // 4) % 8
    qq = (slot // 32) % 4
    aa = (slot // 128) % NA
    hh = slot // (128 * NA)
    atom = tl.minimum(pid_n * NA + aa, N // 64 - 1)   # past N: the last atom (stores are masked)
    step0 = k_start // 128
    w_ptrs = w32_ptr + expert * (stride_we // 4) + (atom * (K // 128) + step0) * 1024 \
        + hh * 512 + qq * 128 + gg * 16 + tt * 4 + ww
    # the scales in `fragment_layout.to_fragment_scale_order`'s order: a warp's 8 rows are 64 contiguous bytes
    s_ptrs = ws_ptr + expert * (stride_wse // 2) + (atom * (K // 128) + step0) * 256 \
        + hh * 128 + qq * 32 + gg * 4 + ww
    # the activation is stored in the same K order (`fragment_layout.fragment_columns`)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + k_start + tl.arange(0, 128)[None, :]
    for _ in range(k_start, k_end, 128):
        words = tl.load(w_ptrs)
        sc = tl.load(s_ptrs)
        a = tl.load(a_ptrs)
        w_ptrs += 1024
        s_ptrs += 256
        a_ptrs += 128
        wt = decode_fragments(words, sc, BLOCK_N, ASM)
        acc = _mma(acc, a, wt, SWAP_AB, DOT_F32)
    return acc


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [M, N] += a [M, K] w [N, K]^T; SWAP_AB: acc [N, M] += w a^T, so the weight tile decoded in
    registers is the MMA's A operand (Hopper's wgmma reads A from registers, B from shared memory)
    and the few routed rows are its N. DOT_F32: fp32 operands (the interpreter; fp32 activations)."""
    if DOT_F32:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
        if SWAP_AB:
            out = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            out = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        w = w.to(a.dtype)
        if SWAP_AB:
            out = tl.dot(w, tl.trans(a), acc)
        else:
            out = tl.dot(a, tl.trans(w), acc)
    return out


@triton.jit
def _w4a4_gemm_kernel(
        a_ptr, asdec_ptr, stride_am,
        rv_ptr, rsdec_ptr, KR, rw_ptr, stride_rwe, stride_rwn,
        w32_ptr, ws_ptr, ws2_ptr, stride_we, stride_wn, stride_wse, stride_wsn,
        c_ptr, stride_cm, bias_ptr, topk_w_ptr,
        sorted_ptr, expert_ptr, npost_ptr,
        M, N, K, K_SPLIT, A_ROW_DIV, NUM_M_BLOCKS,
        SPLIT_K: tl.constexpr, ROUTED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr, W4A16: tl.constexpr, DOT_F32: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_KR: tl.constexpr, SWAP_AB: tl.constexpr,
        FRAG: tl.constexpr, FRAG_ASM: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KR: tl.constexpr,
        GROUP_M: tl.constexpr, USE_PDL: tl.constexpr = False):
    """C[rows] = A[rows] Wq[e]^T: A is the exact fp16 activation tile of act_quant (W4A4) or
    the float activation (W4A16); Wq[e] is decoded from packed words in registers; with RAC,
    + R[rows] C[e]^T over the k residual channels (C: the stored fp16 weight columns).
    SPLIT_K > 1: program axis 1 takes K_SPLIT of K and stores its fp32 partial
    (scaled; bias and residual in split 0) at row m * SPLIT_K + split, summed by `combine.topk_sum`.
    FRAG: the codes are in `fragment_layout`'s order (BLOCK_K 128, N a multiple of 64, K of 128)
    and decode to value * scale * 2^-6 (FRAG_ASM: inline asm; else plain Triton)."""
    pdl_prologue(USE_PDL)
    # program -> (m block, n tile); GROUP_M m-blocks share an n sweep (L2 reuse of A and W)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(NUM_M_BLOCKS - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    pid_k = tl.program_id(1)
    if SPLIT_K == 1:  # a constant start: the loads' 16-byte alignment stays provable
        k_start = 0
        k_end = K
    else:
        k_start = tl.multiple_of(pid_k * K_SPLIT, BLOCK_K)
        k_end = tl.minimum(K, k_start + K_SPLIT)

    offs_m = tl.arange(0, BLOCK_M)
    if ROUTED:
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        c_rows = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m)
        row_mask = c_rows < M
        a_rows = tl.where(row_mask, c_rows // A_ROW_DIV, 0).to(tl.int64)
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    else:
        c_rows = pid_m * BLOCK_M + offs_m
        row_mask = c_rows < M
        a_rows = tl.where(row_mask, c_rows, 0).to(tl.int64)
        expert = 0
    c_rows = c_rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # loads read in-bounds rows (pad rows: activation row 0; rows past N: the last weight row) and
    # are unmasked along M and N; the store masks them. With EVEN_K the main loop has no masks at
    # all and advances its pointers, which keeps the per-step address math off the decode's ALUs.
    offs_nl = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w32_ptr + expert * (stride_we // 4) + offs_nl[:, None] * (stride_wn // 4) \
        + (tl.multiple_of(k_start // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :]
    s_ptrs = ws_ptr + expert * stride_wse + offs_nl[:, None] * stride_wsn \
        + (tl.multiple_of(k_start // 16, BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16))[None, :]
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_start + tl.arange(0, BLOCK_K))[None, :]

    if SWAP_AB:  # accumulate C^T (transposed back before the epilogue)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FRAG:
        acc = _fragment_main_loop(acc, a_ptr, a_rows, stride_am, w32_ptr, ws_ptr, expert,
                                  stride_we, stride_wse, pid_n, N, K, k_start, k_end,
                                  SWAP_AB, DOT_F32, FRAG_ASM, BLOCK_M, BLOCK_N)
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                ww = tl.load(w_ptrs)
                wsb = tl.load(s_ptrs)
                a = tl.load(a_ptrs)
            else:
                kw = (k0 // 8 + tl.arange(0, BLOCK_K // 8)) < K // 8
                ks = (k0 // 16 + tl.arange(0, BLOCK_K // 16)) < K // 16
                ka = (k0 + tl.arange(0, BLOCK_K)) < K
                ww = tl.load(w_ptrs, mask=kw[None, :], other=0)
                wsb = tl.load(s_ptrs, mask=ks[None, :], other=0)
                a = tl.load(a_ptrs, mask=ka[None, :], other=0.0)
            w_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 16
            a_ptrs += BLOCK_K
            wt = decode_words_f16(ww.to(tl.uint32, bitcast=True), wsb, BLOCK_N, BLOCK_K)
            acc = _mma(acc, a, wt, SWAP_AB, DOT_F32)

    ws2 = tl.load(ws2_ptr + expert)
    if FRAG:  # its weight tile is value * scale * 2^-6, the v2 tile's 2^-7 times 2 (exact)
        acc = acc * 0.5
    if W4A16:
        if SWAP_AB:
            acc = tl.trans(acc)
        out = acc * (ws2 * 128.0)
    else:
        sdec = tl.load(asdec_ptr + a_rows, mask=row_mask, other=1.0)
        if HAS_RES:
            # RAC: + rq Wq[:, S]^T as k more K-steps (the residual has its own per-row S_dec:
            # rescale the accumulator to it and keep one accumulator)
            # (split 0 only: the other splits run no residual step and keep their S_dec)
            rdec = tl.load(rsdec_ptr + a_rows, mask=row_mask, other=1.0)
            kr_run = KR
            if SPLIT_K > 1:
                rdec = tl.where(pid_k == 0, rdec, sdec)
                kr_run = tl.where(pid_k == 0, KR, 0)
            if SWAP_AB:
                acc = acc * tl.math.div_rn(sdec, rdec)[None, :]
            else:
                acc = acc * tl.math.div_rn(sdec, rdec)[:, None]
            rw_rows = rw_ptr + expert * stride_rwe + offs_n[:, None].to(tl.int64) * stride_rwn
            r_rows = rv_ptr + a_rows[:, None] * KR
            # one step at k <= BLOCK_K; not pipelined (no extra shared-memory stages: occupancy)
            for j0 in tl.range(0, kr_run, BLOCK_KR, num_stages=1):
                j = j0 + tl.arange(0, BLOCK_KR)
                if EVEN_KR:
                    wg = tl.load(rw_rows + j[None, :], mask=n_mask[:, None], other=0.0)
                    rt = tl.load(r_rows + j[None, :], mask=row_mask[:, None], other=0.0)
                else:
                    jmask = j < KR
                    wg = tl.load(rw_rows + j[None, :], mask=n_mask[:, None] & jmask[None, :],
                                 other=0.0)
                    rt = tl.load(r_rows + j[None, :], mask=row_mask[:, None] & jmask[None, :],
                                 other=0.0)
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
    if MUL_WEIGHT:
        out = out * tl.load(topk_w_ptr + c_rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    if SPLIT_K > 1:
        c_rows = c_rows * SPLIT_K + pid_k
    c_off = c_rows[:, None] * stride_cm + offs_n[None, :]
    c_mask = row_mask[:, None] & n_mask[None, :]
    if OUT_BF16:
        tl.store(c_ptr + c_off, bf16_round(out).to(tl.uint16), mask=c_mask)
    else:
        tl.store(c_ptr + c_off, out.to(c_ptr.dtype.element_ty), mask=c_mask)


class GemmConfig(NamedTuple):
    """Tile shape and launch parameters of one GEMM launch."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    swap_ab: bool = False  # C^T = W A^T: the decoded weight tile as the MMA's A operand (small M)
    split_k: int = 1  # K split over this many programs per tile, fp32 partials summed (`dense_split_k`)
    max_regs: Optional[int] = None  # Triton's maxnreg: a register cap per thread (more CTAs per SM), None: ptxas'


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at
    import): bf16/fp16 dots are computed in fp32 there (its bf16 dot is broken)."""
    return type(_w4a4_gemm_kernel).__name__ == "InterpretedFunction"


def _block_k(k: int) -> int:
    """The K tile of the default configs: 128, or the whole (power-of-2 padded) K below it."""
    return 128 if k % 128 == 0 or k > 128 else max(16, triton.next_power_of_2(k))


def default_config(rows_per_expert: float, n: int, k: int, rac: bool = False) -> GemmConfig:
    """Grouped (MoE) tile choice by rows per expert (decode: weight streaming; prefill:
    tensor-core bound); the dense GEMM takes `dense_config`.
    rac: the launch runs the residual K-steps too; at prefill its tile then takes K 128, which
    halves RAC's cost over W4A4 there. All are spill-free on sm_90 (ptxas); docs/benchmarks.md
    has the sweep."""
    bk = _block_k(k)
    if rows_per_expert <= 16:
        return GemmConfig(16, 64, bk, 4, 4, 8, True)
    if rows_per_expert <= 64:
        return GemmConfig(64, 128, bk, 8, 3)
    return GemmConfig(128, 128, bk if rac else min(bk, 64), 8, 3)


def fragment_config(rows_per_expert: float, n: int, k: int, rac: bool = False, dense: bool = False) -> GemmConfig:
    """Tile choice for fragment-order weights (K step 128), from `tools/bench_moe_layer.py --sweep` and
    `tools/bench_w4a4_linear.py` on the H100 (docs/benchmarks.md sections 5 and 6). Swap-AB (the decoded weight
    as wgmma's register operand) with as many token columns as the rows need, by mean rows per expert:

    - grouped, 0.5-1 row (decode batches of 9-16 at 128 experts, top-8): 16 tokens x 256 weight rows on 8 warps,
      capped at 96 registers (N a multiple of 256): one activation tile per 256 rows instead of 128, half the CTAs
      (1.13x W4A4 / 1.03x RAC at 16 tokens; slower at 16 rows). Not below: untimed there, and at one token fc2
      would run 64 such programs on 132 SMs;
    - <= 16 rows: 16 tokens x 128 rows on 4 warps, capped at 96 registers (5 CTAs per SM, no spills);
    - grouped, 33-48 rows: 64 tokens, 4 stages: random routing puts most experts under 64 rows, so each expert's
      weights are decoded once where the 32-token tile decodes them twice (1.13x at 48 rows; at 32 and 64 rows,
      where more experts need a second tile of either, the 32-token tile wins by 28% and 9%);
    - grouped, <= 64 rows: 32 tokens capped at 168 registers (3 CTAs per SM, no spills); the dense op up to 32
      rows: 32 tokens capped at 128 (4 CTAs per SM; ptxas spills 80 / 112 bytes a thread, W4A4 / RAC);
    - above: 64 tokens, uncapped (the grouped layer at any row count: at 512 rows per expert 2.55 against 2.73 ms
      for the 128 x 128 tile on 8 warps, which decodes a weight tile once per 128 rows but through shared memory);
      the dense op only up to 64 rows (at 96-128 rows the 128 x 128 tile was 0-6% faster).

    N not a multiple of 128 (64-row N tiles) keeps the (64 | 128) x 128 tiles above 32 rows. k and rac are
    taken for `default_config`'s signature (`moe_configs` calls either): the tiles do not depend on them."""
    bn = 128 if n % 128 == 0 else 64
    if not dense and 0.5 < rows_per_expert <= 1 and n % 256 == 0:
        return GemmConfig(16, 256, 128, 8, 3, 8, True, max_regs=96)
    if rows_per_expert <= 16:
        return GemmConfig(16, bn, 128, 4, 3, 8, True, max_regs=96)
    if not dense and bn == 128 and 32 < rows_per_expert <= 48:
        return GemmConfig(64, 128, 128, 4, 4, 8, True)
    if not dense and bn == 128 and rows_per_expert <= 64:
        return GemmConfig(32, 128, 128, 4, 3, 8, True, max_regs=168)
    if rows_per_expert <= 32:
        return GemmConfig(32, bn, 128, 4, 3, 8, True, max_regs=128)
    if bn == 128 and (rows_per_expert <= 64 or not dense):
        return GemmConfig(64, 128, 128, 4, 3, 8, True)
    return GemmConfig(64 if rows_per_expert <= 64 else 128, 128, 128, 8, 3)


def dense_split_k(programs: int, k_steps: int, num_sms: int) -> int:
    """Split K (powers of 2, at most 8) until a dense launch of `programs` tiles has >= 2 x SMs
    programs, keeping >= 4 K-steps per split: at decode M a dense layer has too few tiles to
    stream its weight at HBM speed (16 x 2048 x 4096: 32 programs on 132 SMs)."""
    split = 1
    while programs * split < 2 * num_sms and k_steps // (2 * split) >= 4 and split < 8:
        split *= 2
    return split


def grouped_split_k(m: int, num_experts: int, n: int, k: int, config: GemmConfig, num_sms: int) -> int:
    """`dense_split_k` for a grouped launch of m routed rows: at most min(m, E) experts have rows, so
    min(m, E) x N-tiles programs do work (the rest exit at once). At decode batch 1 (8 rows at top-8)
    Qwen3-30B-A3B's fc1 has 96 such programs of 16 K-steps each on 132 SMs: split 4."""
    programs = min(m, num_experts) * triton.cdiv(n, config.block_n)
    return dense_split_k(programs, triton.cdiv(k, config.block_k), num_sms)


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device for the split-K choice; 0 (no split) on CPU and in the interpreter."""
    return _num_sms(device) if device.type == "cuda" and not interpreting() else 0


def dense_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """Tile and split-K of the dense GEMM (attention / shared projections) at m rows, from the
    sweep of `tools/bench_w4a4_linear.py --sweep` (docs/benchmarks.md); num_sms 0: no split."""
    bk = _block_k(k)
    if m <= 16:
        tile = GemmConfig(16, 64, bk, 4, 4, 8, True)
    elif m <= 64:
        tile = GemmConfig(64, 64, bk, 4, 3)
    else:
        tile = GemmConfig(128, 128, min(bk, 64), 8, 3)
    programs = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    return tile._replace(split_k=dense_split_k(programs, triton.cdiv(k, tile.block_k), num_sms))


def linear_config(m: int, n: int, k: int, fragment_layout: bool, device: torch.device) -> GemmConfig:
    """The dense GEMM's launch at m rows: `fragment_config(dense=True)`'s tile (fragment-order weights) or
    `dense_config`'s, K split until the GPU is full (`dense_split_k`)."""
    if not fragment_layout:
        return dense_config(m, n, k, device_sms(device))
    config = fragment_config(m, n, k, dense=True)
    programs = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    return config._replace(split_k=dense_split_k(programs, k // 128, device_sms(device)))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _words(t: torch.Tensor, name: str) -> torch.Tensor:
    """Row-major packed codes [..., K//2] viewed as int32 words (8 codes each)."""
    if t.stride(-1) != 1 or t.shape[-1] % 4 or t.data_ptr() % 4 or \
            any(s % 4 for s in t.stride()[:-1]):
        raise ValueError(f"{name}: packed codes must be row-major with 4-byte aligned rows, "
                         f"got shape {tuple(t.shape)} stride {t.stride()}")
    return t.view(torch.int32)


def launch_gemm(a: torch.Tensor, a_s_dec: Optional[torch.Tensor], w: torch.Tensor,
                w_scale: torch.Tensor, w_scale_2: torch.Tensor, out: torch.Tensor, *, m: int,
                w4a16: bool = False, r=None, comp_weight: Optional[torch.Tensor] = None,
                bias=None, routing=None, a_row_div: int = 1, topk_weights=None,
                config: Optional[GemmConfig] = None, fragment_layout: bool = False) -> torch.Tensor:
    """Run the kernel. a: the exact fp16 activation values of act_quant [Ma, K] (or the float
    x with w4a16); w [E, N, K//2] (E = 1 dense); out [M, N]; routing = (sorted_ids,
    expert_ids, num_post) for the grouped form; RAC: r = (values [Ma, k], s_dec [Ma]) of the
    residual and comp_weight = its weight columns, fp16 [E, N, k] (`rac_weight_columns`);
    fragment_layout: w and w_scale are in `fragment_layout.to_fragment_order`'s and
    `to_fragment_scale_order`'s byte orders (the v3 main loop)."""
    e, n, k2 = w.shape
    k = k2 * 2
    if a.stride(-1) != 1:
        raise ValueError("activation: expected a row-major tensor")
    if fragment_layout:
        check_fragment_shape(w, "weight")
        if config is None and routing is None:
            config = linear_config(m, n, k, True, a.device)
        elif config is None:
            config = fragment_config(m / max(1, e), n, k, rac=r is not None)
        if config.block_k != 128 or config.block_n % 64 or config.block_m % 16:
            raise ValueError(f"config: fragment-order weights need block_k 128, block_n a multiple "
                             f"of 64 and block_m of 16, got {config}")
        if w_scale.stride(-1) != 1 or w_scale.stride(-2) != k // 16 or w_scale.stride(0) % 2:
            raise ValueError(f"weight_scale: expected fragment-order E4M3 scales [E, N, K//16], each expert's "
                             f"contiguous, got shape {tuple(w_scale.shape)} stride {w_scale.stride()}")
    if config is None and routing is None:
        config = linear_config(m, n, k, False, a.device)
    elif config is None:
        config = default_config(m / max(1, e), n, k, rac=r is not None)
    bm, bn = config.block_m, config.block_n
    bk = min(config.block_k, max(16, triton.next_power_of_2(k)))
    split = config.split_k
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    if routing is None:
        num_m_blocks = triton.cdiv(m, bm)
        sorted_ids = expert_ids = npost = w_scale_2
    else:
        sorted_ids, expert_ids, npost = routing
        # every non-empty block holds >= 1 of the m routed rows, so at most m blocks do work: at decode
        # batch 1 (8 rows, 128 experts, block 16) 8 of the 121 padded blocks, the rest would launch to exit
        num_m_blocks = min(sorted_ids.numel() // bm, m)
    kr = 0 if r is None else comp_weight.shape[-1]
    if kr and (comp_weight.dtype != torch.float16 or comp_weight.shape != (e, n, kr)
               or comp_weight.stride(-1) != 1 or r[0].shape[-1] != kr or not r[0].is_contiguous()):
        raise ValueError(f"comp_weight: expected fp16 [{e}, {n}, k] (row-major) and residual "
                         f"values [rows, k], got {comp_weight.dtype} {tuple(comp_weight.shape)} "
                         f"and {tuple(r[0].shape)}")
    rw = comp_weight if kr else w_scale_2
    bkr = min(bk, max(16, triton.next_power_of_2(max(kr, 1))))
    if split > 1:  # fp32 partials, row m * split + s
        c = torch.empty(m * split, n, dtype=torch.float32, device=out.device)
    else:
        c = out.view(torch.uint16) if out.dtype == torch.bfloat16 else out
    out_bf16 = c.dtype == torch.uint16
    grid = (num_m_blocks * triton.cdiv(n, bn), split)
    ws = w_scale.view(torch.uint16 if fragment_layout else torch.uint8)
    _w4a4_gemm_kernel[grid](
        a, a_s_dec if a_s_dec is not None else w_scale_2, a.stride(0),
        r[0] if kr else a, r[1] if kr else w_scale_2, kr,
        rw, rw.stride(0) if kr else 0, rw.stride(1) if kr else 0,
        _words(w, "weight"), ws, w_scale_2, w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), c, c.stride(0), bias if bias is not None else w_scale_2,
        topk_weights if topk_weights is not None else w_scale_2,
        sorted_ids, expert_ids, npost, m, n, k, k_split, a_row_div, num_m_blocks,
        SPLIT_K=split, ROUTED=routing is not None, MUL_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None, HAS_RES=kr > 0, W4A16=w4a16,
        DOT_F32=interpreting() or a.dtype == torch.float32,
        EVEN_K=k % bk == 0, EVEN_KR=kr % bkr == 0, SWAP_AB=config.swap_ab,
        FRAG=fragment_layout, FRAG_ASM=fragment_layout and inline_ptx(a.device),
        OUT_BF16=out_bf16, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, BLOCK_KR=bkr,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
        **({} if config.max_regs is None else {"maxnreg": config.max_regs}), **pdl_options(a.device))
    if split > 1:
        topk_sum(c, split, out=out)
    return out
