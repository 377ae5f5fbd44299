"""The layer-level expert stream (``ExpertsLayer``) quantizes to the same bytes as the per-expert HF stream.

Expected values come from the per-expert reference (``nvfp4.quantize_with_shared_scale`` for gate+up,
``nvfp4.quantize`` for down, torch backend), never from the grouped layer code under test.
"""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.errors import NonFiniteError
from quads_megatron.models import qwen3_moe
from quads_megatron.nvfp4 import triton_kernels
from quads_megatron.plan import ExpertsLayer, QuantizedExperts, QuantPlan, quantize_named_params, quantize_scale_groups
from quads_megatron.plan.named_params import flat_named, rollout_items
from quads_megatron.recipe import QuadsRecipe

E, H, F = 4, 64, 32
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_kernels.available(), reason="triton not installed"))]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _plan(rollout="w4a16"):
    dims = qwen3_moe.Dims(vocab_size=96, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          num_experts=E, moe_ffn=F, tie_word_embeddings=False)
    return QuantPlan.resolve(QuadsRecipe(train_precision="w4a16", rollout_precision=rollout), dims)


def _layer(layer, seed, dtype=torch.bfloat16, stacked=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-4, 4, (E, 1, 1), generator=g).float())
    fc1 = (torch.randn(E, 2 * F, H, generator=g) * scale).to(dtype)
    fc1[1, F:] *= 8  # the up half holds expert 1's amax: gate must use it too (shared scale group)
    fc2 = (torch.randn(E, H, F, generator=g) * scale).to(dtype)
    fc1, fc2 = fc1.to(device), fc2.to(device)
    return ExpertsLayer(layer, fc1 if stacked else list(fc1), fc2 if stacked else list(fc2))


def _reference(item):
    """{ModelOpt name: tensor} of the layer by the per-expert reference quantizer."""
    out = {}
    for e, w1, w2 in zip(item.experts, item.fc1, item.fc2):
        pre = f"model.layers.{item.layer}.mlp.experts.{e}"
        w1, w2 = w1.cpu(), w2.cpu()
        qs = nvfp4.quantize_with_shared_scale([w1[:F], w1[F:]], backend="torch") + [nvfp4.quantize(w2, backend="torch")]
        for proj, q in zip(("gate_proj", "up_proj", "down_proj"), qs):
            out[f"{pre}.{proj}.weight"] = q.data
            out[f"{pre}.{proj}.weight_scale"] = q.scale
            out[f"{pre}.{proj}.weight_scale_2"] = q.global_scale.reshape(())
    return out


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stacked", [False, True])
def test_layer_stream_equals_per_expert_reference(device, backend, stacked, monkeypatch):
    monkeypatch.setenv("QUADS_BACKEND", backend)
    item = _layer(1, seed=3, stacked=stacked, device=device)
    got = list(quantize_named_params([item], _plan()))
    ref = _reference(item)
    assert [n for n, _ in got] == list(ref)  # per-expert ModelOpt names, in the per-expert stream's order
    for name, t in got:
        assert _same(t.cpu(), ref[name]), name


def test_mixed_stream_keeps_order_and_dense_weights():
    plan = _plan()
    dense = ("model.layers.0.input_layernorm.weight", torch.ones(H))
    a, b = _layer(0, seed=1), _layer(1, seed=2)
    items = list(quantize_scale_groups([dense, a, ("model.norm.weight", torch.ones(H)), b], plan))
    assert items[0] == ([dense[0]], [dense[1]], None)
    assert isinstance(items[1], QuantizedExperts) and items[1].layer == 0
    assert items[2][0] == ["model.norm.weight"] and items[2][2] is None
    assert isinstance(items[3], QuantizedExperts) and items[3].layer == 1
    # quantized=False gives the layer's BF16 weights under their HF names (a BF16 sync)
    assert [n for n, _ in rollout_items(items[1], quantized=False)] == [n for n, _ in a.hf_items()]


def test_scale_groups_view_equals_reference():
    item = _layer(0, seed=5)
    (q,) = quantize_scale_groups([item], _plan())
    ref = _reference(item)
    for names, tensors, qs in q.scale_groups():
        for n, t, x in zip(names, tensors, qs):
            assert _same(x.data, ref[n]) and _same(x.scale, ref[n + "_scale"])
            assert torch.equal(x.dequantize(torch.float32), nvfp4.dequantize(nvfp4.NVFP4Tensor(
                ref[n], ref[n + "_scale"], ref[n + "_scale_2"], t.shape), torch.float32))


def test_bf16_rollout_plan_passes_the_layer_through_per_expert():
    item = _layer(0, seed=6)
    got = list(quantize_scale_groups([item], _plan(rollout="bf16")))
    assert [n for ns, _, _ in got for n in ns] == [n for n, _ in item.hf_items()]
    assert all(q is None for _, _, q in got)
    assert [n for n, _ in flat_named([item])] == [n for n, _ in item.hf_items()]


def test_nonfinite_expert_is_named_once_at_the_end():
    item = _layer(1, seed=7)
    item.fc2[2][3, 5] = float("inf")
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight"):
        list(quantize_scale_groups([item], _plan()))


def test_written_into_destination_buffers_in_place():
    item = _layer(0, seed=8)
    w13 = torch.zeros(E, 2 * F, H // 2, dtype=torch.uint8)
    s13 = torch.zeros(E, 2 * F, H // 16, dtype=torch.float8_e4m3fn)
    g13 = torch.zeros(E)
    w2 = torch.zeros(E, H, F // 2, dtype=torch.uint8)
    s2 = torch.zeros(E, H, F // 16, dtype=torch.float8_e4m3fn)
    g2 = torch.zeros(E)

    def destination(layer, role, experts):  # the per-expert groups' shapes, as NVFP4Experts.grouped_buffers
        if role == ("gate_proj", "up_proj"):
            return w13.view(2 * E, F, H // 2), s13.view(2 * E, F, H // 16), g13
        return w2, s2, g2

    (q,) = quantize_scale_groups([item], _plan(), destination=destination)
    assert q.fc1.data.data_ptr() == w13.data_ptr() and q.fc2.scale.data_ptr() == s2.data_ptr()
    ref = _reference(item)
    for e in range(E):
        pre = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(w13[e], torch.cat([ref[f"{pre}.gate_proj.weight"], ref[f"{pre}.up_proj.weight"]]))
        assert torch.equal(g13[e], ref[f"{pre}.gate_proj.weight_scale_2"])
        assert _same(s2[e], ref[f"{pre}.down_proj.weight_scale"]) and torch.equal(g2[e], ref[f"{pre}.down_proj.weight_scale_2"])
