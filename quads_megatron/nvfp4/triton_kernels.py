"""Triton kernels and device helpers for NVFP4 (1x16 blocks), bit-identical to the torch code of `core.py`.

The `@triton.jit` helpers (`e2m1_encode`, `e2m1_decode`, `e4m3_encode`, `e4m3_decode`,
`bf16_round`) are the only NVFP4 encode/decode code in Triton: the rollout GEMMs import
them. They use integer bit operations instead of fp8/bf16 casts so that the result is
the same on the GPU and in the CPU interpreter (TRITON_INTERPRET=1), whose fp8 and bf16
casts are wrong; the divisions use `tl.math.div_rn` (IEEE round-to-nearest), as torch does.
"""

from __future__ import annotations

import functools

import torch

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
    def _quantize_kernel(x_ptr, q_ptr, s_ptr, dq_ptr, senc_ptr, sdec_ptr, R, K,
                         PER_ROW: tl.constexpr, FAKE: tl.constexpr, OUT_BF16: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # the tile is loaded as [rows, 16-blocks, 8 pairs, 2] so that block reductions and
        # nibble packing need no data movement between threads
        NB: tl.constexpr = BLOCK_K // 16
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        blocks = pid_k * NB + tl.arange(0, NB)
        rmask = rows < R
        bmask = rmask[:, None] & (blocks < K // 16)[None, :]                     # [R, NB]
        r4 = rows.to(tl.int64)[:, None, None, None]
        b4 = blocks[None, :, None, None]
        p4 = tl.arange(0, 8)[None, None, :, None]
        e4 = tl.arange(0, 2)[None, None, None, :]
        offs = r4 * K + b4 * 16 + p4 * 2 + e4
        mask4 = bmask[:, :, None, None] & (p4 >= 0) & (e4 >= 0)
        x = tl.load(x_ptr + offs, mask=mask4, other=0.0).to(tl.float32)
        if PER_ROW:
            s_enc = tl.load(senc_ptr + rows, mask=rmask, other=1.0)[:, None]
            s_dec = tl.load(sdec_ptr + rows, mask=rmask, other=1.0)[:, None]
        else:
            s_enc = tl.load(senc_ptr)
            s_dec = tl.load(sdec_ptr)
        vmax = tl.max(tl.max(tl.abs(x), axis=3), axis=2)                        # [R, NB]
        sf_bits, sf_val, enc = block_scales(vmax, s_enc, s_dec)
        scaled = tl.minimum(tl.maximum(x * enc[:, :, None, None], -6.0), 6.0)
        codes = e2m1_encode(scaled)
        if FAKE:
            dq = e2m1_decode(codes) * sf_val[:, :, None, None]
            if PER_ROW:
                dq = dq * s_dec[:, :, None, None]
            else:
                dq = dq * s_dec
            if OUT_BF16:
                tl.store(dq_ptr + offs, bf16_round(dq).to(tl.uint16), mask=mask4)
            else:
                tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=mask4)
        else:
            lo, hi = tl.split(codes)
            packed = lo | (hi << 4)                                              # [R, NB, 8]
            r3 = rows.to(tl.int64)[:, None, None]
            poffs = r3 * (K // 2) + blocks[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
            tl.store(q_ptr + poffs, packed, mask=bmask[:, :, None])
            tl.store(s_ptr + rows.to(tl.int64)[:, None] * (K // 16) + blocks[None, :], sf_bits,
                     mask=bmask)

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
"""Launch shapes of the elementwise kernels, the best measured on the H200 (docs/benchmarks.md)."""


def _tile(k: int, tile, default) -> tuple:
    t = dict(default, **(tile or {}))
    block_k = t["block_k"] if k % t["block_k"] == 0 else _block_k(k)
    return t["block_r"], min(block_k, max(16, triton.next_power_of_2(k))), t["num_warps"]


def quantize(x: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor, tile=None) -> tuple:
    """Triton NVFP4 1x16 quantization of `x` given its global scales: (data, scale)."""
    _require_triton()
    x = x.contiguous()
    rows, k = _launch_shape(x.shape)
    senc, per_row = _scale_layout(s_enc, rows, tuple(x.shape[:-1]))
    sdec, _ = _scale_layout(s_dec, rows, tuple(x.shape[:-1]))
    data = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], k // 16), dtype=torch.uint8, device=x.device)
    block_r, block_k, warps = _tile(k, tile, QUANTIZE_TILE)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _quantize_kernel[grid](x, data, scale, data, senc, sdec, rows, k, PER_ROW=per_row,
                           FAKE=False, OUT_BF16=False, BLOCK_R=block_r, BLOCK_K=block_k,
                           num_warps=warps)
    return data, scale.view(torch.float8_e4m3fn)


def fake_quantize(x: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor,
                  tile=None) -> torch.Tensor:
    """One pass x -> dequantize(quantize(x)) in x's dtype (no packed intermediate)."""
    _require_triton()
    x = x.contiguous()
    rows, k = _launch_shape(x.shape)
    senc, per_row = _scale_layout(s_enc, rows, tuple(x.shape[:-1]))
    sdec, _ = _scale_layout(s_dec, rows, tuple(x.shape[:-1]))
    bf16 = x.dtype == torch.bfloat16
    out = torch.empty(x.shape, dtype=torch.uint16 if bf16 else x.dtype, device=x.device)
    block_r, block_k, warps = _tile(k, tile, QUANTIZE_TILE)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _quantize_kernel[grid](x, out, out, out, senc, sdec, rows, k, PER_ROW=per_row, FAKE=True,
                           OUT_BF16=bf16, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
    return out.view(torch.bfloat16) if bf16 else out


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
    block_r, block_k, warps = _tile(k, tile, DEQUANTIZE_TILE)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](data, scale, sdec, out, rows, k, PER_ROW=per_row, OUT_BF16=bf16,
                             BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
    return out.view(torch.bfloat16) if bf16 else out
