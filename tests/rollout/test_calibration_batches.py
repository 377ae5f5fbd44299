"""Calibration in left-padded batches (``RolloutModel.calibrate``): padding reaches no statistic.

The property checked: a batch whose prompts are padded to a common length calibrates what the same
prompts give run one at a time (``batch_tokens=1``: each prompt its own batch, no padding) — the same
RAC channels for every group and the same amax up to fp32 GEMM rounding — for per-token and static
scaling, experts and attention. The batching itself is checked against hand-built tensors.
"""

import pytest
import torch

from quads_megatron.plan import QuantPlan
from quads_megatron.recipe import QuadsRecipe
from quads_megatron.rollout.model import RolloutModel, calibration_batches

from tests.rl.engines.test_decode import _config, _source_weights

PROMPTS = [[1, 5, 7, 9, 11, 13, 2, 8], [2, 4, 6], [9, 3, 3, 1, 7], [40, 41]]


def test_batches_are_left_padded_in_order_within_the_token_budget():
    batches = calibration_batches([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]], "cpu", batch_tokens=6)
    # 3 + 1 -> 2 x 3 = 6 fits; adding [5, 6] makes 3 x 3 = 9 > 6; [5, 6] + [7..10] = 2 x 4 = 8 > 6
    assert [b[0].tolist() for b in batches] == [[[1, 2, 3], [0, 0, 4]], [[5, 6]], [[7, 8, 9, 10]]]
    assert [b[1].tolist() for b in batches] == [[[1, 1, 1], [0, 0, 1]], [[1, 1]], [[1, 1, 1, 1]]]
    with pytest.raises(ValueError, match="empty prompt"):
        calibration_batches([[1], []], "cpu", 8)


@pytest.mark.parametrize("scaling", ["per_token", "static"])
def test_padded_batches_calibrate_what_single_prompts_do(scaling):
    from quads_megatron.models import qwen3_moe

    cfg = _config()
    recipe = QuadsRecipe(train_precision="w4a16", rollout_precision="w4a4_rac", rac_channels=16,
                         activation_scaling=scaling, scope=["routed_experts", "attention"])
    plan = QuantPlan.resolve(recipe, qwen3_moe.dims_from_hf_config(cfg.to_dict()))
    model = RolloutModel(cfg, plan, dtype=torch.float32, device=torch.device("cpu"))
    model.load_weights(_source_weights(0, cfg))
    model.calibrate(PROMPTS, batch_tokens=1)
    alone = {name: (c.amax.clone(), None if c.comp_index is None else c.comp_index.clone())
             for name, c in model.calibration.items()}
    model.calibrate(PROMPTS)  # one batch of 4 x 8 tokens, 14 of them padding
    assert set(model.calibration) == set(alone) and alone
    for name, c in model.calibration.items():
        amax, comp = alone[name]
        torch.testing.assert_close(c.amax, amax, rtol=1e-5, atol=0, msg=f"{name}: amax")
        if comp is not None:
            assert torch.equal(c.comp_index, comp), f"{name}: RAC channels"
