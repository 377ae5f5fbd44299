"""The rollout layout of a plan: tensor specs and the groups sharing an input scale / RAC set, written out by hand."""

import torch

from quads_megatron.models import qwen3_moe
from quads_megatron.plan import QuantPlan, RolloutLayout
from quads_megatron.recipe import QuadsRecipe

DIMS = qwen3_moe.Dims(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      num_experts=3, moe_ffn=32, tie_word_embeddings=False)


def _layout(**recipe):
    return RolloutLayout(QuantPlan.resolve(QuadsRecipe(**recipe), DIMS))


def test_expert_and_attention_groups():
    lay = _layout(rollout_precision="w4a4_rac", rac_channels=16, scope=["routed_experts", "attention"],
                  bf16_patterns=["model.layers.1.self_attn.o_proj"])
    names = [g.name for g in lay]
    assert names == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                     "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                     "model.layers.1.self_attn.qkv_proj",
                     "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    fc1 = lay["model.layers.0.mlp.experts.gate_up_proj"]
    assert fc1.members == tuple(f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(3)
                                for p in ("gate", "up"))
    assert (fc1.in_features, fc1.per_member_rac, fc1.rac_channels, fc1.static) == (64, False, 16, False)
    fc2 = lay.group_of("model.layers.1.mlp.experts.2.down_proj.weight")
    assert fc2.per_member_rac and fc2.member_index("model.layers.1.mlp.experts.2.down_proj.weight") == 2
    assert fc2.in_features == 32
    qkv = lay.group_of("model.layers.1.self_attn.k_proj.weight")
    assert qkv.members[0] == "model.layers.1.self_attn.q_proj.weight" and len(qkv.members) == 3
    assert lay.group_of("model.layers.1.self_attn.o_proj.weight") is None   # carved out: BF16
    assert lay.plan["model.layers.0.mlp.experts.1.up_proj.weight"].scale_group == (
        "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight")


def test_tensor_specs():
    lay = _layout(rollout_precision="w4a4_rac", rac_channels=16, activation_scaling="static")
    shapes, dtypes = lay.tensor_specs(qwen3_moe.hf_shapes(DIMS))
    down = "model.layers.0.mlp.experts.1.down_proj"    # [H=64, F=32]
    assert {s: (shapes[f"{down}.{s}"], dtypes[f"{down}.{s}"]) for s in
            ("weight", "weight_scale", "weight_scale_2", "input_scale", "input_comp_index")} == {
        "weight": ((64, 16), torch.uint8), "weight_scale": ((64, 2), torch.float8_e4m3fn),
        "weight_scale_2": ((), torch.float32), "input_scale": ((), torch.float32),
        "input_comp_index": ((16,), torch.int32)}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64, 64)    # attention out of scope: as in HF
    assert "model.layers.0.self_attn.q_proj.weight" not in dtypes
    w4a16 = _layout(rollout_precision="w4a16")
    shapes, _ = w4a16.tensor_specs(qwen3_moe.hf_shapes(DIMS))
    assert not [n for n in shapes if n.endswith(("input_scale", "input_comp_index"))] and not list(w4a16)
