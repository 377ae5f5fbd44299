"""Checkpoint/resume in Megatron's legacy layout: {save}/iter_NNNNNNN/mp_rank_TT_EEE/model_optim_rng.pt.

Writes go to iter_NNNNNNN.tmp and are renamed only after every rank finished, and the tracker file
`latest_checkpointed_iteration.txt` is replaced atomically, so a crash mid-save (or mid-step) never
loses the previous checkpoint. Resume needs the same TP/EP layout.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _mp_dir() -> str:
    from megatron.core import parallel_state as ps

    return f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_{ps.get_expert_model_parallel_rank():03d}"


def _is_writer() -> bool:
    """One writer per (TP rank, EP rank): the first expert-data-parallel replica."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, state: dict) -> Path:
    """Save this rank's state for `iteration`; collective (all ranks call it). Returns the iteration dir."""
    save_dir = Path(save_dir)
    name = f"iter_{iteration:07d}"
    tmp, final = save_dir / f"{name}.tmp", save_dir / name
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    if _is_writer():
        (tmp / _mp_dir()).mkdir(exist_ok=True)
        state = dict(state, iteration=iteration, rng_state=torch.get_rng_state())
        torch.save(state, tmp / _mp_dir() / "model_optim_rng.pt")
    _barrier()
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = save_dir / f"{TRACKER}.tmp"
        tracker_tmp.write_text(f"{iteration}\n")
        os.replace(tracker_tmp, save_dir / TRACKER)
    _barrier()
    return final


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """Iteration named by the tracker file, or None when the directory holds no checkpoint yet."""
    tracker = Path(load_dir) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None) -> dict | None:
    """Load this rank's state (latest iteration by default); None when there is no checkpoint."""
    it = latest_iteration(load_dir) if iteration is None else iteration
    if it is None:
        return None
    path = Path(load_dir) / f"iter_{it:07d}" / _mp_dir() / "model_optim_rng.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is missing: was it saved with another --tensor/--expert-model-parallel-size?")
    state = torch.load(path, map_location="cpu", weights_only=False)
    torch.set_rng_state(state["rng_state"])
    return state
