"""Where this process computes: the one place that picks CUDA or CPU for the trainer and the local engine."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """This rank's CUDA device (torchrun's LOCAL_RANK, set by ``initialize_distributed``) when CUDA works, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device=None) -> torch.device:
    """``device`` as a torch.device (None: ``default_device()``); 'cuda' without a usable GPU is a ConfigError."""
    from quads_megatron.errors import ConfigError

    if device is None:
        return default_device()
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r}: not a torch device ({e}); expected cpu or cuda[:N]") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA was asked for but no GPU is usable here")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif d.type != "cpu":
        raise ConfigError(f"device {device!r}: expected cpu or cuda[:N]")
    return d
