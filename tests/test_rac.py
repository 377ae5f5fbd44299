"""RAC math (quads_megatron.rac) on hand-derived vectors: compensated activations, statistics,
channel choice, index checks.

The rows below are built so that every NVFP4 rounding is known by hand (S_enc = 2688 / amax,
block scale = e4m3(block_amax * S_enc / 6), code = RNE_e2m1(x / (scale * S_dec))):
a row with amax 2688 has S_dec = 1; a block holding 2688 gets scale 448, so its other elements
are divided by 448 and anything below 0.25 * 448 = 112 rounds to 0; a block of 3s gets scale
0.5 and is exact; a block [6, 0.2, 1, ...] gets scale 1, so 0.2 rounds to 0 and 1 is exact.
"""

import pytest
import torch

from quads_megatron.rac import (ActivationStats, calibrate_comp_channels, check_comp_index,
                                compensated_activation, quantize_compensated)

OUTLIER_BLOCK = [2688.0] + [100.0] * 15      # 100 / 448 < 0.25: crushed to 0
EXACT_BLOCK = [3.0] * 16                     # scale 0.5, code 6: exact
SMALL_BLOCK = [6.0, 0.2] + [1.0] * 14        # scale 1: 0.2 -> 0, 1 exact
ROW = OUTLIER_BLOCK + EXACT_BLOCK + SMALL_BLOCK
ROW_Q = [2688.0] + [0.0] * 15 + EXACT_BLOCK + [6.0, 0.0] + [1.0] * 14


def _idx(*channels):
    return torch.tensor(sorted(channels), dtype=torch.int32)


def test_quantized_row_matches_hand_rounding():
    xq, rq = compensated_activation(torch.tensor([ROW]), None)
    assert torch.equal(xq, torch.tensor([ROW_Q]))
    assert rq.shape == (1, 0)


def test_residual_makes_the_chosen_channels_exact():
    # S = the outlier block: r = [0, 100 x15]; its own per-row scale (amax 100) codes 100 as 6
    x = torch.tensor([ROW])
    xq, rq = compensated_activation(x, _idx(*range(16)))
    assert torch.equal(xq, torch.tensor([ROW_Q]))          # the main quantization is untouched
    torch.testing.assert_close(rq, torch.tensor([[0.0] + [100.0] * 15]), rtol=1e-6, atol=0)
    torch.testing.assert_close(xq[:, :16] + rq, x[:, :16], rtol=1e-6, atol=0)
    # a channel outside S keeps its error (0.2 -> 0)
    assert float(xq[0, 33]) == 0.0


def test_residual_keeps_the_second_quantizations_error():
    # r = [0, 100, 50, 30, 0 ...] on block 0: scale 448 at S_dec = 100/2688, codes 6, 3, 1.8 -> 2
    x = torch.tensor([[2688.0, 100.0, 50.0, 30.0] + [0.0] * 12 + EXACT_BLOCK])
    _, rq = compensated_activation(x, _idx(*range(16)))
    want = torch.tensor([[0.0, 100.0, 50.0, 200.0 / 6] + [0.0] * 12])
    torch.testing.assert_close(rq, want, rtol=1e-6, atol=1e-6)
    # the residual error is one E2M1 rounding at the residual's scale: at most amax(r) / 6
    err = (x[:, :16] - torch.tensor([[2688.0] + [0.0] * 15]) - rq).abs()
    assert float(err.max()) <= 100.0 / 6


def test_static_scale_saturates_and_rac_recovers_the_outlier():
    # input_scale 2^-6 encodes amax 42 (block scale 448, step 7): 84 saturates to 42, 21 is
    # exact; per token (amax 84, step 14) both are exact
    x = torch.tensor([[84.0] + [21.0] * 15])
    scale = 2.0 ** -6
    qx, qr = quantize_compensated(x, None, input_scale=scale)
    assert qr is None
    xq_static, _ = compensated_activation(x, None, input_scale=scale)
    assert xq_static.tolist() == [[42.0] + [21.0] * 15]
    xq_token, _ = compensated_activation(x, None)
    assert xq_token.tolist() == x.tolist()
    xq, rq = compensated_activation(x, _idx(*range(16)), input_scale=scale)
    torch.testing.assert_close(xq + rq, x, rtol=1e-6, atol=0)  # r = [42, 0, ...] is exact in its own scale


def test_per_group_sets_gather_each_rows_own_channels():
    # row 0 uses set 0 (block 0), row 1 set 1 (block 2): each sees its own block's residual
    x = torch.tensor([ROW, ROW])
    comp = torch.stack([_idx(*range(16)), _idx(*range(32, 48))])
    _, rq = compensated_activation(x, comp, groups=torch.tensor([0, 1]))
    torch.testing.assert_close(rq[0], torch.tensor([0.0] + [100.0] * 15), rtol=1e-6, atol=0)
    # block 2's residual: [0, 0.2, 0 ...] codes 0.2 as 6 at its own scale
    torch.testing.assert_close(rq[1], torch.tensor([0.0, 0.2] + [0.0] * 14), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="groups"):
        compensated_activation(x, comp)


def test_statistics_are_the_hand_squared_errors():
    stats = ActivationStats(48)
    stats.update(torch.tensor([ROW]))
    stats.update(torch.tensor([ROW_Q]))                    # exact row: adds zero error
    want = torch.zeros(48)
    want[1:16] = 100.0 ** 2 / 2
    want[33] = 0.2 ** 2 / 2
    torch.testing.assert_close(stats.mean_sq_err(), want, rtol=1e-6, atol=0)
    # the channels that carry error are the ones chosen (15 in the outlier block + channel 33)
    assert calibrate_comp_channels(stats, torch.ones(48), 16).tolist() == [*range(1, 16), 33]


def test_channel_choice_weighs_error_by_weight_column_norm():
    sq = torch.arange(1.0, 49.0)                           # error grows with the channel index
    norm = torch.ones(48)
    assert calibrate_comp_channels(sq, norm, 16).tolist() == list(range(32, 48))
    norm[0], norm[47] = 1000.0, 0.0                        # a heavy column wins, a zero one never does
    assert calibrate_comp_channels(sq, norm, 16).tolist() == [0, *range(32, 47)]
    assert calibrate_comp_channels(sq, norm, 0).shape == (0,)


def test_per_expert_statistics_and_sets():
    # expert 0 sees the outlier in block 0, expert 1 in block 1, expert 2 sees no tokens
    row1 = EXACT_BLOCK + OUTLIER_BLOCK + SMALL_BLOCK
    stats = ActivationStats(48, num_groups=3)
    stats.update(torch.tensor([ROW, row1, ROW]), torch.tensor([0, 1, 0]))
    assert stats.count.tolist() == [2.0, 1.0, 0.0]
    sq = stats.mean_sq_err()
    assert float(sq[2].abs().sum()) == 0.0
    comp = calibrate_comp_channels(stats, torch.ones(3, 48), 16)
    assert comp.dtype == torch.int32 and comp.shape == (3, 16)
    assert comp[0].tolist() == [*range(1, 16), 33]
    assert comp[1].tolist() == [*range(17, 32), 33]


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
