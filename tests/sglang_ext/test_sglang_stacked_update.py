"""Whole-layer expert updates (`sglang_ext.stacked_load`): one loader call per FusedMoE parameter.

Weights go through SGLang's own `Qwen3MoeForCausalLM.load_weights` (the routing code, run on a module
holding one FusedMoE at `model.layers.0.mlp.experts`): per-expert HF names take its expert branch, the
FusedMoE parameters' own names (`model.layers.0.mlp.experts.w13_weight`) its two-argument branch. The
reference is the per-expert update of the same checkpoint on a twin layer: every parameter and the
output must be bit-identical, the storage kept, and the v3 layout one conversion of the loaded bytes.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fixtures import moe_checkpoint
from quads_megatron.errors import CheckpointError
from quads_megatron.plan.kernel_layout import KERNEL_WEIGHT_LAYOUT, scales_to_kernel_layout, to_kernel_layout
from quads_megatron.plan.rollout_schema import RolloutQuantConfig

pytest.importorskip("sglang", reason="SGLang is not installed")

E, TOPK, RAC_K = 4, 2, 16
SIZES = {"v3": (128, 128), "v2": (64, 32)}  # (hidden, ffn): the kernel layout fits the first only
GU, DOWN = ("gate_proj", "up_proj"), ("down_proj",)
PREFIX = "model.layers.0.mlp.experts"


class _OneLayer(torch.nn.Module):
    """`model.layers.0.mlp.experts` = a FusedMoE: what `Qwen3MoeForCausalLM.load_weights` reads (config.num_experts,
    named_parameters)."""

    def __init__(self, experts, num_experts):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_experts=num_experts)
        self.model = torch.nn.Module()
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = experts
        self.model.layers = torch.nn.ModuleList([block])

    def load(self, named):
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

        Qwen3MoeForCausalLM.load_weights(self, list(named))


def _config(mode):
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision=mode, activation_scaling="static",
                                          rac_channels=RAC_K if mode == "w4a4_rac" else 0))


def _build(mode, layout):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    h, f = SIZES[layout]
    layer = FusedMoE(num_experts=E, hidden_size=h, intermediate_size=f, layer_id=0, top_k=TOPK,
                     params_dtype=torch.bfloat16, quant_config=_config(mode), prefix=PREFIX)
    assert layer.quads_weight_layout == (KERNEL_WEIGHT_LAYOUT if layout == "v3" else "modelopt")
    return layer, _OneLayer(layer, E)


def _per_expert(ckpt):
    return [(f"{PREFIX}.{k[len('experts.'):]}", v) for k, v in ckpt.items()]


def _cat(ckpt, key, projs):
    """[E, rows of projs, ...]: each expert's projections' tensors concatenated along rows (w13 = gate; up)."""
    return torch.stack([torch.cat([ckpt[f"experts.{e}.{p}.{key}"].reshape(-1, *ckpt[f"experts.{e}.{p}.{key}"].shape[1:])
                                   if ckpt[f"experts.{e}.{p}.{key}"].ndim else ckpt[f"experts.{e}.{p}.{key}"].reshape(1)
                                   for p in projs]) for e in range(E)])


def _stacked(ckpt, rac: bool):
    """The FusedMoE parameters' names, each the whole layer, stacked from the per-expert checkpoint tensors."""
    out = {f"{PREFIX}.w13_weight": _cat(ckpt, "weight", GU), f"{PREFIX}.w2_weight": _cat(ckpt, "weight", DOWN),
           f"{PREFIX}.w13_weight_scale": _cat(ckpt, "weight_scale", GU),
           f"{PREFIX}.w2_weight_scale": _cat(ckpt, "weight_scale", DOWN),
           f"{PREFIX}.w13_weight_scale_2": _cat(ckpt, "weight_scale_2", GU),            # [E, 2]
           f"{PREFIX}.w2_weight_scale_2": _cat(ckpt, "weight_scale_2", DOWN).reshape(E),
           f"{PREFIX}.w13_input_scale": _cat(ckpt, "input_scale", GU),
           f"{PREFIX}.w2_input_scale": _cat(ckpt, "input_scale", DOWN).reshape(E)}
    if rac:
        out[f"{PREFIX}.w13_input_comp_index"] = torch.stack(
            [torch.stack([ckpt[f"experts.{e}.{p}.input_comp_index"] for p in GU]) for e in range(E)])
        out[f"{PREFIX}.w2_input_comp_index"] = torch.stack([ckpt[f"experts.{e}.down_proj.input_comp_index"]
                                                            for e in range(E)])
    return out


def _process(model):
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def _update(model, named):
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    model.load(named)
    _process(model)


def _routed(h, seed=3):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, h, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
    return x, StandardTopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), logits)


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _ready(mode, layout, seed=10):
    layer, model = _build(mode, layout)
    h, f = SIZES[layout]
    model.load(_per_expert(moe_checkpoint(E, h, f, RAC_K, seed)))
    _process(model)
    return layer, model


@pytest.mark.parametrize("layout", ["v2", "v3"])
@pytest.mark.parametrize("mode", ["w4a4", "w4a4_rac"])
def test_a_stacked_update_equals_the_per_expert_update(sglang_runtime, monkeypatch, mode, layout):
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    h, f = SIZES[layout]
    new = moe_checkpoint(E, h, f, RAC_K, 11)
    (ref, ref_model), (layer, model) = _ready(mode, layout), _ready(mode, layout)
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    _update(ref_model, _per_expert(new))
    calls = []
    for p in layer.parameters():  # count the loads: one per FusedMoE parameter
        if not hasattr(p, "weight_loader"):
            continue  # derived after loading (global scales, RAC columns)
        inner = p.weight_loader
        p.weight_loader = lambda *a, _f=inner, **k: calls.append(1) or _f(*a, **k)
    stacked = _stacked(new, rac=mode == "w4a4_rac")
    _update(model, stacked.items())
    assert len(calls) == len(stacked)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs  # in place: CUDA graphs stay valid
    params = dict(ref.named_parameters())
    for n, p in layer.named_parameters():
        assert torch.equal(_bytes(p), _bytes(params[n])), n
    w13, w2 = stacked[f"{PREFIX}.w13_weight"], stacked[f"{PREFIX}.w2_weight"]
    convert = to_kernel_layout if layout == "v3" else (lambda t: t)
    assert torch.equal(layer.w13_weight, convert(w13)) and torch.equal(layer.w2_weight, convert(w2))  # converted once
    convert = scales_to_kernel_layout if layout == "v3" else (lambda t: t)
    for pname in ("w13_weight_scale", "w2_weight_scale"):
        assert torch.equal(_bytes(getattr(layer, pname)), _bytes(convert(stacked[f"{PREFIX}.{pname}"]))), pname
    x, topk = _routed(h)
    y = layer(x, topk)
    assert torch.equal(y, ref(x, topk))
    fresh, fresh_model = _build(mode, layout)
    fresh_model.load(_per_expert(new))
    _process(fresh_model)
    assert torch.equal(y, fresh(x, topk))


def test_a_stacked_bf16_update_equals_the_per_expert_one(sglang_runtime, monkeypatch):
    """--sglang-weight-sync tensor-bf16: whole-layer BF16 w13 [E, 2F, H] / w2 [E, H, F] quantize as per-expert ones."""
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    h, f = SIZES["v3"]
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * f, h, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, h, f, generator=g) * 0.05).to(torch.bfloat16)
    per_expert = [(f"{PREFIX}.{e}.{p}.weight", t) for e in range(E)
                  for p, t in (("gate_proj", w13[e, :f]), ("up_proj", w13[e, f:]), ("down_proj", w2[e]))]
    (ref, ref_model), (layer, model) = _ready("w4a4_rac", "v3"), _ready("w4a4_rac", "v3")
    _update(ref_model, per_expert)
    _update(model, [(f"{PREFIX}.w13_weight", w13), (f"{PREFIX}.w2_weight", w2)])
    params = dict(ref.named_parameters())
    for n, p in layer.named_parameters():
        assert torch.equal(_bytes(p), _bytes(params[n])), n


def test_a_wrong_stacked_tensor_is_a_named_error(sglang_runtime, monkeypatch):
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    h, f = SIZES["v2"]
    layer, model = _ready("w4a4_rac", "v2")
    good = _stacked(moe_checkpoint(E, h, f, RAC_K, 12), rac=True)
    before = layer.w13_weight.detach().clone()
    for key, bad, match in (
            ("w13_weight", good[f"{PREFIX}.w13_weight"][:E - 1],
             rf"{PREFIX}.w13_weight: expected a whole-layer uint8 .*shape \({E}, {2 * f}, {h // 2}\), got .*\({E - 1}, "),
            ("w2_weight_scale", good[f"{PREFIX}.w2_weight_scale"].float(), rf"{PREFIX}.w2_weight_scale: expected .*float8"),
            ("w13_weight_scale_2", torch.full((E, 2), float("nan")), rf"{PREFIX}.w13_weight_scale_2: .*finite and positive"),
            ("w2_input_comp_index", good[f"{PREFIX}.w2_input_comp_index"].flip(-1),
             rf"{PREFIX}.w2_input_comp_index: .*sorted ascending")):
        with pytest.raises(CheckpointError, match=match):
            model.load([(f"{PREFIX}.{key}", bad)])
    assert torch.equal(layer.w13_weight, before)  # nothing written


def test_a_layer_without_every_expert_refuses_and_keeps_the_per_expert_path(sglang_runtime, monkeypatch):
    """A rank that holds a slice of the experts (EP > 1; here the layer's EP attributes as SGLang sets them
    for rank 0 of 2) takes no whole-layer tensor; per-expert names still load."""
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    from sglang_ext.stacked_load import holds_every_expert

    h, f = SIZES["v2"]
    layer, model = _ready("w4a4", "v2")
    assert holds_every_expert(layer)
    new = moe_checkpoint(E, h, f, RAC_K, 13)
    monkeypatch.setattr(layer, "moe_ep_size", 2)
    with pytest.raises(CheckpointError, match=rf"{PREFIX}.w13_weight: a whole-layer tensor needs every expert .*EP 2"):
        model.load([(f"{PREFIX}.w13_weight", _stacked(new, rac=False)[f"{PREFIX}.w13_weight"])])
    monkeypatch.setattr(layer, "moe_ep_size", 1)
    _update(model, _per_expert(new))
    assert torch.equal(layer.w2_weight, _stacked(new, rac=False)[f"{PREFIX}.w2_weight"])
