"""`NVFP4Tensor`: packed E2M1 codes + E4M3 block scales + FP32 decode scale, and its ModelOpt view."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .format import BLOCK_SIZE


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape `shape` (last dim K).

    data:         uint8 `[..., K // 2]`, two E2M1 codes per byte, element 2i in the low nibble.
    scale:        float8_e4m3fn `[..., K // 16]`, one per 16 consecutive elements of a row
                  (with 16x16 blocks every row of a 16-row group repeats its block's scale,
                  which is the layout TE, ModelOpt and SGLang read).
    global_scale: float32 decode scale S_dec = 1 / S_enc: shape `[]` per tensor, `[..., 1]`
                  per row (or any shape broadcastable to `shape[:-1] + (1,)`).
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    block_shape: tuple = (1, BLOCK_SIZE)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, *, backend=None) -> torch.Tensor:
        """Decode to `dtype` (see `quads_megatron.nvfp4.dequantize`; same `backend`)."""
        from .core import dequantize

        return dequantize(self, dtype, backend=backend)

    # --- ModelOpt / SGLang / vLLM checkpoint view -------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """ModelOpt name of the packed codes."""
        return self.data

    @property
    def weight_scale(self) -> torch.Tensor:
        """ModelOpt name of the E4M3 block scales."""
        return self.scale

    @property
    def weight_scale_2(self) -> torch.Tensor:
        """ModelOpt name of the FP32 per-tensor decode scale."""
        return self.global_scale

    def to_modelopt(self) -> dict:
        """The tensors under the names an NVFP4 ModelOpt checkpoint stores for one linear."""
        return {"weight": self.data, "weight_scale": self.scale,
                "weight_scale_2": self.global_scale.to(torch.float32)}

    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, shape: Optional[Sequence[int]] = None,
                      block_shape: tuple = (1, BLOCK_SIZE), name: str = "weight") -> "NVFP4Tensor":
        """Wrap checkpoint tensors, checking dtypes and shapes; `name` appears in errors."""
        if weight.dtype != torch.uint8:
            raise ValueError(f"{name}: expected packed uint8 NVFP4 codes, got dtype {weight.dtype}")
        if weight_scale.dtype != torch.float8_e4m3fn:
            if weight_scale.dtype == torch.uint8 and weight_scale.shape[:-1] == weight.shape[:-1]:
                weight_scale = weight_scale.view(torch.float8_e4m3fn)
            else:
                raise ValueError(f"{name}_scale: expected float8_e4m3fn block scales, "
                                 f"got dtype {weight_scale.dtype}")
        k = weight.shape[-1] * 2
        logical = torch.Size(shape) if shape is not None else torch.Size((*weight.shape[:-1], k))
        if logical[-1] != k or tuple(logical[:-1]) != tuple(weight.shape[:-1]):
            raise ValueError(f"{name}: packed shape {tuple(weight.shape)} does not hold logical "
                             f"shape {tuple(logical)} (expected [..., K // 2])")
        if k % BLOCK_SIZE:
            raise ValueError(f"{name}: K = {k} is not a multiple of {BLOCK_SIZE}")
        want = (*weight.shape[:-1], k // BLOCK_SIZE)
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"{name}_scale: expected shape {want} (one scale per 16 inputs), "
                             f"got {tuple(weight_scale.shape)}")
        gs = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
        try:
            torch.broadcast_shapes(gs.shape, (*weight.shape[:-1], 1))
        except RuntimeError:
            raise ValueError(f"{name}_scale_2: shape {tuple(gs.shape)} does not broadcast to "
                             f"{(*weight.shape[:-1], 1)}") from None
        return cls(weight, weight_scale, gs, logical, tuple(block_shape))

    def to(self, device) -> "NVFP4Tensor":
        """Move all parts to `device`."""
        return NVFP4Tensor(self.data.to(device), self.scale.to(device),
                           self.global_scale.to(device), self.shape, self.block_shape)
