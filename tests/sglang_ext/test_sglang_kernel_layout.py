"""SGLang's FusedMoE with QuadsMoEMethod on the v3 kernel weight layout (issue 25), at a size that fits it.

Independent of the wiring: the checkpoint's ModelOpt bytes, `plan.kernel_layout`'s permutation (its
own bit-exact tests) and the v2 main loop (`w4a4_fused_moe(weight_layout="modelopt")`) on the
checkpoint tensors: the layer's buffers must be exactly one conversion of the bytes loaded last,
read back to them, and compute what the v2 loop computes.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fixtures import load_experts, moe_checkpoint
from quads_megatron.kernels import w4a4_fused_moe
from quads_megatron.kernels.rac_columns import rac_weight_columns
from quads_megatron.plan.kernel_layout import KERNEL_WEIGHT_LAYOUT, scales_to_kernel_layout, to_kernel_layout
from quads_megatron.plan.rollout_schema import RolloutQuantConfig

pytest.importorskip("sglang", reason="SGLang is not installed")

E, H, F, TOPK, RAC_K = 4, 128, 128, 2, 16
GU = ("gate_proj", "up_proj")


def _config(mode="w4a4_rac", scaling="static"):
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision=mode, activation_scaling=scaling,
                                          rac_channels=RAC_K if mode == "w4a4_rac" else 0))


def _build(cfg):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    return FusedMoE(num_experts=E, hidden_size=H, intermediate_size=F, layer_id=0, top_k=TOPK,
                    params_dtype=torch.bfloat16, quant_config=cfg, prefix="model.layers.0.mlp.experts")


def _load(layer, ckpt: dict) -> None:
    load_experts(layer, ckpt, E)


def _stack(ckpt, key, projs):
    return torch.stack([torch.cat([ckpt[f"experts.{e}.{p}.{key}"] for p in projs]) for e in range(E)])


def _modelopt_tensors(ckpt):
    """(w13, w2) codes and (w13, w2) block scales, straight from the checkpoint dict."""
    return (_stack(ckpt, "weight", GU), _stack(ckpt, "weight", ["down_proj"]),
            _stack(ckpt, "weight_scale", GU), _stack(ckpt, "weight_scale", ["down_proj"]))


def _v2(x, topk, ckpt, cfg):
    """The v2 main loop (ModelOpt-order codes) on the checkpoint's tensors, as the layer ran before."""
    s = cfg.rollout
    c13 = ckpt["experts.0.gate_proj.input_comp_index"]
    c2 = torch.stack([ckpt[f"experts.{e}.down_proj.input_comp_index"] for e in range(E)])
    w13, w2, s13, s2 = _modelopt_tensors(ckpt)
    return w4a4_fused_moe(
        x, w13, s13, torch.stack([ckpt[f"experts.{e}.gate_proj.weight_scale_2"] for e in range(E)]),
        w2, s2, torch.stack([ckpt[f"experts.{e}.down_proj.weight_scale_2"] for e in range(E)]),
        topk.topk_weights, topk.topk_ids, act_mode=s.precision, w13_comp_index=c13, w2_comp_index=c2,
        w13_input_scale=ckpt["experts.0.gate_proj.input_scale"],
        w2_input_scale=torch.stack([ckpt[f"experts.{e}.down_proj.input_scale"] for e in range(E)]).max(),
        w13_comp_weight=rac_weight_columns(w13, s13, c13), w2_comp_weight=rac_weight_columns(w2, s2, c2),
        weight_layout="modelopt")


def _check_codes(layer, w13, w2, s13, s2):
    """The layer holds one conversion of the codes (w13, w2) and scales (s13, s2) and reads them back as loaded."""
    from sglang_ext.moe_method import modelopt_bytes

    assert torch.equal(layer.w13_weight, to_kernel_layout(w13))
    assert torch.equal(layer.w2_weight, to_kernel_layout(w2))
    assert torch.equal(layer.w13_weight_scale.view(torch.uint8), scales_to_kernel_layout(s13).view(torch.uint8))
    assert torch.equal(layer.w2_weight_scale.view(torch.uint8), scales_to_kernel_layout(s2).view(torch.uint8))
    for pname, want in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale", s13), ("w2_weight_scale", s2)):
        assert torch.equal(modelopt_bytes(layer, pname).view(torch.uint8), want.view(torch.uint8)), pname  # a re-send
    assert torch.equal(layer.w13_comp_weight, rac_weight_columns(w13, s13, layer.w13_comp_index))


@pytest.fixture(scope="module")
def routed():
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
    return x, StandardTopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), logits)


def _process(model):
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def _restore(model):
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))


def test_layer_runs_v3_like_v2_and_reloads_in_place(sglang_runtime, monkeypatch, routed):
    """Triton (the interpreter): the v3 layer gives the v2 loop's output; a weight update converts the new
    bytes once into the same storage and the output follows (the same as a freshly loaded layer)."""
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    x, topk = routed
    cfg = _config()
    layer = _build(cfg)
    assert layer.quads_weight_layout == KERNEL_WEIGHT_LAYOUT
    model = torch.nn.ModuleDict({"experts": layer})
    ckpts = [moe_checkpoint(E, H, F, RAC_K, s) for s in (20, 30)]
    _load(layer, ckpts[0])
    _process(model)
    _check_codes(layer, *_modelopt_tensors(ckpts[0]))
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    y0 = layer(x, topk)
    torch.testing.assert_close(y0.float(), _v2(x, topk, ckpts[0], cfg).float(), rtol=0, atol=0)  # bit-identical to the v2 loop
    _process(model)  # a process without a load converts nothing
    _check_codes(layer, *_modelopt_tensors(ckpts[0]))
    _restore(model)
    _load(layer, ckpts[1])
    _process(model)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs
    _check_codes(layer, *_modelopt_tensors(ckpts[1]))
    y1 = layer(x, topk)
    assert not torch.equal(y1, y0)
    fresh = _build(cfg)
    _load(fresh, ckpts[1])
    _process(torch.nn.ModuleDict({"experts": fresh}))
    assert torch.equal(y1, fresh(x, topk))
    torch.testing.assert_close(y1.float(), _v2(x, topk, ckpts[1], cfg).float(), rtol=0, atol=0)  # bit-identical to the v2 loop


def test_a_partial_update_converts_only_what_it_wrote(sglang_runtime, monkeypatch, routed):
    """One expert's gate codes and another's down projection re-sent: those slices convert, the rest keep
    their bytes (converting them again would scramble them)."""
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    layer = _build(_config())
    model = torch.nn.ModuleDict({"experts": layer})
    old, new = (moe_checkpoint(E, H, F, RAC_K, s) for s in (40, 41))
    _load(layer, old)
    _process(model)
    part = {"experts.2.gate_proj.weight": new["experts.2.gate_proj.weight"]}
    part.update({f"experts.1.down_proj.{k}": new[f"experts.1.down_proj.{k}"]
                 for k in ("weight", "weight_scale", "weight_scale_2")})
    _restore(model)
    _load(layer, part)
    _process(model)
    want = dict(old, **part)
    _check_codes(layer, *_modelopt_tensors(want))
    x, topk = routed
    fresh = _build(_config())
    _load(fresh, want)
    _process(torch.nn.ModuleDict({"experts": fresh}))
    assert torch.equal(layer(x, topk), fresh(x, topk))


def test_bf16_weight_sync_converts_the_server_quantized_codes_once(sglang_runtime, monkeypatch, routed):
    """--sglang-weight-sync tensor-bf16: the codes the server quantizes go into the kernel layout once."""
    from quads_megatron import nvfp4

    monkeypatch.setenv("QUADS_BACKEND", "torch")
    layer = _build(_config())
    model = torch.nn.ModuleDict({"experts": layer})
    base = moe_checkpoint(E, H, F, RAC_K, 50)
    _load(layer, base)
    _process(model)
    g = torch.Generator().manual_seed(51)
    update = {k: v for k, v in base.items() if not k.endswith(("weight", "weight_scale", "weight_scale_2"))}
    exported = dict(base)
    for e in range(E):
        pre = f"experts.{e}"
        for proj, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
            update[f"{pre}.{proj}.weight"] = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
        gate, up = nvfp4.quantize_with_shared_scale([update[f"{pre}.gate_proj.weight"], update[f"{pre}.up_proj.weight"]])
        for proj, q in (("gate_proj", gate), ("up_proj", up), ("down_proj", nvfp4.quantize(update[f"{pre}.down_proj.weight"]))):
            for key, v in q.to_modelopt().items():
                exported[f"{pre}.{proj}.{key}"] = v
    _restore(model)
    _load(layer, update)
    _process(model)
    _check_codes(layer, *_modelopt_tensors(exported))


# ---- the dense linear method (attention projections) ---------------------------------------------
def _qkv(cfg):
    """SGLang's QKVParallelLinear at K = 128: q 4 heads x 32 (128 rows), k and v 2 x 32 (64 rows each)."""
    from sglang.srt.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(H, 32, 4, 2, bias=False, params_dtype=torch.bfloat16, quant_config=cfg,
                              prefix="model.layers.0.self_attn.qkv_proj")
    return layer, [("q", 128), ("k", 64), ("v", 64)]


def _linear_shards(shards, seed):
    from sglang_fixtures import comp_index, input_scale, nvfp4_linear

    out = []
    for i, (_, n) in enumerate(shards):
        t = nvfp4_linear(n, H, seed + i)
        t.update(input_scale=input_scale(seed + i), input_comp_index=comp_index(H, RAC_K, seed + i))
        out.append(t)
    return out


def _linear_load(layer, shards, tensors, keys=None):
    for (sid, _), t in zip(shards, tensors):
        for name, v in t.items():
            if keys is None or name in keys:
                p = getattr(layer, name)
                p.weight_loader(p, v, sid)


def _v2_linear(x, tensors, cfg):
    """The v2 main loop (ModelOpt codes) per checkpoint matrix, concatenated (as the layer ran before)."""
    from quads_megatron.kernels import w4a4_linear

    static = torch.stack([t["input_scale"] for t in tensors]).max()
    return torch.cat([w4a4_linear(x, t["weight"], t["weight_scale"], t["weight_scale_2"],
                                  act_mode=cfg.rollout.precision.value, comp_index=t["input_comp_index"],
                                  input_scale=static, weight_layout="modelopt") for t in tensors], dim=-1)


def test_linear_runs_v3_like_v2_and_converts_partial_reloads_once(sglang_runtime, monkeypatch, routed):
    from sglang_ext.linear_method import modelopt_bytes

    monkeypatch.setenv("QUADS_BACKEND", "triton")
    cfg = _config()
    layer, shards = _qkv(cfg)
    assert layer.quads_weight_layout == KERNEL_WEIGHT_LAYOUT
    model = torch.nn.ModuleDict({"proj": layer})
    old, new = _linear_shards(shards, 80), _linear_shards(shards, 90)
    _linear_load(layer, shards, old)
    _process(model)
    codes = torch.cat([t["weight"] for t in old])
    assert torch.equal(layer.weight, to_kernel_layout(codes)) and torch.equal(modelopt_bytes(layer), codes)
    scales = torch.cat([t["weight_scale"] for t in old]).view(torch.uint8)
    assert torch.equal(layer.weight_scale.view(torch.uint8), scales_to_kernel_layout(scales))
    assert torch.equal(modelopt_bytes(layer, "weight_scale").view(torch.uint8), scales)
    x = routed[0][:3]
    torch.testing.assert_close(layer(x)[0].float(), _v2_linear(x, old, cfg).float(), rtol=0, atol=0)  # bit-identical to the v2 loop
    ptr = layer.weight.data_ptr()
    _restore(model)
    _linear_load(layer, shards[1:2], new[1:2], keys=("weight",))  # k's codes only: a partial update
    _process(model)
    want = [old[0], dict(old[1], weight=new[1]["weight"]), old[2]]
    codes = torch.cat([t["weight"] for t in want])
    assert layer.weight.data_ptr() == ptr
    assert torch.equal(layer.weight, to_kernel_layout(codes)) and torch.equal(modelopt_bytes(layer), codes)
    assert torch.equal(modelopt_bytes(layer, "weight_scale").view(torch.uint8), scales)  # not rewritten, not reconverted
    assert torch.equal(layer.comp_weight, torch.cat([rac_weight_columns(
        t["weight"], t["weight_scale"], t["input_comp_index"]) for t in want]))
    torch.testing.assert_close(layer(x)[0].float(), _v2_linear(x, want, cfg).float(), rtol=0, atol=0)  # bit-identical to the v2 loop
