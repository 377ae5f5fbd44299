"""GRPO advantages: group normalisation, the no-std variant, layout errors."""

import pytest
import torch

from quads_megatron.rl.advantages import grpo_advantages


def test_group_normalised():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 3.0])
    a = grpo_advantages(r, 4)
    g = a.view(2, 4)
    assert torch.allclose(g.mean(1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(g.std(1, unbiased=False), torch.ones(2), atol=1e-4)
    assert a[0] > 0 and a[1] < 0 and a[4] > 0 and a[5] < 0


def test_no_std_and_equal_rewards():
    r = torch.tensor([2.0, 0.0, 5.0, 5.0])
    assert torch.equal(grpo_advantages(r, 2, normalize_std=False), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert torch.equal(grpo_advantages(r, 2)[2:], torch.zeros(2))  # all-equal group: no signal, no NaN


def test_bad_layout():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), 2)
