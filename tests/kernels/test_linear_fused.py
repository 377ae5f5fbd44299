"""The one-launch dense W4A4(+RAC) linear (`kernels/linear_fused.py`) against the two-launch path.

The two-launch path (act_quant pre-pass + GEMM + split-K sum) is itself checked against the torch
reference (tests/kernels/test_w4a4_kernels.py); under the same `GemmConfig` the fused kernel must
give the same bits: the same activation codes and scales, the same products in the same order.
CPU: Triton's interpreter (tests/conftest.py), small shapes; GPU (-m gpu): real sizes.
"""

import pytest
import torch
import triton
import triton.language as tl

from quads_megatron.kernels import reference, w4a4_linear
from quads_megatron.kernels.act_quant import quantize_activation_rac
from quads_megatron.kernels.fragment_layout import to_fragment_order
from quads_megatron.kernels.gemm import GemmConfig, interpreting, launch_gemm
from quads_megatron.kernels.linear_fused import (FUSED_MAX_M, fused_config, nvfp4_values_f16,
                                                 w4a4_linear_fused)
from quads_megatron.kernels.rac_columns import rac_weight_columns
from quads_megatron.nvfp4 import quantize
from quads_megatron.nvfp4.triton_kernels import global_scales

CUDA = torch.cuda.is_available()
cpu_kernels = pytest.mark.skipif(CUDA or not interpreting(),
                                 reason="CPU kernel tests need TRITON_INTERPRET=1 and no GPU")
gpu = pytest.mark.gpu


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _case(m, n, k_in, k, dtype, device, seed, static=False, bias=False):
    """Activation with outlier channels, a quantized random weight, sorted channels, scale, bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k_in, generator=gen) * (0.5 + torch.rand(k_in, generator=gen))
    x[:, 3] *= 30.0
    x[0, 5:21] = 0.0  # an all-zero NVFP4 block
    q = quantize(torch.randn(n, k_in, generator=gen) * 0.05)
    w = (q.data.to(device), q.scale.to(device), q.global_scale.reshape(()).to(device))
    ci = torch.sort(torch.randperm(k_in, generator=gen)[:k]).values.int().to(device) if k else None
    iscale = torch.tensor(float(x.abs().max()) / 2688 * 0.7) if static else None
    b = torch.randn(n, generator=gen).to(device) if bias else None
    return x.to(dtype).to(device), w, ci, iscale, b


def _two_launch(x, w, ci, iscale, b, config, frag=False):
    """Pre-pass + GEMM (+ split-K sum): the path the fused kernel replaces (frag: the codes in
    `fragment_layout`'s order, the v3 main loop)."""
    wd, ws, ws2 = w
    out = torch.empty(x.shape[0], wd.shape[0], dtype=x.dtype, device=x.device)
    qa = quantize_activation_rac(x, ci, iscale, fragment_order=frag)
    r = None if ci is None else (qa.r_values, qa.r_s_dec)
    cols = None if ci is None else rac_weight_columns(wd, ws, ci)[None]
    codes = to_fragment_order(wd) if frag else wd
    launch_gemm(qa.values, qa.s_dec, codes[None], ws[None], ws2.reshape(1), out, m=x.shape[0], r=r,
                comp_weight=cols, bias=None if b is None else b.float(), config=config,
                fragment_layout=frag)
    return out


def _fused(x, w, ci, iscale, b, config, amax_k=None, frag=False):
    wd, ws, ws2 = w
    out = torch.empty(x.shape[0], wd.shape[0], dtype=x.dtype, device=x.device)
    cols = None if ci is None else rac_weight_columns(wd, ws, ci)
    return w4a4_linear_fused(x, to_fragment_order(wd) if frag else wd, ws, ws2, out, comp_index=ci,
                             comp_weight=cols, input_scale=iscale,
                             bias=None if b is None else b.float(), config=config, amax_k=amax_k,
                             fragment_layout=frag)


def _check_equal(device, m, n, k_in, k, dtype, config, static=False, bias=False, amax_k=None,
                 frag=False):
    x, w, ci, iscale, b = _case(m, n, k_in, k, dtype, device, m * 31 + n + k_in + k, static, bias)
    got = _fused(x, w, ci, iscale, b, config, amax_k, frag)
    want = _two_launch(x, w, ci, iscale, b, config, frag)
    assert got.dtype == dtype and got.shape == (m, n) and torch.isfinite(got).all()
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"
    ref = reference.w4a4_linear(x.cpu(), *(t.cpu() for t in w), act_mode="w4a4_rac" if k else "w4a4",
                                comp_index=None if ci is None else ci.cpu(), input_scale=iscale,
                                bias=None if b is None else b.cpu())
    assert rel(got.cpu(), ref) < (2e-6 if dtype == torch.float32 else 4e-3)


C = GemmConfig


@cpu_kernels
@pytest.mark.parametrize("m,n,k_in,k,dtype,config,static,bias", [
    (5, 40, 272, 32, torch.float32, C(16, 16, 16, 4, 2, split_k=3), False, True),   # 17 K-steps / 3
    (1, 24, 80, 0, torch.bfloat16, C(16, 16, 32, 4, 2), False, False),              # M = 1, K % BK
    (17, 40, 64, 16, torch.bfloat16, C(16, 16, 32, 4, 2, 8, True, 2), True, True),  # swap-AB, static
    (3, 24, 96, 48, torch.float16, C(16, 16, 32, 4, 2, split_k=2), False, False),   # 2 residual steps
    (6, 24, 96, 48, torch.float32, C(16, 16, 32, 4, 2, 8, True), False, True),      # same, 1 split
    (5, 40, 256, 32, torch.bfloat16, C(16, 16, 32, 4, 2, 8, True, 2), False, True),  # bf16 amax words
])
def test_fused_equals_two_launch_cpu(m, n, k_in, k, dtype, config, static, bias):
    _check_equal("cpu", m, n, k_in, k, dtype, config, static, bias, amax_k=32)


@cpu_kernels
@pytest.mark.parametrize("m,n,k_in,k,dtype,config,bias", [
    (5, 64, 256, 32, torch.bfloat16, C(16, 64, 128, 4, 2, 8, True, 2), True),   # swap-AB, 2 splits
    (3, 128, 128, 0, torch.float32, C(16, 128, 128, 4, 2), False),              # 2 atoms per tile
])
def test_fused_fragment_layout_equals_two_launch_cpu(m, n, k_in, k, dtype, config, bias):
    """Codes in the v3 fragment order: the fused A tile is made in the fragment GEMM's K order."""
    _check_equal("cpu", m, n, k_in, k, dtype, config, bias=bias, amax_k=64, frag=True)


@triton.jit
def _values_probe(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + r * COLS + c)
    s_enc, s_dec = global_scales(tl.max(tl.abs(x), axis=1))
    tl.store(out_ptr + r * COLS + c, nvfp4_values_f16(x, s_enc, s_dec, ROWS, COLS))


def _check_values(device):
    """Every E2M1 grid point, every rounding tie and its neighbours one ulp away: the values tile
    equals act_quant's (bit for bit, signed zeros included)."""
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    pts = torch.cat([grid, torch.nextafter(grid, torch.tensor(9.0)),
                     torch.nextafter(grid, torch.tensor(-1.0)).clamp_min(0)])
    pts = torch.cat([pts, -pts, torch.tensor([-0.0, 1e-30, -1e-30])])
    row = torch.cat([pts, torch.zeros(16 * triton.cdiv(pts.numel(), 16) - pts.numel())])
    blocks = row.view(-1, 16)
    blocks[:, 0] = 6.0  # each block's amax: the ties sit on the E2M1 grid of a 448-scaled block
    rows = torch.stack([row, row * 3.7, row * 1e-3, row * 448.0 * 6.0])
    cols = triton.next_power_of_2(rows.shape[1])
    rows = torch.nn.functional.pad(rows, (0, cols - rows.shape[1])).contiguous().to(device)
    out = torch.empty(rows.shape, dtype=torch.float16, device=device)
    _values_probe[(1,)](rows, out, ROWS=rows.shape[0], COLS=cols)
    want = quantize_activation_rac(rows).values
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@cpu_kernels
def test_values_tile_equals_act_quant_cpu():
    _check_values("cpu")


@cpu_kernels
def test_split_counts_are_left_zeroed_cpu():
    """The per-tile arrival counts go back to zero, so a second launch sums again (same bits)."""
    from quads_megatron.kernels.linear_fused import _tile_counts

    cfg = C(16, 16, 16, 4, 2, split_k=4)
    x, w, ci, iscale, b = _case(4, 48, 128, 16, torch.float32, "cpu", 5)
    first = _fused(x, w, ci, iscale, b, cfg)
    assert not _tile_counts(torch.device("cpu"), 3).any()
    assert torch.equal(_fused(x, w, ci, iscale, b, cfg), first)


@cpu_kernels
def test_dispatch_by_m_cpu(monkeypatch):
    """w4a4_linear runs the fused launch up to FUSED_MAX_M rows and the pre-pass above it."""
    from quads_megatron.kernels import ops

    calls = []
    real = ops.quantize_activation_rac
    monkeypatch.setattr(ops, "quantize_activation_rac", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, ci, _, _ = _case(FUSED_MAX_M + 1, 16, 32, 16, torch.float32, "cpu", 9)
    kw = dict(act_mode="w4a4_rac", comp_index=ci, backend="triton")
    small = w4a4_linear(x[:3], *w, **kw)
    assert calls == []
    ref = reference.w4a4_linear(x[:3], *w, act_mode="w4a4_rac", comp_index=ci)
    assert rel(small, ref) < 2e-6
    w4a4_linear(x, *w, **kw)
    assert calls == [1]


def test_fused_config_tiles_and_splits():
    """<= 16 rows: the two-launch decode tile and split; above: the 8-warp 64 x 64 tile, K split for
    about one wave of one program per SM (132 SMs), never below 4 K-steps per split."""
    from quads_megatron.kernels.gemm import dense_config

    assert fused_config(16, 5120, 2048, 132) == dense_config(16, 5120, 2048, 132)
    assert fused_config(1, 2048, 4096, 132).split_k == 8
    mid = fused_config(32, 2048, 4096, 132)   # 32-row swap-AB tile: 32 tiles, split 8
    assert (mid.block_m, mid.block_n, mid.swap_ab, mid.split_k) == (32, 64, True, 8)
    big = fused_config(64, 2048, 4096, 132)   # 32 tiles: 128 programs
    assert (big.block_m, big.block_n, big.num_warps, big.split_k) == (64, 64, 8, 4)
    assert fused_config(64, 5120, 2048, 132).split_k == 2   # 80 tiles: 160 programs
    assert fused_config(64, 2048, 512, 132).split_k == 1    # 4 K-steps: no split
    assert fused_config(64, 2048, 4096, 0).split_k == 1
    frag = fused_config(16, 2048, 4096, 132, fragment_layout=True)   # 16 tiles of 128 rows
    assert (frag.block_n, frag.num_warps, frag.swap_ab, frag.split_k) == (128, 8, True, 8)
    assert fused_config(64, 2048, 4096, 132, fragment_layout=True).split_k == 4  # 2 x 16 tiles: 128


def test_topk_sum_adds_left_to_right():
    """The split-K sum (and the MoE top-k sum) adds the rows in order in fp32, as the fused kernel's
    last split does: equal to torch's sequential fp32 sum, rounded once."""
    if not (CUDA or interpreting()):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from quads_megatron.kernels.combine import topk_sum

    dev = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(6 * 5, 33, generator=gen) * torch.logspace(-6, 6, 33)
    got = topk_sum(rows.to(dev), 5).cpu()
    v = rows.view(6, 5, 33)
    want = (((v[:, 0] + v[:, 1]) + v[:, 2]) + v[:, 3]) + v[:, 4]
    assert torch.equal(got, want)
    got16 = topk_sum(rows.to(dev), 5, out=torch.empty(6, 33, dtype=torch.bfloat16, device=dev))
    assert torch.equal(got16.cpu(), want.to(torch.bfloat16))


# ---- GPU: real sizes, the default configs ------------------------------------------------------
@gpu
@pytest.mark.parametrize("m", [1, 16, 29, 64])
@pytest.mark.parametrize("n,k_in", [(5120, 2048), (2048, 4096)])
@pytest.mark.parametrize("k,bias", [(64, True), (0, False)])
def test_fused_equals_two_launch_gpu(m, n, k_in, k, bias):
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    _check_equal("cuda", m, n, k_in, k, torch.bfloat16, fused_config(m, n, k_in, num_sms), bias=bias)


@gpu
@pytest.mark.parametrize("config", [C(16, 64, 128, 4, 4, 8, True, 8), C(16, 128, 128, 8, 3, 8, True, 4),
                                    C(64, 64, 128, 4, 3, 8, False, 4), C(32, 64, 128, 4, 4, 8, True, 1)])
def test_fused_equals_two_launch_sweep_configs_gpu(config):
    """The --sweep alternatives of tools/bench_w4a4_linear.py give the same bits too (fp32 output)."""
    _check_equal("cuda", 24, 2048 + 64, 2048 + 48, 64, torch.float32, config, bias=True)
    _check_equal("cuda", 24, 1024, 2048, 64, torch.bfloat16, config, static=True)


@gpu
def test_fused_in_cuda_graph_gpu():
    """Replays of a captured fused launch (split-K counts reused across replays) give the eager bits."""
    x, w, ci, iscale, b = _case(16, 2048, 4096, 64, torch.bfloat16, "cuda", 3, bias=True)
    kw = dict(act_mode="w4a4_rac", comp_index=ci, bias=b, check_inputs=False,
              comp_weight=rac_weight_columns(w[0], w[1], ci))
    eager = w4a4_linear(x, *w, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w4a4_linear(x, *w, **kw)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w4a4_linear(x, *w, **kw)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k_in", [(5120, 2048), (2048, 4096)])
def test_fused_fragment_layout_equals_two_launch_gpu(m, n, k_in):
    """v3 fragment-order codes (inline-asm decode) at real sizes, the fused default config."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    _check_equal("cuda", m, n, k_in, 64, torch.bfloat16,
                 fused_config(m, n, k_in, num_sms, fragment_layout=True), bias=True, frag=True)
