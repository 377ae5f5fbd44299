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
