"""`NVFP4Tensor`: packed E2M1 codes + E4M3 block scales + FP32 decode scale, and its ModelOpt view."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from quads_megatron.errors import ConfigError, InputError

from .format import BLOCK_SIZE

BLOCK_SHAPES = ((1, BLOCK_SIZE), (BLOCK_SIZE, BLOCK_SIZE))
"""The tilings the recipe supports: 1x16 (every tensor) and 16x16 (2D weight tiles, per-row scale layout)."""
E4M3_NAN_BITS = 0x7F  # float8_e4m3fn has no Inf: 0x7F / 0xFF are NaN


def check_block_shape(block_shape) -> tuple:
    """(1, 16) or (16, 16) as a tuple of ints; anything else is a ConfigError."""
    try:
        bs = tuple(int(b) for b in block_shape)
    except (TypeError, ValueError):
        bs = None
    if bs not in BLOCK_SHAPES:
        raise ConfigError(f"block_shape: expected one of {list(BLOCK_SHAPES)} (NVFP4 1x16 blocks or 16x16 "
                          f"weight tiles), got {block_shape!r}")
    return bs


def bad_block_scales(scale: torch.Tensor):
    """The first kind of invalid E4M3 block scale in ``scale`` as (kind, count, index of the first), or None.

    kind is "nan" (bytes 0x7F / 0xFF: E4M3 has no Inf) or "negative" (sign bit set, not -0): NVFP4
    block scales are amax / 6 >= 0. One host sync; reads the bytes, so float8 or raw uint8 both work.
    """
    bits = scale.view(torch.uint8)
    nan = (bits & E4M3_NAN_BITS) == E4M3_NAN_BITS
    neg = ((bits & 0x80) != 0) & (bits != 0x80)
    for kind, bad in (("nan", nan), ("negative", neg)):
        if bool(bad.any()):
            return kind, int(bad.sum()), tuple(torch.nonzero(bad)[0].tolist())
    return None


def _what(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape `shape` (last dim K).

    data:         uint8 `[..., K // 2]`, two E2M1 codes per byte, element 2i in the low nibble.
    scale:        float8_e4m3fn `[..., K // 16]`, one per 16 consecutive elements of a row
                  (with 16x16 blocks every row of a 16-row group repeats its block's scale,
                  which is the layout TE, ModelOpt and SGLang read). Exactly that shape: short
                  scales are not broadcast; uint8 bytes are refused (`from_modelopt` reinterprets them).
    global_scale: float32 decode scale S_dec = 1 / S_enc, finite and > 0: shape `[]` per tensor,
                  `[..., 1]` per row (or any shape broadcastable to `shape[:-1] + (1,)`).
    block_shape:  (1, 16) or (16, 16).

    Construction checks every field (`validate`) and raises InputError / ConfigError naming it;
    `quantize` builds its results through `_trusted`, which skips only the value checks (a host
    sync) of fields it computed itself.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    block_shape: tuple = (1, BLOCK_SIZE)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def _build(cls, data, scale, global_scale, shape, block_shape, values: bool, name: str) -> "NVFP4Tensor":
        """Set the fields and validate them, errors naming `name`."""
        obj = cls.__new__(cls)
        obj.data, obj.scale, obj.global_scale, obj.shape, obj.block_shape = data, scale, global_scale, shape, block_shape
        obj.validate(values=values, name=name)
        return obj

    @classmethod
    def _trusted(cls, data, scale, global_scale, shape, block_shape) -> "NVFP4Tensor":
        """Wrap fields computed by `quantize`: structure checked, values (finite scales) not."""
        return cls._build(data, scale, global_scale, shape, block_shape, values=False, name="NVFP4Tensor")

    def unbind(self) -> list:
        """The matrices of a stacked ``[M, R, K]`` tensor as M NVFP4Tensors (views, per-matrix scalar
        S_dec); this tensor was checked, so its parts are not checked again (a layer has hundreds)."""
        if len(self.shape) != 3:
            raise InputError(f"NVFP4Tensor.unbind: expected a stacked [M, R, K] tensor, got shape {tuple(self.shape)}")
        gs = self.global_scale.expand(self.shape[0], 1, 1).reshape(-1)
        shape = torch.Size(self.shape[1:])
        parts = []
        for d, s, g in zip(self.data.unbind(0), self.scale.unbind(0), gs.unbind(0)):
            obj = type(self).__new__(type(self))
            obj.data, obj.scale, obj.global_scale, obj.shape, obj.block_shape = d, s, g, shape, self.block_shape
            parts.append(obj)
        return parts

    def validate(self, values: bool = True, name: str = "NVFP4Tensor") -> None:
        """Check dtypes, shapes, block_shape and (values=True) finite, non-negative scales; InputError names the field."""
        self.block_shape = check_block_shape(self.block_shape)
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8:
            raise InputError(f"{name}.data: expected packed uint8 E2M1 codes, got {_what(self.data)}")
        try:
            self.shape = torch.Size(self.shape)
        except (TypeError, ValueError):
            raise InputError(f"{name}.shape: expected a sequence of ints, got {self.shape!r}") from None
        shape = tuple(self.shape)
        if not shape or shape[-1] % BLOCK_SIZE or shape[-1] <= 0:
            raise InputError(f"{name}.shape: the last dimension must be a positive multiple of {BLOCK_SIZE}, "
                             f"got {shape}")
        k = shape[-1]
        if tuple(self.data.shape) != (*shape[:-1], k // 2):
            raise InputError(f"{name}.data: expected shape {(*shape[:-1], k // 2)} (K // 2 bytes per row of "
                             f"logical shape {shape}), got {tuple(self.data.shape)}")
        if self.block_shape == (BLOCK_SIZE, BLOCK_SIZE) and (len(shape) < 2 or shape[-2] % BLOCK_SIZE):
            raise InputError(f"{name}.shape: 16x16 blocks need the second-to-last dimension to be a multiple "
                             f"of {BLOCK_SIZE}, got {shape}")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float8_e4m3fn:
            hint = (" (raw E4M3 bytes: pass scale.view(torch.float8_e4m3fn) or use NVFP4Tensor.from_modelopt)"
                    if isinstance(self.scale, torch.Tensor) and self.scale.dtype == torch.uint8 else "")
            raise InputError(f"{name}.scale: expected float8_e4m3fn block scales, got {_what(self.scale)}{hint}")
        want = (*shape[:-1], k // BLOCK_SIZE)
        if tuple(self.scale.shape) != want:
            raise InputError(f"{name}.scale: expected shape {want} (one scale per {BLOCK_SIZE} elements of "
                             f"each row; no broadcasting), got {tuple(self.scale.shape)}")
        gs = self.global_scale
        if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32:
            raise InputError(f"{name}.global_scale: expected a float32 tensor (S_dec), got {_what(gs)}")
        row = (*shape[:-1], 1)
        try:
            ok = gs.ndim <= len(row) and tuple(torch.broadcast_shapes(gs.shape, row)) == row
        except RuntimeError:
            ok = False
        if not ok:
            raise InputError(f"{name}.global_scale: shape {tuple(gs.shape)} does not broadcast to the row "
                             f"shape {row} ([] per tensor, [..., 1] per row)")
        devices = {t.device for t in (self.data, self.scale, gs)}
        if len(devices) > 1:
            raise InputError(f"{name}: data, scale and global_scale are on different devices {sorted(map(str, devices))}")
        if values:
            self._validate_values(name)

    def _validate_values(self, name: str) -> None:
        """Finite positive global scale; block scales neither NaN (0x7F/0xFF) nor negative (one host sync)."""
        gs = self.global_scale
        if not bool((torch.isfinite(gs) & (gs > 0)).all()):
            bad = gs[~(torch.isfinite(gs) & (gs > 0))].reshape(-1)[0].item()
            raise InputError(f"{name}.global_scale: expected finite values > 0 (S_dec = amax / 2688), found {bad}")
        bad = bad_block_scales(self.scale)
        if bad is not None:
            kind, n, at = bad
            what = "NaN (bytes 0x7F/0xFF)" if kind == "nan" else "negative"
            raise InputError(f"{name}.scale: {n} block scales are {what}, first at {at}")

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
        """Wrap checkpoint tensors, checking every field; `name` (the HF name) appears in errors.

        uint8 `weight_scale` holds the E4M3 bytes and is reinterpreted (never converted by value).
        """
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8:
            raise InputError(f"{name}: expected packed uint8 NVFP4 codes, got {_what(weight)}")
        if isinstance(weight_scale, torch.Tensor) and weight_scale.dtype == torch.uint8:
            weight_scale = weight_scale.view(torch.float8_e4m3fn)
        elif not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype != torch.float8_e4m3fn:
            raise InputError(f"{name}_scale: expected float8_e4m3fn block scales, got {_what(weight_scale)}")
        k = weight.shape[-1] * 2 if weight.ndim else 0
        logical = torch.Size(shape) if shape is not None else torch.Size((*weight.shape[:-1], k))
        if not logical or logical[-1] != k or tuple(logical[:-1]) != tuple(weight.shape[:-1]):
            raise InputError(f"{name}: packed shape {tuple(weight.shape)} does not hold logical "
                             f"shape {tuple(logical)} (expected [..., K // 2])")
        if k % BLOCK_SIZE or k == 0:
            raise InputError(f"{name}: K = {k} is not a positive multiple of {BLOCK_SIZE}")
        want = (*weight.shape[:-1], k // BLOCK_SIZE)
        if tuple(weight_scale.shape) != want:
            raise InputError(f"{name}_scale: expected shape {want} (one scale per 16 inputs), "
                             f"got {tuple(weight_scale.shape)}")
        if not isinstance(weight_scale_2, torch.Tensor) or not weight_scale_2.is_floating_point():
            raise InputError(f"{name}_scale_2: expected a float32 per-tensor scale, got {_what(weight_scale_2)}")
        gs = weight_scale_2.to(device=weight.device, dtype=torch.float32)
        return cls._build(weight, weight_scale, gs, logical, block_shape, values=True, name=name)

    def to(self, device) -> "NVFP4Tensor":
        """Move all parts to `device`."""
        return NVFP4Tensor._trusted(self.data.to(device), self.scale.to(device),
                                    self.global_scale.to(device), self.shape, self.block_shape)
