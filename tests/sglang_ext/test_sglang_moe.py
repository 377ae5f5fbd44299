"""SGLang's FusedMoE built with QuadsMoEMethod: expert loading by HF names, forward, RL reload cycles.

Weights go in the way SGLang's Qwen3-MoE `load_weights` sends them: HF per-expert names mapped
by `FusedMoE.make_expert_params_mapping` and written by each parameter's weight loader.
Outputs are checked against two things the layer does not run: the kernel reference
(`kernels.reference`, bit-exact against the Triton kernels in the interpreter) and `_by_token`,
the layer's definition written out token by token from the checkpoint's per-expert tensors with
only the NVFP4 format (`quads_megatron.nvfp4`), so the torch-backend tests do not compare the
reference with itself.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fixtures import dequantized_weight, load_experts, moe_checkpoint, nvfp4_row
from quads_megatron.plan.rollout_schema import RolloutQuantConfig
from quads_megatron.kernels import reference
from quads_megatron.kernels.rac_columns import rac_weight_columns

pytest.importorskip("sglang", reason="SGLang is not installed")

E, H, F, TOPK, RAC_K = 4, 64, 32, 2, 16


@pytest.fixture(autouse=True)
def triton_kernels_on_cpu(monkeypatch):
    """Run the layers' apply through the Triton kernels (the interpreter on CPU), not the torch
    reference the ops fall back to on CPU, so the comparison below is kernel vs reference."""
    monkeypatch.setenv("QUADS_BACKEND", "triton")


def _config(mode: str, scaling: str):
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision=mode, activation_scaling=scaling,
                                     rac_channels=RAC_K if mode == "w4a4_rac" else 0))


def _expert_checkpoint(seed: int) -> dict:
    """HF-named tensors of one MoE layer (`experts.{e}.{gate,up,down}_proj.*`)."""
    return moe_checkpoint(E, H, F, RAC_K, seed)


def _load(layer, ckpt: dict) -> None:
    load_experts(layer, ckpt, E)


def _stack(ckpt: dict, key: str, projs) -> torch.Tensor:
    return torch.stack([torch.cat([ckpt[f"experts.{e}.{p}.{key}"] for p in projs]) for e in range(E)])


def _expected(x, topk_w, topk_ids, ckpt, cfg) -> torch.Tensor:
    """The kernel reference on tensors stacked straight from the checkpoint dict."""
    s = cfg.rollout
    gu = ("gate_proj", "up_proj")
    static = s.static_activation_scale
    w2_scales = torch.stack([ckpt[f"experts.{e}.down_proj.input_scale"] for e in range(E)])
    return reference.w4a4_fused_moe(
        x, _stack(ckpt, "weight", gu), _stack(ckpt, "weight_scale", gu),
        torch.stack([ckpt[f"experts.{e}.gate_proj.weight_scale_2"] for e in range(E)]),
        _stack(ckpt, "weight", ["down_proj"]), _stack(ckpt, "weight_scale", ["down_proj"]),
        torch.stack([ckpt[f"experts.{e}.down_proj.weight_scale_2"] for e in range(E)]),
        topk_w, topk_ids, act_mode=s.precision,
        w13_comp_index=ckpt["experts.0.gate_proj.input_comp_index"] if s.uses_rac else None,
        w2_comp_index=torch.stack([ckpt[f"experts.{e}.down_proj.input_comp_index"]
                                   for e in range(E)]) if s.uses_rac else None,
        w13_input_scale=ckpt["experts.0.gate_proj.input_scale"] if static else None,
        w2_input_scale=w2_scales.max() if static else None)


def _by_token(x, topk_w, topk_ids, ckpt, cfg) -> torch.Tensor:
    """sum_j w_j * down_e(SiLU(gate_e(x)) * up_e(x)) per token, from the per-expert HF tensors."""
    s = cfg.rollout
    static = s.static_activation_scale

    def weight(e, proj):
        return dequantized_weight({k: ckpt[f"experts.{e}.{proj}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")})

    def comp(e, proj):
        return ckpt[f"experts.{e}.{proj}.input_comp_index"] if s.uses_rac else None

    # gate and up read the same input with the same static scale; SGLang's fc2 takes one static
    # input scale for all experts: the largest
    w13_scale = float(ckpt["experts.0.gate_proj.input_scale"]) if static else None
    w2_scale = max(float(ckpt[f"experts.{e}.down_proj.input_scale"]) for e in range(E)) if static else None
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            v = x[t].to(torch.float32)
            gate = nvfp4_row(v, weight(e, "gate_proj"), s.precision, comp(e, "gate_proj"), w13_scale)
            up = nvfp4_row(v, weight(e, "up_proj"), s.precision, comp(e, "up_proj"), w13_scale)
            gate, up = gate.to(x.dtype).float(), up.to(x.dtype).float()  # SGLang's bf16 intermediate cache
            h = torch.nn.functional.silu(gate) * up
            if s.precision == "w4a16":
                h = h.to(x.dtype).float()
            y = nvfp4_row(h, weight(e, "down_proj"), s.precision, comp(e, "down_proj"), w2_scale)
            out[t] += (y * float(topk_w[t, j])).to(x.dtype).float()
    return out.to(x.dtype)


def _assert_matches_definition(y, x, topk, ckpt, cfg):
    """The layer's output against `_by_token`: fp32 sums in another order may move a W4A4 code of
    h by one step, so per token the relative error is bounded by a code flip (2e-2), and most
    tokens agree to bf16 rounding (here they agree exactly; leaving out RAC gives ~1e-1)."""
    want = _by_token(x, topk.topk_weights, topk.topk_ids, ckpt, cfg).float()
    err = (y.float() - want).norm(dim=-1) / want.norm(dim=-1)
    assert float(err.max()) < 2e-2 and float(err.median()) < 1e-3, err


def _build(cfg):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    return FusedMoE(num_experts=E, hidden_size=H, intermediate_size=F, layer_id=0, top_k=TOPK,
                    params_dtype=torch.bfloat16, quant_config=cfg, prefix="model.layers.0.mlp.experts")


@pytest.fixture(scope="module")
def routed():
    """Hidden states and a standard top-k routing of 6 tokens."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return x, StandardTopKOutput(w, ids.to(torch.int32), logits)


@pytest.mark.parametrize("mode,scaling", [("w4a4_rac", "per_token"), ("w4a4", "static"),
                                          ("w4a16", "per_token")])
def test_fused_moe_matches_reference(sglang_runtime, routed, mode, scaling):
    from sglang_ext.moe_method import QuadsMoEMethod

    x, topk = routed
    cfg = _config(mode, scaling)
    layer = _build(cfg)
    assert isinstance(layer.quant_method, QuadsMoEMethod)
    assert tuple(layer.w13_weight.shape) == (E, 2 * F, H // 2)
    assert tuple(layer.w13_weight_scale_2.shape) == (E, 2)
    ckpt = _expert_checkpoint(20)
    _load(layer, ckpt)
    layer.quant_method.process_weights_after_loading(layer)
    y = layer(x, topk)
    want = _expected(x, topk.topk_weights, topk.topk_ids, ckpt, cfg)
    torch.testing.assert_close(y, want, rtol=0, atol=0)   # Triton kernels == kernel reference
    _assert_matches_definition(y, x, topk, ckpt, cfg)


def test_gate_up_scale_mismatch_is_an_error(sglang_runtime):
    layer = _build(_config("w4a4_rac", "per_token"))
    ckpt = _expert_checkpoint(30)
    ckpt["experts.2.up_proj.weight_scale_2"] = ckpt["experts.2.up_proj.weight_scale_2"] * 2
    _load(layer, ckpt)
    with pytest.raises(ValueError, match=r"gate and up of experts \[2\]"):
        layer.quant_method.process_weights_after_loading(layer)


def test_missing_down_proj_comp_index_is_an_error(sglang_runtime):
    layer = _build(_config("w4a4_rac", "per_token"))
    ckpt = _expert_checkpoint(31)
    del ckpt["experts.3.down_proj.input_comp_index"]
    _load(layer, ckpt)
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj\.input_comp_index: missing"):
        layer.quant_method.process_weights_after_loading(layer)


def test_twenty_reload_cycles_keep_identity_and_outputs(sglang_runtime, monkeypatch, routed):
    """RL weight sync: SGLang's restore -> load (new weights) -> process, 20 times."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    # 20 cycles x the Triton interpreter is slow on 2 cores; the kernel-vs-reference equality
    # is checked by the apply tests above, here the torch path checks the reload plumbing: each
    # checkpoint's first load against the by-token definition, every later load bit-equal to it
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    x, topk = routed
    cfg = _config("w4a4_rac", "static")
    layer = _build(cfg)
    model = torch.nn.ModuleDict({"experts": layer})
    ckpts = [_expert_checkpoint(40), _expert_checkpoint(60)]
    _load(layer, ckpts[0])
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    ids = {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()}
    assert {"w13_global_scale", "w13_comp_index", "w13_input_global_scale", "w13_comp_weight",
            "w2_comp_weight"} <= set(ids)
    first = {0: layer(x, topk)}
    _assert_matches_definition(first[0], x, topk, ckpts[0], cfg)
    for cycle in range(20):
        v = (cycle + 1) % 2
        DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
        _load(layer, ckpts[v])
        DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
        assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
        y = layer(x, topk)
        if v not in first:
            first[v] = y
            _assert_matches_definition(y, x, topk, ckpts[v], cfg)
            assert not torch.equal(y, first[0])   # the new weights are in use
        torch.testing.assert_close(y, first[v], rtol=0, atol=0)
        # the RAC weight columns the Triton path reads follow the reloaded weights
        assert torch.equal(layer.w13_comp_weight, rac_weight_columns(
            layer.w13_weight, layer.w13_weight_scale, layer.w13_comp_index))
        assert torch.equal(layer.w2_comp_weight, rac_weight_columns(
            layer.w2_weight, layer.w2_weight_scale, layer.w2_input_comp_index))


def _bf16_update(seed: int, ckpt: dict) -> dict:
    """A BF16 weight sync of the layer: per-expert HF weights, other tensors (input scales, RAC) as NVFP4 sends them."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in ckpt.items() if not k.endswith(("weight", "weight_scale", "weight_scale_2"))}
    for e in range(E):
        for proj, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
            out[f"experts.{e}.{proj}.weight"] = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    return out


def test_bf16_weight_sync_is_quantized_on_the_server_like_the_export(sglang_runtime, monkeypatch, routed):
    """--sglang-weight-sync tensor-bf16: the layer quantizes BF16 experts at the end of the update into its
    NVFP4 parameters in place; the result equals loading the trainer's NVFP4 export of the same weights."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from quads_megatron import nvfp4

    monkeypatch.setenv("QUADS_BACKEND", "torch")
    x, topk = routed
    cfg = _config("w4a4_rac", "static")
    layer = _build(cfg)
    model = torch.nn.ModuleDict({"experts": layer})
    base = _expert_checkpoint(70)
    _load(layer, base)
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    ids = {n: p.data_ptr() for n, p in layer.named_parameters()}
    update = _bf16_update(71, base)
    exported = dict(base)  # the same weights as the trainer's exporter writes them
    for e in range(E):
        pre = f"experts.{e}"
        gate, up = nvfp4.quantize_with_shared_scale([update[f"{pre}.gate_proj.weight"], update[f"{pre}.up_proj.weight"]])
        for proj, q in (("gate_proj", gate), ("up_proj", up), ("down_proj", nvfp4.quantize(update[f"{pre}.down_proj.weight"]))):
            for key, v in q.to_modelopt().items():
                exported[f"{pre}.{proj}.{key}"] = v
    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    _load(layer, update)
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ids
    y = layer(x, topk)
    _assert_matches_definition(y, x, topk, exported, cfg)
    fresh = _build(cfg)  # the export loaded the ordinary way gives the same bits
    _load(fresh, exported)
    DefaultModelLoader.postprocess_weights(torch.nn.ModuleDict({"experts": fresh}), torch.device("cpu"))
    torch.testing.assert_close(y, fresh(x, topk), rtol=0, atol=0)
    assert torch.equal(layer.w13_weight[2, F:], exported["experts.2.up_proj.weight"])
    # an expert missing a projection, or a non-finite weight, is refused by name
    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    broken = dict(update)
    del broken["experts.1.down_proj.weight"]
    _load(layer, broken)
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight: missing from the BF16 weight update"):
        layer.quant_method.process_weights_after_loading(layer)
    broken = dict(update)
    broken["experts.3.up_proj.weight"] = broken["experts.3.up_proj.weight"].clone()
    broken["experts.3.up_proj.weight"][0, 0] = float("nan")
    _load(layer, broken)
    with pytest.raises(ValueError, match=r"experts\.3\.gate_proj\.weight: NaN or Inf"):
        layer.quant_method.process_weights_after_loading(layer)


# ---------------------------------------------------------------------- GPU: SGLang's routing op
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_sglang_align_gives_the_kernels_routing_output_gpu(sglang_runtime, tokens):
    """The forward on CUDA sorts rows with SGLang's `moe_align_block_size` (its one-launch Triton form
    up to 64 routed rows, its CUDA op above; 128 experts as Qwen3-30B-A3B): the layer's output equals
    the kernels' own routing's bit for bit (each row is computed alone, whatever its place in the
    expert's run), and both agree with the torch reference on fragment-order weights with RAC."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import moe_align_block_size

    from quads_megatron.kernels import w4a4_fused_moe
    from quads_megatron.kernels.fragment_layout import to_fragment_order
    from tests.kernels.test_w4a4_kernels import activations, comp, random_packed, rel

    e, h, f, topk = 128, 512, 256, 8
    gen = torch.Generator().manual_seed(tokens)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13, w2 = random_packed(e, 2 * f, h, "cuda", g), random_packed(e, h, f, "cuda", g)
    x = activations(tokens, h, torch.bfloat16, "cuda", gen)
    tw, ti = torch.topk(torch.randn(tokens, e, generator=gen).softmax(-1), topk)
    tw, ti = tw.cuda(), ti.int().cuda()
    c13, c2 = comp(h, RAC_K, gen).cuda(), comp(f, RAC_K, gen, e).cuda()
    kw = dict(act_mode="w4a4_rac", w13_comp_index=c13, w2_comp_index=c2, backend="triton",
              w13_comp_weight=rac_weight_columns(w13[0], w13[1], c13),
              w2_comp_weight=rac_weight_columns(w2[0], w2[1], c2))
    frag13 = (to_fragment_order(w13[0]), *w13[1:])
    frag2 = (to_fragment_order(w2[0]), *w2[1:])
    ours = w4a4_fused_moe(x, *frag13, *frag2, tw, ti, **kw, weight_layout="fragment")
    theirs = w4a4_fused_moe(x, *frag13, *frag2, tw, ti, **kw, weight_layout="fragment",
                            align_block_size=moe_align_block_size)
    assert torch.equal(theirs, ours)
    ref = reference.w4a4_fused_moe(x, *w13, *w2, tw, ti, act_mode="w4a4_rac", w13_comp_index=c13,
                                   w2_comp_index=c2)
    assert rel(theirs, ref) < 8e-3
