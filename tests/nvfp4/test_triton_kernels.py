"""Triton NVFP4 kernels are bit-identical to the torch reference (CPU interpreter and GPU)."""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.nvfp4 import core, triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.available(), reason="triton not installed")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _data(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1),
                                                                   generator=g).float())
    x[..., :16] *= 1e-6  # a block with a subnormal E4M3 scale in many rows
    return x.to(dtype).to(device)


CASES = [((1, 16), torch.bfloat16), ((33, 48), torch.float32), ((7, 272), torch.float16),
         ((2, 5, 64), torch.bfloat16), ((64, 256), torch.bfloat16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, dtype", CASES)
@pytest.mark.parametrize("per_row", [False, True])
def test_quantize_dequantize_fake_quantize_match_torch(device, shape, dtype, per_row):
    x = _data(shape, dtype, device, seed=hash((shape, per_row)) % 1000)
    s_enc = core.global_encode_scale(nvfp4.amax_of(x, per_row))
    s_dec = torch.div(1.0, s_enc)
    data, scale = triton_kernels.quantize(x, s_enc, s_dec)
    ref_data, ref_scale = core.quantize_reference(x, s_enc, s_dec)
    assert torch.equal(data, ref_data)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    for out_dtype in (torch.float32, torch.bfloat16):
        got = triton_kernels.dequantize(data, scale, s_dec, out_dtype)
        assert torch.equal(got, core.dequantize_reference(ref_data, ref_scale, s_dec, out_dtype))
    fq = triton_kernels.fake_quantize(x, s_enc, s_dec)
    assert fq.dtype == x.dtype
    assert torch.equal(fq, core.dequantize_reference(ref_data, ref_scale, s_dec, x.dtype))


@pytest.mark.gpu
def test_public_api_dispatches_to_triton_on_cuda_and_agrees_with_torch(monkeypatch):
    x = _data((512, 2048), torch.bfloat16, "cuda", seed=7)
    q = nvfp4.quantize(x, per_row=True)
    monkeypatch.setenv("QUADS_NVFP4_BACKEND", "torch")
    q_ref = nvfp4.quantize(x, per_row=True)
    assert torch.equal(q.data, q_ref.data)
    assert torch.equal(q.scale.view(torch.uint8), q_ref.scale.view(torch.uint8))
    assert torch.equal(nvfp4.fake_quantize(x), nvfp4.dequantize(nvfp4.quantize(x)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 16), (37, 2048), (2, 3, 48)])
def test_amax_kernel_matches_torch(device, shape):
    x = _data(shape, torch.bfloat16, device, seed=11)
    assert torch.equal(triton_kernels.amax(x), nvfp4.amax_of(x))
    assert torch.equal(triton_kernels.amax(x, per_row=True), nvfp4.amax_of(x, per_row=True))


@pytest.mark.parametrize("tile", [{"block_r": 8, "block_k": 256, "num_warps": 4},
                                  {"block_r": 16, "block_k": 64, "num_warps": 2}])
def test_other_tiles_give_the_same_bits(tile):
    x = _data((24, 512), torch.bfloat16, "cpu", seed=5)
    s_enc = core.global_encode_scale(nvfp4.amax_of(x, True))
    s_dec = torch.div(1.0, s_enc)
    data, scale = triton_kernels.quantize(x, s_enc, s_dec, tile=tile)
    ref = core.quantize_reference(x, s_enc, s_dec)
    assert torch.equal(data, ref[0]) and torch.equal(scale.view(torch.uint8), ref[1].view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_every_e2m1_rounding_case_on_a_dense_sweep(device):
    """All multiples of 2^-10 in [-6, 6] (every tie included), 15 per block plus a 6.0 that
    pins the block scale to 1, after an anchor 2688 that pins S_enc to 1."""
    sweep = torch.arange(-6 * 1024, 6 * 1024 + 1, dtype=torch.float32) / 1024
    sweep = torch.cat([sweep, torch.zeros((-sweep.numel()) % 15)]).view(-1, 15)
    blocks = torch.cat([sweep, torch.full((sweep.shape[0], 1), 6.0)], dim=1)
    anchor = torch.zeros(blocks.shape[0], 16)
    anchor[:, 0] = 2688.0
    x = torch.cat([anchor, blocks], dim=1).to(device)
    one = torch.ones((), device=device)
    data, scale = triton_kernels.quantize(x, one, one)
    ref_data, ref_scale = core.quantize_reference(x, one, one)
    assert torch.equal(data, ref_data)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
