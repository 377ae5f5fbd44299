"""RAC math (quads_megatron.rac): compensated activations, statistics, channel calibration, index checks."""

import pytest
import torch

from quads_megatron.nvfp4 import dequantize, quantize
from quads_megatron.rac import (ActivationStats, calibrate_comp_channels, check_comp_index,
                                compensated_activation, quantize_compensated,
                                weight_column_norm_sq)


def _x(m=32, k=128, seed=0, hot=(5, 70)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.5 + torch.rand(k, generator=g))
    x[:, list(hot)] *= 30
    return x


def test_compensated_activation_is_quantized_residual():
    x = _x()
    comp = torch.arange(0, 128, 8, dtype=torch.int32)  # 16 channels
    xq, rq = compensated_activation(x, comp)
    assert torch.equal(xq, dequantize(quantize(x, per_row=True), torch.float32))
    r = x[:, comp.long()] - xq[:, comp.long()]
    assert torch.equal(rq, dequantize(quantize(r, per_row=True), torch.float32))
    # compensation strictly shrinks the error on S and leaves the other channels alone
    err_before = (x[:, comp.long()] - xq[:, comp.long()]).norm()
    err_after = (x[:, comp.long()] - xq[:, comp.long()] - rq).norm()
    assert err_after < 0.25 * err_before


def test_static_scale_and_empty_set():
    x = _x(seed=1)
    scale = float(x.abs().max()) / 2688
    qx, qr = quantize_compensated(x, None, input_scale=scale)
    assert qr is None
    ref = quantize(x, amax=torch.tensor(scale) * 2688)
    assert torch.equal(qx.data, ref.data) and torch.equal(qx.global_scale, ref.global_scale)
    xq, rq = compensated_activation(x, torch.zeros(0, dtype=torch.int32))
    assert rq.shape == (32, 0)


def test_per_group_sets_gather_each_rows_own_channels():
    x = _x(m=6, k=64, seed=2, hot=(5,))
    comp = torch.stack([torch.arange(16), torch.arange(32, 48)]).int()
    groups = torch.tensor([0, 1, 1, 0, 1, 0])
    _, rq = compensated_activation(x, comp, groups=groups)
    for i, g in enumerate(groups.tolist()):
        _, rq_i = compensated_activation(x[i:i + 1], comp[g])
        assert torch.equal(rq[i], rq_i[0])
    with pytest.raises(ValueError, match="groups"):
        compensated_activation(x, comp)


def test_calibration_targets_the_blocks_of_outlier_channels():
    # an outlier sets its block's scale, so its block-mates are the ones crushed to zero:
    # they carry the largest E[(x - xq)^2], and RAC should pick them
    x = _x(m=256, k=128, seed=3, hot=(5, 70))
    stats = ActivationStats(128)
    stats.update(x[:128])
    stats.update(x[128:])
    w = torch.randn(64, 128) * 0.05
    comp = calibrate_comp_channels(stats, weight_column_norm_sq(quantize(w)), 32)
    assert comp.dtype == torch.int32 and comp.shape == (32,)
    assert bool((comp[1:] > comp[:-1]).all())
    in_hot_blocks = [c for c in comp.tolist() if c // 16 in (0, 4)]
    assert len(in_hot_blocks) >= 28, comp
    # a zero weight column is never worth compensating
    w[:, 71] = 0
    assert 71 not in calibrate_comp_channels(stats, weight_column_norm_sq(w), 32).tolist()


def test_grouped_stats_and_per_expert_calibration():
    x = _x(m=64, k=64, seed=4, hot=())
    groups = torch.arange(64) % 2
    x[groups == 0, 3] *= 40
    x[groups == 1, 50] *= 40
    stats = ActivationStats(64, num_groups=3)
    stats.update(x, groups)
    assert torch.equal(stats.count, torch.tensor([32.0, 32.0, 0.0], dtype=torch.float64))
    norm = torch.ones(3, 64)
    comp = calibrate_comp_channels(stats, norm, 16)
    assert comp.shape == (3, 16)
    assert sum(c // 16 == 0 for c in comp[0].tolist()) >= 12   # expert 0: block of channel 3
    assert sum(c // 16 == 3 for c in comp[1].tolist()) >= 12   # expert 1: block of channel 50


def test_bad_indices_and_stats_inputs():
    with pytest.raises(ValueError, match="int32"):
        check_comp_index(torch.arange(16.0), 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        check_comp_index(torch.arange(8, dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="out of range"):
        check_comp_index(torch.arange(56, 72, dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="sorted"):
        check_comp_index(torch.arange(16, dtype=torch.int32).flip(0), 64)
    with pytest.raises(ValueError, match="exceeds"):
        check_comp_index(torch.arange(32, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        ActivationStats(40)
    with pytest.raises(ValueError, match="channels"):
        ActivationStats(64).update(torch.randn(4, 32))
    with pytest.raises(ValueError, match="k = 8"):
        calibrate_comp_channels(torch.rand(64), torch.rand(64), 8)
