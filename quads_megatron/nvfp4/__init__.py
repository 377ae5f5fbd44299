"""NVFP4 numerics, the one source of truth: E2M1 codes, E4M3 per-16 scales, FP32 tensor scale.

The trainer (fake quantization), the rollout kernels and the checkpoint converters all
call this package; it imports torch only (Triton lazily, for its kernels). The compute
backend (Triton kernels or the torch reference) is chosen in one place, `resolve_backend`
(`backend=` argument, else QUADS_BACKEND, else Triton on CUDA and torch on CPU).
"""

from .backend import BACKENDS, resolve_backend
from .format import BLOCK_SIZE, E2M1_VALUES, E4M3_MAX, FP4_MAX, e2m1_table
from .core import (amax_of, dequantize, fake_quantize, global_decode_scale,
                       global_encode_scale, quantize, quantize_with_shared_scale, shared_amax)
from .grouped import amax_grouped, fake_quantize_grouped, quantize_grouped, refit_grouped
from .tensor import NVFP4Tensor

__all__ = [
    "BACKENDS", "BLOCK_SIZE", "E2M1_VALUES", "E4M3_MAX", "FP4_MAX", "NVFP4Tensor", "amax_grouped", "amax_of",
    "dequantize", "fake_quantize_grouped", "quantize_grouped",
    "e2m1_table", "fake_quantize", "global_decode_scale", "global_encode_scale", "quantize",
    "quantize_with_shared_scale", "refit_grouped", "resolve_backend", "shared_amax",
]
