"""Single-process AQAT checks on the tiny Qwen3-MoE GPTModel: STE gradients, training, cache, activation mode, carve-outs, errors."""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.recipe import QuadsRecipe

VOCAB, SEQ = 256, 16
FC1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1"
FC2 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2"


@pytest.fixture(scope="module", autouse=True)
def single_process():
    from quads_megatron.megatron.parallel import initialize_distributed

    initialize_distributed(tp=1, ep=1)


def build(seed=0, **overrides):
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.presets import qwen3_moe_config

    torch.manual_seed(seed)
    return build_gpt_model(qwen3_moe_config("tiny", **overrides), VOCAB, SEQ)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(2, SEQ), torch.roll(tokens, -1, dims=1)


def loss_of(model, data):
    tokens, pos, labels = data
    return model(tokens, pos, None, labels=labels).float().mean()


def module(model, name):
    return dict(model.named_modules())[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_straight_through_gradient_equals_dequantized_weight_gradient(dtype):
    from quads_megatron.megatron.aqat import apply_quads, fake_quantized_state

    qat, ref = apply_quads(build(params_dtype=dtype)), build(params_dtype=dtype)
    fq = fake_quantized_state(qat)
    assert len(fq) == 16  # 2 layers x 4 experts x (fc1, fc2)
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, w in fq.items():
            ref_params[name].copy_(w)
    data = batch()
    loss_q, loss_r = loss_of(qat, data), loss_of(ref, data)
    assert torch.equal(loss_q, loss_r)
    loss_q.backward()
    loss_r.backward()
    for name, p in qat.named_parameters():
        assert torch.equal(p.grad, ref_params[name].grad), name
    # the master weights stayed unquantized
    w = dict(qat.named_parameters())[f"{FC1}.weight"]
    assert not torch.equal(w, fq[f"{FC1}.weight"])


def test_a_few_optimizer_steps_lower_the_loss():
    from quads_megatron.megatron.aqat import apply_quads, register_post_optimizer_hook

    model = apply_quads(build())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    register_post_optimizer_hook(opt, model)
    data, losses = batch(), []
    for _ in range(6):
        loss = loss_of(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_weight_cache_recomputes_only_when_the_master_weight_changes():
    from quads_megatron.megatron.aqat import apply_quads, post_optimizer_hook, quads_targets

    model = apply_quads(build())
    wfq = quads_targets(model)[FC1].weights["weight"]
    shared = wfq.shared  # every local expert's fc1 reads one cache, refreshed for all in one launch
    calls = []
    real = shared.refresh
    shared.refresh = lambda: calls.append(1) or real()
    data = batch()
    loss_of(model, data)
    loss_of(model, data)
    assert len(calls) == 1, "second micro-batch must reuse the cached fake-quant weight"
    w = module(model, FC1).weight
    with torch.no_grad():
        w.mul_(0.5)                       # in-place update (what torch optimizers do)
    loss_of(model, data)
    assert len(calls) == 2
    w.data.copy_(w.data * 2)              # a .data write (Megatron mixed precision) is invisible...
    loss_of(model, data)
    assert len(calls) == 2
    post_optimizer_hook(model)            # ...until the post-optimizer hook drops the cache
    loss_of(model, data)
    assert len(calls) == 3
    assert torch.equal(wfq.value(w), nvfp4.dequantize(nvfp4.quantize(w.detach()), w.dtype))
    post_optimizer_hook(model)
    with torch.inference_mode():          # rollout log-probs fill the cache...
        loss_of(model, data)
    loss_of(model, data).backward()       # ...and the training forward/backward reuses it
    assert len(calls) == 4 and w.grad is not None

    uncached = apply_quads(build(), QuadsRecipe(cache_weights=False))
    u = quads_targets(uncached)[FC1].weights["weight"]
    real_u, n = u.compute, []
    u.compute = lambda w: n.append(1) or real_u(w)
    loss_of(uncached, data)
    loss_of(uncached, data)
    assert len(n) == 2


def _gemm_inputs(model, name):
    """Spy on one expert linear: (input at the module boundary, input the GEMM received)."""
    mod, seen = module(model, name), {}
    mod.register_forward_pre_hook(lambda m, args: seen.setdefault("raw", args[0].detach().clone()))
    real = mod._forward_impl

    def spy(input, weight, *args, **kwargs):
        seen.setdefault("gemm", input.detach().clone())
        seen.setdefault("weight", weight.detach().clone())
        return real(input, weight, *args, **kwargs)

    mod._forward_impl = spy
    return seen


@pytest.mark.parametrize("mode,scaling", [("w4a16", "per_token"), ("w4a4", "per_token"),
                                          ("w4a4", "static")])
def test_train_precision(mode, scaling):
    from quads_megatron.megatron.aqat import apply_quads

    model = apply_quads(build(), QuadsRecipe(train_precision=mode, activation_scaling=scaling))
    fc1, fc2 = _gemm_inputs(model, FC1), _gemm_inputs(model, FC2)
    attn = _gemm_inputs(model, "decoder.layers.0.self_attention.linear_qkv")
    loss_of(model, batch())
    for seen in (fc1, fc2):
        assert seen["raw"].shape[0] > 0, "expert 0 received no tokens"
        if mode == "w4a16":
            assert torch.equal(seen["gemm"], seen["raw"])
        else:
            expected = nvfp4.fake_quantize(seen["raw"], per_row=scaling == "per_token")
            assert torch.equal(seen["gemm"], expected)
            assert not torch.equal(seen["gemm"], seen["raw"])
    w = module(model, FC1).weight.detach()
    assert torch.equal(fc1["weight"], nvfp4.dequantize(nvfp4.quantize(w), w.dtype))
    assert torch.equal(attn["gemm"], attn["raw"]), "attention is out of the default scope"


def test_bf16_carve_outs_keep_layers_unquantized():
    from quads_megatron.megatron.aqat import apply_quads, quads_targets

    first = quads_targets(apply_quads(build(), QuadsRecipe(bf16_first_layers=1)))
    assert first and all(n.startswith("decoder.layers.1.") for n in first)
    last = quads_targets(apply_quads(build(), QuadsRecipe(bf16_last_layers=1)))
    assert last and all(n.startswith("decoder.layers.0.") for n in last)
    # patterns name HF modules (the plan's canonical names); a fused MoE layer is carved as a whole
    model = apply_quads(build(), QuadsRecipe(bf16_patterns=["model.layers.0.mlp.experts.*"]))
    names = set(quads_targets(model))
    assert len(names) == 8 and all(n.startswith("decoder.layers.1.") for n in names)
    # a carved-out expert computes with its master weight
    seen = _gemm_inputs(model, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1")
    loss_of(model, batch())
    assert torch.equal(seen["weight"], module(
        model, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1").weight.detach())
    with pytest.raises(ValueError, match="a fused MoE layer is NVFP4 or BF16 as a whole"):
        apply_quads(build(), QuadsRecipe(bf16_patterns=["model.layers.0.mlp.experts.1.*"]))
    with pytest.raises(ValueError, match="share one global scale"):
        apply_quads(build(), QuadsRecipe(scope=["attention"], bf16_patterns=["model.layers.0.self_attn.k_proj"]))
    attn = apply_quads(build(), QuadsRecipe(scope=["attention"], bf16_patterns=["model.layers.0.self_attn.o_proj"]))
    assert sorted(quads_targets(attn)) == ["decoder.layers.0.self_attention.linear_qkv",
                                           "decoder.layers.1.self_attention.linear_proj",
                                           "decoder.layers.1.self_attention.linear_qkv"]


def test_wider_scope_and_16x16_blocks():
    from quads_megatron.megatron.aqat import apply_quads, fake_quantized_state

    model = apply_quads(build(), QuadsRecipe(scope=["routed_experts", "attention"],
                                             block_shape=[16, 16]))
    fq = fake_quantized_state(model)
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert qkv in fq and len(fq) == 20
    for name in (qkv, f"{FC2}.weight"):
        w = dict(model.named_parameters())[name].detach()
        assert torch.equal(fq[name], nvfp4.dequantize(nvfp4.quantize(w, block_shape=(16, 16)), w.dtype))
    assert torch.isfinite(loss_of(model, batch()))


def test_grouped_mlp_experts(monkeypatch):
    from quads_megatron.megatron.aqat import apply_quads, fake_quantized_state

    # GroupedMLP's activation is @jit_fuser (torch.compile): ~20 s to compile on 2 cores.
    monkeypatch.setattr(torch._dynamo.config, "disable", True)

    model = build(moe_grouped_gemm=True, params_dtype=torch.bfloat16)
    apply_quads(model)
    fq = fake_quantized_state(model)
    experts = module(model, "decoder.layers.0.mlp.experts")
    E, H = experts.num_local_experts, model.config.hidden_size
    w1 = experts.weight1.detach().view(E, H, -1)
    q1 = fq["decoder.layers.0.mlp.experts.weight1"].view(E, H, -1)
    w2 = experts.weight2.detach().view(E, -1, H)
    q2 = fq["decoder.layers.0.mlp.experts.weight2"].view(E, -1, H)
    for e in range(E):   # expert e's fc1 is w1[e].T ([2F, H]), fc2 is w2[e].T ([H, F])
        ref1 = nvfp4.dequantize(nvfp4.quantize(w1[e].t().contiguous()), torch.bfloat16)
        ref2 = nvfp4.dequantize(nvfp4.quantize(w2[e].t().contiguous()), torch.bfloat16)
        assert torch.equal(q1[e].t(), ref1) and torch.equal(q2[e].t(), ref2), e
    loss = loss_of(model, batch())
    loss.backward()
    assert torch.isfinite(loss) and experts.weight1.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="GroupedMLP computes it inside"):
        apply_quads(build(moe_grouped_gemm=True, params_dtype=torch.bfloat16),
                    QuadsRecipe(train_precision="w4a4"))


def test_bad_input_is_a_clear_error():
    from quads_megatron.megatron.aqat import apply_quads

    with pytest.raises(ValueError, match="match no weight"):
        apply_quads(build(), QuadsRecipe(bf16_patterns=["model.layers.7.*"]))
    with pytest.raises(ValueError, match="QuadsRecipe.scope: 'shared_experts' is not one of"):
        QuadsRecipe(scope=["routed_experts", "shared_experts"])
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight has K=40"):
        apply_quads(build(moe_ffn_hidden_size=40))
    with pytest.raises(ValueError, match="train_precision: 'fp8' is not one of"):
        QuadsRecipe(train_precision="fp8")
    with pytest.raises(ValueError, match="RAC is rollout-only"):
        QuadsRecipe(train_precision="w4a4_rac")
    model = apply_quads(build())
    with pytest.raises(RuntimeError, match="already converted"):
        apply_quads(model)
    with pytest.raises(RuntimeError, match="Transformer Engine NVFP4"):
        apply_quads(build(), QuadsRecipe(backend="te"))
    with pytest.raises(TypeError, match="GPTModel"):
        apply_quads(torch.nn.Linear(16, 16))


def test_refit_layer_stream_reuses_the_trainers_amax_and_the_refresh_reuses_it_back(monkeypatch):
    """One read per optimizer step after the amax pass: the sync's layer stream carries the AQAT cache's per-expert
    amax (the build skips its pass, same bytes as the per-expert stream) and the build writes the cache's fake
    quantization from the same read (the next forward refreshes nothing)."""
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.megatron.aqat import apply_quads, plan_for_model, post_optimizer_hook
    from quads_megatron.plan import ExpertsLayer, quantize_named_params

    model = apply_quads(build(params_dtype=torch.bfloat16))
    plan = plan_for_model(model, QuadsRecipe())
    calls = []
    real = nvfp4.amax_grouped
    monkeypatch.setattr(nvfp4, "amax_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    for step in range(2):
        if step:
            w = module(model, FC1).weight
            w.data.copy_(w.data * 3)           # a Megatron-style .data write ...
            post_optimizer_hook(model)         # ... announced by the post-optimizer hook
        calls.clear()
        stacked = list(iter_hf_weights(model, vocab_size=VOCAB, stacked_experts=True))
        layers = [x for x in stacked if isinstance(x, ExpertsLayer)]
        assert len(layers) == 2 and len(calls) == 4  # one amax pass per layer and projection
        for item in layers:
            for (amax, bad), mats in zip(item.amax, (item.fc1, item.fc2)):
                want = torch.stack([m.detach().abs().amax().float() for m in mats])  # independent of the kernels
                assert torch.equal(amax, want) and not bool(bad.any())
        got = dict(quantize_named_params(stacked, plan))
        expected = dict(quantize_named_params(iter_hf_weights(model, vocab_size=VOCAB), plan))
        assert got.keys() == expected.keys()
        for n, t in expected.items():
            assert torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
        assert len(calls) == 4, "the build used the carried amax, the per-expert path has no grouped amax"
        shared = quads_targets_of(model)[FC1].weights["weight"].shared
        refreshes = []
        real_refresh = shared.refresh
        shared.refresh = lambda: refreshes.append(1) or real_refresh()
        loss_of(model, batch())                # the build wrote the AQAT cache from the same read: no refresh
        assert len(calls) == 4 and refreshes == []
        for e in range(4):                     # ... and what it wrote is the per-tensor fake quantization
            name = f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1"
            w = module(model, name).weight
            fq = quads_targets_of(model)[name].weights["weight"]
            assert torch.equal(fq.value(w), nvfp4.dequantize(nvfp4.quantize(w.detach(), backend="torch"), w.dtype))
        assert refreshes == []


def quads_targets_of(model):
    from quads_megatron.megatron.aqat import quads_targets

    return quads_targets(model)
