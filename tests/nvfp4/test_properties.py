"""Hypothesis properties of NVFP4 quantization (>= 1000 examples each in CI)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quads_megatron import nvfp4

EXAMPLES = settings(max_examples=1000, deadline=None)


@st.composite
def tensors(draw, max_rows=4, max_blocks=4, normal_scales=False):
    """Random float32 / bf16 tensors with per-block magnitudes spread over many octaves.

    normal_scales keeps every block amax within 2^-8 of the tensor amax, so all block
    scales are normal E4M3 numbers (subnormal scales are not idempotent: their 1-3 bit
    precision can leave a block's largest code below 6).
    """
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    seed = draw(st.integers(0, 2**31 - 1))
    base = draw(st.integers(-30, 30))
    spread = draw(st.integers(0, 8 if normal_scales else 30))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks, 16, generator=g)
    octave = torch.randint(0, spread + 1, (rows, blocks, 1), generator=g).float()
    x = (x * torch.exp2(base - octave)).reshape(rows, blocks * 16)
    if draw(st.booleans()):
        x[0, 0] = 0.0
    return x.to(dtype)


def _codes(q):
    return torch.stack((q.data & 0xF, q.data >> 4), -1).reshape(*q.data.shape[:-1], -1)


@EXAMPLES
@given(tensors(normal_scales=True), st.booleans())
def test_requantizing_the_dequantized_tensor_is_identity(x, per_row):
    amax = nvfp4.amax_of(x, per_row)
    q = nvfp4.quantize(x, per_row=per_row, amax=amax)
    xh = nvfp4.dequantize(q, torch.float32)
    q2 = nvfp4.quantize(xh, per_row=per_row, amax=amax)
    assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))
    # codes agree except that a -0 code (a tiny negative input) decodes to -0.0 and
    # re-encodes as +0: the values are identical
    assert torch.equal(_codes(q2), torch.where(_codes(q) == 8, 0, _codes(q)))
    assert torch.equal(nvfp4.dequantize(q2, torch.float32), xh)
    assert torch.equal(q2.global_scale, q.global_scale)


@EXAMPLES
@given(tensors(), st.booleans())
def test_error_is_bounded_per_block(x, per_row):
    q = nvfp4.quantize(x, per_row=per_row)
    xh = nvfp4.dequantize(q, torch.float32).double()
    rows, k = x.shape
    xb = x.double().view(rows, k // 16, 16)
    step = (q.scale.double() * q.global_scale.double().reshape(-1, 1)).unsqueeze(-1)  # sf*S_dec
    vec_max = xb.abs().amax(-1, keepdim=True)
    # inside the grid the error is at most half a grid gap (<= 1 * step, the 4..6 gap);
    # past 6 * step (scale rounded down) the value saturates at 6 * step
    bound = torch.maximum(step, vec_max - 6 * step) * (1 + 1e-5) + 1e-45
    err = (xb - xh.view(rows, k // 16, 16)).abs()
    assert torch.all(err <= bound)


@EXAMPLES
@given(tensors(), st.booleans())
def test_sign_symmetry(x, per_row):
    q = nvfp4.quantize(x, per_row=per_row)
    qn = nvfp4.quantize(-x, per_row=per_row)
    assert torch.equal(qn.scale.view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(qn.global_scale, q.global_scale)
    assert torch.equal(nvfp4.dequantize(qn, torch.float32), -nvfp4.dequantize(q, torch.float32))


@EXAMPLES
@given(tensors(), st.integers(-40, 40), st.booleans())
def test_power_of_two_scale_invariance(x, k, per_row):
    x = x.float()
    q = nvfp4.quantize(x, per_row=per_row)
    q2 = nvfp4.quantize(x * 2.0 ** k, per_row=per_row)
    assert torch.equal(q2.data, q.data)
    assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))
    nonzero = q.global_scale != 1.0  # all-zero rows keep S_dec = 1
    assert torch.equal(q2.global_scale[nonzero], q.global_scale[nonzero] * 2.0 ** k)


@settings(max_examples=200, deadline=None)
@given(tensors(), st.booleans())
def test_fake_quantize_is_dequantize_of_quantize_with_identity_gradient(x, per_row):
    """The fused Triton fake-quantize kernel (CPU interpreter here; tests/conftest.py turns it
    on without a GPU) against the torch reference's dequantize(quantize(x)), and its STE."""
    x = x.clone().requires_grad_(True)
    y = nvfp4.fake_quantize(x, per_row=per_row, backend="triton")
    assert y.dtype == x.dtype and y.shape == x.shape
    ref = nvfp4.dequantize(nvfp4.quantize(x.detach(), per_row=per_row, backend="torch"), x.dtype,
                           backend="torch")
    assert torch.equal(y.detach(), ref)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_quantize_triton_matches_torch_gpu(per_row, dtype):
    """Full-size variant of the property above: the CUDA kernel against the torch reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 2048, generator=g) * torch.exp2(torch.randint(-20, 20, (4096, 1),
                                                                        generator=g).float())
    x = x.to(dtype).cuda().requires_grad_(True)
    y = nvfp4.fake_quantize(x, per_row=per_row, backend="triton")
    ref = nvfp4.dequantize(nvfp4.quantize(x.detach(), per_row=per_row, backend="torch"), dtype,
                           backend="torch")
    assert torch.equal(y.detach(), ref)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones_like(x))
