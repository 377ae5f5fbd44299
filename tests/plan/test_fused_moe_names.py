"""The SGLang wire names of a weight stream (`plan.fused_moe_names.sglang_named`): per expert, or one tensor per
FusedMoE parameter of a layer, the latter the layer stream's own buffers, equal to the per-expert reference
quantizer's tensors stacked."""

import pytest
import torch

from quads_megatron.plan import ExpertsLayer, quantize_named_params
from quads_megatron.plan.fused_moe_names import sglang_named

from test_expert_layers import E, F, _layer, _plan, _reference, _same

PRE = "model.layers.1.mlp.experts"
PARAMS = [f"{PRE}.{n}" for n in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight",
                                 "w2_weight_scale", "w2_weight_scale_2")]


def _quantized(stacked=True):
    item = _layer(1, seed=3, stacked=stacked)
    (q,) = list(quantize_named_params([item], _plan(), keep_layers=True))
    return item, q


def test_per_expert_names_unless_stacked():
    item, q = _quantized()
    got = list(sglang_named([q, ("model.norm.weight", torch.ones(4))]))
    ref = _reference(item)
    assert [n for n, _ in got] == list(ref) + ["model.norm.weight"]
    assert all(_same(t, ref[n]) for n, t in got[:-1])


def test_stacked_names_are_the_layer_buffers_and_the_reference_stacked():
    item, q = _quantized()
    got = dict(sglang_named([q], stacked=True))
    assert list(got) == PARAMS
    assert got[f"{PRE}.w13_weight"].data_ptr() == q.fc1.data.data_ptr()   # no copy of the layer's buffers
    assert got[f"{PRE}.w2_weight_scale"].data_ptr() == q.fc2.scale.data_ptr()
    ref = _reference(item)

    def r(e, proj, key):
        return ref[f"{PRE}.{e}.{proj}.{key}"]

    for e in range(E):
        for key in ("weight", "weight_scale"):
            assert _same(got[f"{PRE}.w13_{key}"][e], torch.cat([r(e, "gate_proj", key), r(e, "up_proj", key)]))
            assert _same(got[f"{PRE}.w2_{key}"][e], r(e, "down_proj", key))
        assert got[f"{PRE}.w13_weight_scale_2"][e].tolist() == [r(e, "gate_proj", "weight_scale_2").item()] * 2
        assert got[f"{PRE}.w2_weight_scale_2"][e].item() == r(e, "down_proj", "weight_scale_2").item()
    assert got[f"{PRE}.w13_weight"].shape == (E, 2 * F, item.fc1[0].shape[-1] // 2)


def test_a_layer_of_other_experts_keeps_per_expert_names():
    item = _layer(1, seed=3)
    item = ExpertsLayer(1, item.fc1[1:], item.fc2[1:], experts=[1, 2, 3])  # a shard of the experts
    (q,) = list(quantize_named_params([item], _plan(), keep_layers=True))
    names = [n for n, _ in sglang_named([q], stacked=True)]
    assert names == [n for n, _ in q.rollout_items()] and names[0].startswith(f"{PRE}.1.")


def test_bf16_layers_go_out_whole_only_when_stacked_in_memory():
    tensors = _layer(1, seed=4, stacked=True)
    got = dict(sglang_named([tensors], stacked=True))
    assert list(got) == [f"{PRE}.w13_weight", f"{PRE}.w2_weight"]
    assert got[f"{PRE}.w13_weight"] is tensors.fc1 and got[f"{PRE}.w2_weight"] is tensors.fc2
    listed = _layer(1, seed=4, stacked=False)   # separate tensors: stacking would copy, so per expert
    assert [n for n, _ in sglang_named([listed], stacked=True)] == [n for n, _ in listed.hf_items()]


def _activation(num_experts, k=16):
    g = torch.Generator().manual_seed(0)
    out = []
    for e in range(num_experts):
        for proj, k_in in (("gate_proj", 64), ("up_proj", 64), ("down_proj", 32)):
            out.append((f"{PRE}.{e}.{proj}.input_scale", torch.rand((), generator=g) + 0.1))
            out.append((f"{PRE}.{e}.{proj}.input_comp_index",
                        torch.randperm(k_in, generator=g)[:k].sort().values.to(torch.int32)))
    return out


@pytest.mark.parametrize("num_experts", [None, E])
def test_activation_tensors_are_stacked_per_layer(num_experts):
    per = dict(_activation(E))
    got = dict(sglang_named(list(per.items()) + [("lm_head.weight", torch.zeros(2))], stacked=True,
                            num_experts=num_experts))
    assert sorted(got) == sorted(["lm_head.weight"] + [f"{PRE}.{w}_{k}" for w in ("w13", "w2")
                                                       for k in ("input_scale", "input_comp_index")])
    s13, c13 = got[f"{PRE}.w13_input_scale"], got[f"{PRE}.w13_input_comp_index"]
    s2, c2 = got[f"{PRE}.w2_input_scale"], got[f"{PRE}.w2_input_comp_index"]
    assert s13.shape == (E, 2) and s2.shape == (E,) and c13.shape == (E, 2, 16) and c2.shape == (E, 16)
    for e in range(E):
        for j, proj in enumerate(("gate_proj", "up_proj")):
            assert s13[e, j] == per[f"{PRE}.{e}.{proj}.input_scale"]
            assert torch.equal(c13[e, j], per[f"{PRE}.{e}.{proj}.input_comp_index"])
        assert s2[e] == per[f"{PRE}.{e}.down_proj.input_scale"]
        assert torch.equal(c2[e], per[f"{PRE}.{e}.down_proj.input_comp_index"])


def test_an_incomplete_activation_set_keeps_per_expert_names():
    per = [nt for nt in _activation(E) if ".2.up_proj." not in nt[0]]
    got = list(sglang_named(per, stacked=True, num_experts=E))
    assert sorted(n for n, _ in got) == sorted(n for n, _ in per)
    assert list(sglang_named(per)) == per   # not stacked: as given
