"""NVFP4 quantize / dequantize / fake-quantize: the one implementation of the format.

We follow NVIDIA Transformer Engine's reference quantizer
(`transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`, `NVFP4QuantizerRef`,
1x16 or 16x16 tiles, no random Hadamard transform, no stochastic rounding) bit for bit,
operation order included, because TE's CUDA kernels are tested exact against it and
TE is what Megatron-Core trains NVFP4 with. All arithmetic is fp32:

1. amax = max|x| (per tensor, per row, or given);
2. S_enc = 2688 / amax, capped at FLT_MAX; S_enc = 1 when amax == 0 or S_enc == 0
   (TE's kernel rule; the Python reference would give FLT_MAX for an all-zero tensor,
   which decodes to the same zeros); S_dec = 1 / S_enc;
3. block scale sf = e4m3(clamp(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX), +-448)), RNE;
4. code = RNE_e2m1(clamp(x * min(1 / (fp32(sf) * S_dec), FLT_MAX), +-6)), ties to even;
5. two codes per byte, element 2i in the low nibble;
6. x_hat = e2m1 * fp32(sf) * S_dec (left to right: the first product is exact).

NVIDIA ModelOpt's `NVFP4QTensor` computes the same quantity in another order
(weight_scale_2 = amax / 2688, scaled = x / (sf * weight_scale_2)) and stores 0x38 for an
all-zero block; it agrees with this code except at exact E4M3 / E2M1 ties (tested).

Backends (`backend.resolve_backend`: the `backend=` argument, else QUADS_BACKEND, else Triton
on CUDA and torch on CPU): "triton" runs the kernels of `triton_kernels` (on CPU tensors in
Triton's interpreter), which are tested bit-identical to the torch code here; "torch" runs
the torch code. 16x16 blocks have only the torch code and run it on either backend.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import torch

from quads_megatron.errors import ConfigError, InputError, NonFiniteError

from .backend import resolve_backend
from .format import (BLOCK_SIZE, E2M1_BOUNDS_GE, E2M1_BOUNDS_GT, E4M3_MAX, FLT_MAX, FP4_MAX,
                     GLOBAL_SCALE_NUMERATOR)
from .tensor import NVFP4Tensor, check_block_shape

BlockShape = Sequence[int]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- scales ------------------------------------------------------------------------------
def amax_of(x: torch.Tensor, per_row: bool = False, *,
            backend: Optional[str] = None) -> torch.Tensor:
    """max|x| in fp32: a scalar, or `[..., 1]` per row of the last dimension.

    backend: "triton" | "torch" | None (`resolve_backend`); Triton reads float tensors once
    with one kernel (other dtypes, and empty tensors, take the torch code). Equal for finite
    x; NaN propagates in torch but not reliably in the kernel (quantize checks finiteness)."""
    if x.dtype in _FLOAT_DTYPES and x.numel() and resolve_backend(x, backend) == "triton":
        from . import triton_kernels

        return triton_kernels.amax(x, per_row)
    return _amax_torch(x, per_row)


def _amax_torch(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    if per_row:
        return x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    return x.abs().amax().to(torch.float32)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 2688 / amax, capped at FLT_MAX, and 1 where amax is 0 or S_enc is 0."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    s_enc = torch.div(torch.tensor(GLOBAL_SCALE_NUMERATOR, dtype=torch.float32,
                                   device=amax.device), amax)
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def global_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_dec = 1 / S_enc: the FP32 per-tensor scale stored as `weight_scale_2`."""
    return torch.div(1.0, global_encode_scale(amax))


def _block_scale_multiplier(s_enc: torch.Tensor) -> torch.Tensor:
    """S_enc * fp32(1/6): TE folds the FP4 reciprocal into the global scale first."""
    return s_enc * torch.reciprocal(torch.tensor(FP4_MAX, dtype=torch.float32, device=s_enc.device))


# --- validation --------------------------------------------------------------------------
def _check_input(x: torch.Tensor, block_shape: BlockShape, per_row: bool, check_finite: bool,
                 name: str = "x") -> tuple:
    """Type, shape and block checks of a quantize input (InputError / ConfigError), NaN/Inf (NonFiniteError)."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise InputError(f"{name}: expected a float32, bfloat16 or float16 tensor, got {x.dtype}")
    if x.numel() == 0:
        raise InputError(f"{name}: cannot quantize an empty tensor of shape {tuple(x.shape)}")
    if x.ndim < 1 or x.shape[-1] % BLOCK_SIZE:
        raise InputError(f"{name}: the last dimension must be a multiple of {BLOCK_SIZE} "
                         f"(NVFP4 blocks), got shape {tuple(x.shape)}")
    block_shape = check_block_shape(block_shape)
    if block_shape == (BLOCK_SIZE, BLOCK_SIZE):
        if per_row:
            raise ConfigError("per_row scaling needs 1x16 blocks, not 16x16")
        if x.ndim < 2 or x.shape[-2] % BLOCK_SIZE:
            raise InputError(f"{name}: 16x16 blocks need the second-to-last dimension to be a "
                             f"multiple of 16, got shape {tuple(x.shape)}")
    if check_finite and not bool(torch.isfinite(x).all()):
        nan = torch.isnan(x)
        bad = nan if bool(nan.any()) else torch.isinf(x)
        at = tuple(torch.nonzero(bad)[0].tolist())
        raise NonFiniteError(f"{name}: contains {'NaN' if bad is nan else 'Inf'} ({int(bad.sum())} of "
                             f"{x.numel()} elements, first at {at}); NVFP4 can only encode finite values")
    return block_shape


def _poison_nonfinite(x: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """S_dec with NaN wherever the rows it scales hold NaN/Inf: no host sync, no silent finite garbage.

    check_finite=False skips the (syncing) check; without this an Inf would quantize to
    2688 * S_dec and zero the rest of its tensor. NaN makes the damage visible downstream.
    """
    bad = ~torch.isfinite(x)
    if s_dec.ndim == 0:
        return torch.where(bad.any(), torch.full_like(s_dec, float("nan")), s_dec)
    bad = bad.any(dim=-1, keepdim=True)
    padded = (1,) * (bad.ndim - s_dec.ndim) + tuple(s_dec.shape)
    dims = tuple(i for i, (a, b) in enumerate(zip(padded, bad.shape)) if a == 1 and b != 1)
    if dims:
        bad = bad.any(dim=dims, keepdim=True)
    return torch.where(bad.reshape(s_dec.shape), torch.full_like(s_dec, float("nan")), s_dec)


def _resolve_amax(x: torch.Tensor, per_row: bool, amax, backend: str) -> torch.Tensor:
    """The amax to quantize with (x's own, computed on the resolved `backend`, or the given one)."""
    row_shape = (*x.shape[:-1], 1)
    if amax is None:
        if backend == "triton":
            from . import triton_kernels

            return triton_kernels.amax(x, per_row)
        return _amax_torch(x, per_row)
    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise InputError(f"amax must be finite and >= 0, got {amax}")
    try:
        ok = tuple(torch.broadcast_shapes(amax.shape, row_shape)) == row_shape
    except RuntimeError:
        ok = False
    if not ok:
        raise InputError(f"amax of shape {tuple(amax.shape)} does not broadcast to the row "
                         f"shape {row_shape} of x")
    if per_row and amax.ndim == 0:
        amax = amax.expand(row_shape)
    return amax


def _as_block_broadcast(t: torch.Tensor) -> torch.Tensor:
    """Give a per-tensor/per-row scale one more trailing dim to broadcast over [..., nb, 16]."""
    return t if t.ndim == 0 else t.unsqueeze(-1)


# --- the torch reference -----------------------------------------------------------------
def _e2m1_encode(scaled: torch.Tensor) -> torch.Tensor:
    """RNE onto the E2M1 grid of values already clamped to [-6, 6]: uint8 codes 0..15."""
    mag = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for b in E2M1_BOUNDS_GT:
        code += mag > b
    for b in E2M1_BOUNDS_GE:
        code += mag >= b
    code |= (scaled < 0).to(torch.uint8) << 3
    return code


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(data: torch.Tensor) -> torch.Tensor:
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], -1)


def _block_amax(xf: torch.Tensor, block_shape: tuple) -> torch.Tensor:
    """Block amax broadcast to the per-row scale layout: `[..., rows, K // 16]`."""
    *lead, k = xf.shape
    if block_shape == (1, BLOCK_SIZE):
        return xf.view(*lead, k // BLOCK_SIZE, BLOCK_SIZE).abs().amax(dim=-1)
    m = lead[-1]
    tiles = xf.view(*lead[:-1], m // BLOCK_SIZE, BLOCK_SIZE, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = tiles.abs().amax(dim=(-3, -1))
    return amax.repeat_interleave(BLOCK_SIZE, dim=-2)


def quantize_reference(x: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor,
                       block_shape: tuple = (1, BLOCK_SIZE)) -> tuple:
    """TE's reference steps 3-5 in torch, given the global scales: (data, scale)."""
    xf = x.to(torch.float32)
    *lead, k = xf.shape
    vec_max = _block_amax(xf, block_shape).unsqueeze(-1)                     # [..., nb, 1]
    mult = _as_block_broadcast(_block_scale_multiplier(s_enc))
    sf = torch.clamp(torch.clamp(vec_max * mult, max=FLT_MAX), -E4M3_MAX, E4M3_MAX)
    sf = sf.to(torch.float8_e4m3fn)
    dec = _as_block_broadcast(s_dec)
    enc = torch.clamp(torch.div(1.0, sf.to(torch.float32) * dec), max=FLT_MAX)
    scaled = torch.clamp(xf.view(*lead, k // BLOCK_SIZE, BLOCK_SIZE) * enc, -FP4_MAX, FP4_MAX)
    codes = _e2m1_encode(scaled).view(*lead, k)
    return _pack(codes), sf.squeeze(-1)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (integer tensor, low 4 bits) -> fp32 values, by arithmetic: exact, equal to
    `e2m1_table` (-0.0 for code 8), and with no host-to-device table copy (graph-safe)."""
    mag = codes & 0x7
    exp, man = (mag >> 1).to(torch.float32), (mag & 0x1).to(torch.float32)
    val = torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1.0) * (1.0 + 0.5 * man))
    return torch.where((codes & 0x8) != 0, -val, val)


def dequantize_columns(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 e2m1 * e4m3 of the columns `index` of packed NVFP4 rows (no global scale).

    data uint8 [..., N, K//2] (element 2i in the low nibble), scale e4m3 (or its uint8 bits)
    [..., N, K//16], index int [..., k] broadcast over N (one set, or one per leading index):
    a gather of codes and scales, no full dequantization and no host sync."""
    idx = index.to(device=data.device, dtype=torch.int64).expand(*data.shape[:-1], index.shape[-1])
    byte = torch.gather(data, -1, idx // 2).to(torch.int32)
    codes = (byte >> ((idx & 1) * 4).to(torch.int32)) & 0xF
    sbits = torch.gather(scale.view(torch.uint8), -1, idx // BLOCK_SIZE)
    return e2m1_values(codes) * sbits.view(torch.float8_e4m3fn).to(torch.float32)


def dequantize_reference(data: torch.Tensor, scale: torch.Tensor, s_dec: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x_hat = e2m1 * fp32(sf) * S_dec in fp32, then cast to `dtype`."""
    codes = _unpack(data)
    *lead, k = codes.shape
    values = e2m1_values(codes).view(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    out = values * scale.to(torch.float32).unsqueeze(-1) * _as_block_broadcast(
        s_dec.to(torch.float32))
    return out.view(*lead, k).to(dtype)


# --- backend choice ----------------------------------------------------------------------
def _kernel_backend(x: torch.Tensor, block_shape: tuple, backend: Optional[str]) -> str:
    """The one backend resolution of a public call; 16x16 blocks have only the torch code."""
    name = resolve_backend(x, backend)
    return name if tuple(block_shape) == (1, BLOCK_SIZE) else "torch"


def _quantize(x: torch.Tensor, block_shape: tuple, per_row: bool, amax, backend: str):
    """(data, scale, S_enc, S_dec) on the resolved backend."""
    s_enc = global_encode_scale(_resolve_amax(x, per_row, amax, backend))
    s_dec = torch.div(1.0, s_enc)
    if backend == "triton":
        from . import triton_kernels

        data, scale = triton_kernels.quantize(x, s_enc, s_dec)
    else:
        data, scale = quantize_reference(x, s_enc, s_dec, block_shape)
    return data, scale, s_enc, s_dec


# --- public API --------------------------------------------------------------------------
def quantize(x: torch.Tensor, *, block_shape: BlockShape = (1, BLOCK_SIZE), per_row: bool = False,
             amax: Optional[Union[torch.Tensor, float]] = None,
             check_finite: bool = True, backend: Optional[str] = None, name: str = "x") -> NVFP4Tensor:
    """Quantize `x` (last dim a multiple of 16) to NVFP4, bit-exact with TE's reference.

    per_row: one global scale per row (per-token activations); amax: use this amax
    (e.g. all-reduced across TP ranks, or shared by gate and up) instead of x's own.
    check_finite=True (default): NaN/Inf in x is a NonFiniteError naming `name` (the tensor's
    HF name where the caller has one). check_finite=False skips that host sync on hot paths;
    a row (per_row) or tensor holding NaN/Inf then gets a NaN global scale, so it dequantizes
    to NaN, never to finite garbage (results for finite inputs are bit-identical either way).
    backend: "triton" | "torch" | None (`resolve_backend`: QUADS_BACKEND, else by device).
    """
    block_shape = _check_input(x, block_shape, per_row, check_finite, name)
    kernel = _kernel_backend(x, block_shape, backend)
    data, scale, _, s_dec = _quantize(x, block_shape, per_row, amax, kernel)
    if not check_finite:
        s_dec = _poison_nonfinite(x, s_dec)
    return NVFP4Tensor._trusted(data, scale, s_dec, x.shape, block_shape)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """Decode an `NVFP4Tensor` to `dtype` (x_hat = e2m1 * sf * S_dec in fp32, then cast).

    The tensor's fields were checked when it was built; their structure is checked again here
    (cheap, no sync) in case a field was replaced since.
    backend: "triton" | "torch" | None (`resolve_backend`)."""
    if not isinstance(q, NVFP4Tensor):
        raise InputError(f"dequantize expects an NVFP4Tensor, got {type(q).__name__}")
    q.validate(values=False)
    if _kernel_backend(q.data, q.block_shape, backend) == "triton":
        from . import triton_kernels

        return triton_kernels.dequantize(q.data, q.scale, q.global_scale, dtype).view(q.shape)
    return dequantize_reference(q.data, q.scale, q.global_scale, dtype).view(q.shape)


class _FakeQuantize(torch.autograd.Function):
    """Forward: dequantize(quantize(x)); backward: identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, block_shape, per_row, amax, check_finite, backend):
        block_shape = _check_input(x, block_shape, per_row, check_finite)
        name = _kernel_backend(x, block_shape, backend)
        if name == "triton":
            from . import triton_kernels

            s_enc = global_encode_scale(_resolve_amax(x, per_row, amax, name))
            return triton_kernels.fake_quantize(x, s_enc, torch.div(1.0, s_enc))
        data, scale, _, s_dec = _quantize(x, block_shape, per_row, amax, name)
        return dequantize_reference(data, scale, s_dec, x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None, None, None, None


def fake_quantize(x: torch.Tensor, *, block_shape: BlockShape = (1, BLOCK_SIZE),
                  per_row: bool = False, amax: Optional[Union[torch.Tensor, float]] = None,
                  check_finite: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """x -> dequantize(quantize(x)) in x's dtype, with a straight-through gradient.

    backend: "triton" | "torch" | None (`resolve_backend`); Triton runs one fused kernel."""
    if isinstance(amax, torch.Tensor):
        amax = amax.detach()
    return _FakeQuantize.apply(x, tuple(block_shape), per_row, amax, check_finite, backend)


def shared_amax(tensors: Iterable[torch.Tensor], *, backend: Optional[str] = None) -> torch.Tensor:
    """One amax for several tensors (the max of theirs): gate and up of one expert."""
    return torch.stack([amax_of(t, backend=backend) for t in tensors]).amax()


def quantize_with_shared_scale(tensors: Sequence[torch.Tensor], **opts) -> List[NVFP4Tensor]:
    """Quantize tensors that one fused kernel reads with one global scale (gate/up, q/k/v)."""
    if "amax" in opts or opts.get("per_row"):
        raise ConfigError("quantize_with_shared_scale computes the shared amax itself; "
                         "per_row is not meaningful for a shared per-tensor scale")
    amax = shared_amax(tensors, backend=opts.get("backend"))
    return [quantize(t, amax=amax, **opts) for t in tensors]
