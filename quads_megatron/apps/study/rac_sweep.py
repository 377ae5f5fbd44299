"""RAC's cost/benefit knobs: replace an engine's calibrated compensation channels by random ones of the same k."""

from __future__ import annotations

import torch

from quads_megatron.rollout.modules import NVFP4Experts


def _random_sets(groups: int | None, channels: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted int32 channel sets: [k], or [groups, k] (one per expert), drawn uniformly without replacement."""
    if groups is None:
        return torch.sort(torch.randperm(channels, generator=gen)[:k]).values.to(torch.int32)
    return torch.stack([_random_sets(None, channels, k, gen) for _ in range(groups)])


def randomize_channels(engine, seed: int = 0) -> int:
    """Give every RAC module of ``engine`` random channels of its calibrated k (same shapes); return modules changed."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for m in engine.nvfp4_modules.values():
        if isinstance(m, NVFP4Experts) and m.w13_comp_index is not None:
            k1, k2 = m.w13_comp_index.shape[-1], m.w2_comp_index.shape[-1]
            dev = m.w13.device
            m.w13_comp_index = _random_sets(None, m.hidden, k1, gen).to(dev)
            m.w2_comp_index = _random_sets(m.num_experts, m.ffn, k2, gen).to(dev)
            n += 1
        elif getattr(m, "comp_index", None) is not None:
            m.comp_index = _random_sets(None, m.in_features, m.comp_index.shape[-1], gen).to(m.weight.device)
            n += 1
    return n
