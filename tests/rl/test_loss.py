"""Policy loss: PPO clipping, TIS weights and cap, token MIS masking, k3 KL.

Every expectation here is written down by hand (or is an exact identity of the estimator), not
recomputed with the code under test. Tensors are float64 so the hand values compare tightly.
"""

import math

import pytest
import torch

from quads_megatron.rl.loss import LossConfig, k3_kl, policy_loss

F64 = torch.float64


def _t(*v):
    return torch.tensor(v, dtype=F64)


def _run(logp_offset, adv, cfg, *, rollout_offset=None, mask=None, token_denom=None):
    """One sequence [1, T]: old_logp = -1, logp = old + logp_offset, rollout = old - rollout_offset."""
    old = torch.full((1, len(logp_offset)), -1.0, dtype=F64)
    x = (old + _t(*logp_offset)[None]).requires_grad_(True)
    rollout = old if rollout_offset is None else old - _t(*rollout_offset)[None]
    m = torch.ones_like(old) if mask is None else _t(*mask)[None]
    loss, st = policy_loss(x, old, rollout, _t(*adv)[None], m, cfg, token_denom=token_denom)
    loss.backward()
    return loss.detach(), x.grad[0], st


def test_on_policy_gradient_is_reinforce():
    torch.manual_seed(0)
    lp = torch.randn(3, 5) * 0.1 - 1.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    x = lp.clone().requires_grad_(True)
    loss, st = policy_loss(x, lp, lp, adv, mask, LossConfig())
    loss.backward()
    # ratio 1, no clipping, TIS weight 1: loss = -sum(A) / n, d loss / d logp = -A / n_tokens on masked tokens
    expect = -(adv[:, None] * mask) / 11
    assert torch.allclose(x.grad, expect, atol=1e-7)
    assert float(loss.detach()) == pytest.approx(-(3 * 1.0 + 5 * -0.5 + 3 * 2.0) / 11, rel=1e-6)
    assert float(st["pg_clipfrac"]) == 0.0 and float(st["tis_weight_mean"]) == pytest.approx(1.0)
    assert float(st["ess_ratio"]) == pytest.approx(1.0)


# PPO: ratio r = pi/pi_old, per-token loss -min(r A, clip(r, 1-eps, 1+eps_high) A).
# Tokens (r, A) and the hand values with eps = 0.2:
#   (1.5, +1): min(1.5, 1.2) = 1.2  -> loss -1.2, clipped, no gradient
#   (1.5, -1): min(-1.5, -1.2) = -1.5 -> loss 1.5, d/dlogp = -A r = 1.5
#   (0.5, +1): min(0.5, 0.8) = 0.5  -> loss -0.5, d/dlogp = -0.5
#   (0.5, -1): min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped, no gradient
#   (1.1, +1): inside the band       -> loss -1.1, d/dlogp = -1.1
#   (0.85, -1): inside the band      -> loss 0.85, d/dlogp = 0.85
#   (9.0, +1) with mask 0: ignored
PPO_R = [1.5, 1.5, 0.5, 0.5, 1.1, 0.85, 9.0]
PPO_A = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0]
PPO_MASK = [1, 1, 1, 1, 1, 1, 0]


def test_ppo_clip_hand_values():
    loss, grad, st = _run([math.log(r) for r in PPO_R], PPO_A, LossConfig(clip_eps=0.2, tis=False), mask=PPO_MASK)
    assert float(loss) == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8 - 1.1 + 0.85) / 6, abs=1e-12)
    torch.testing.assert_close(grad, _t(0.0, 1.5, -0.5, 0.0, -1.1, 0.85, 0.0) / 6, rtol=0, atol=1e-12)
    assert float(st["pg_clipfrac"]) == pytest.approx(2 / 6)          # exactly the two zero-gradient tokens
    assert float(st["ppo_ratio_mean"]) == pytest.approx((1.5 + 1.5 + 0.5 + 0.5 + 1.1 + 0.85) / 6)


def test_ppo_clip_high_side_is_separate():
    # eps_high = 0.6: (1.5, +1) is now inside [0.8, 1.6] (loss -1.5, gradient -1.5); the low side is unchanged.
    loss, grad, st = _run([math.log(r) for r in PPO_R], PPO_A,
                          LossConfig(clip_eps=0.2, clip_eps_high=0.6, tis=False), mask=PPO_MASK)
    assert float(loss) == pytest.approx((-1.5 + 1.5 - 0.5 + 0.8 - 1.1 + 0.85) / 6, abs=1e-12)
    torch.testing.assert_close(grad, _t(-1.5, 1.5, -0.5, 0.0, -1.1, 0.85, 0.0) / 6, rtol=0, atol=1e-12)
    assert float(st["pg_clipfrac"]) == pytest.approx(1 / 6)


# TIS: w = min(pi_old / pi_rollout, cap), a constant factor on each token's PPO term.
# old - rollout = log(q) for q = 0.5, 1.5, 3.0, 4.0; cap 2 -> w = 0.5, 1.5, 2, 2.
TIS_Q = [0.5, 1.5, 3.0, 4.0]
TIS_A = [1.0, -2.0, 0.5, 1.0]


def test_tis_weight_is_capped_ratio_of_old_to_rollout():
    loss, grad, st = _run([0.0] * 4, TIS_A, LossConfig(tis_cap=2.0), rollout_offset=[math.log(q) for q in TIS_Q])
    w = [0.5, 1.5, 2.0, 2.0]
    assert float(loss) == pytest.approx(-(0.5 * 1 - 1.5 * 2 + 2 * 0.5 + 2 * 1) / 4, abs=1e-12)
    torch.testing.assert_close(grad, -_t(*[a * wi for a, wi in zip(TIS_A, w)]) / 4, rtol=0, atol=1e-12)
    assert float(st["tis_weight_mean"]) == pytest.approx(6.0 / 4)
    assert float(st["tis_clipfrac"]) == pytest.approx(2 / 4)
    # ESS of the uncapped ratios: mean(q)^2 / mean(q^2) = (9/4)^2 / (27.5/4)
    assert float(st["ess_ratio"]) == pytest.approx((9 / 4) ** 2 / (27.5 / 4))


def test_tis_off_means_weight_one():
    loss, grad, st = _run([0.0] * 4, TIS_A, LossConfig(tis=False), rollout_offset=[math.log(q) for q in TIS_Q])
    assert float(loss) == pytest.approx(-sum(TIS_A) / 4, abs=1e-12)
    torch.testing.assert_close(grad, -_t(*TIS_A) / 4, rtol=0, atol=1e-12)
    assert float(st["tis_weight_mean"]) == 1.0 and float(st["tis_clipfrac"]) == 0.0


def test_tis_weight_times_ppo_clip():
    # r = 1.5 with A = +1 is clipped to 1.2, then weighted by w = 1.5: loss -1.8 and no gradient;
    # r = 0.5 with A = +1 is unclipped: loss -0.5 * 0.5 (w = 0.5), gradient -0.25.
    loss, grad, _ = _run([math.log(1.5), math.log(0.5)], [1.0, 1.0], LossConfig(tis_cap=2.0),
                         rollout_offset=[math.log(1.5), math.log(0.5)])
    assert float(loss) == pytest.approx((-1.8 - 0.25) / 2, abs=1e-12)
    torch.testing.assert_close(grad, _t(0.0, -0.25) / 2, rtol=0, atol=1e-12)


# MIS: drop tokens whose pi_old / pi_rollout leaves [0.5, 2]; the loss is still divided by all
# masked-in tokens. q = 0.3 (drop), 0.6, 1.0, 1.9 (keep), 2.5 (drop).
MIS_Q = [0.3, 0.6, 1.0, 1.9, 2.5]
MIS_A = [1.0, 2.0, -1.0, 0.5, 3.0]


def test_mis_masks_tokens_outside_band():
    loss, grad, st = _run([0.0] * 5, MIS_A, LossConfig(tis=False, mis=True),
                          rollout_offset=[math.log(q) for q in MIS_Q])
    assert float(loss) == pytest.approx(-(2.0 - 1.0 + 0.5) / 5, abs=1e-12)
    torch.testing.assert_close(grad, -_t(0.0, 2.0, -1.0, 0.5, 0.0) / 5, rtol=0, atol=1e-12)
    assert float(st["mis_maskfrac"]) == pytest.approx(2 / 5)


def test_mis_with_tis_and_custom_band_and_token_denom():
    # band [0.25, 3]: only q = 0.3 ... 2.5 all kept; TIS cap 2 weights 0.3, 0.6, 1, 1.9, 2; denominator 10.
    loss, grad, st = _run([0.0] * 5, MIS_A, LossConfig(tis=True, tis_cap=2.0, mis=True, mis_low=0.25, mis_high=3.0),
                          rollout_offset=[math.log(q) for q in MIS_Q], token_denom=10.0)
    w = [0.3, 0.6, 1.0, 1.9, 2.0]
    assert float(loss) == pytest.approx(-sum(a * wi for a, wi in zip(MIS_A, w)) / 10, abs=1e-12)
    torch.testing.assert_close(grad, -_t(*[a * wi for a, wi in zip(MIS_A, w)]) / 10, rtol=0, atol=1e-12)
    assert float(st["mis_maskfrac"]) == 0.0


def test_k3_hand_values():
    # k3(logp, ref) = e^d - d - 1 with d = ref - logp
    logp = _t(0.0, 0.0, 0.0, 1.0, -3.0)
    ref = _t(0.0, 1.0, -1.0, 1.0 + math.log(2.0), -3.0 - math.log(4.0))
    expect = _t(0.0, math.e - 2.0, math.exp(-1.0), 1.0 - math.log(2.0), 0.25 + math.log(4.0) - 1.0)
    torch.testing.assert_close(k3_kl(logp, ref), expect, rtol=1e-12, atol=1e-12)


def test_k3_is_unbiased_for_kl_on_a_discrete_distribution():
    # E_{x~pi}[k3] = sum pi (ref/pi) - sum pi log(ref/pi) - 1 = KL(pi || ref), exactly, for full support.
    torch.manual_seed(1)
    logpi = torch.log_softmax(torch.randn(7, dtype=F64) * 2, 0)
    logref = torch.log_softmax(torch.randn(7, dtype=F64) * 2, 0)
    pi = logpi.exp()
    kl = float((pi * (logpi - logref)).sum())
    assert kl > 0.1
    assert float((pi * k3_kl(logpi, logref)).sum()) == pytest.approx(kl, rel=1e-10)
    # and it is KL(pi || ref), not KL(ref || pi): that one is a different number here
    assert float((pi * k3_kl(logref, logpi)).sum()) != pytest.approx(kl, rel=1e-3)


def test_kl_penalty_term_value_and_gradient():
    # on-policy, no TIS; rollout - logp = d: loss adds c * (e^d - d - 1), gradient c * (1 - e^d) per token / n
    c = 0.5
    d = [math.log(2.0), -1.0, 0.0]
    loss, grad, _ = _run([0.0] * 3, [1.0, 1.0, -1.0], LossConfig(tis=False, kl_coef=c), rollout_offset=[-v for v in d])
    k3 = [1.0 - math.log(2.0), math.exp(-1.0), 0.0]
    assert float(loss) == pytest.approx((-1.0 + c * k3[0] - 1.0 + c * k3[1] + 1.0 + c * k3[2]) / 3, abs=1e-12)
    expect = [(-a + c * (1.0 - math.exp(v))) / 3 for a, v in zip([1.0, 1.0, -1.0], d)]
    torch.testing.assert_close(grad, _t(*expect), rtol=0, atol=1e-12)


def test_shape_mismatch_is_an_error():
    lp = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="shapes differ"):
        policy_loss(lp, lp[:, :4], lp, torch.zeros(3), torch.ones(3, 5), LossConfig())
