"""GRPO policy loss: PPO-clip surrogate with rollout/trainer mismatch correction (TIS, token MIS)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossConfig:
    """Knobs of the policy loss (defaults follow common GRPO/TIS settings)."""

    clip_eps: float = 0.2            # PPO ratio clip, low side (1 - eps)
    clip_eps_high: float | None = None  # high side (1 + eps_high); None = clip_eps (DAPO uses 0.28)
    tis: bool = True                 # truncated importance sampling w = min(pi_old_train / pi_rollout, cap)
    tis_cap: float = 2.0
    mis: bool = False                # token-level masked IS: drop tokens whose ratio leaves [mis_low, mis_high]
    mis_low: float = 0.5
    mis_high: float = 2.0
    kl_coef: float = 0.0             # k3 KL to the rollout policy (0: off)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor | float | None = None) -> torch.Tensor:
    """Sum of x over mask divided by denom (default: number of masked-in entries, at least 1)."""
    m = mask.to(x.dtype)
    d = m.sum().clamp_min(1.0) if denom is None else denom
    return (x * m).sum() / d


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) for samples from pi: exp(ref-logp) - (ref-logp) - 1 >= 0."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp_min(0.0)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    token_denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (loss, stats) for per-token tensors [B, T]; advantages is [B] or [B, T].

    logp: current trainer log-probs (with grad); old_logp: trainer log-probs of the policy that
    generated the batch (detached); rollout_logp: what the rollout engine reported. The PPO ratio is
    taken against old_logp; the mismatch between old_logp and rollout_logp is corrected with a
    truncated IS weight (TIS) and/or a token mask (MIS). Loss is a token mean over `token_denom`
    tokens (default: the masked tokens of this batch).
    """
    if not (logp.shape == old_logp.shape == rollout_logp.shape == mask.shape):
        raise ValueError(
            f"policy_loss: shapes differ: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
            f"rollout_logp {tuple(rollout_logp.shape)}, mask {tuple(mask.shape)}")
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    mask = mask.to(logp.dtype)
    old_logp, rollout_logp = old_logp.detach(), rollout_logp.detach()

    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + hi) * adv
    pg = -torch.minimum(surr1, surr2)
    clipped = (surr2 < surr1).to(logp.dtype)

    is_ratio = torch.exp((old_logp - rollout_logp).clamp(-20.0, 20.0))
    weight = torch.ones_like(is_ratio)
    if cfg.tis:
        weight = is_ratio.clamp(max=cfg.tis_cap)
    loss_mask = mask
    if cfg.mis:
        keep = ((is_ratio >= cfg.mis_low) & (is_ratio <= cfg.mis_high)).to(logp.dtype)
        loss_mask = mask * keep
    per_token = pg * weight
    if cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * k3_kl(logp, rollout_logp)
    loss = masked_mean(per_token, loss_mask, token_denom if token_denom is not None else mask.sum().clamp_min(1.0))

    with torch.no_grad():
        stats = {
            "pg_clipfrac": masked_mean(clipped, mask),
            "ppo_ratio_mean": masked_mean(ratio, mask),
            "tis_weight_mean": masked_mean(weight, mask),
            "tis_clipfrac": masked_mean((is_ratio > cfg.tis_cap).to(logp.dtype), mask) if cfg.tis else torch.zeros(()),
            "mis_maskfrac": 1.0 - masked_mean(loss_mask, mask) if cfg.mis else torch.zeros(()),
            # effective sample size of the train/rollout IS ratios over the tokens, in (0, 1]
            "ess_ratio": masked_mean(is_ratio, mask) ** 2 / masked_mean(is_ratio ** 2, mask).clamp_min(1e-30),
        }
    return loss, stats
