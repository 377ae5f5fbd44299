"""Load-time checks of ModelOpt NVFP4 (+RAC) checkpoint tensors for the quads linear and MoE methods.

SGLang copies each checkpoint tensor into a preallocated parameter through the parameter's
`weight_loader`; a tensor the checkpoint lacks leaves uninitialized memory, and a wrong dtype
is converted by value. The quads methods wrap their loaders with `checked_loader` so every
tensor is checked before it is copied (dtype, shape, finite and positive scales, NaN E4M3
bytes, RAC channel indices in range / sorted / unique / of the configured count), and record
which slices were written (`SliceLog`) so `process_weights_after_loading` names whatever the
first load did not provide. Every failure is a `CheckpointError` naming the tensor by its
checkpoint (HF) name: layer prefix + ModelOpt name, e.g.
`model.layers.0.mlp.experts.3.up_proj.weight_scale`.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

import torch

from quads_megatron.errors import CheckpointError
from quads_megatron.nvfp4.tensor import bad_block_scales
FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"


def check_packed_codes(name: str, t: torch.Tensor, want: Tuple[Optional[int], ...]) -> torch.Tensor:
    """`weight`: uint8 two-E2M1-codes-per-byte of shape `want` (None = any size on that dim)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise CheckpointError(f"{name}: expected packed NVFP4 codes as uint8 {_shape(want)}, got "
                              f"{_describe(t) if isinstance(t, torch.Tensor) else type(t).__name__}")
    _check_shape(name, t, want, "two E2M1 codes per byte: K // 2 columns")
    return t


def as_block_scale(name: str, t: torch.Tensor, want: Tuple[Optional[int], ...]) -> torch.Tensor:
    """`weight_scale`: float8_e4m3fn, or its raw bytes stored as uint8 (reinterpreted, never converted by value)."""
    if t.dtype == torch.uint8:
        t = t.view(torch.float8_e4m3fn)
    elif t.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{name}: expected float8_e4m3fn block scales (or their bytes as uint8) "
                              f"{_shape(want)}, got {_describe(t)}")
    _check_shape(name, t, want, "one E4M3 scale per 16 inputs: K // 16 columns")
    return check_block_scale_values(name, t)


def check_block_scale_values(name: str, t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn block scales of any shape: no NaN byte, none negative."""
    bad = bad_block_scales(t)
    if bad is not None:
        kind, n, at = bad
        what = "E4M3 NaN bytes (0x7F/0xFF)" if kind == "nan" else "negative"
        raise CheckpointError(f"{name}: {n} block scales are {what}, first at {at}"
                              + ("; NVFP4 block scales are >= 0" if kind == "negative" else ""))
    return t


def check_tensor_scale(name: str, t: torch.Tensor, what: str) -> torch.Tensor:
    """`weight_scale_2` / `input_scale`: one finite, positive float per tensor."""
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_SCALE_DTYPES:
        raise CheckpointError(f"{name}: expected a float32 per-tensor {what}, got "
                              f"{_describe(t) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.numel() != 1:
        raise CheckpointError(f"{name}: expected one per-tensor {what}, got shape {tuple(t.shape)}")
    v = float(t.reshape(()).float())
    if not (v > 0 and v != float("inf")):
        raise CheckpointError(f"{name}: expected a finite, positive {what}, got {v}")
    return t.to(torch.float32)


def check_comp_index(name: str, t: torch.Tensor, k: int, k_in: int) -> torch.Tensor:
    """`input_comp_index`: int32 [k] RAC channels, sorted ascending, unique, in [0, k_in)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES or t.ndim != 1:
        raise CheckpointError(f"{name}: expected int32 [{k}] RAC channel indices, got "
                              f"{_describe(t) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.numel() != k:
        raise CheckpointError(f"{name}: expected {k} RAC channel indices (quantization_config.rac_channels), "
                              f"got {t.numel()}")
    return check_comp_index_values(name, t, k_in)


def check_comp_index_values(name: str, t: torch.Tensor, k_in: int) -> torch.Tensor:
    """RAC channel sets along the last dim (one set, or a whole layer's [E, ..., k]): each in [0, k_in),
    unique and sorted ascending; returned as int32."""
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= k_in:
        raise CheckpointError(f"{name}: RAC channel index out of range [0, {k_in}): min {lo}, max {hi}")
    step = t[..., 1:] - t[..., :-1]
    if bool((step == 0).any()):
        dup = int(t[..., 1:][step == 0][0])
        raise CheckpointError(f"{name}: RAC channel indices must be unique, {dup} is repeated")
    if bool((step < 0).any()):
        at = tuple(torch.nonzero(step < 0)[0].tolist())
        after = at[:-1] + (at[-1] + 1,)
        raise CheckpointError(f"{name}: RAC channel indices must be sorted ascending, got {int(t[at])} "
                              f"before {int(t[after])} at position {at[-1] if t.dim() == 1 else at}")
    return t.to(torch.int32)


def _shape(want: Tuple[Optional[int], ...]) -> str:
    return "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"


def _check_shape(name: str, t: torch.Tensor, want: Tuple[Optional[int], ...], hint: str) -> None:
    ok = t.ndim == len(want) and all(w is None or w == s for w, s in zip(want, t.shape))
    if not ok:
        raise CheckpointError(f"{name}: expected shape {_shape(want)} ({hint}), got {tuple(t.shape)}")


class SliceLog:
    """Which (parameter, slice) pairs the loads have written; a slice is a shard or (expert, shard)."""

    def __init__(self) -> None:
        self.written: Dict[str, Set] = {}

    def mark(self, pname: str, slices: Iterable) -> None:
        self.written.setdefault(pname, set()).update(slices)

    def missing(self, pname: str, expected: Iterable) -> list:
        have = self.written.get(pname, set())
        return [s for s in expected if s not in have]


def checked_loader(inner: Callable, check: Callable) -> Callable:
    """A weight_loader that runs `check(param, loaded_weight, *args, **kwargs) -> tensor` first, then `inner`."""
    @functools.wraps(inner)
    def load(param, loaded_weight, *args, **kwargs):
        return inner(param, check(param, loaded_weight, *args, **kwargs), *args, **kwargs)

    return load
