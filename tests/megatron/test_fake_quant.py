"""WeightFakeQuant layouts (stacked experts, GroupedMLP) equal per-expert quads_megatron.nvfp4; CPU and, marked gpu, CUDA/Triton."""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.megatron.fake_quant import WeightFakeQuant

E, N, K = 4, 32, 64


def _ref(w):  # one expert matrix [N, K], torch reference numerics
    return nvfp4.dequantize(nvfp4.quantize(w), w.dtype)


def _check(device, monkeypatch):
    g = torch.Generator().manual_seed(0)
    stack = (torch.randn(E, N, K, generator=g) * torch.rand(E, 1, 1, generator=g)).to(device, torch.bfloat16)
    got_stack = WeightFakeQuant("stack", stack).compute(stack)
    w1 = torch.randn(K, E * N, generator=g).to(device, torch.bfloat16)     # GroupedMLP weight1
    got1 = WeightFakeQuant("weight1", w1, layout="grouped_fc1", num_experts=E).compute(w1)
    w2 = torch.randn(E * N, K, generator=g).to(device, torch.bfloat16)     # GroupedMLP weight2
    got2 = WeightFakeQuant("weight2", w2, layout="grouped_fc2", num_experts=E).compute(w2)
    monkeypatch.setenv("QUADS_BACKEND", "torch")
    for e in range(E):
        assert torch.equal(got_stack[e], _ref(stack[e])), e
        assert torch.equal(got1.view(E, K, N)[e].t(), _ref(w1.view(E, K, N)[e].t().contiguous())), e
        assert torch.equal(got2.view(E, N, K)[e].t(), _ref(w2.view(E, N, K)[e].t().contiguous())), e
    assert got1.shape == w1.shape and got2.shape == w2.shape


def test_layouts_match_per_expert_reference_cpu(monkeypatch):
    _check("cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layouts_match_per_expert_reference_cuda(monkeypatch):
    _check("cuda", monkeypatch)


def test_straight_through_and_shape_errors():
    w = torch.randn(N, K, requires_grad=True)
    q = WeightFakeQuant("w", w)
    out = q(w)
    (out * 3).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))
    with pytest.raises(ValueError, match=r"lin: per-rank reduction dim K=40 .* not a multiple of 16"):
        WeightFakeQuant("lin", torch.randn(N, 40))
    with pytest.raises(ValueError, match=r"lin: per-rank output dim N=24"):
        WeightFakeQuant("lin", torch.randn(24, K), block_shape=(16, 16))
