"""The rollout kernels' weight layout: the one load-time step from NVFP4 codes and block scales to the GEMM's byte order.

Checkpoints, export, refit sources and the wire format keep ModelOpt's layout (packed codes
[..., N, K/2] uint8, two E2M1 codes per byte; E4M3 block scales [..., N, K/16];
`layout.nvfp4_weight_specs`). The v3 GEMM (`kernels.fragment_layout`) reads both pre-permuted: the
codes into its wgmma register-fragment order, the block scales into the same 64-row x 128-column
tiles (a warp's rows contiguous), each a same-shape, same-dtype byte permutation (global scales keep
their layout). Every place that puts rollout weights where the kernels read them converts the codes
and the scales it wrote once per load, into the same buffers (`out=`, so captured CUDA graphs keep
their pointers), and passes ``weight_layout=KERNEL_WEIGHT_LAYOUT`` to `w4a4_fused_moe` /
`w4a4_linear`; the `from_` functions are the exact inverses (checks, RAC columns, the BF16 sync).

Both permutations are local to 64-row tiles: the rows [r0, r1) of a converted matrix (r0, r1
multiples of 64) are the conversion of rows [r0, r1) alone, so gate and up halves, single experts
and N-sharded slices convert independently; a K-sharded weight converts its local shard.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

from quads_megatron.kernels.fragment_layout import (COLS, ROWS, from_fragment_order, from_fragment_scale_order,
                                                    to_fragment_order, to_fragment_scale_order)

KERNEL_WEIGHT_LAYOUT = "fragment"  # the `weight_layout=` the kernels take for these bytes


def kernel_layout_fits(n: int, k: int) -> bool:
    """True when an [N, K] NVFP4 weight can take the kernel layout (N % 64 == 0, K % 128 == 0)."""
    return n % ROWS == 0 and k % COLS == 0


def to_kernel_layout(codes: torch.Tensor, out: Optional[torch.Tensor] = None,
                     name: str = "weight") -> torch.Tensor:
    """ModelOpt packed codes [..., N, K/2] uint8 -> the kernel's byte order (a new tensor, or
    written into `out`, which may be `codes` itself: an in-place reload)."""
    return to_fragment_order(codes, out=out, name=name)


def from_kernel_layout(frag: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """The exact inverse of `to_kernel_layout`: the kernel's bytes -> ModelOpt packed codes."""
    return from_fragment_order(frag, name=name)


def scales_to_kernel_layout(scales: torch.Tensor, out: Optional[torch.Tensor] = None,
                            name: str = "weight_scale") -> torch.Tensor:
    """ModelOpt block scales [..., N, K/16] (one byte each) -> the kernel's order (a new tensor, or written
    into `out`, which may be `scales` itself)."""
    return to_fragment_scale_order(scales, out=out, name=name)


def scales_from_kernel_layout(frag: torch.Tensor, name: str = "weight_scale") -> torch.Tensor:
    """The exact inverse of `scales_to_kernel_layout`."""
    return from_fragment_scale_order(frag, name=name)


def _runs(rows: list) -> list:
    """Sorted row indices -> [(start, stop)] of their contiguous runs."""
    runs = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [tuple(x) for x in runs]


def _converters(scales: bool) -> tuple:
    """(to, from) of the codes' or the block scales' permutation."""
    return (scales_to_kernel_layout, scales_from_kernel_layout) if scales else (to_kernel_layout, from_kernel_layout)


def rows_to_kernel_layout(buf: torch.Tensor, written: Mapping[int, Iterable[int]],
                          name: str = "weight", scales: bool = False) -> None:
    """A partial load's step: convert in place the rows a load wrote, ``written`` = {expert: row indices}
    of ModelOpt codes [E, N, K/2] (scales=True: block scales [E, N, K/16]), each row once however often it
    was written (runs of whole 64-row tiles: the layout is tile-local, the other rows keep their
    kernel-layout bytes). Runs that continue into the next expert's rows convert together (one launch on
    CUDA when whole experts were written)."""
    convert = _converters(scales)[0]
    n = buf.shape[1]
    rows = sorted({e * n + r for e, rs in written.items() for r in rs})
    flat = buf.view(-1, *buf.shape[2:]) if buf.is_contiguous() else None
    for r0, r1 in _runs(rows):
        if flat is not None and n % ROWS == 0 and r0 % ROWS == 0 and r1 % ROWS == 0:
            part = flat[r0:r1]  # whole tiles, possibly of several experts: one conversion
            convert(part, out=part, name=f"{name}[rows {r0}:{r1} of [E * N]]")
            continue
        for e in range(r0 // n, (r1 - 1) // n + 1):  # per expert (a run not of whole tiles raises)
            a, b = max(r0 - e * n, 0), min(r1 - e * n, n)
            part = buf[e, a:b]
            convert(part, out=part, name=f"{name}[{e}, {a}:{b}]")


class PendingRows:
    """The rows of one buffer of NVFP4 codes (``[E, N, K/2]``, or ``[N, K/2]`` as one expert; scales=True: block
    scales ``[E, N, K/16]``) written in ModelOpt order since its last conversion: the one bookkeeping of every
    loader that holds kernel-layout weights (one per buffer: codes and scales are written by separate loads).
    ``settle`` converts exactly those rows, once, in place; ``modelopt`` reads the buffer back in ModelOpt
    order (settling a partial load first)."""

    def __init__(self, scales: bool = False) -> None:
        self.spans: set = set()  # (expert, row0, row1)
        self.scales = scales

    def mark(self, experts: Iterable[int], row0: int, row1: int) -> None:
        self.spans.update((int(e), int(row0), int(row1)) for e in experts)

    def covers(self, buf: torch.Tensor) -> bool:
        """True when every row of ``buf`` was written since the last conversion (all of it is ModelOpt order)."""
        b = buf if buf.dim() == 3 else buf.unsqueeze(0)
        by_expert: dict = {}
        for e, r0, r1 in self.spans:
            by_expert.setdefault(e, []).append((r0, r1))
        for e in range(b.shape[0]):
            end = 0
            for r0, r1 in sorted(by_expert.get(e, ())):
                if r0 > end:
                    return False
                end = max(end, r1)
            if end < b.shape[1]:
                return False
        return True

    def settle(self, buf: torch.Tensor, name: str = "weight") -> None:
        """The rows written since the last conversion -> the kernel layout, in place (each once)."""
        if not self.spans:
            return
        if self.covers(buf):
            _converters(self.scales)[0](buf, out=buf, name=name)
        else:
            rows: dict = {}
            for e, r0, r1 in self.spans:
                rows.setdefault(e, set()).update(range(r0, r1))
            rows_to_kernel_layout(buf if buf.dim() == 3 else buf.unsqueeze(0), rows, name=name, scales=self.scales)
        self.spans.clear()

    def modelopt(self, buf: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """``buf``'s bytes in ModelOpt order: ``buf`` itself when a load rewrote all of it and is not settled
        yet, else a read-back copy (a partial load is settled first, so the buffer is in one layout)."""
        if self.covers(buf):
            return buf
        self.settle(buf, name)
        return _converters(self.scales)[1](buf, name=name)
