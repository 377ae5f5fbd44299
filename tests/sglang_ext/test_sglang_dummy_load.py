"""`--load-format dummy` with `--quantization quads`: what SGLang's DummyModelLoader does to a quads layer.

The loader fills floating parameters with uniform(-1e-3, 1e-3) (`initialize_dummy_weights`) and then calls
`process_weights_after_loading`; the quads methods then draw their own weights of that range and quantize
them. Checked against properties the fill does not compute: the dequantized weights span SGLang's dummy
range with a uniform distribution's spread, RAC channels are valid sets, the forward equals the kernel
reference on the tensors read back, merged linear shards stay one GEMM, and a later real load (an RL
update) is not overwritten.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fixtures import load_experts, moe_checkpoint
from quads_megatron import nvfp4
from quads_megatron.kernels import reference
from quads_megatron.plan.rollout_schema import RolloutQuantConfig

pytest.importorskip("sglang", reason="SGLang is not installed")

E, H, F, TOPK, RAC_K = 4, 128, 128, 2, 16  # kernel-layout shapes (N % 64, K % 128)
RANGE = 1e-3


@pytest.fixture
def dummy_format(sglang_runtime):
    """This process published as a server started with --load-format dummy; the test runtime's args after."""
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish
    from sglang.srt.server_args import ServerArgs

    def pub(**kw):
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, **kw), role="test",
                ranks=SpawnRanks(world_rank=0))

    pub(load_format="dummy")
    assert get_model().load_format == "dummy"
    yield
    pub()


def _config(mode: str, scaling: str = "per_token"):
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision=mode, activation_scaling=scaling,
                                          rac_channels=RAC_K if mode == "w4a4_rac" else 0))


def _dummy_load(layer) -> None:
    """SGLang's DummyModelLoader on one module: dummy floats, then the quant method's post-processing."""
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    initialize_dummy_weights(layer)
    layer.quant_method.process_weights_after_loading(layer)


def _weights(codes, scale, scale_2) -> torch.Tensor:
    return nvfp4.dequantize(nvfp4.NVFP4Tensor(codes, scale.view(torch.float8_e4m3fn), scale_2.reshape(()).float(),
                                              (codes.shape[0], codes.shape[1] * 2)), torch.float32)


def _assert_dummy_range(w: torch.Tensor, what: str) -> None:
    """Quantized uniform(-1e-3, 1e-3): inside the range (the max maps to E2M1's 6 exactly, E4M3 rounding of
    block scales may lift a block by < 1/16) with a uniform's spread, 1e-3 / sqrt(3)."""
    assert float(w.abs().max()) <= RANGE * (1 + 1 / 16), what
    assert abs(float(w.std()) / (RANGE / 3 ** 0.5) - 1) < 0.1, (what, float(w.std()))


def _assert_channel_set(c: torch.Tensor, k_in: int, what: str) -> None:
    assert c.dtype == torch.int32 and c.shape[-1] == RAC_K, what
    assert int(c.min()) >= 0 and int(c.max()) < k_in and bool((c[..., 1:] > c[..., :-1]).all()), (what, c)


@pytest.mark.parametrize("mode,scaling", [("w4a4_rac", "per_token"), ("w4a4", "static"), ("w4a16", "per_token")])
def test_dummy_moe_layer(dummy_format, monkeypatch, mode, scaling):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_ext.moe_method import modelopt_bytes

    monkeypatch.setenv("QUADS_BACKEND", "triton")  # the Triton kernels (interpreter) against the reference
    layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=F, layer_id=3, top_k=TOPK,
                     params_dtype=torch.bfloat16, quant_config=_config(mode, scaling),
                     prefix="model.layers.3.mlp.experts")
    assert layer.quads_weight_layout == "fragment"
    _dummy_load(layer)
    w13, w2 = modelopt_bytes(layer, "w13_weight").clone(), modelopt_bytes(layer, "w2_weight").clone()
    s13, s2 = modelopt_bytes(layer, "w13_weight_scale").clone(), modelopt_bytes(layer, "w2_weight_scale").clone()
    for e in range(E):
        _assert_dummy_range(_weights(w13[e], s13[e], layer.w13_weight_scale_2[e, 0]), f"w13[{e}]")
        _assert_dummy_range(_weights(w2[e], s2[e], layer.w2_weight_scale_2[e]), f"w2[{e}]")
    assert bool((layer.w13_weight_scale_2[:, 0] == layer.w13_weight_scale_2[:, 1]).all())
    if mode == "w4a4_rac":
        _assert_channel_set(layer.w13_comp_index, H, "w13_comp_index")
        _assert_channel_set(layer.w2_input_comp_index, F, "w2_input_comp_index")
        assert not bool((layer.w2_input_comp_index == layer.w2_input_comp_index[0]).all())  # one set per expert

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(6, E, generator=g), -1), TOPK, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    y = layer(x, StandardTopKOutput(w, ids.to(torch.int32), None))
    rac, static = mode == "w4a4_rac", scaling == "static"
    want = reference.w4a4_fused_moe(
        x, w13, s13, layer.w13_weight_scale_2[:, 0], w2, s2,
        layer.w2_weight_scale_2, w, ids, act_mode=mode, w13_comp_index=layer.w13_comp_index if rac else None,
        w2_comp_index=layer.w2_input_comp_index if rac else None,
        w13_input_scale=layer.w13_input_scale.max() if static else None,
        w2_input_scale=layer.w2_input_scale.max() if static else None)
    assert bool(torch.isfinite(y).all()) and float(want.abs().max()) > 0
    ok, stats = reference.w4a4_moe_agreement(y, want, tol=1e-30)
    assert ok, stats

    # an RL update after a dummy start: its weights are served, not drawn again
    ckpt = moe_checkpoint(E, H, F, RAC_K, seed=8)
    load_experts(layer, ckpt, E)
    layer.quant_method.process_weights_after_loading(layer)
    got = modelopt_bytes(layer, "w2_weight")
    assert torch.equal(got[1], ckpt["experts.1.down_proj.weight"])


def test_dummy_linear_merged_shards_run_as_one_gemm(dummy_format, monkeypatch):
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    from sglang_ext.linear_method import modelopt_bytes

    monkeypatch.setenv("QUADS_BACKEND", "triton")
    layer = MergedColumnParallelLinear(H, [64, 64], bias=False, params_dtype=torch.bfloat16,
                                       quant_config=_config("w4a4_rac"), prefix="model.layers.0.mlp.gate_up_proj")
    _dummy_load(layer)
    assert layer.quads_shard_rows is None  # one global scale and one RAC set for both shards: one GEMM
    codes, scales = modelopt_bytes(layer).clone(), modelopt_bytes(layer, "weight_scale").clone()
    _assert_dummy_range(_weights(codes, scales, layer.weight_scale_2[0]), "weight")
    comp = layer.input_comp_index.view(2, RAC_K)
    _assert_channel_set(comp, H, "input_comp_index")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = layer(x)[0]
    want = torch.cat([reference.w4a4_linear(x, codes[r], scales[r], layer.weight_scale_2[i],
                                            act_mode="w4a4_rac", comp_index=comp[i])
                      for i, r in enumerate((slice(0, 64), slice(64, 128)))], dim=-1)
    assert bool(torch.isfinite(y).all())
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=1e-6)


def test_real_load_is_not_replaced(sglang_runtime):
    """Without --load-format dummy a layer nothing was loaded into is still a named error."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=F, layer_id=0, top_k=TOPK,
                     params_dtype=torch.bfloat16, quant_config=_config("w4a4"), prefix="model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight, .* and 4 more: missing from the checkpoint"):
        _dummy_load(layer)
