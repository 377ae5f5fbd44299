"""Triton kernels and device helpers for NVFP4 (1x16 blocks), bit-identical to the torch code of `core.py`.

The `@triton.jit` helpers (`e2m1_encode`, `e2m1_decode`, `e4m3_encode`, `e4m3_decode`,
`bf16_round`) are the only NVFP4 encode/decode code in Triton: the rollout GEMMs import
them. They use integer bit operations instead of fp8/bf16 casts so that the result is
the same on the GPU and in the CPU interpreter (TRITON_INTERPRET=1), whose fp8 and bf16
casts are wrong; the divisions use `tl.math.div_rn` (IEEE round-to-nearest), as torch does.
One exception, `bf16x2`: on NVIDIA GPUs the quantize kernels' bf16 pairs come from the hardware's
round-to-nearest-even convert (the same bits), in one instruction instead of ten.
"""

from __future__ import annotations

import functools

import torch

from quads_megatron.errors import InputError

try:  # triton is a dependency of torch on Linux, but keep the numerics importable without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None


def available() -> bool:
    """True when Triton can be imported (kernels need a CUDA device or TRITON_INTERPRET=1)."""
    return triton is not None


def interpreting() -> bool:
    """True when our kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 was
    set when this module was imported); only then can they run on CPU tensors."""
    return triton is not None and type(_quantize_kernel).__name__ == "InterpretedFunction"


def _require_triton():
    if triton is None:
        raise RuntimeError("quads_megatron.nvfp4.triton_kernels needs the `triton` package "
                           "(pip install triton); the torch reference path works without it")


if triton is not None:

    @triton.jit
    def e2m1_encode(v):
        """fp32 values already scaled into [-6, 6] -> uint8 E2M1 codes (RNE, TE's ties).

        On [0, 2] the grid step is 0.5, on (2, 4] it is 1, on (4, 6] it is 2: the code is
        round-half-even(|v| / step) plus 0, 2 or 4. The integer rounding reads the low
        mantissa bits of |v| / step + 1.5 * 2^23 (exact for the small values here).
        """
        a = tl.abs(v)
        inv_step = tl.where(a <= 2.0, 2.0, tl.where(a <= 4.0, 1.0, 0.5))
        offset = tl.where(a <= 2.0, 0, tl.where(a <= 4.0, 2, 4))
        k = (a * inv_step + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        sign = (v < 0).to(tl.int32)
        return ((k + offset) | (sign << 3)).to(tl.uint8)

    @triton.jit
    def e2m1_decode(code):
        """uint8/int E2M1 codes (low 4 bits) -> fp32 values, built from their bit pattern."""
        c = code.to(tl.int32) & 0xF
        e = (c >> 1) & 0x3
        m = c & 0x1
        sign = c >> 3
        exp_f = tl.where(e > 0, e + 126, tl.where(m > 0, 126, 0))
        mant = tl.where(e > 0, m << 22, 0)
        bits = (sign << 31) | (exp_f << 23) | mant
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_encode(v):
        """fp32 in [0, 448] -> float8_e4m3fn bits as uint8, round to nearest even."""
        bits = v.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        # normal e4m3 (unbiased exponent >= -6): round the 23-bit mantissa to 3 bits
        rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
        normal = (((rounded >> 23) & 0xFF) - 120) << 3 | ((rounded >> 20) & 0x7)
        # subnormal e4m3: n = RNE(v * 2^9) in 0..8 (8 is the smallest normal, code 0x08)
        m = (bits & 0x7FFFFF) | 0x800000
        shift = tl.minimum(141 - exp, 31)
        q = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        return tl.where(exp >= 121, normal, sub).to(tl.uint8)

    @triton.jit
    def e4m3_decode(b):
        """float8_e4m3fn bits (uint8) -> fp32 (finite codes; scales are never NaN)."""
        c = b.to(tl.int32) & 0xFF
        e = (c >> 3) & 0xF
        m = c & 0x7
        sign = c >> 7
        normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125
        sub = tl.where(sign == 1, -sub, sub)
        return tl.where(e > 0, normal, sub)

    @triton.jit
    def bf16_round(x):
        """fp32 -> bf16 bits (uint16 payload in int32), round to nearest even."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF

    @triton.jit
    def global_scales(amax):
        """(S_enc, S_dec) from fp32 amax, exactly `core.global_encode_scale` and its inverse:
        S_enc = 2688 / amax capped at FLT_MAX, 1 where amax is 0 or S_enc is 0."""
        safe = tl.where(amax == 0.0, 1.0, amax)
        s_enc = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), safe),
                           3.4028234663852886e38)
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
        return s_enc, s_dec

    @triton.jit
    def block_scales(vmax, s_enc, s_dec):
        """Block amax -> (E4M3 scale bits, decoded scale, element encode scale), TE's order:
        sf = e4m3(min(vmax * (S_enc * fp32(1/6)), 448)); enc = min(1 / (sf * S_dec), FLT_MAX)."""
        sf_bits = e4m3_encode(tl.minimum(vmax * (s_enc * 0.16666666666666666), 448.0))
        sf_val = e4m3_decode(sf_bits)
        enc = tl.minimum(tl.math.div_rn(tl.full(sf_val.shape, 1.0, tl.float32), sf_val * s_dec),
                         3.4028234663852886e38)
        return sf_bits, sf_val, enc

    @triton.jit
    def nvfp4_block_quantize(x, s_enc, s_dec, BLOCKS: tl.constexpr, ROWS: tl.constexpr):
        """One tile [ROWS, BLOCKS*16] fp32 -> (codes [ROWS, BLOCKS*16] uint8, scale bits
        [ROWS, BLOCKS] uint8, decoded scale [ROWS, BLOCKS] fp32); s_enc/s_dec are scalars
        or [ROWS, 1]. TE's reference operation order."""
        xb = tl.reshape(x, (ROWS, BLOCKS, 16))
        vmax = tl.max(tl.abs(xb), axis=2)
        sf_bits, sf_val, enc = block_scales(vmax, s_enc, s_dec)
        scaled = tl.minimum(tl.maximum(xb * enc[:, :, None], -6.0), 6.0)
        codes = e2m1_encode(tl.reshape(scaled, (ROWS, BLOCKS * 16)))
        return codes, sf_bits, sf_val

    @triton.jit
    def e2m1_round(a):
        """|v| already scaled and clamped to [0, 6] -> (E2M1 code magnitude 0..7, rounded value), RNE.

        On [1, 6] E2M1 is a float with one mantissa bit: round the fp32 mantissa to bit 22 (ties to
        even) and read the code from exponent and that bit. On [0, 1) the grid step is 0.5: adding
        2^22 (whose ulp is 0.5) rounds to it. Bit moves only; the same ties as TE's thresholds."""
        bits = a.to(tl.int32, bitcast=True)
        rb = (bits + 0x1FFFFF + ((bits >> 22) & 1)) & -4194304          # keep sign, exponent, bit 22
        shifted = a + 4194304.0
        small = a < 1.0
        code = tl.where(small, shifted.to(tl.int32, bitcast=True) - 0x4A800000, (rb >> 22) - 252)
        value = tl.where(small, shifted - 4194304.0, rb.to(tl.float32, bitcast=True))
        return code, value

    @triton.jit
    def load_pairs(ptr, mask, IN_KIND: tl.constexpr):
        """Load words of two consecutive elements -> (even, odd) as fp32. IN_KIND 0: bf16 pairs in
        int32 words, 1: fp16 pairs in int32, 2: fp32 pairs in int64. One wide load per pair, and the
        nibble packing needs no data movement between threads."""
        w = tl.load(ptr, mask=mask, other=0)
        if IN_KIND == 0:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        elif IN_KIND == 1:
            lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            lo = w.to(tl.int32).to(tl.float32, bitcast=True)
            hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        return lo, hi

    @triton.jit
    def bf16x2(lo, hi, ASM: tl.constexpr):
        """Two fp32 -> one int32 word of bf16 (lo in the low half), round to nearest even. ASM: one
        `cvt.rn.bf16x2.f32` per pair on the GPU; else `bf16_round` bit moves (the interpreter's cast
        truncates). The same bits for every non-NaN input; NaN stays NaN."""
        if ASM:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return bf16_round(lo) | (bf16_round(hi) << 16)

    @triton.jit
    def store_pairs(ptr, lo, hi, mask, IN_KIND: tl.constexpr, ASM: tl.constexpr = False):
        """The inverse of `load_pairs` (bf16 rounded to nearest even, as torch's cast; ASM: see
        `bf16x2`)."""
        if IN_KIND == 0:
            w = bf16x2(lo, hi, ASM)
        elif IN_KIND == 1:
            w = (lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
                 | (hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32) << 16))
        else:
            w = ((lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
                 | (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32))
        tl.store(ptr, w, mask=mask)

    @triton.jit
    def pairs_max(lo, hi):
        """max |x| over the last axis of a [rows, blocks, n] tile of element pairs -> [rows, blocks]."""
        return tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2)

    @triton.jit
    def encode_pairs(lo, hi, enc):
        """E2M1 of a [rows, blocks, n] tile of element pairs with each block's encode scale `enc`
        [rows, blocks] -> (packed codes uint8, signed E2M1 values of the even and odd elements)."""
        c_lo, v_lo = e2m1_round(tl.minimum(tl.abs(lo * enc[:, :, None]), 6.0))
        c_hi, v_hi = e2m1_round(tl.minimum(tl.abs(hi * enc[:, :, None]), 6.0))
        s_lo = (lo < 0).to(tl.int32)
        s_hi = (hi < 0).to(tl.int32)
        packed = (c_lo | (s_lo << 3) | (c_hi << 4) | (s_hi << 7)).to(tl.uint8)
        # the sign as a bit: negating in fp arithmetic may compile to 0 - v, which loses -0.0
        signed_lo = (v_lo.to(tl.int32, bitcast=True) | (s_lo << 31)).to(tl.float32, bitcast=True)
        signed_hi = (v_hi.to(tl.int32, bitcast=True) | (s_hi << 31)).to(tl.float32, bitcast=True)
        return packed, signed_lo, signed_hi

    @triton.jit
    def quantize_halves(src, mask, s_enc, s_dec, IN_KIND: tl.constexpr):
        """NVFP4 of 16-element blocks whose two 8-element halves are the words at `src` and `src + 4`
        ([rows, blocks, 4] word pointers: a thread owns whole blocks, so the block max, its scale and the
        scale byte's store need no data from another thread). TE's operation order. Returns (scale bits,
        decoded scale [rows, blocks]; packed codes and signed E2M1 values of the first half, then of the
        second); unused results cost nothing (the compiler drops them)."""
        a_lo, a_hi = load_pairs(src, mask, IN_KIND)
        b_lo, b_hi = load_pairs(src + 4, mask, IN_KIND)
        sf_bits, sf_val, enc = block_scales(tl.maximum(pairs_max(a_lo, a_hi), pairs_max(b_lo, b_hi)), s_enc, s_dec)
        pk_a, va_lo, va_hi = encode_pairs(a_lo, a_hi, enc)
        pk_b, vb_lo, vb_hi = encode_pairs(b_lo, b_hi, enc)
        return sf_bits, sf_val, pk_a, va_lo, va_hi, pk_b, vb_lo, vb_hi

    @triton.jit
    def store_halves(dqw_ptr, q_ptr, s_ptr, row, k0, half, K, mask, q, s_dec,
                     FAKE: tl.constexpr, PACK: tl.constexpr, IN_KIND: tl.constexpr, ASM: tl.constexpr):
        """Store `quantize_halves`' results `q` for rows `row` [rows, 1, 1] at word columns `k0 + half` (the
        first halves; k0 a multiple of 8): the fake-quantized values (FAKE, e2m1 * scale * s_dec in that
        order) and/or the packed codes with the scale byte, stored by the thread owning the block (PACK)."""
        sf_bits, sf_val, pk_a, va_lo, va_hi, pk_b, vb_lo, vb_hi = q
        woffs = row * (K // 2) + k0 + half
        if FAKE:
            sf = sf_val[:, :, None]
            store_pairs(dqw_ptr + woffs, va_lo * sf * s_dec, va_hi * sf * s_dec, mask, IN_KIND, ASM)
            store_pairs(dqw_ptr + woffs + 4, vb_lo * sf * s_dec, vb_hi * sf * s_dec, mask, IN_KIND, ASM)
        if PACK:
            tl.store(q_ptr + woffs, pk_a, mask=mask)
            tl.store(q_ptr + woffs + 4, pk_b, mask=mask)
            first = (half % 8) == 0
            tl.store(s_ptr + row * (K // 16) + (k0 + half) // 8, tl.broadcast_to(sf_bits[:, :, None], mask.shape),
                     mask=mask & first)

    @triton.jit
    def _quantize_kernel(xw_ptr, q_ptr, s_ptr, dqw_ptr, senc_ptr, sdec_ptr, R, K,
                         PER_ROW: tl.constexpr, FAKE: tl.constexpr, IN_KIND: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False):
        """One [BLOCK_R, BLOCK_K] tile of an [R, K] tensor with given global scales (scalar or per row);
        x (and the fake-quantized output) are addressed as words of two elements. As in the grouped
        kernel, a thread owns whole 16-element blocks (the two halves loaded as two tiles of one layout),
        so the block max, its scale and the scale byte's store stay in-thread."""
        NB: tl.constexpr = BLOCK_K // 16
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        k0 = pid_k * (BLOCK_K // 2)
        half = tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
        mask = rmask[:, None, None] & (k0 + half < K // 2)
        row = rows.to(tl.int64)[:, None, None]
        if PER_ROW:
            s_enc = tl.load(senc_ptr + rows, mask=rmask, other=1.0)[:, None]
            s_dec = tl.load(sdec_ptr + rows, mask=rmask, other=1.0)[:, None]
            d = s_dec[:, :, None]
        else:
            s_enc = tl.load(senc_ptr)
            s_dec = tl.load(sdec_ptr)
            d = s_dec
        q = quantize_halves(xw_ptr + row * (K // 2) + k0 + half, mask, s_enc, s_dec, IN_KIND)
        store_halves(dqw_ptr, q_ptr, s_ptr, row, k0, half, K, mask, q, d, FAKE, not FAKE, IN_KIND, ASM)

    @triton.jit
    def _dequantize_kernel(q_ptr, s_ptr, sdec_ptr, out_ptr, R, K,
                           PER_ROW: tl.constexpr, OUT_BF16: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(q_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :],
                         mask=rmask[:, None] & (pcols < K // 2)[None, :], other=0)
        scols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        sbits = tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // 16) + scols[None, :],
                        mask=rmask[:, None] & (scols < K // 16)[None, :], other=0)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_R, BLOCK_K))
        vals = tl.reshape(e2m1_decode(codes), (BLOCK_R, BLOCK_K // 16, 16))
        if PER_ROW:
            s_dec = tl.load(sdec_ptr + rows, mask=rmask, other=1.0)[:, None]
        else:
            s_dec = tl.load(sdec_ptr)
        out = tl.reshape(vals * e4m3_decode(sbits)[:, :, None], (BLOCK_R, BLOCK_K)) * s_dec
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols < K)[None, :]
        offs = rows[:, None].to(tl.int64) * K + cols[None, :]
        if OUT_BF16:
            tl.store(out_ptr + offs, bf16_round(out).to(tl.uint16), mask=mask)
        else:
            tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _grouped_kernel(tab_ptr, q_ptr, s_ptr, dqw_ptr, sdec_ptr, amax_ptr, bad_ptr, R, K,
                        GROUP: tl.constexpr, MODE: tl.constexpr, FAKE: tl.constexpr, PACK: tl.constexpr,
                        IN_KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        ALIGNED: tl.constexpr = False, ASM: tl.constexpr = False):
        """NVFP4 of G scale groups of GROUP matrices [R, K] each (pointer table `tab_ptr`), one global
        scale per group, outputs stacked [G * GROUP, R, ...]; a program owns BLOCK_R rows (all of K)
        of one group. MODE 2: the amax pass (max|x| and a NaN/Inf flag per group, atomics into
        `amax_ptr` / `bad_ptr`); MODE 0: quantize with those, writing the fake-quantized values (FAKE), the
        packed codes and scales (PACK), or both from one read (the refit: AQAT cache and rollout weights). A
        group holding NaN/Inf gets a NaN S_dec,
        so it decodes to NaN and never to finite garbage. Two launches, not one: quantize programs
        waiting on per-group counters in a single launch were slower (docs/benchmarks.md).
        ALIGNED: every row starts on 16 bytes (128-bit loads); ASM: the GPU's bf16 pair convert."""
        NB: tl.constexpr = BLOCK_K // 16
        GR = GROUP * R
        T = tl.cdiv(GR, BLOCK_R)
        pid = tl.program_id(0)
        g = pid // T
        t = pid % T
        gr = t * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = gr < GR
        mat = g * GROUP + gr // R
        base = tl.load(tab_ptr + mat, mask=rmask, other=0)                    # byte addresses
        WORD_BYTES: tl.constexpr = 8 if IN_KIND == 2 else 4
        row_addr = base + (gr % R).to(tl.int64) * (K // 2) * WORD_BYTES
        if IN_KIND == 2:
            rows_ptr = row_addr.to(tl.pointer_type(tl.int64))
        else:
            rows_ptr = row_addr.to(tl.pointer_type(tl.int32))
        if ALIGNED:
            rows_ptr = tl.multiple_of(rows_ptr, 16)
        out_row = (g * GR + gr).to(tl.int64)
        if MODE == 2:
            cols = tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
            m = tl.zeros((BLOCK_R, NB, 8), tl.float32)
            nonfinite = tl.zeros((BLOCK_R, NB, 8), tl.int32)
            for k0 in range(0, K // 2, BLOCK_K // 2):
                mask = rmask[:, None, None] & (k0 + cols < K // 2)
                lo, hi = load_pairs(rows_ptr[:, None, None] + k0 + cols, mask, IN_KIND)
                a_lo = tl.abs(lo)
                a_hi = tl.abs(hi)
                m = tl.maximum(m, tl.maximum(a_lo, a_hi))
                ok = (a_lo <= 3.4028234663852886e38) & (a_hi <= 3.4028234663852886e38)
                nonfinite = tl.maximum(nonfinite, tl.where(ok, 0, 1))
            tl.atomic_max(amax_ptr + g, tl.max(tl.max(tl.max(m, axis=2), axis=1), axis=0))
            tl.atomic_max(bad_ptr + g, tl.max(tl.max(tl.max(nonfinite, axis=2), axis=1), axis=0))
        else:
            amax = tl.load(amax_ptr + g)
            bad = tl.load(bad_ptr + g)
            s_enc, s_dec = global_scales(amax)
            s_out = tl.where((bad > 0) | (amax != amax), float("nan"), s_dec)
            if t == 0:
                tl.store(sdec_ptr + g, s_out)
            # a thread owns whole 16-element blocks: the words of each block's two halves are loaded as
            # two tiles of one layout, so the block max, its scale and the scale's store stay in-thread
            half = tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
            for k0 in range(0, K // 2, BLOCK_K // 2):
                mask = rmask[:, None, None] & (k0 + half < K // 2)
                q = quantize_halves(rows_ptr[:, None, None] + k0 + half, mask, s_enc, s_dec, IN_KIND)
                store_halves(dqw_ptr, q_ptr, s_ptr, out_row[:, None, None], k0, half, K, mask, q, s_out,
                             FAKE, PACK, IN_KIND, ASM)


if triton is not None:

    @triton.jit
    def _amax_kernel(x_ptr, out_ptr, R, K, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """max|x| per row (PER_ROW) or of the whole tensor (atomic max), in fp32."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                        mask=rmask[:, None] & (cols < K)[None, :], other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        row_max = tl.max(acc, axis=1)
        if PER_ROW:
            tl.store(out_ptr + rows, row_max, mask=rmask)
        else:
            tl.atomic_max(out_ptr, tl.max(row_max, axis=0))


def amax(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """Triton max|x| in fp32 (a scalar, or `[..., 1]` per row): one read of x."""
    _require_triton()
    x = x.contiguous()
    rows, k = _launch_shape(x.shape)
    out = torch.zeros(rows if per_row else 1, dtype=torch.float32, device=x.device)
    block_r, block_k = (4, 1024) if k >= 1024 else (32, _block_k(k))
    block_r = interpreter_rows(block_r, block_k, rows, x.device)
    _amax_kernel[(triton.cdiv(rows, block_r),)](x, out, rows, k, PER_ROW=per_row,
                                                  BLOCK_R=block_r, BLOCK_K=block_k)
    return out.view(*x.shape[:-1], 1) if per_row else out.view(())


def _scale_layout(s: torch.Tensor, rows: int, lead: tuple) -> tuple:
    """(flat fp32 per-row tensor or scalar tensor, per_row flag) for a kernel launch."""
    s = s.to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1).contiguous(), False
    return s.expand(*lead, 1).reshape(rows).contiguous(), True


@functools.lru_cache(maxsize=None)
def _block_k(k: int) -> int:
    for b in (128, 64, 32, 16):
        if k % b == 0:
            return b
    return 16


def _launch_shape(x_shape) -> tuple:
    k = x_shape[-1]
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    return rows, k


QUANTIZE_TILE = {"block_r": 4, "block_k": 512, "num_warps": 4}
DEQUANTIZE_TILE = {"block_r": 32, "block_k": 128, "num_warps": 4}
"""Launch shapes of the elementwise kernels, chosen by the tile sweep in docs/benchmarks.md."""


INTERPRETER_TILE_ELEMENTS = 8192
"""Elements per program in Triton's CPU interpreter, which runs a program as numpy operations on whole
tiles: its cost is per program and operation, not per element, so a launch there takes few large tiles."""


def interpreter_rows(block_r: int, block_k: int, rows: int, device: torch.device) -> int:
    """A default launch's BLOCK_R on `device`: block_r on a GPU; on CPU tensors (the interpreter) about
    INTERPRETER_TILE_ELEMENTS per program, at most the rows there are (a power of two). Every kernel here
    gives the same bits for any BLOCK_R (blocks of 16 along K are independent; the amax is a max), so
    only the launch count changes."""
    if device.type != "cpu":
        return block_r
    return max(block_r, min(triton.next_power_of_2(max(rows, 1)), INTERPRETER_TILE_ELEMENTS // block_k))


def _tile(k: int, tile, default, rows: int, device: torch.device) -> tuple:
    t = dict(default, **(tile or {}))
    block_k = t["block_k"] if k % t["block_k"] == 0 else _block_k(k)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_r = t["block_r"]
    if "block_r" not in (tile or {}):  # a block_r the caller chose is kept, on any device
        block_r = interpreter_rows(block_r, block_k, rows, device)
    return block_r, block_k, t["num_warps"]


_WORDS = {torch.bfloat16: (torch.int32, 0), torch.float16: (torch.int32, 1),
          torch.float32: (torch.int64, 2)}


def _words(x: torch.Tensor) -> tuple:
    """(x viewed as words of two elements, the kernels' IN_KIND) for a contiguous float tensor."""
    if x.dtype not in _WORDS:
        raise TypeError(f"NVFP4 kernels take bfloat16, float16 or float32 tensors, got {x.dtype}")
    word, kind = _WORDS[x.dtype]
    if x.storage_offset() % 2:  # a word view needs an even element offset
        x = x.clone()
    return x.view(word), kind


def quantize(x: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor, tile=None) -> tuple:
    """Triton NVFP4 1x16 quantization of `x` given its global scales: (data, scale)."""
    _require_triton()
    xw, kind = _words(x.contiguous())
    rows, k = _launch_shape(x.shape)
    senc, per_row = _scale_layout(s_enc, rows, tuple(x.shape[:-1]))
    sdec, _ = _scale_layout(s_dec, rows, tuple(x.shape[:-1]))
    data = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], k // 16), dtype=torch.uint8, device=x.device)
    block_r, block_k, warps = _tile(k, tile, QUANTIZE_TILE, rows, x.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _quantize_kernel[grid](xw, data, scale, xw, senc, sdec, rows, k, PER_ROW=per_row,
                           FAKE=False, IN_KIND=kind, BLOCK_R=block_r, BLOCK_K=block_k,
                           num_warps=warps)
    return data, scale.view(torch.float8_e4m3fn)


def fake_quantize(x: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor,
                  tile=None) -> torch.Tensor:
    """One pass x -> dequantize(quantize(x)) in x's dtype (no packed intermediate)."""
    _require_triton()
    xw, kind = _words(x.contiguous())
    rows, k = _launch_shape(x.shape)
    senc, per_row = _scale_layout(s_enc, rows, tuple(x.shape[:-1]))
    sdec, _ = _scale_layout(s_dec, rows, tuple(x.shape[:-1]))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ow, _ = _words(out)
    block_r, block_k, warps = _tile(k, tile, QUANTIZE_TILE, rows, x.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _quantize_kernel[grid](xw, ow, ow, ow, senc, sdec, rows, k, PER_ROW=per_row, FAKE=True,
                           IN_KIND=kind, BLOCK_R=block_r, BLOCK_K=block_k, ASM=inline_ptx(x.device),
                           num_warps=warps)
    return out


def dequantize(data: torch.Tensor, scale: torch.Tensor, s_dec: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16, tile=None) -> torch.Tensor:
    """Triton NVFP4 1x16 dequantization to `dtype` (bf16 rounded RNE, like torch's cast)."""
    _require_triton()
    data = data.contiguous()
    scale = scale.contiguous().view(torch.uint8)
    k = data.shape[-1] * 2
    rows = data.numel() // data.shape[-1]
    sdec, per_row = _scale_layout(s_dec, rows, tuple(data.shape[:-1]))
    bf16 = dtype == torch.bfloat16
    out = torch.empty((*data.shape[:-1], k), dtype=torch.uint16 if bf16 else dtype,
                      device=data.device)
    block_r, block_k, warps = _tile(k, tile, DEQUANTIZE_TILE, rows, data.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](data, scale, sdec, out, rows, k, PER_ROW=per_row, OUT_BF16=bf16,
                             BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
    return out.view(torch.bfloat16) if bf16 else out


def inline_ptx(device: torch.device) -> bool:
    """True where inline PTX runs: an NVIDIA GPU (not ROCm, not the CPU interpreter). The one test for
    every kernel's PTX (the bf16 pair convert here, the GEMM's fragment decode, PDL's griddepcontrol)."""
    return device.type == "cuda" and torch.version.hip is None and not interpreting()


def grouped_tile(k: int, mode: int) -> dict:
    """The grouped kernel's launch shape for rows of K elements: BLOCK_K the largest power of two that
    divides K (at most 512, so no inner step is partly masked), and BLOCK_R rows so that a program's step
    holds one 16-element block per thread of its 4 warps (the quantize passes; 2 for the amax pass).
    Measured on the H100 against the other shapes in docs/benchmarks.md section 2."""
    block_k = min(512, k & -k)
    blocks = 128 * (2 if mode == AMAX_ONLY else 1)
    return {"block_r": max(1, blocks * 16 // block_k), "block_k": block_k, "num_warps": 4}


AMAX_GIVEN, AMAX_ONLY = 0, 2


def pointer_table(mats) -> tuple:
    """(int64 device tensor of base byte addresses, M, R, K, dtype, device, alignment) of M matrices
    [R, K]: a list of contiguous 2-D tensors of one shape and dtype, or a contiguous 3-D tensor.
    alignment: the largest power of two up to 16 that divides every row's starting address (the kernel
    loads element pairs as one word, and 16 bytes at a time where rows allow it)."""
    if isinstance(mats, torch.Tensor):
        m, r, k = mats.shape
        row = k * mats.element_size()
        table = mats.data_ptr() + r * row * torch.arange(m, device=mats.device, dtype=torch.int64)
        return table, m, r, k, mats.dtype, mats.device, _alignment((mats.data_ptr(), row))
    first = mats[0]
    ptrs = tuple(t.data_ptr() for t in mats)
    align = _alignment(ptrs + (first.shape[1] * first.element_size(),))
    if first.is_cuda:
        table = _device_table(ptrs, first.device, torch.cuda.current_stream(first.device).stream_id)
    else:
        table = torch.tensor(ptrs, dtype=torch.int64)
    return table, len(mats), first.shape[0], first.shape[1], first.dtype, first.device, align


def _alignment(values) -> int:
    """The largest power of two up to 16 dividing every value."""
    bits = 16
    for v in values:
        bits |= v
    return bits & -bits


@functools.lru_cache(maxsize=512)
def _device_table(ptrs: tuple, device: torch.device, stream_id: int) -> torch.Tensor:
    """The device copy of a table of addresses, kept: a trainer's expert weights keep their addresses
    from step to step, so each refit reuses its tables (no host-to-device copy, no pinned buffer). The
    key is the addresses themselves (a hit is the same table) and the stream that first used it."""
    return torch.tensor(ptrs, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def grouped(mats, group: int, *, mode: int, fake: bool = False, amax=None, bad=None, out=None,
            tile=None, pack=None, out_fake=None):
    """The grouped NVFP4 kernel over M = G * group matrices (see `_grouped_kernel`), one launch.
    `mats`: the matrices, or their `pointer_table` (built once for the amax and the quantize launch).

    mode AMAX_ONLY: returns (amax fp32 [G], nonfinite int32 [G]); AMAX_GIVEN: quantizes with `amax`
    / `bad` and returns the fake-quantized [M, R, K] tensor (fake) or (data uint8 [M, R, K/2], scale
    e4m3 [M, R, K/16], S_dec [G]); `out` gives those buffers. fake and pack: both from one read,
    returns (fake-quantized, data, scale, S_dec); `out` the packed buffers, `out_fake` the other."""
    _require_triton()
    table, m, r, k, dtype, device, align = mats if isinstance(mats, tuple) else pointer_table(mats)
    word = 8 if dtype == torch.float32 else 4
    if align < word:
        raise InputError(f"grouped NVFP4: a matrix row starts on a {align}-byte boundary, not a {word}-byte one (a "
                         f"view at an odd element offset); the kernel reads {dtype} pairs as {word}-byte words: "
                         f"pass a copy (.clone())")
    if m % group:
        raise ValueError(f"grouped NVFP4: {m} matrices do not split into scale groups of {group}")
    g = m // group
    kind = _WORDS[dtype][1]
    pack = (not fake) if pack is None else pack
    both = fake and pack
    t = dict(grouped_tile(k, mode), **(tile or {}))
    block_k = min(t["block_k"], max(16, triton.next_power_of_2(k)))
    if "block_r" not in (tile or {}):  # as `_tile`
        t["block_r"] = interpreter_rows(t["block_r"], block_k, group * r, device)
    if mode == AMAX_ONLY:
        ws = torch.zeros(2 * g, dtype=torch.int32, device=device)
        bad_ws, amax_ws = ws[:g], ws[g:].view(torch.float32)
        q = s = dq = sdec = amax_ws
    else:
        amax_ws = amax.reshape(g).to(device=device, dtype=torch.float32).contiguous()
        bad_ws = (torch.zeros(g, dtype=torch.int32, device=device) if bad is None
                  else bad.reshape(g).to(device=device, dtype=torch.int32).contiguous())
        if both:
            dq_t = out_fake if out_fake is not None else torch.empty((m, r, k), dtype=dtype, device=device)
            dq = _words(dq_t)[0]
            data, scale, sdec = out if out is not None else (
                torch.empty((m, r, k // 2), dtype=torch.uint8, device=device),
                torch.empty((m, r, k // 16), dtype=torch.uint8, device=device),
                torch.empty(g, dtype=torch.float32, device=device))
            q, s = data, scale.view(torch.uint8)
        elif fake:
            dq_t = out if out is not None else torch.empty((m, r, k), dtype=dtype, device=device)
            dq = _words(dq_t)[0]
            q = s = dq
            sdec = torch.empty(g, dtype=torch.float32, device=device)
        else:
            data, scale, sdec = out if out is not None else (
                torch.empty((m, r, k // 2), dtype=torch.uint8, device=device),
                torch.empty((m, r, k // 16), dtype=torch.uint8, device=device),
                torch.empty(g, dtype=torch.float32, device=device))
            q, s, dq = data, scale.view(torch.uint8), data
    grid = (triton.cdiv(group * r, t["block_r"]) * g,)
    _grouped_kernel[grid](table, q, s, dq, sdec, amax_ws, bad_ws, r, k, GROUP=group, MODE=mode, FAKE=fake,
                          PACK=pack, IN_KIND=kind, BLOCK_R=t["block_r"], BLOCK_K=block_k, ALIGNED=align == 16,
                          ASM=inline_ptx(device), num_warps=t["num_warps"])
    if mode == AMAX_ONLY:
        return amax_ws, bad_ws
    if both:
        return dq_t, data, scale.view(torch.float8_e4m3fn), sdec
    if fake:
        return dq_t, sdec
    return data, scale.view(torch.float8_e4m3fn), sdec
