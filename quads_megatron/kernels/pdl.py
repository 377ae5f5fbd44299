"""Programmatic dependent launch (Hopper and later) for the chain of rollout kernels.

At decode a MoE layer is ~9 launches of a few microseconds each, and inside a CUDA graph the gap
between two dependent kernels is a sizeable share of each. With PDL a kernel is launched while the
one before it still runs: its programs first wait (`griddepcontrol.wait`: the previous grid has
finished and its writes are visible), then let the next kernel launch
(`griddepcontrol.launch_dependents`), so no kernel reads anything before its inputs are complete.
SGLang launches its own decode-size MoE routing the same way. CPU (the interpreter), ROCm and GPUs
before sm_90 launch as usual.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quads_megatron.nvfp4.triton_kernels import inline_ptx

_enabled = True


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First statement of every kernel in the chain: wait for the previous grid, then release the next."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    return inline_ptx(device) and torch.cuda.get_device_capability(device)[0] >= 9   # griddepcontrol is PTX


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel taking `USE_PDL`: PDL on sm_90+ CUDA, nothing elsewhere."""
    if _enabled and _supported(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {}


@contextlib.contextmanager
def disabled():
    """Launch without PDL inside the block (benchmarks measure what it saves)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
