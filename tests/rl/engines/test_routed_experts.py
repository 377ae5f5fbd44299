"""The local engine returns its routers' top-k expert ids per fed token and layer, in SGLang's layout."""

import pytest
import torch

from quads_megatron.rl.engines.base import SamplingParams

from tests.rl.engines.test_decode import _engine


@torch.no_grad()
def _reference_routes(eng, prompt, response):
    """Top-k of softmax(router logits) from one no-cache forward of the unpadded fed tokens (HF's own
    ``output_router_logits``), as [len(prompt) + len(response) - 1, L, K]."""
    fed = torch.tensor([prompt + response[:-1]], device=eng.device)
    out = eng.model(input_ids=fed, output_router_logits=True)
    k = eng.model.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(lg.float(), -1), k, -1).indices for lg in out.router_logits], 1)


@pytest.mark.parametrize("precision", ["bf16", "w4a4_rac"])
def test_routes_follow_each_fed_token(precision):
    eng = _engine(precision)
    prompts = [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8]]  # ragged: left padding
    stop = 11
    params = SamplingParams(temperature=1.0, max_new_tokens=9, stop_token_ids=[stop])
    outs = eng.generate(prompts, params, seed=7)
    L, K = eng.model.config.num_hidden_layers, eng.model.config.num_experts_per_tok
    for o, p in zip(outs, prompts):
        r = o.routed_experts
        assert r.dtype == torch.int32 and r.shape == (len(p) + len(o.response_ids) - 1, L, K)
        ref = _reference_routes(eng, p, o.response_ids)
        # a top-k set is what is replayed; order within it may differ between the two computations
        assert torch.equal(r.sort(-1).values, ref.to(torch.int32).sort(-1).values)


def test_a_one_token_response_has_the_prompt_rows_only():
    eng = _engine("bf16")
    params = SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=[])
    (o,) = eng.generate([[3, 14, 15]], params, seed=0)
    assert o.routed_experts.shape[0] == 3 and len(o.response_ids) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,dtype,min_share", [("bf16", torch.bfloat16, 0.9), ("w4a4_rac", torch.float32, 0.98)])
def test_cuda_graph_decode_records_what_eager_decode_records(precision, dtype, min_share):
    """The recorder's static buffer inside the captured decode graph is refilled on every replay: the graph
    engine returns the eager engine's tokens and routes bit for bit, and both follow each fed token's router
    (a no-cache forward; in bf16 its rounding differs from the cached decode's, so near-ties may flip)."""
    graph = _engine(precision, device="cuda", dtype=dtype)
    eager = _engine(precision, device="cuda", dtype=dtype)
    eager.uses_cuda_graph = False
    assert graph.uses_cuda_graph
    prompts = [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8]]
    params = SamplingParams(temperature=1.0, max_new_tokens=9, stop_token_ids=[11])
    for g, e, p in zip(graph.generate(prompts, params, seed=7), eager.generate(prompts, params, seed=7), prompts):
        assert g.response_ids == e.response_ids
        assert torch.equal(g.routed_experts, e.routed_experts)
        ref = _reference_routes(eager, p, e.response_ids).to(torch.int32).cpu()
        same = (g.routed_experts.sort(-1).values == ref.sort(-1).values).all(-1).float().mean().item()
        assert same >= min_share, f"{precision}: {same:.3f} of (token, layer) top-k sets follow the router"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hf_experts_outside_bf16_decode_eagerly():
    """transformers' experts in fp32 take grouped_mm's host-synchronising path, which a CUDA graph cannot
    capture: the engine decodes them eagerly instead of failing at capture."""
    eng = _engine("bf16", device="cuda", dtype=torch.float32)
    assert not eng.uses_cuda_graph
    (o,) = eng.generate([[3, 14, 15]], SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[]), seed=0)
    assert len(o.response_ids) == 4 and o.routed_experts.shape[0] == 3 + 4 - 1
