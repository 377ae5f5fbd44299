"""Programmatic dependent launch: where it is used, and that a chain launched with it computes
what the same chain launched plainly does (in a CUDA graph, where decode runs)."""

from __future__ import annotations

import pytest
import torch

from quads_megatron.apps.study.timing import capture_graph
from quads_megatron.kernels import pdl, w4a4_fused_moe
from quads_megatron.kernels.fragment_layout import to_fragment_order, to_fragment_scale_order
from quads_megatron.kernels.rac_columns import rac_weight_columns

from tests.kernels.test_w4a4_kernels import activations, comp, random_packed

gpu = pytest.mark.gpu


def test_no_pdl_off_cuda():
    assert pdl.pdl_options(torch.device("cpu")) == {}


@gpu
def test_pdl_where_the_gpu_has_it_and_not_inside_disabled():
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability(dev)[0] >= 9
    assert pdl.pdl_options(dev) == ({"USE_PDL": True, "launch_pdl": True} if hopper else {})
    with pdl.disabled():
        assert pdl.pdl_options(dev) == {}
    assert pdl.pdl_options(dev) == ({"USE_PDL": True, "launch_pdl": True} if hopper else {})


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 64, 600])
def test_pdl_chain_in_a_graph_equals_plain_launches_gpu(tokens):
    """The MoE layer (routing, two pre-passes, fc1 with split-K at 1-2 tokens, fc2, top-k sums) replayed
    with PDL, the input refilled between replays, gives the plain launches' output bit for bit: no
    kernel reads its input before the previous one has written it."""
    e, h, f, topk = 128, 2048, 768, 8
    gen = torch.Generator().manual_seed(tokens)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13, w2 = random_packed(e, 2 * f, h, "cuda", g), random_packed(e, h, f, "cuda", g)
    c13, c2 = comp(h, 64, gen).cuda(), comp(f, 64, gen, e).cuda()
    weights = (to_fragment_order(w13[0]), to_fragment_scale_order(w13[1]), w13[2],
               to_fragment_order(w2[0]), to_fragment_scale_order(w2[1]), w2[2])
    kw = dict(act_mode="w4a4_rac", w13_comp_index=c13, w2_comp_index=c2, backend="triton",
              check_inputs=False, weight_layout="fragment",
              w13_comp_weight=rac_weight_columns(w13[0], w13[1], c13),
              w2_comp_weight=rac_weight_columns(w2[0], w2[1], c2))
    x = torch.empty(tokens, h, dtype=torch.bfloat16, device="cuda")
    tw = torch.empty(tokens, topk, device="cuda")
    ti = torch.empty(tokens, topk, dtype=torch.int32, device="cuda")

    def fill(seed):
        gs = torch.Generator().manual_seed(seed)
        x.copy_(activations(tokens, h, torch.bfloat16, "cpu", gs))
        w, i = torch.topk(torch.randn(tokens, e, generator=gs).softmax(-1), topk)
        tw.copy_(w)
        ti.copy_(i)

    fill(0)
    graph, out = capture_graph(lambda: w4a4_fused_moe(x, *weights, tw, ti, **kw))
    for seed in (1, 2, 3):
        fill(seed)
        graph.replay()
        with pdl.disabled():
            want = w4a4_fused_moe(x, *weights, tw, ti, **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, want), seed
