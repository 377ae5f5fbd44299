"""Policy loss: PPO clipping, TIS weights and cap, token MIS masking, k3 KL."""

import pytest
import torch

from quads_megatron.rl.loss import LossConfig, k3_kl, policy_loss


def _inputs():
    torch.manual_seed(0)
    lp = torch.randn(3, 5) * 0.1 - 1.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    return lp, mask, adv


def test_on_policy_gradient_is_reinforce():
    lp, mask, adv = _inputs()
    x = lp.clone().requires_grad_(True)
    loss, st = policy_loss(x, lp, lp, adv, mask, LossConfig())
    loss.backward()
    # ratio 1, no clipping, TIS weight 1: d loss / d logp = -A / n_tokens on masked tokens
    expect = -(adv[:, None] * mask) / mask.sum()
    assert torch.allclose(x.grad, expect, atol=1e-7)
    assert float(st["pg_clipfrac"]) == 0.0 and float(st["tis_weight_mean"]) == pytest.approx(1.0)
    assert float(st["ess_ratio"]) == pytest.approx(1.0)


def test_ppo_clip_stops_gradient_outside_trust_region():
    lp, mask, adv = _inputs()
    x = (lp + 0.5).requires_grad_(True)  # ratio e^0.5 > 1.2: clipped for positive advantages
    loss, st = policy_loss(x, lp, lp, adv, mask, LossConfig(clip_eps=0.2, tis=False))
    loss.backward()
    assert torch.all(x.grad[0][mask[0].bool()] == 0) and torch.all(x.grad[2][mask[2].bool()] == 0)
    assert torch.all(x.grad[1][mask[1].bool()] != 0)  # negative advantage: unclipped side
    assert 0 < float(st["pg_clipfrac"]) < 1


def test_tis_weight_is_capped_ratio_of_old_to_rollout():
    lp, mask, adv = _inputs()
    rollout = lp.clone()
    rollout[1] -= 2.0  # trainer thinks these tokens are e^2 = 7.4x likelier: capped at 2
    rollout[0] += 0.1
    x = lp.clone().requires_grad_(True)
    loss, st = policy_loss(x, lp, rollout, adv, mask, LossConfig(tis_cap=2.0))
    loss.backward()
    w = torch.exp(lp - rollout).clamp(max=2.0)
    assert torch.allclose(x.grad, -(adv[:, None] * mask * w) / mask.sum(), atol=1e-6)
    assert float(st["tis_clipfrac"]) == pytest.approx(5 / 11)
    assert 0 < float(st["ess_ratio"]) < 1


def test_mis_masks_tokens_outside_band():
    lp, mask, adv = _inputs()
    rollout = lp.clone()
    rollout[1, :2] -= 3.0
    x = lp.clone().requires_grad_(True)
    loss, st = policy_loss(x, lp, rollout, adv, mask, LossConfig(tis=False, mis=True))
    loss.backward()
    assert torch.all(x.grad[1, :2] == 0) and torch.all(x.grad[1, 2:] != 0)
    assert float(st["mis_maskfrac"]) == pytest.approx(2 / 11)


def test_k3_nonnegative_and_zero_on_equal():
    a = torch.randn(100)
    assert torch.all(k3_kl(a, a) == 0)
    assert torch.all(k3_kl(a, a + torch.randn(100)) >= 0)


def test_shape_mismatch_is_an_error():
    lp, mask, adv = _inputs()
    with pytest.raises(ValueError, match="shapes differ"):
        policy_loss(lp, lp[:, :4], lp, adv, mask, LossConfig())
