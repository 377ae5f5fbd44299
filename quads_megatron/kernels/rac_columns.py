"""The RAC weight columns Wq[:, S]: built once per weight (load time / weight update), read by the Hopper GEMM's residual K-steps.

RAC adds rq Wq[:, S]^T to the W4A4 product. Gathering k single columns out of the packed weight
inside the GEMM (byte loads, nibble selects, per-element scale lookups) cost about as much as
the whole main loop (docs/benchmarks.md), so the columns are stored instead, per expert, in the exact fp16
form the main loop decodes to (e2m1 * e4m3 * 2^-7: at most 6 significant bits, |v| <= 21, an
exact fp16), and the residual runs as k extra K-steps of plain fp16 MMA into the same fp32
accumulator: bit-for-bit the products the gather form computed, so RAC stays exact. The fp32
per-tensor scale (weight_scale_2) is applied in the GEMM epilogue, as for the main loop.

Cost: 2 bytes per compensated channel and output row, i.e. 2k / (0.5625 K) of the packed
weight. Smaller forms (packed codes with the scales gathered from weight_scale, or codes plus a
stored scale byte) were measured slower: the residual step is not pipelined, so their decode
costs more than their bytes save (docs/benchmarks.md section 5).

Whoever owns the weights rebuilds the columns whenever the weight or the channels change
(SGLang's `process_weights_after_loading`, the local engine's `refresh_rac_columns` after each
weight load and calibration); the ops build them per call when none are passed.
"""

from __future__ import annotations

import torch

from quads_megatron.nvfp4.core import dequantize_columns

__all__ = ["rac_weight_columns"]


def rac_weight_columns(weight: torch.Tensor, weight_scale: torch.Tensor,
                       comp_index: torch.Tensor) -> torch.Tensor:
    """fp16 [..., N, k]: columns S of the NVFP4 weight as e2m1 * e4m3 * 2^-7 (exact; no weight_scale_2).

    weight: packed codes uint8 [N, K//2] or [E, N, K//2] (ModelOpt layout, element 2i in the low
    nibble); weight_scale: e4m3 [..., N, K//16] (float8_e4m3fn or its uint8 bits); comp_index:
    int [k] (one set for every expert) or [E, k] (one set per expert). No host syncs."""
    if weight.dtype != torch.uint8 or weight.ndim not in (2, 3):
        raise ValueError(f"weight: expected packed codes uint8 [N, K//2] or [E, N, K//2], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    k_in = weight.shape[-1] * 2
    if tuple(weight_scale.shape) != (*weight.shape[:-1], k_in // 16):
        raise ValueError(f"weight_scale: expected shape {(*weight.shape[:-1], k_in // 16)}, got "
                         f"{tuple(weight_scale.shape)}")
    if comp_index.ndim == 2 and (weight.ndim != 3 or comp_index.shape[0] != weight.shape[0]):
        raise ValueError(f"comp_index: one set per expert [E, k] needs weight [E, N, K//2] with the "
                         f"same E, got comp_index {tuple(comp_index.shape)}, weight {tuple(weight.shape)}")
    if comp_index.ndim not in (1, 2):
        raise ValueError(f"comp_index: expected [k] or [E, k], got {tuple(comp_index.shape)}")
    idx = comp_index.unsqueeze(-2) if comp_index.ndim == 2 else comp_index  # [E, 1, k] or [k]
    return (dequantize_columns(weight, weight_scale, idx) * 2.0 ** -7).to(torch.float16).contiguous()
