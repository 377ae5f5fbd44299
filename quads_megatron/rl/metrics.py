"""Step metrics: rollout/trainer mismatch, entropy, rewards; a TensorBoard writer and a compact line."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from pathlib import Path

import torch

from .loss import k3_kl, masked_mean


def mismatch_stats(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """train_rollout_logprob_abs_diff (masked mean |lp_train - lp_rollout|) and train_rollout_kl (k3)."""
    m = mask.to(train_logp.dtype)
    gap = train_logp.detach() - rollout_logp.detach()
    return {
        "train_rollout_logprob_abs_diff": masked_mean(gap.abs(), m),
        "train_rollout_kl": masked_mean(k3_kl(rollout_logp.detach(), train_logp.detach()), m),
    }


def _quiet_event_writer_errors() -> None:
    """TensorBoard's event writer thread prints the traceback of a failed write (full or read-only disk) and
    re-raises the error in the next ``add_*``/``flush``, where StepLogger names it in one line: keep the
    thread's copy quiet (every other thread's exception is printed as before)."""
    previous = threading.excepthook
    if getattr(previous, "_quads_quiet", False):
        return

    def hook(args):
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    hook._quads_quiet = True
    threading.excepthook = hook


def routing_disagreement_counts(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[differing (token, layer) pairs, pairs, tokens differing in any layer, tokens] over the positions of
    ``mask`` [B, S-1] (those scoring a response token); diff [B, S-1, L] bool, the trainer's top-k set != the
    rollout's."""
    m = mask.bool().to(diff.device)
    d = diff[m]  # [tokens, L]
    return torch.tensor([float(d.sum()), float(d.numel()), float(d.any(-1).sum()), float(d.shape[0])],
                        dtype=torch.float64)


# A step's record in the job's history (summary JSON, checkpoints) -> the TensorBoard scalar it is logged as:
# one map, so a cut run's history can be read back from its event file (`read_history`).
HISTORY_SCALARS = {"reward": "reward/mean", "gap": "mismatch/train_rollout_logprob_abs_diff",
                   "routing_disagreement": "mismatch/routing_disagreement",
                   "gap_p99": "mismatch/logprob_abs_diff_p99", "kl": "mismatch/train_rollout_kl",
                   "grad_norm": "optim/grad_norm", "pass": "eval/pass@1"}


def history_record(step: int, scalars: dict[str, float]) -> dict:
    """One step's history record from the step's scalars (a key is None where the step did not log it)."""
    return {"step": step, **{k: scalars.get(tag) for k, tag in HISTORY_SCALARS.items()}}


def mean_or_none(values) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def reward_window(steps: int) -> int:
    """How many first / last steps the summary's reward before / after averages."""
    return max(1, min(5, steps // 3)) if steps else 1


def history_summary(steps: list[dict], pass_before: float | None) -> dict:
    """A run's summary figures from its step records (the job's own summary, and a cut run's read back)."""
    k = reward_window(len(steps))
    passes = [h["pass"] for h in steps if h.get("pass") is not None]
    return {
        "steps": len(steps),
        "reward_before": sum(h["reward"] for h in steps[:k]) / k if steps else None,
        "reward_after": sum(h["reward"] for h in steps[-k:]) / k if steps else None,
        "pass@1_before": pass_before,
        "pass@1_after": passes[-1] if passes else None,
        "mean_logprob_abs_diff": mean_or_none(h["gap"] for h in steps),
        "mean_routing_disagreement": mean_or_none(h.get("routing_disagreement") for h in steps),
        "history": steps,
    }


def read_history(tensorboard_dir: str | os.PathLike) -> tuple[list[dict], float | None]:
    """(history, pass@1 before GRPO) of a run, read back from the TensorBoard events in ``tensorboard_dir``:
    the records the job keeps in memory, for a run that was cut before it wrote its summary (float32 values,
    as the event file stores them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from quads_megatron.errors import ConfigError

    acc = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", ()))
    if HISTORY_SCALARS["reward"] not in tags:
        raise ConfigError(f"{tensorboard_dir}: no GRPO step in its TensorBoard events (no {HISTORY_SCALARS['reward']!r})")
    by_step: dict[int, dict[str, float]] = {}
    for tag in tags & set(HISTORY_SCALARS.values()):
        for e in acc.Scalars(tag):
            by_step.setdefault(e.step, {})[tag] = e.value
    pass_before = by_step.pop(0, {}).get(HISTORY_SCALARS["pass"])
    steps = sorted(s for s, v in by_step.items() if HISTORY_SCALARS["reward"] in v)
    return [history_record(s, by_step[s]) for s in steps], pass_before


class StepLogger:
    """Writes scalars/histograms to TensorBoard (rank 0) and prints one compact line per step."""

    LINE_KEYS = [("reward/mean", "reward", "{:.3f}"), ("eval/pass@1", "pass@1", "{:.3f}"),
                 ("loss/policy", "loss", "{:+.4f}"), ("mismatch/train_rollout_logprob_abs_diff", "|dlp|", "{:.2e}"),
                 ("mismatch/train_rollout_kl", "kl", "{:.1e}"), ("mismatch/tis_weight_mean", "tis", "{:.3f}"),
                 ("mismatch/routing_disagreement", "route", "{:.3f}"),
                 ("optim/grad_norm", "gnorm", "{:.3f}"), ("response/length_mean", "len", "{:.1f}"),
                 ("time/step", "t", "{:.2f}s")]

    def __init__(self, tensorboard_dir: str | os.PathLike | None, enabled: bool = True, print_fn=print):
        self.enabled = enabled
        self.print_fn = print_fn
        self.writer = None
        self.dir = Path(tensorboard_dir) if tensorboard_dir else None
        if enabled and self.dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_event_writer_errors()
            with self._named_write_errors():
                self.dir.mkdir(parents=True, exist_ok=True)
                self.writer = SummaryWriter(log_dir=str(self.dir))

    @contextlib.contextmanager
    def _named_write_errors(self):
        """A full or read-only disk under --tensorboard-dir is a one-line ConfigError naming it, not a traceback."""
        from quads_megatron.errors import ConfigError

        try:
            yield
        except OSError as e:
            raise ConfigError(f"--tensorboard-dir {self.dir}: writing TensorBoard events failed: "
                              f"{e.strerror or e}") from None

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, torch.Tensor] | None = None,
            line: bool = True) -> str:
        """Record one step; return the compact line."""
        if not self.enabled:
            return ""
        if self.writer is not None:
            with self._named_write_errors():
                for k, v in scalars.items():
                    if v is not None and math.isfinite(float(v)):
                        self.writer.add_scalar(k, float(v), step)
                for k, h in (histograms or {}).items():
                    if h is not None and h.numel():
                        self.writer.add_histogram(k, h.detach().float().cpu(), step)
                self.writer.flush()
        parts = [f"step {step}"]
        for key, short, fmt in self.LINE_KEYS:
            if key in scalars and scalars[key] is not None:
                parts.append(f"{short} {fmt.format(float(scalars[key]))}")
        text = " | ".join(parts)
        if line and self.print_fn is not None:
            self.print_fn(text)
        return text

    def text(self, tag: str, value: str, step: int = 0) -> None:
        """Record a text summary (run config, final summary)."""
        if self.enabled and self.writer is not None:
            with self._named_write_errors():
                self.writer.add_text(tag, value, step)
                self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(OSError):   # a failed write was reported by log() already; close runs in finally
                self.writer.close()
