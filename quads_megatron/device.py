"""Where this process computes: the one place that picks CUDA or CPU for the trainer and the local engine."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """This rank's CUDA device (torchrun's LOCAL_RANK, set by ``initialize_distributed``) when CUDA works, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device=None, what: str = "device") -> torch.device:
    """``device`` as a torch.device (None: ``default_device()``): cpu or cuda[:N], cuda only with a GPU.

    A bad value is a ConfigError naming ``what`` (the flag, e.g. ``--device``).
    """
    from quads_megatron.errors import ConfigError

    if device is None:
        return default_device()
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} {device!r}: expected cpu, cuda or cuda:N")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what} {device}: no CUDA GPU is available on this machine (use {what} cpu)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(f"{what} {device}: only {torch.cuda.device_count()} CUDA device(s) present")
    return d
