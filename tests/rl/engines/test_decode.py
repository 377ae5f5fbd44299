"""The local engine's cached decode (StaticDecoder) scores tokens exactly as a no-cache forward of the whole sequence."""

import pytest
import torch

from quads_megatron.plan import QuantPlan
from quads_megatron.recipe import QuadsRecipe
from quads_megatron.rl.engines.base import SamplingParams
from quads_megatron.rl.engines.local import LocalEngine


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _source_weights(seed: int = 0, config=None):
    """HF-named weights of a seeded random model (default `_config()`), experts split per expert as the
    trainer's sync sends them."""
    from transformers import AutoModelForCausalLM

    config = config or _config()
    f = config.moe_intermediate_size
    torch.manual_seed(seed)
    src = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    named = []
    for name, t in src.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len(".gate_up_proj")]
            for e in range(t.shape[0]):
                named += [(f"{pre}.{e}.gate_proj.weight", t[e, :f]), (f"{pre}.{e}.up_proj.weight", t[e, f:])]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len(".down_proj")]
            named += [(f"{pre}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            named.append((name, t))
    return named


def _engine(precision, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    from quads_megatron.models import qwen3_moe

    cfg = _config()
    dims = qwen3_moe.dims_from_hf_config(cfg.to_dict())
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="w4a16", rollout_precision=precision,
                                         rac_channels=16 if precision == "w4a4_rac" else 0), dims)
    eng = LocalEngine(cfg, plan, max_seq_len=40, device=device, dtype=dtype, pad_token_id=0)
    eng.update_weights([(k, v.to(device)) for k, v in _source_weights(seed)])
    if plan.rollout_precision.quantizes_activations:
        eng.calibrate([[1, 5, 7, 9, 11, 13], [2, 4, 6]])
    return eng


@torch.no_grad()
def _rescore(eng, prompt, response, temperature):
    """log p(response | prompt) from one forward of the unpadded sequence, no cache."""
    ids = torch.tensor([prompt + response])
    logits = eng.model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("precision", ["bf16", "w4a4_rac"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_decode_matches_a_full_forward(precision, temperature):
    eng = _engine(precision)
    prompts = [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8]]  # ragged: left padding
    params = SamplingParams(temperature=temperature, max_new_tokens=12, stop_token_ids=[])
    outs = eng.generate(prompts, params, seed=3)
    for o, p in zip(outs, prompts):
        assert len(o.response_ids) == 12
        ref = _rescore(eng, p, o.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, rtol=0, atol=2e-4)
        if temperature == 0.0:
            assert all(abs(lp) < 50 for lp in o.logprobs)
    again = eng.generate(prompts, params, seed=3)  # the decoder and its cache are reused: same result
    assert [o.response_ids for o in again] == [o.response_ids for o in outs]


@pytest.mark.parametrize("precision", ["bf16", "w4a4_rac"])
def test_a_weight_update_and_recalibration_keep_the_decoder(precision):
    """Weights and RAC channels are written in place, so the engine keeps its decoder (and, on CUDA, its graph)
    across a GRPO step's sync; what it then samples is what a freshly built engine with those weights samples."""
    eng = _engine(precision)
    prompts = [[3, 14, 15, 9, 26], [5, 35]]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=[])
    eng.generate(prompts, params, seed=5)
    dec = eng._decoders[2]
    eng.update_weights(_source_weights(seed=1))
    if precision == "w4a4_rac":
        eng.calibrate([[1, 5, 7, 9, 11, 13], [2, 4, 6]])
    out = eng.generate(prompts, params, seed=5)
    assert eng._decoders[2] is dec
    fresh = _engine(precision, seed=1).generate(prompts, params, seed=5)
    assert [o.response_ids for o in out] == [o.response_ids for o in fresh]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in out]), torch.tensor([o.logprobs for o in fresh]),
                               rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "w4a4", "w4a4_rac"])
def test_cuda_graph_decode_replays_the_eager_step(precision):
    """On CUDA the captured step gives the eager step's tokens and log-probs (same kernels, same buffers)."""
    eng = _engine(precision)
    cuda = LocalEngine(eng.model.config, eng.plan, max_seq_len=40, device="cuda", dtype=torch.bfloat16, pad_token_id=0)
    assert cuda.uses_cuda_graph
    prompts = [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    src = _source_weights()
    cuda.update_weights(src)
    if cuda.plan.rollout_precision.quantizes_activations:
        cuda.calibrate([[1, 5, 7, 9, 11, 13], [2, 4, 6]])
    graph = cuda.generate(prompts, params, seed=1)
    cuda.uses_cuda_graph = False
    cuda._decoders.clear()
    eager = cuda.generate(prompts, params, seed=1)
    assert [o.response_ids for o in graph] == [o.response_ids for o in eager]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in graph]), torch.tensor([o.logprobs for o in eager]),
                               rtol=0, atol=1e-3)
    for g, e in zip(graph, eager):  # the graph's static routes buffer is refreshed by every replay
        assert torch.equal(g.routed_experts, e.routed_experts)
