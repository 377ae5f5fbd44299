"""Per-kernel time from a torch profiler chrome trace (SGLang's `/start_profile` writes one per rank and stage):
where a decode step's GPU time goes, kernel by kernel, to compare two servers on the same batch."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class KernelTime:
    name: str
    calls: int
    total_us: float


def kernel_times(trace: str | Path, category: str = "kernel") -> list[KernelTime]:
    """Complete events of ``category`` in ``trace`` (``.json`` or ``.json.gz``) summed by name, longest first."""
    path = Path(trace)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    by_name: dict[str, KernelTime] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != category:
            continue
        k = by_name.setdefault(e["name"], KernelTime(e["name"], 0, 0.0))
        k.calls += 1
        k.total_us += float(e.get("dur", 0.0))
    if not by_name:
        raise ValueError(f"{path}: no '{category}' events (was the profiler's GPU activity on?)")
    return sorted(by_name.values(), key=lambda k: -k.total_us)


def per_step_table(kernels: dict[str, list[KernelTime]], steps: int, top: int = 12, width: int = 60) -> str:
    """A text table: each trace's ``top`` kernels (``kernel_times`` of it) in microseconds per step
    (``steps`` profiled steps each)."""
    lines = []
    for label, times in kernels.items():
        total = sum(k.total_us for k in times) / steps
        lines.append(f"{label}: {total:.1f} us of kernels per step, {sum(k.calls for k in times) / steps:.0f} launches")
        for k in times[:top]:
            name = k.name if len(k.name) <= width else k.name[: width - 3] + "..."
            lines.append(f"  {name:<{width}} {k.total_us / steps:9.1f} us  x{k.calls / steps:5.1f}")
    return "\n".join(lines)
