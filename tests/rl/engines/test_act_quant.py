"""w16a4 (activation error only): BF16 expert weights, NVFP4 per-token activations at both GEMM inputs."""

import torch

from quads_megatron import nvfp4
from quads_megatron.rollout.modules import ActQuantExperts, ActQuantLinear
from quads_megatron.vocab import Precision, parse_precision


def _fq_rows(x):
    """Per-row NVFP4 quantize -> dequantize through the public nvfp4 API (the format's source of truth)."""
    return nvfp4.dequantize(nvfp4.quantize(x.float(), per_row=True), torch.float32)


def test_w16a4_is_an_activation_only_precision():
    p = parse_precision("w16a4")
    assert p is Precision.W16A4 and p.quantizes_activations and not p.quantizes_weights and not p.uses_rac


def test_act_quant_experts_match_a_dense_reference():
    torch.manual_seed(0)
    E, H, F, T, k = 4, 32, 48, 10, 2
    m = ActQuantExperts(E, H, F, Precision.W16A4, "cpu", torch.float32)
    m.gate_up_proj.copy_(torch.randn(E, 2 * F, H) * 0.1)
    m.down_proj.copy_(torch.randn(E, H, F) * 0.1)
    x = torch.randn(T, H)
    x[:, 3] *= 30  # an outlier channel: activation error is visible
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[:, 0] = 0  # expert 0 gets every token, expert E-1 may get none
    w = torch.softmax(torch.randn(T, k), -1)
    ref = torch.zeros(T, H)
    xq = _fq_rows(x)
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            gu = m.gate_up_proj[e] @ xq[t]
            h = torch.nn.functional.silu(gu[:F]) * gu[F:]
            ref[t] += w[t, s] * (m.down_proj[e] @ _fq_rows(h[None])[0])
    out = m(x, ids, w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = torch.zeros(T, H)  # and it differs from the unquantized layer: the activations were quantized
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            gu = m.gate_up_proj[e] @ x[t]
            exact[t] += w[t, s] * (m.down_proj[e] @ (torch.nn.functional.silu(gu[:F]) * gu[F:]))
    assert (out - exact).norm() > 1e-3 * exact.norm()


def test_act_quant_linear_quantizes_its_input():
    torch.manual_seed(1)
    lin = ActQuantLinear(32, 16, Precision.W16A4, "cpu", torch.float32)
    lin.weight.copy_(torch.randn(16, 32))
    x = torch.randn(5, 32)
    torch.testing.assert_close(lin(x), _fq_rows(x) @ lin.weight.t(), rtol=1e-5, atol=1e-5)
