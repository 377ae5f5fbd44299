"""The local engine on the v3 kernel weight layout (issue 25) at a size that fits it (hidden = FFN = 128).

What is independent of the wiring: the same engine built with ``kernel_layout=False`` (the v2 layout,
checked elsewhere against the reference), and ``plan.kernel_layout``'s own permutation (checked
bit-exactly in tests/plan and tests/kernels): the v3 buffers must be exactly one conversion of the
v2 engine's bytes, and the engine must sample what the v2 engine samples.
"""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.kernels.gemm import interpreting
from quads_megatron.plan import ExpertsLayer, QuantPlan
from quads_megatron.plan.kernel_layout import KERNEL_WEIGHT_LAYOUT, scales_to_kernel_layout, to_kernel_layout
from quads_megatron.recipe import QuadsRecipe
from quads_megatron.rl.engines.local import LocalEngine
from quads_megatron.rl.engines.base import SamplingParams

from tests.rl.engines.test_decode import _source_weights as decode_source_weights

H = F = 128
E = 4
PROMPTS = [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8]]
CALIB = [[1, 5, 7, 9, 11, 13], [2, 4, 6]]


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=96, hidden_size=H, intermediate_size=128, moe_intermediate_size=F,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=E, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _source_weights(seed: int = 0):
    """The trainer's per-weight sync of a seeded random model of `_config()` (test_decode's stream)."""
    return decode_source_weights(seed, _config())


def _layer_stream(named):
    """The same weights as the refit's layer stream: each layer's experts as one ExpertsLayer."""
    out, experts = [], {}
    for name, t in named:
        if ".mlp.experts." not in name:
            out.append((name, t))
            continue
        parts = name.split(".")
        experts.setdefault(int(parts[2]), {}).setdefault(int(parts[5]), {})[parts[6]] = t
    for layer, by in sorted(experts.items()):
        out.append(ExpertsLayer(layer, [torch.cat([by[i]["gate_proj"], by[i]["up_proj"]]) for i in range(E)],
                                [by[i]["down_proj"] for i in range(E)]))
    return out


def _engine(precision, kernel_layout=True, seed=0, device="cpu", dtype=torch.float32, stream=None):
    from quads_megatron.models import qwen3_moe

    cfg = _config()
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="w4a16", rollout_precision=precision,
                                         rac_channels=16 if precision == "w4a4_rac" else 0),
                             qwen3_moe.dims_from_hf_config(cfg.to_dict()))
    eng = LocalEngine(cfg, plan, max_seq_len=40, device=device, dtype=dtype, pad_token_id=0,
                      kernel_layout=kernel_layout)
    _update(eng, seed, stream)
    return eng


def _update(eng, seed, stream=None):
    named = [(k, v.to(eng.device)) for k, v in _source_weights(seed)]
    eng.update_weights(stream(named) if stream else named, measure_error=True)
    if eng.plan.rollout_precision.quantizes_activations:
        eng.calibrate(CALIB)


def _experts(eng, layer=1):
    return eng.nvfp4_modules[f"model.layers.{layer}.mlp.experts"]


def _check_one_conversion(v3, v2):
    """Every NVFP4 buffer of the v3 engine is exactly one conversion of the v2 engine's, and reads back to it."""
    for name, m3 in v3.nvfp4_modules.items():
        m2 = v2.nvfp4_modules[name]
        assert m3.weight_layout == KERNEL_WEIGHT_LAYOUT and m2.weight_layout == "modelopt", name
        if hasattr(m3, "w13"):
            pairs = [(getattr(m3, w), getattr(m2, w), m3.modelopt_codes(w), to_kernel_layout) for w in ("w13", "w2")]
            pairs += [(getattr(m3, f"{w}_scale"), getattr(m2, f"{w}_scale"), m3.modelopt_scales(w),
                       scales_to_kernel_layout) for w in ("w13", "w2")]
        else:
            pairs = [(m3.weight, m2.weight, m3.modelopt_codes(), to_kernel_layout),
                     (m3.weight_scale, m2.weight_scale, m3.modelopt_scales(), scales_to_kernel_layout)]
        for frag, modelopt, back, convert in pairs:
            assert torch.equal(frag.view(torch.uint8), convert(modelopt).view(torch.uint8)), name
            assert torch.equal(back.view(torch.uint8), modelopt.view(torch.uint8)), name
        assert m3.meter.rel == pytest.approx(m2.meter.rel, rel=1e-6)  # the meter sees ModelOpt values (sums may differ in order)


def _same_generation(a, b, params, seed=3, atol=0.0):
    outs_a, outs_b = a.generate(PROMPTS, params, seed=seed), b.generate(PROMPTS, params, seed=seed)
    assert [o.response_ids for o in outs_a] == [o.response_ids for o in outs_b]
    la = torch.tensor([lp for o in outs_a for lp in o.logprobs])
    lb = torch.tensor([lp for o in outs_b for lp in o.logprobs])
    if atol == 0.0:
        assert torch.equal(la, lb)
    else:
        torch.testing.assert_close(la, lb, rtol=0, atol=atol)
    return outs_a


def test_the_layout_is_chosen_by_shape():
    """Fitting shapes (N % 64, K % 128) take the kernel layout; the others (hidden 64) keep ModelOpt's."""
    from test_decode import _config as small_config
    from quads_megatron.models import qwen3_moe

    eng = _engine("w4a4")
    assert {m.weight_layout for m in eng.nvfp4_modules.values()} == {KERNEL_WEIGHT_LAYOUT}
    cfg = small_config()
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="w4a16", rollout_precision="w4a4"),
                             qwen3_moe.dims_from_hf_config(cfg.to_dict()))
    small = LocalEngine(cfg, plan, max_seq_len=40, device="cpu", dtype=torch.float32)
    assert {m.weight_layout for m in small.nvfp4_modules.values()} == {"modelopt"}


@pytest.mark.parametrize("precision", ["w4a4", "w4a4_rac", "w4a16"])
def test_v3_engine_samples_the_v2_engine_and_reloads_in_place(precision):
    """Torch backend (CPU default): the kernel-layout bytes are read back for the reference, so tokens and
    log-probs are bit-identical to the v2 engine's; an in-place reload keeps the storage and converts once."""
    v3, v2 = _engine(precision), _engine(precision, kernel_layout=False)
    _check_one_conversion(v3, v2)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[])
    _same_generation(v3, v2, params)
    m = _experts(v3)
    ptrs = [getattr(m, n).untyped_storage().data_ptr() for n in ("w13", "w2", "w13_scale", "w2_scale")]
    dec = v3._decoders[len(PROMPTS)]
    for seed, stream in ((1, None), (2, _layer_stream)):  # per-weight sync, then the refit's layer stream
        _update(v3, seed, stream)
        _update(v2, seed)
        assert [getattr(m, n).untyped_storage().data_ptr() for n in ("w13", "w2", "w13_scale", "w2_scale")] == ptrs
        assert v3._decoders[len(PROMPTS)] is dec
        _check_one_conversion(v3, v2)
        _same_generation(v3, v2, params, seed=seed)


def test_a_partial_load_converts_only_what_it_wrote():
    """One expert's up_proj rewritten: those rows convert, nothing else is converted a second time."""
    v3, v2 = _engine("w4a4"), _engine("w4a4", kernel_layout=False)
    m3, m2 = _experts(v3), _experts(v2)
    gen = torch.Generator().manual_seed(7)
    g, u = nvfp4.quantize_with_shared_scale([torch.randn(F, H, generator=gen), torch.randn(F, H, generator=gen)])
    d = nvfp4.quantize(torch.randn(H, F, generator=gen))
    for m in (m3, m2):
        m.load("up_proj", 2, u)
        m.load("down_proj", 1, d)
    assert torch.equal(m3.modelopt_codes("w13"), m2.w13)  # a read mid-load sees ModelOpt bytes
    assert torch.equal(m3.modelopt_scales("w2"), m2.w2_scale)
    m3.settle_load()
    m3.settle_load()  # nothing pending: a second settle converts nothing
    _check_one_conversion(v3, v2)


def test_a_model_whose_buffers_are_sent_keeps_modelopt_bytes():
    """The SGLang sync's calibration model (kernel_layout=False) hands out views of its buffers that the sync
    sends after the stream: they must be the quantizer's ModelOpt bytes (the same stream without buffers)."""
    from quads_megatron.plan import quantize_scale_groups
    from quads_megatron.plan.named_params import rollout_items
    from quads_megatron.rollout import CALIBRATION_DTYPE, RolloutModel

    eng = _engine("w4a4")
    model = RolloutModel(_config(), eng.plan, dtype=CALIBRATION_DTYPE, device="cpu", kernel_layout=False)
    named = _source_weights(4)
    held = [(n, t) for item in model.load_groups(_layer_stream(named)) for n, t in rollout_items(item)]
    want = dict((n, t) for item in quantize_scale_groups(_layer_stream(named), eng.plan) for n, t in rollout_items(item))
    assert len(held) == len(want) and any(n.endswith("experts.0.gate_proj.weight") for n, _ in held)
    for n, t in held:
        assert t.dtype == want[n].dtype and torch.equal(t.reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)), n


@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(),
                    reason="CPU kernel tests need TRITON_INTERPRET=1 and no GPU")
@pytest.mark.parametrize("precision", ["w4a4_rac"])
def test_v3_kernels_sample_the_v2_kernels_cpu(precision, monkeypatch):
    """Triton (the interpreter): after an in-place reload through the layer stream, the v3 main loop on the
    engine's converted buffers gives the v2 loop's tokens and logprobs (prefill and one decode step). One
    generation, after the reload (the suite's slowest test otherwise: ~25 s an interpreted generation); the
    first load's bytes, and every reload's, are checked in `test_v3_engine_samples_the_v2_engine_and_reloads_in_place`."""
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    v3, v2 = _engine(precision), _engine(precision, kernel_layout=False)
    _update(v3, 1, _layer_stream)
    _update(v2, 1)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, stop_token_ids=[])
    _same_generation(v3, v2, params)  # bit-identical: the v3 loop sums as the v2 loop does


def _logits_close(a, b, tol):
    """Full-forward logits of both engines on one prompt: relative error below tol (GPU tiles of the two main
    loops may sum in different orders, so greedy tokens of a random model are compared within one engine)."""
    ids = torch.tensor([PROMPTS[2]], device=a.device)
    la, lb = a.model(input_ids=ids).logits.float(), b.model(input_ids=ids).logits.float()
    assert float((la - lb).norm() / lb.norm()) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["w4a4", "w4a4_rac", "w4a16"])
def test_v3_engine_cuda_graphs_gpu(precision):
    """On CUDA (bf16, graphs): the v3 engine's buffers are one conversion of the v2 engine's, its logits the
    v2 engine's, its captured step survives an in-place layer-stream reload, and graph = eager."""
    v3 = _engine(precision, device="cuda", dtype=torch.bfloat16)
    v2 = _engine(precision, kernel_layout=False, device="cuda", dtype=torch.bfloat16)
    assert v3.uses_cuda_graph
    _check_one_conversion(v3, v2)
    _logits_close(v3, v2, 2e-2)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    v3.generate(PROMPTS, params, seed=3)
    dec = v3._decoders[len(PROMPTS)]
    ptr = _experts(v3).w13.data_ptr()
    _update(v3, 1, _layer_stream)
    _update(v2, 1, _layer_stream)
    assert v3._decoders[len(PROMPTS)] is dec and _experts(v3).w13.data_ptr() == ptr
    _check_one_conversion(v3, v2)
    _logits_close(v3, v2, 2e-2)
    graph = v3.generate(PROMPTS, params, seed=3)
    v3.uses_cuda_graph = False
    v3._decoders.clear()
    eager = v3.generate(PROMPTS, params, seed=3)
    assert [o.response_ids for o in graph] == [o.response_ids for o in eager]
    torch.testing.assert_close(torch.tensor([lp for o in graph for lp in o.logprobs]),
                               torch.tensor([lp for o in eager for lp in o.logprobs]), rtol=0, atol=1e-3)
