"""QuantPlan: the decisions per weight, the checks, and the ModelOpt exclude list SGLang matches."""

import pytest

from quads_megatron.models import qwen3_moe
from quads_megatron.plan import EXPERT_TENSOR_PARALLEL, TENSOR_PARALLEL, QuantPlan
from quads_megatron.recipe import QuadsRecipe
from quads_megatron.vocab import Precision

DIMS = qwen3_moe.Dims(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      num_experts=4, moe_ffn=64, tie_word_embeddings=False)
EXP = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
ATT = "model.layers.{}.self_attn.{}_proj.weight"


def test_default_plan_quantizes_routed_experts_only():
    plan = QuantPlan.resolve(QuadsRecipe(), DIMS)
    t = plan[EXP.format(1, 2, "up")]
    assert (t.train, t.rollout, t.rac_channels, t.block_shape) == (Precision.W4A16, Precision.W4A4_RAC, 16, (1, 16))
    assert t.scale_group == (EXP.format(1, 2, "gate"), EXP.format(1, 2, "up"))
    assert t.reduce_group == EXPERT_TENSOR_PARALLEL
    assert plan[EXP.format(1, 2, "down")].scale_group == (EXP.format(1, 2, "down"),)
    assert not plan[ATT.format(0, "q")].quantized and plan["model.norm.weight"] is None
    assert sum(t.quantized for t in plan) == 3 * 4 * 3


def test_carve_outs_apply_to_trainer_and_rollout_alike():
    plan = QuantPlan.resolve(QuadsRecipe(bf16_first_layers=1, bf16_last_layers=1, scope=["routed_experts", "attention"],
                                         bf16_patterns=["model.layers.1.self_attn.o_proj"]), DIMS)
    for layer in (0, 2):
        assert all(t.train is t.rollout is Precision.BF16 for t in plan if t.layer == layer)
    assert plan[ATT.format(1, "q")].quantized and plan[ATT.format(1, "q")].reduce_group == TENSOR_PARALLEL
    assert plan[ATT.format(1, "q")].scale_group == tuple(ATT.format(1, p) for p in "qkv")
    assert not plan[ATT.format(1, "o")].quantized
    excl = plan.exclude_modules()
    assert {"model.layers.0.mlp.experts*", "model.layers.2.self_attn*", "model.layers.1.self_attn.o_proj"} <= set(excl)
    assert "model.layers.1.mlp.experts*" not in excl


def test_bf16_trainer_with_w4a4_rollout_is_the_naive_baseline():
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="bf16", rollout_precision="w4a4"), DIMS)
    assert not plan.train_quantizes and plan.rollout_quantizes and plan.rac_channels == 0
    assert plan.rollout_config().to_quantization_config()["precision"] == "w4a4"


@pytest.mark.parametrize("recipe,kwargs,match", [
    (QuadsRecipe(bf16_patterns=["model.layers.0.mlp.experts.3.*"]), {}, "as a whole"),
    (QuadsRecipe(scope=["attention"], bf16_patterns=["model.layers.0.self_attn.v_proj"]), {}, "share one global scale"),
    (QuadsRecipe(bf16_patterns=["decoder.layers.0.*"]), {}, "match no weight"),
    (QuadsRecipe(rac_channels=80), {}, "exceeds the 64 input channels"),
    (QuadsRecipe(), {"etp": 8}, "multiple of 16"),
    (QuadsRecipe(), {"tp": 0}, "must be an int >= 1"),
])
def test_inconsistent_plans_are_refused_naming_the_weight(recipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantPlan.resolve(recipe, DIMS, **kwargs)


def test_rollout_side_only_needs_no_trainer_sharding_rule():
    """ETP=8 splits fc2's K=64 into 8 (not a multiple of 16): fine when only the rollout quantizes."""
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="bf16", rollout_precision="w4a4"), DIMS, etp=8)
    assert plan.rollout_quantizes


def test_exclude_modules_mean_the_same_in_sglang():
    """SGLang's own ModelOpt matcher, fed the plan's exclude list, skips exactly the plan's BF16 modules."""
    pytest.importorskip("sglang")
    from sglang_ext.config import QuadsConfig

    plan = QuantPlan.resolve(QuadsRecipe(bf16_first_layers=1, scope=["routed_experts", "attention"],
                                         bf16_patterns=["model.layers.2.self_attn.o_proj"]), DIMS)
    probe = QuadsConfig(plan.rollout_config())
    for layer in range(DIMS.num_layers):
        experts = f"model.layers.{layer}.mlp.experts"
        assert probe.is_layer_excluded(experts) == (not plan[EXP.format(layer, 0, "gate")].quantized), experts
        for proj in ("q", "o"):
            prefix = f"model.layers.{layer}.self_attn.{proj}_proj"
            assert probe.is_layer_excluded(prefix) == (not plan[ATT.format(layer, proj)].quantized), prefix
    assert probe.is_layer_excluded("lm_head") and probe.is_layer_excluded("model.layers.1.mlp.gate")
