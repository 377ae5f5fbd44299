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
    s_enc = core.global_encode_scale(nvfp4.amax_of(x, per_row, backend="torch"))
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


@pytest.mark.parametrize("device, shape", [("cpu", (6, 80)),
                                           pytest.param("cuda", (512, 2048), marks=pytest.mark.gpu)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_public_api_triton_backend_agrees_with_torch_backend(device, shape, per_row, dtype):
    """quantize / dequantize / fake_quantize / amax_of with backend="triton" (the CPU
    interpreter on CPU) against the same calls with backend="torch"."""
    x = _data(shape, dtype, device, seed=7)
    q = nvfp4.quantize(x, per_row=per_row, backend="triton")
    q_ref = nvfp4.quantize(x, per_row=per_row, backend="torch")
    assert torch.equal(q.data, q_ref.data)
    assert torch.equal(q.scale.view(torch.uint8), q_ref.scale.view(torch.uint8))
    assert torch.equal(q.global_scale, q_ref.global_scale)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(nvfp4.dequantize(q_ref, dtype, backend="triton"),
                           nvfp4.dequantize(q_ref, dtype, backend="torch"))
    assert torch.equal(nvfp4.fake_quantize(x, per_row=per_row, backend="triton"),
                       nvfp4.dequantize(q_ref, x.dtype, backend="torch"))
    assert torch.equal(nvfp4.amax_of(x, per_row, backend="triton"),
                       nvfp4.amax_of(x, per_row, backend="torch"))


def _count_kernel_calls(monkeypatch):
    calls = []
    for name in ("quantize", "dequantize", "fake_quantize", "amax"):
        fn = getattr(triton_kernels, name)
        monkeypatch.setattr(triton_kernels, name,
                            lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    return calls


def _all_entry_points(x, **kw):
    q = nvfp4.quantize(x, **kw)
    nvfp4.dequantize(q, **kw)
    nvfp4.fake_quantize(x, **kw)
    nvfp4.amax_of(x, **kw)


def test_backend_choice_reaches_the_kernels_cpu(monkeypatch):
    """Explicit backend > QUADS_BACKEND > device rule (CPU: torch); 16x16 blocks: torch."""
    calls = _count_kernel_calls(monkeypatch)
    x = _data((4, 32), torch.float32, "cpu", seed=1)
    monkeypatch.delenv("QUADS_BACKEND", raising=False)
    _all_entry_points(x)
    assert calls == []
    _all_entry_points(x, backend="triton")
    assert calls == ["amax", "quantize", "dequantize", "amax", "fake_quantize", "amax"]
    calls.clear()
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    _all_entry_points(x)
    assert len(calls) == 6
    calls.clear()
    _all_entry_points(x, backend="torch")
    assert calls == []
    nvfp4.quantize(torch.randn(16, 32), block_shape=(16, 16))
    assert calls == []


@pytest.mark.gpu
def test_cuda_tensors_default_to_triton(monkeypatch):
    monkeypatch.delenv("QUADS_BACKEND", raising=False)
    calls = _count_kernel_calls(monkeypatch)
    _all_entry_points(_data((64, 256), torch.bfloat16, "cuda", seed=2))
    assert len(calls) == 6
    assert nvfp4.resolve_backend(torch.device("cuda")) == "triton"


def test_resolve_backend_rules_and_errors(monkeypatch):
    monkeypatch.delenv("QUADS_BACKEND", raising=False)
    assert nvfp4.resolve_backend("cpu") == "torch"
    assert nvfp4.resolve_backend(torch.zeros(1), "triton") == "triton"
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    assert nvfp4.resolve_backend("cpu") == "triton"
    assert nvfp4.resolve_backend("cpu", "torch") == "torch"
    monkeypatch.setenv("QUADS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="QUADS_BACKEND.*'cuda'"):
        nvfp4.resolve_backend("cpu")
    monkeypatch.delenv("QUADS_BACKEND")
    with pytest.raises(ValueError, match="unknown compute backend 'tirton'"):
        nvfp4.resolve_backend("cpu", "tirton")
    with pytest.raises(ValueError, match="unknown compute backend"):
        nvfp4.quantize(torch.ones(16), backend="auto")
    monkeypatch.setattr(triton_kernels, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        nvfp4.quantize(torch.ones(16), backend="triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 16), (37, 2048), (2, 3, 48)])
def test_amax_kernel_matches_torch(device, shape):
    x = _data(shape, torch.bfloat16, device, seed=11)
    assert torch.equal(triton_kernels.amax(x), nvfp4.amax_of(x, backend="torch"))
    assert torch.equal(triton_kernels.amax(x, per_row=True),
                       nvfp4.amax_of(x, per_row=True, backend="torch"))


@pytest.mark.parametrize("tile", [{"block_r": 8, "block_k": 256, "num_warps": 4},
                                  {"block_r": 16, "block_k": 64, "num_warps": 2}])
def test_other_tiles_give_the_same_bits(tile):
    x = _data((24, 512), torch.bfloat16, "cpu", seed=5)
    s_enc = core.global_encode_scale(nvfp4.amax_of(x, True, backend="torch"))
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


def test_inline_ptx_only_on_nvidia_gpus(monkeypatch):
    """The one gate of every kernel's inline PTX: never on CPU, never for the interpreter, never on ROCm."""
    assert triton_kernels.inline_ptx(torch.device("cpu")) is False
    cuda = torch.device("cuda")
    if triton_kernels.interpreting():
        assert triton_kernels.inline_ptx(cuda) is False
    monkeypatch.setattr(triton_kernels, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert triton_kernels.inline_ptx(cuda) is False
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_kernels.inline_ptx(cuda) is True
