"""Residual Activation Compensation (RAC): the rollout-side half of QUADS, in plain torch.

For a W4A4 linear `y = x Wq^T` the activation is quantized online, `xq = dq(q(x))` (one
global scale per token by default, a static per-tensor `input_scale` otherwise). On a sorted
set S of k compensation channels (k % 16 == 0, the checkpoint's `input_comp_index`) the
residual `r = x[:, S] - xq[:, S]` is quantized again with its own per-row global scale and
1x16 blocks over the gathered channels, `rq = dq(q(r))`, and

    y = xq Wq^T + rq Wq[:, S]^T

which is one native W4A4 GEMM over K + k columns. All NVFP4 arithmetic is
`quads_megatron.nvfp4`; the Triton kernels in `quads_megatron.kernels` are tested against this.

Channel selection: S = the k channels with the largest expected output error
`E[(x - xq)_c^2] * ||Wq[:, c]||^2` on calibration activations (`ActivationStats` +
`calibrate_comp_channels`). fc1 of all experts of a layer reads the same hidden states, so
fc1 uses one set per layer. fc2's inputs differ per expert, and per-expert sets remove more of
its error than one per-layer set (`tools/rac_channel_choice.py`, docs/benchmarks.md) while
costing E*k int32 and nothing in the kernel (one pointer offset per expert), so fc2 uses one
set per expert (`[E, k]`); per-layer sets (`[k]`) stay supported everywhere.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from quads_megatron.nvfp4 import NVFP4Tensor, dequantize, quantize
from quads_megatron.nvfp4.format import BLOCK_SIZE, GLOBAL_SCALE_NUMERATOR

__all__ = [
    "ActivationStats", "calibrate_comp_channels", "check_comp_index", "compensated_activation",
    "quantize_activation", "quantize_compensated", "weight_column_norm_sq",
]


def check_comp_index(comp_index: Optional[torch.Tensor], num_channels: int,
                     num_groups: Optional[int] = None, name: str = "comp_index",
                     check_values: bool = True) -> int:
    """Validate a compensation index ([k] or [G, k], sorted, unique, in range); return k.

    check_values=False skips the checks that read the values (a host sync).
    """
    if comp_index is None:
        return 0
    if not isinstance(comp_index, torch.Tensor) or comp_index.dtype not in (torch.int32,
                                                                              torch.int64):
        raise ValueError(f"{name}: expected an int32 tensor of channel indices, got "
                         f"{getattr(comp_index, 'dtype', type(comp_index).__name__)}")
    if comp_index.ndim not in (1, 2):
        raise ValueError(f"{name}: expected shape [k] or [groups, k], got {tuple(comp_index.shape)}")
    if comp_index.ndim == 2 and num_groups is not None and comp_index.shape[0] != num_groups:
        raise ValueError(f"{name}: expected {num_groups} rows (one set per expert), got "
                         f"{comp_index.shape[0]}")
    k = comp_index.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(f"{name}: k = {k} compensation channels is not a multiple of {BLOCK_SIZE}")
    if k == 0:
        return 0
    if k > num_channels:
        raise ValueError(f"{name}: k = {k} exceeds the {num_channels} input channels")
    if not check_values:
        return k
    lo, hi = int(comp_index.min()), int(comp_index.max())
    if lo < 0 or hi >= num_channels:
        raise ValueError(f"{name}: channel index out of range [0, {num_channels}): "
                         f"min {lo}, max {hi}")
    if k > 1 and not bool((comp_index[..., 1:] > comp_index[..., :-1]).all()):
        raise ValueError(f"{name}: indices must be sorted ascending without repeats")
    return k


def _static_amax(input_scale) -> torch.Tensor:
    """Static per-tensor activation decode scale -> the amax it encodes (S_dec = amax/2688)."""
    s = torch.as_tensor(input_scale, dtype=torch.float32)
    if s.numel() != 1:
        raise ValueError(f"input_scale: expected one per-tensor scale, got shape {tuple(s.shape)}")
    return s.reshape(()) * GLOBAL_SCALE_NUMERATOR


def quantize_activation(x: torch.Tensor, input_scale=None) -> NVFP4Tensor:
    """q(x): per-token global scale (input_scale None) or the static per-tensor scale."""
    if input_scale is None:
        return quantize(x, per_row=True, check_finite=False)
    return quantize(x, amax=_static_amax(input_scale).to(x.device), check_finite=False)


def _gather(x: torch.Tensor, comp_index: torch.Tensor, groups: Optional[torch.Tensor]):
    """x[..., S] for a shared set, or x[row, S[groups[row]]] for per-group sets."""
    idx = comp_index.long()
    if idx.ndim == 1:
        return x[..., idx]
    if groups is None:
        raise ValueError("comp_index has one set per expert ([E, k]); pass groups (expert of "
                         "each row)")
    rows = x.reshape(-1, x.shape[-1])
    g = groups.reshape(-1).long()
    if g.numel() != rows.shape[0]:
        raise ValueError(f"groups: expected {rows.shape[0]} entries (one per row), got {g.numel()}")
    return torch.gather(rows, 1, idx[g]).view(*x.shape[:-1], idx.shape[-1])


def quantize_compensated(x: torch.Tensor, comp_index: Optional[torch.Tensor],
                         input_scale=None, groups: Optional[torch.Tensor] = None
                         ) -> Tuple[NVFP4Tensor, Optional[NVFP4Tensor]]:
    """(q(x), q(r)) with r = x[..., S] - dq(q(x))[..., S]; q(r) is None when k == 0."""
    qx = quantize_activation(x, input_scale)
    k = check_comp_index(comp_index, x.shape[-1])
    if k == 0:
        return qx, None
    xq = dequantize(qx, torch.float32)
    r = _gather(x.to(torch.float32), comp_index, groups) - _gather(xq, comp_index, groups)
    return qx, quantize(r, per_row=True, check_finite=False)


def compensated_activation(x: torch.Tensor, comp_index: Optional[torch.Tensor],
                           input_scale=None, groups: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(xq, rq) in fp32: the dequantized activation and the dequantized residual on S."""
    qx, qr = quantize_compensated(x, comp_index, input_scale, groups)
    xq = dequantize(qx, torch.float32)
    if qr is None:
        return xq, xq.new_zeros((*x.shape[:-1], 0))
    return xq, dequantize(qr, torch.float32)


def weight_column_norm_sq(w: Union[torch.Tensor, NVFP4Tensor], per_expert: bool = True
                          ) -> torch.Tensor:
    """||Wq[:, c]||^2 per input channel: [K] for [N, K], [E, K] (or summed [K]) for [E, N, K]."""
    wf = dequantize(w, torch.float32) if isinstance(w, NVFP4Tensor) else w.to(torch.float32)
    norm = wf.square().sum(dim=-2)
    if norm.ndim == 2 and not per_expert:
        norm = norm.sum(dim=0)
    return norm


class ActivationStats:
    """Accumulates E[(x - xq)_c^2] per input channel (optionally per group, e.g. per expert), on the device of
    the activations (float64 sums; no host sync per update)."""

    def __init__(self, num_channels: int, num_groups: Optional[int] = None, input_scale=None):
        if num_channels % BLOCK_SIZE:
            raise ValueError(f"num_channels = {num_channels} is not a multiple of {BLOCK_SIZE}")
        shape = (num_channels,) if num_groups is None else (num_groups, num_channels)
        self.num_channels, self.num_groups, self.input_scale = num_channels, num_groups, input_scale
        self.sq_err_sum = torch.zeros(shape, dtype=torch.float64)
        self.count = torch.zeros(shape[:-1], dtype=torch.float64)

    @torch.no_grad()
    def update(self, x: torch.Tensor, groups: Union[None, int, torch.Tensor] = None) -> None:
        """Add activations x [..., K] (groups, when per group: the group of every row, or one int for all rows)."""
        if x.shape[-1] != self.num_channels:
            raise ValueError(f"x: expected {self.num_channels} channels, got {x.shape[-1]}")
        rows = x.reshape(-1, self.num_channels)
        if rows.shape[0] == 0:
            return
        xq = dequantize(quantize_activation(rows, self.input_scale), torch.float32)
        err = (rows.to(torch.float32) - xq).square().to(torch.float64)
        if self.sq_err_sum.device != err.device:
            self.sq_err_sum, self.count = self.sq_err_sum.to(err.device), self.count.to(err.device)
        if self.num_groups is None:
            self.sq_err_sum += err.sum(0)
            self.count += rows.shape[0]
            return
        if groups is None:
            raise ValueError("ActivationStats(num_groups=...): update needs groups per row")
        if isinstance(groups, int):
            if not 0 <= groups < self.num_groups:
                raise ValueError(f"groups: expected an id in [0, {self.num_groups}), got {groups}")
            self.sq_err_sum[groups] += err.sum(0)
            self.count[groups] += rows.shape[0]
            return
        g = groups.reshape(-1).long()
        if g.numel() != rows.shape[0] or int(g.min()) < 0 or int(g.max()) >= self.num_groups:
            raise ValueError(f"groups: expected {rows.shape[0]} ids in [0, {self.num_groups})")
        g = g.to(err.device)
        self.sq_err_sum.index_add_(0, g, err)
        self.count.index_add_(0, g, torch.ones(g.numel(), dtype=torch.float64, device=err.device))

    def mean_sq_err(self) -> torch.Tensor:
        """E[(x - xq)_c^2] (zeros for groups that saw no rows), fp32."""
        denom = self.count.clamp(min=1).unsqueeze(-1)
        return (self.sq_err_sum / denom).to(torch.float32)


def calibrate_comp_channels(stats_or_sq_err: Union[ActivationStats, torch.Tensor],
                            weight_col_norm_sq: torch.Tensor, k: int) -> torch.Tensor:
    """The k channels with the largest E[(x - xq)_c^2] * ||Wq[:, c]||^2: int32 sorted [k] / [G, k]."""
    sq = (stats_or_sq_err.mean_sq_err() if isinstance(stats_or_sq_err, ActivationStats)
          else stats_or_sq_err).to(torch.float32)
    norm = weight_col_norm_sq.to(torch.float32).to(sq.device)
    if sq.shape[-1] != norm.shape[-1]:
        raise ValueError(f"weight_col_norm_sq: {norm.shape[-1]} channels, statistics have "
                         f"{sq.shape[-1]}")
    if k % BLOCK_SIZE or k < 0 or k > sq.shape[-1]:
        raise ValueError(f"k = {k}: expected a multiple of {BLOCK_SIZE} in [0, {sq.shape[-1]}]")
    score = sq * norm
    idx = torch.topk(score, k, dim=-1).indices
    return torch.sort(idx, dim=-1).values.to(torch.int32).contiguous()
