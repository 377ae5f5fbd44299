"""GRPO advantages: rewards normalised within each prompt's group of samples."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Return (r - mean_group) [/ (std_group + eps)] for rewards laid out as [n_prompts * group_size].

    Samples of one prompt are contiguous. normalize_std=False gives the Dr.GRPO variant
    (no std division), which does not up-weight groups with nearly equal rewards.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [n_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=False) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + eps)
    return adv.reshape(-1)
