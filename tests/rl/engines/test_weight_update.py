"""The local engine's weight update writes each layer's expert NVFP4 buffers in place, with the exporter's numbers."""

import torch

from quads_megatron import nvfp4
from quads_megatron.plan import QuantPlan
from quads_megatron.recipe import QuadsRecipe
from quads_megatron.rl.engines.local import LocalEngine

from test_decode import _config, _source_weights  # noqa: E402 (this directory is on sys.path under pytest)


def _engine():
    from quads_megatron.models import qwen3_moe

    cfg = _config()
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="w4a16", rollout_precision="w4a16"),
                             qwen3_moe.dims_from_hf_config(cfg.to_dict()))
    return LocalEngine(cfg, plan, max_seq_len=40, device="cpu", dtype=torch.float32, pad_token_id=0)


def _expected(named, layer, expert):
    """(gate+up data, gate+up S_dec, down data) by per-tensor nvfp4.quantize (the pre-grouped path)."""
    w = dict(named)
    pre = f"model.layers.{layer}.mlp.experts.{expert}"
    gate, up, down = (w[f"{pre}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    g, u = nvfp4.quantize_with_shared_scale([gate, up], backend="torch")
    d = nvfp4.quantize(down, backend="torch")
    return torch.cat([g.data, u.data]), g.global_scale, d.data, d.global_scale


def test_update_writes_expert_buffers_in_place_and_exactly():
    eng = _engine()
    experts = eng.nvfp4_modules["model.layers.1.mlp.experts"]
    ptrs = (experts.w13.data_ptr(), experts.w2_scale.data_ptr())
    for seed in (0, 1):  # a second step's sync overwrites the same buffers
        named = _source_weights(seed)
        eng.update_weights(named, measure_error=True)
        assert (experts.w13.data_ptr(), experts.w2_scale.data_ptr()) == ptrs
        for e in range(4):
            w13, s13, w2, s2 = _expected(named, 1, e)
            assert torch.equal(experts.w13[e], w13) and torch.equal(experts.w13_scale_2[e], s13)
            assert torch.equal(experts.w2[e], w2) and torch.equal(experts.w2_scale_2[e], s2)
        assert 0.0 < experts.meter.rel < 0.2  # the error meter still sees every expert weight


def _layer_stream(named):
    """The same weights as the trainer's layer stream: each layer's experts as one ExpertsLayer ([gate; up], down)."""
    from quads_megatron.plan import ExpertsLayer

    out, experts = [], {}
    for name, t in named:
        parts = name.split(".")
        if ".mlp.experts." not in name:
            out.append((name, t))
            continue
        layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
        d = experts.setdefault(layer, {}).setdefault(e, {})
        d[proj] = t
        if len(d) == 3 and len(experts[layer]) == 4 and all(len(v) == 3 for v in experts[layer].values()):
            by = experts.pop(layer)
            out.append(ExpertsLayer(layer, [torch.cat([by[i]["gate_proj"], by[i]["up_proj"]]) for i in range(4)],
                                    [by[i]["down_proj"] for i in range(4)]))
    return out


def test_layer_stream_update_is_in_place_and_equals_per_expert_update():
    """The layer-level stream writes the same bytes into the same storage (CUDA graphs keep their buffers)."""
    eng, ref = _engine(), _engine()
    experts = eng.nvfp4_modules["model.layers.1.mlp.experts"]
    names = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")
    ptrs = [getattr(experts, n).untyped_storage().data_ptr() for n in names]
    for seed in (0, 1):
        named = _source_weights(seed)
        eng.update_weights(_layer_stream(named), measure_error=True)
        ref.update_weights(named, measure_error=True)
        assert [getattr(experts, n).untyped_storage().data_ptr() for n in names] == ptrs
        for layer in (0, 1):
            a, b = (x.nvfp4_modules[f"model.layers.{layer}.mlp.experts"] for x in (eng, ref))
            for n in names:
                assert torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).view(torch.uint8)), n
            for e in range(4):
                w13, s13, w2, s2 = _expected(named, layer, e)
                assert torch.equal(a.w13[e], w13) and torch.equal(a.w2_scale_2[e], s2)
        assert abs(experts.meter.rel - ref.nvfp4_modules["model.layers.1.mlp.experts"].meter.rel) < 1e-6
    for (n, p), (_, q) in zip(eng.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(p, q), n  # the dense weights of the mixed stream landed too


def test_layer_item_quantized_elsewhere_is_copied_into_the_buffers():
    """load_layer (quantized off the engine's buffers, e.g. another device): the same bytes, the same storage."""
    from quads_megatron.plan import quantize_experts_layer

    eng = _engine()
    named = _source_weights(2)
    eng.update_weights(named)
    m = eng.nvfp4_modules["model.layers.0.mlp.experts"]
    before = {n: getattr(m, n).clone() for n in ("w13", "w13_scale_2", "w2", "w2_scale")}
    ptr = m.w13.data_ptr()
    item = [x for x in _layer_stream(named) if not isinstance(x, tuple) and x.layer == 0][0]
    m.w13.zero_()
    m.w2_scale.zero_()
    q = quantize_experts_layer(item)
    m.load_layer(item.experts, q.fc1, q.fc2)
    assert m.w13.data_ptr() == ptr
    for n, t in before.items():
        assert torch.equal(getattr(m, n).view(torch.uint8), t.view(torch.uint8)), n
