"""Guarded Blackwell (SM100+) path: native FP4 tensor-core GEMM through FlashInfer's `mm_fp4`.

UNTESTED here (no Blackwell GPU and no FlashInfer on this project's machines); kept small.
Only act_mode "w4a4" takes it. RAC as one native GEMM over K + k columns needs Wq[:, S] as
an NVFP4 operand, but gathered single channels do not share the per-16 block scales of
their source blocks, so Wq[:, S] is not exactly expressible; "w4a4_rac" therefore stays on
the Triton kernel (which runs on any CUDA GPU) until the converter stores a re-blocked
Wq[:, S]. The per-row activation decode scales are applied to FlashInfer's bf16 output
(one more bf16 rounding than the Hopper kernel, which scales its fp32 accumulator).
Scale swizzling (FlashInfer's 128x4 layout) runs per call; a serving integration should
swizzle the weight scales once at load time.
"""

from __future__ import annotations

import torch

from .act_quant import quantize_activation_rac


def available(device: torch.device) -> bool:
    """True on SM100+ with FlashInfer's mm_fp4 importable."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] < 10:
        return False
    try:
        import flashinfer
    except ImportError:
        return False
    return hasattr(flashinfer, "mm_fp4") and hasattr(flashinfer, "nvfp4_block_scale_interleave")


def w4a4_linear_fp4(x, weight, weight_scale, weight_scale_2, input_scale, bias):
    """Naive W4A4 dense linear on Blackwell tensor cores (per-token or static activation scale)."""
    import flashinfer

    k = weight.shape[-1] * 2
    x2d = x.reshape(-1, k).contiguous()
    qa = quantize_activation_rac(x2d, None, input_scale, with_values=False)
    a_sf = flashinfer.nvfp4_block_scale_interleave(qa.scale)
    b_sf = flashinfer.nvfp4_block_scale_interleave(weight_scale.view(torch.uint8).contiguous())
    y = flashinfer.mm_fp4(qa.data, weight.t(), a_sf, b_sf.t(), None, torch.bfloat16)
    y = y.to(torch.float32) * qa.s_dec[:, None] * weight_scale_2.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
