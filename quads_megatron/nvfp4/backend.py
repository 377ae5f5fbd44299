"""The one place where the compute backend is chosen (NVFP4 numerics and the rollout kernels).

`resolve_backend(device, backend=None)` returns "triton" or "torch":
1. an explicit `backend` argument wins;
2. else the environment variable `QUADS_BACKEND` (`triton` | `torch`; unset or empty:
   automatic), read here and nowhere else;
3. else Triton for CUDA tensors (the torch reference where triton is not installed) and the
   torch reference for CPU tensors.

"triton" on a CPU tensor means Triton's CPU interpreter: TRITON_INTERPRET=1 must be set
before triton builds our kernels (before `quads_megatron.nvfp4.triton_kernels` is imported;
tests/conftest.py does it), otherwise a clear error is raised. Every public compute entry
point (`quads_megatron.nvfp4.quantize` / `dequantize` / `fake_quantize` / `amax_of`,
`quads_megatron.kernels.w4a4_linear` / `w4a4_fused_moe`) takes `backend=None` and calls this
once. Imports torch only (triton lazily).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

BACKENDS = ("triton", "torch")
ENV_VAR = "QUADS_BACKEND"

__all__ = ["BACKENDS", "ENV_VAR", "resolve_backend"]


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown compute backend {name!r}; expected one of "
                         f"{BACKENDS} ({ENV_VAR} unset or None: Triton on CUDA, torch on CPU)")
    return name


def _device_of(device) -> torch.device:
    if isinstance(device, torch.Tensor):
        return device.device
    return torch.device(device)


def resolve_backend(device: Union[torch.device, str, torch.Tensor],
                    backend: Optional[str] = None) -> str:
    """"triton" or "torch" for work on `device` (a device, a device string or a tensor).

    `backend` wins over `QUADS_BACKEND`, which wins over the device rule (Triton on CUDA,
    torch on CPU). Raises ValueError for an unknown name and RuntimeError when Triton is
    asked for but cannot run (not installed; on CPU: the interpreter is not on).
    """
    dev = _device_of(device)
    if backend is not None:
        name = _check_name(backend, "backend")
    else:
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env:
            name = _check_name(env, ENV_VAR)
        else:
            if dev.type != "cuda":
                return "torch"
            from . import triton_kernels

            return "triton" if triton_kernels.available() else "torch"
    if name == "triton":
        from . import triton_kernels

        if not triton_kernels.available():
            raise RuntimeError("compute backend 'triton' needs the `triton` package; use "
                               "backend='torch' (the reference) where it is not installed")
        if dev.type != "cuda" and not triton_kernels.interpreting():
            raise RuntimeError(
                f"compute backend 'triton' on a {dev.type} tensor runs Triton's CPU "
                f"interpreter, which is not on: set TRITON_INTERPRET=1 before triton is "
                f"imported (before quads_megatron.nvfp4.triton_kernels is loaded), or use "
                f"backend='torch' / a CUDA tensor")
    return name
