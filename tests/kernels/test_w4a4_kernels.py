"""Triton W4A4 / W4A4+RAC / W4A16 kernels against their torch references (interpreter on CPU, real GPU with -m gpu).

The public ops are called with backend="triton" (on CPU: Triton's interpreter, turned on by
tests/conftest.py); their references with the torch code.
"""

import pytest
import torch
import triton
import triton.language as tl

from quads_megatron.nvfp4 import dequantize, quantize
from quads_megatron.nvfp4.core import dequantize_reference
from quads_megatron.nvfp4.triton_kernels import e2m1_decode, e4m3_decode
from quads_megatron.rac import quantize_compensated
from quads_megatron.kernels import reference, w4a4_fused_moe, w4a4_linear
from quads_megatron.kernels.act_quant import quantize_activation_rac
from quads_megatron.kernels.gemm import GemmConfig, decode_words_f16, interpreting
from quads_megatron.kernels.rac_columns import rac_weight_columns
from quads_megatron.kernels.routing import moe_align_block_size

CUDA = torch.cuda.is_available()
cpu_kernels = pytest.mark.skipif(CUDA or not interpreting(),
                                 reason="CPU kernel tests need TRITON_INTERPRET=1 and no GPU")
gpu = pytest.mark.gpu


FP32_TOL = {"w4a4": 2e-6, "w4a16": 2e-6, "w4a4_rac": 2e-6}
TRITON = dict(backend="triton")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def packed(shape, device, std=0.05, gen=None):
    """Random weight [.., N, K] quantized per matrix: (data, scale, scale_2)."""
    w = torch.randn(*shape, generator=gen) * std
    if w.ndim == 2:
        q = quantize(w)
        return q.data.to(device), q.scale.to(device), q.global_scale.reshape(()).to(device)
    qs = [quantize(m) for m in w]
    return (torch.stack([q.data for q in qs]).to(device),
            torch.stack([q.scale for q in qs]).to(device),
            torch.stack([q.global_scale.reshape(()) for q in qs]).to(device))


def random_packed(e, n, k_in, device, gen):
    """Random NVFP4 experts without running the quantizer (fast at full size): every code, finite e4m3
    scales in [2^-3, 2^4], one scale_2 per expert; drawn on gen's device."""
    g = gen.device
    return (torch.randint(0, 256, (e, n, k_in // 2), dtype=torch.uint8, device=g, generator=gen).to(device),
            torch.randint(0x20, 0x60, (e, n, k_in // 16), dtype=torch.uint8, device=g,
                          generator=gen).view(torch.float8_e4m3fn).to(device),
            (torch.rand(e, device=g, generator=gen) * 1e-3 + 5e-4).to(device))


def activations(m, k, dtype, device, gen, outliers=(3,), factor=30.0):
    x = torch.randn(m, k, generator=gen) * (0.5 + torch.rand(k, generator=gen))
    x[:, list(outliers)] *= factor
    return x.to(dtype).to(device)


def comp(k_total, k, gen, groups=None):
    if groups is None:
        return torch.sort(torch.randperm(k_total, generator=gen)[:k]).values.int()
    return torch.stack([torch.sort(torch.randperm(k_total, generator=gen)[:k]).values
                        for _ in range(groups)]).int()


# ---- decode and activation quantization: bit-exact -------------------------------------
@triton.jit
def _decode_probe(w_ptr, pk_ptr, s_ptr, out_ptr, ref_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    words = tl.load(w_ptr + r[:, None] * (C // 8) + tl.arange(0, C // 8)[None, :])
    sb = tl.load(s_ptr + r[:, None] * (C // 16) + tl.arange(0, C // 16)[None, :])
    fast = decode_words_f16(words.to(tl.uint32, bitcast=True), sb, R, C).to(tl.float32)
    tl.store(out_ptr + r[:, None] * C + tl.arange(0, C)[None, :], fast)
    pk = tl.load(pk_ptr + r[:, None] * (C // 2)
                 + tl.arange(0, C // 2)[None, :])
    codes = tl.reshape(tl.join(pk & 0xF, pk >> 4), (R, C))
    vals = tl.reshape(e2m1_decode(codes), (R, C // 16, 16)) * e4m3_decode(sb)[:, :, None]
    tl.store(ref_ptr + r[:, None] * C + tl.arange(0, C)[None, :],
             tl.reshape(vals, (R, C)) * 0.0078125)


def _check_decode(device):
    # every byte value (both nibbles), under every e4m3 scale exponent range
    data = torch.arange(256, dtype=torch.uint8).repeat(16).view(16, 256)
    scales = (torch.arange(512) % 127).to(torch.uint8).view(16, 32)  # every finite e4m3 >= 0
    out = torch.empty(16, 512, device=device)
    ref = torch.empty(16, 512, device=device)
    _decode_probe[(1,)](data.to(device).view(torch.int32), data.to(device), scales.to(device), out, ref, 16, 512)
    assert torch.equal(out, ref)
    q = quantize(torch.ones(16, 512))  # the lead's torch dequantize defines the order of values
    q.data, q.scale, q.global_scale = data, scales.view(torch.float8_e4m3fn), torch.tensor(2.0 ** -7)
    assert torch.equal(ref.cpu(), dequantize(q, torch.float32))


@cpu_kernels
def test_decode_words_exhaustive_cpu():
    _check_decode("cpu")


@gpu
def test_decode_words_exhaustive_gpu():
    _check_decode("cuda")


def _check_act_quant(device, dtype, static, grouped, m, k_in, k, block_m=None):
    gen = torch.Generator().manual_seed(m * 7 + k_in)
    x = activations(m, k_in, dtype, device, gen)
    groups = torch.randint(0, 3, (m,), generator=gen).to(device) if grouped else None
    ci = comp(k_in, k, gen, 3 if grouped else None).to(device)
    iscale = torch.tensor(float(x.float().abs().max()) / 2688 * 0.7) if static else None
    qa = quantize_activation_rac(x, ci, iscale, groups, block_m=block_m)
    qx, qr = quantize_compensated(x, ci, iscale, groups)
    assert torch.equal(qa.data, qx.data)
    assert torch.equal(qa.scale, qx.scale.view(torch.uint8))
    assert torch.equal(qa.s_dec, qx.global_scale.reshape(-1).expand(m).to(device))
    assert torch.equal(qa.r_data, qr.data)
    assert torch.equal(qa.r_scale, qr.scale.view(torch.uint8))
    assert torch.equal(qa.r_s_dec, qr.global_scale.reshape(-1))
    # the exact fp16 tiles the Hopper GEMM reads, plain and with the residual folded in on S
    one = torch.tensor(1.0, device=device)
    lut = lambda q: dequantize_reference(q.data, q.scale, one, torch.float32)  # noqa: E731
    v = lut(qx) * 2.0 ** -7
    assert torch.equal(qa.values.float(), v)
    assert torch.equal(qa.r_values.float(), lut(qr) * 2.0 ** -7)


@cpu_kernels
@pytest.mark.parametrize("dtype,static,grouped,m,k_in,k,block_m", [
    (torch.bfloat16, False, False, 5, 48, 16, None),    # K = 16 * 3
    (torch.float32, True, False, 3, 80, 32, None),
    (torch.bfloat16, False, True, 6, 272, 48, 4),   # per-expert sets, 4-row programs, K > 256
    (torch.float32, False, False, 2, 1040, 16, None),  # one row per program, K > 1024
])
def test_act_quant_bit_exact_cpu(dtype, static, grouped, m, k_in, k, block_m):
    _check_act_quant("cpu", dtype, static, grouped, m, k_in, k, block_m)


@gpu
@pytest.mark.parametrize("dtype,static,grouped", [(torch.bfloat16, False, False),
                                                  (torch.float32, True, False),
                                                  (torch.float32, False, False),
                                                  (torch.bfloat16, False, True)])
@pytest.mark.parametrize("m", [77, 600])  # the default block_m: 1 row per program, then 4
def test_act_quant_bit_exact_gpu(dtype, static, grouped, m):
    _check_act_quant("cuda", dtype, static, grouped, m, 2064, 64)


# ---- dense linear ----------------------------------------------------------------------
def _check_linear(device, mode, dtype, m, n, k_in, k, static=False, bias=False, tol=None):
    gen = torch.Generator().manual_seed(m + n + k_in)
    x = activations(m, k_in, dtype, device, gen)
    wd, ws, ws2 = packed((n, k_in), device, gen=gen)
    ci = comp(k_in, k, gen).to(device)
    iscale = torch.tensor(float(x.float().abs().max()) / 2688) if static else None
    b = torch.randn(n, generator=gen).to(device) if bias else None
    kw = dict(act_mode=mode, comp_index=ci, input_scale=iscale, bias=b)
    out = w4a4_linear(x, wd, ws, ws2, **kw, **TRITON)
    ref = reference.w4a4_linear(x.cpu(), wd.cpu(), ws.cpu(), ws2.cpu(), act_mode=mode,
                                comp_index=ci.cpu(), input_scale=iscale,
                                bias=None if b is None else b.cpu())
    assert out.shape == (m, n) and out.dtype == dtype and torch.isfinite(out).all()
    # fp32 outputs: fp32 accumulation level; bf16 outputs: a few bf16 roundings
    assert rel(out.cpu(), ref) < (tol or (FP32_TOL[mode] if dtype == torch.float32 else 4e-3))


@cpu_kernels
@pytest.mark.parametrize("mode,dtype,m,n,k_in,k,static,bias", [
    ("w4a4_rac", torch.float32, 5, 48, 272, 32, False, True),   # K = 16 * 17
    ("w4a4", torch.float32, 1, 32, 80, 0, False, False),        # M = 1, K = 16 * 5
    ("w4a4_rac", torch.bfloat16, 17, 40, 64, 16, True, False),  # M % 16 != 0, static scale
    ("w4a16", torch.bfloat16, 3, 24, 48, 0, False, False),
])
def test_linear_matches_reference_cpu(mode, dtype, m, n, k_in, k, static, bias):
    _check_linear("cpu", mode, dtype, m, n, k_in, k, static, bias)


@gpu
@pytest.mark.parametrize("mode,dtype,m", [("w4a4_rac", torch.float32, 1),
                                          ("w4a4_rac", torch.bfloat16, 333),
                                          ("w4a4", torch.bfloat16, 64),
                                          ("w4a16", torch.bfloat16, 200)])
def test_linear_matches_reference_gpu(mode, dtype, m):
    _check_linear("cuda", mode, dtype, m, 1536, 2048 + 48, 64, bias=True)


def _check_exact_rac_gemm(device, m, n, k_in, k):
    """RAC as k extra fp16 K-steps over the stored weight columns equals the reference at fp32 level."""
    from quads_megatron.kernels.gemm import launch_gemm

    gen = torch.Generator().manual_seed(m + k)
    x = activations(m, k_in, torch.float32, device, gen)
    wd, ws, ws2 = packed((n, k_in), device, gen=gen)
    ci = comp(k_in, k, gen).to(device)
    qa = quantize_activation_rac(x, ci)
    out = torch.empty(m, n, device=device)
    launch_gemm(qa.values, qa.s_dec, wd[None], ws[None], ws2.reshape(1), out, m=m,
                r=(qa.r_values, qa.r_s_dec), comp_weight=rac_weight_columns(wd, ws, ci)[None])
    ref = reference.w4a4_linear(x.cpu(), wd.cpu(), ws.cpu(), ws2.cpu(), act_mode="w4a4_rac",
                                comp_index=ci.cpu())
    assert rel(out.cpu(), ref) < 2e-6


@cpu_kernels
@pytest.mark.parametrize("k", [32, 48])  # 48: the last residual step is partial
def test_exact_rac_gemm_cpu(k):
    _check_exact_rac_gemm("cpu", 5, 40, 80, k)


def test_rac_weight_columns_are_the_dequantized_columns():
    """Every code and every e4m3 scale byte (subnormals included): cols * 2^7 * scale_2 == Wq[:, S]
    bit for bit, for one shared set, one set per expert, and a dense weight."""
    gen = torch.Generator().manual_seed(11)
    e, n, k_in, k = 3, 64, 4096, 64
    wd = torch.randint(0, 256, (e, n, k_in // 2), dtype=torch.uint8, generator=gen)
    ws = (torch.arange(e * n * k_in // 16) % 127).to(torch.uint8).view(e, n, k_in // 16)
    ws = ws[:, torch.randperm(n, generator=gen)].contiguous().view(torch.float8_e4m3fn)
    ws2 = torch.rand(e, generator=gen) + 0.5
    wq = reference.dequantize_weight(wd, ws, ws2)
    per = comp(k_in, k, gen, e)
    cols = rac_weight_columns(wd, ws, per)
    assert cols.dtype == torch.float16 and cols.shape == (e, n, k)
    for i in range(e):
        assert torch.equal(cols[i].float() * 128 * ws2[i], wq[i][:, per[i].long()])
    one = per[0]
    assert torch.equal(rac_weight_columns(wd, ws, one).float() * 128 * ws2[:, None, None],
                       wq[:, :, one.long()])
    assert torch.equal(rac_weight_columns(wd[1], ws[1].view(torch.uint8), one),
                       rac_weight_columns(wd, ws, one)[1])
    with pytest.raises(ValueError, match="one set per expert"):
        rac_weight_columns(wd[0], ws[0], per)


def _check_split_k(device, mode, dtype, m, n, k_in, k, config):
    """A dense GEMM with K split over programs (fp32 partials, bias and the RAC residual in split 0,
    summed once) equals the reference at the fp32-accumulation level."""
    from quads_megatron.kernels.gemm import launch_gemm

    gen = torch.Generator().manual_seed(m + n + k)
    x = activations(m, k_in, dtype, device, gen)
    wd, ws, ws2 = packed((n, k_in), device, gen=gen)
    ci = comp(k_in, k, gen).to(device) if k else None
    b = torch.randn(n, generator=gen).to(device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    w = (wd[None], ws[None], ws2.reshape(1))
    if mode == "w4a16":
        launch_gemm(x, None, *w, out, m=m, w4a16=True, bias=b, config=config)
    else:
        qa = quantize_activation_rac(x, ci)
        r = None if ci is None else (qa.r_values, qa.r_s_dec)
        cols = None if ci is None else rac_weight_columns(wd, ws, ci)[None]
        launch_gemm(qa.values, qa.s_dec, *w, out, m=m, r=r, comp_weight=cols, bias=b,
                    config=config)
    ref = reference.w4a4_linear(x.cpu(), wd.cpu(), ws.cpu(), ws2.cpu(), act_mode=mode,
                                comp_index=None if ci is None else ci.cpu(), bias=b.cpu())
    assert rel(out.cpu(), ref) < (FP32_TOL[mode] if dtype == torch.float32 else 4e-3)


@cpu_kernels
@pytest.mark.parametrize("mode,dtype,block_k,split", [
    ("w4a4_rac", torch.float32, 16, 3),   # 17 K-steps over 3 splits (6, 6, 5)
    ("w4a4_rac", torch.bfloat16, 32, 2),  # K % BLOCK_K != 0: the last split's step is masked
    ("w4a4", torch.float32, 16, 5),
    ("w4a16", torch.float32, 16, 4),
])
def test_split_k_dense_gemm_cpu(mode, dtype, block_k, split):

    _check_split_k("cpu", mode, dtype, 5, 40, 272, 32 if mode == "w4a4_rac" else 0,
                   GemmConfig(16, 16, block_k, 4, 2, split_k=split))


@gpu
@pytest.mark.parametrize("mode,dtype,m,n,k_in", [("w4a4_rac", torch.float32, 16, 2048, 4096),
                                                 ("w4a4_rac", torch.bfloat16, 64, 5120, 2048),
                                                 ("w4a16", torch.bfloat16, 16, 2048, 4096)])
def test_split_k_dense_gemm_gpu(mode, dtype, m, n, k_in):
    """The default config at decode M (`dense_config` splits K) against the reference."""
    from quads_megatron.kernels.gemm import _num_sms, dense_config

    assert dense_config(m, n, k_in, _num_sms(torch.device("cuda"))).split_k > 1
    _check_split_k("cuda", mode, dtype, m, n, k_in, 64 if mode == "w4a4_rac" else 0, None)


def test_dense_split_k_fills_the_machine():
    from quads_megatron.kernels.gemm import dense_split_k

    assert dense_split_k(32, 32, 132) == 8     # 256 programs, 4 K-steps each
    assert dense_split_k(32, 64, 132) == 8     # at most 8 (16 measured slower: partial traffic)
    assert dense_split_k(80, 16, 132) == 4     # 320 programs
    assert dense_split_k(300, 64, 132) == 1    # already >= 2 x SMs
    assert dense_split_k(10, 8, 132) == 2      # K-steps bound it: >= 4 per split


@gpu
@pytest.mark.parametrize("m", [1, 300])
def test_exact_rac_gemm_gpu(m):
    _check_exact_rac_gemm("cuda", m, 1536, 2048, 64)


def _check_swap_ab(device, mode, dtype, t, n, k_in, e, topk, k, config):
    """The swapped-operand form (C^T = W A^T, config.swap_ab) of the grouped GEMM equals the reference
    (routed rows, an expert with no rows, RAC with stored columns, partial tiles)."""
    from quads_megatron.kernels.gemm import launch_gemm

    gen = torch.Generator().manual_seed(t + n)
    x = activations(t, k_in, dtype, device, gen)
    wd, ws, ws2 = random_packed(e, n, k_in, device, gen)
    logits = torch.randn(t, e, generator=gen)
    logits[:, e - 1] = -1e4  # one expert gets no rows
    ti = torch.topk(logits, topk).indices.int().to(device)
    ci = comp(k_in, k, gen).to(device)
    m = t * topk
    out = torch.empty(m, n, dtype=dtype, device=device)
    routing = moe_align_block_size(ti, config.block_m, e)
    if mode == "w4a16":
        launch_gemm(x, None, wd, ws, ws2, out, m=m, w4a16=True, routing=routing, a_row_div=topk,
                    config=config)
    else:
        qa = quantize_activation_rac(x, ci if mode == "w4a4_rac" else None)
        rac = mode == "w4a4_rac"
        launch_gemm(qa.values, qa.s_dec, wd, ws, ws2, out, m=m, routing=routing, a_row_div=topk,
                    r=(qa.r_values, qa.r_s_dec) if rac else None,
                    comp_weight=rac_weight_columns(wd, ws, ci) if rac else None, config=config)
    ref = torch.empty(m, n, dtype=dtype, device=device)
    flat = ti.reshape(-1)
    for i in range(e):
        rows = (flat == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        ref[rows] = reference.w4a4_linear(x[rows // topk], wd[i], ws[i], ws2[i], act_mode=mode,
                                          comp_index=ci)
    assert rel(out, ref) < (FP32_TOL[mode] if dtype == torch.float32 else 4e-3)


@cpu_kernels
@pytest.mark.parametrize("mode,dtype", [("w4a4_rac", torch.float32), ("w4a16", torch.float32),
                                        ("w4a4", torch.bfloat16)])
def test_swap_ab_grouped_gemm_cpu(mode, dtype):

    _check_swap_ab("cpu", mode, dtype, 5, 64, 80, 3, 2, 32, GemmConfig(16, 64, 64, 4, 1, 8, True))


@gpu
@pytest.mark.parametrize("mode,dtype", [("w4a4_rac", torch.float32), ("w4a4_rac", torch.bfloat16),
                                        ("w4a16", torch.bfloat16)])
@pytest.mark.parametrize("cfg", [(16, 64, 128, 4, 4, 8, True), (16, 128, 128, 8, 3, 8, True),
                                 (32, 64, 128, 4, 4, 8, True)])
def test_swap_ab_grouped_gemm_gpu(mode, dtype, cfg):

    _check_swap_ab("cuda", mode, dtype, 16, 1536, 2048, 128, 8, 64, GemmConfig(*cfg))


def _check_rac_helps(device):
    gen = torch.Generator().manual_seed(5)
    m, n, k_in = 16, 64, 256
    outl = (3, 77, 140, 201)
    x = activations(m, k_in, torch.float32, device, gen, outliers=outl)
    wd, ws, ws2 = packed((n, k_in), device, gen=gen)
    wq = reference.dequantize_weight(wd.cpu(), ws.cpu(), ws2.cpu())
    y_bf16 = (x.cpu().to(torch.bfloat16).float() @ wq.t())
    # calibrated set: the outlier channels' blocks carry the error
    from quads_megatron.rac import ActivationStats, calibrate_comp_channels, weight_column_norm_sq

    stats = ActivationStats(k_in)
    stats.update(x.cpu())
    ci = calibrate_comp_channels(stats, weight_column_norm_sq(wq), 32).to(device)
    e_naive = rel(w4a4_linear(x, wd, ws, ws2, act_mode="w4a4", **TRITON).cpu(), y_bf16)
    e_rac = rel(w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac", comp_index=ci,
                            **TRITON).cpu(), y_bf16)
    assert e_rac < 0.8 * e_naive, (e_rac, e_naive)


@cpu_kernels
def test_rac_lowers_error_against_bf16_cpu():
    _check_rac_helps("cpu")


@gpu
def test_rac_lowers_error_against_bf16_gpu():
    _check_rac_helps("cuda")


# ---- fused MoE -------------------------------------------------------------------------
def _check_moe(device, mode, dtype, t, h, f, e, topk, per_expert, tol=None, prebuilt=False, configs=None):
    gen = torch.Generator().manual_seed(t + h + e)
    x = activations(t, h, dtype, device, gen)
    w13 = packed((e, 2 * f, h), device, gen=gen)
    w2 = packed((e, h, f), device, gen=gen)
    logits = torch.randn(t, e, generator=gen)
    logits[:, e - 1] = -1e4  # one expert gets no tokens
    tw, ti = torch.topk(logits.softmax(-1), topk)
    tw, ti = tw.to(device), ti.int().to(device)
    c13 = comp(h, 16, gen).to(device)
    c2 = comp(f, 16, gen, e if per_expert else None).to(device)
    kw = dict(act_mode=mode, w13_comp_index=c13, w2_comp_index=c2)
    if prebuilt:  # the RAC weight columns built once, as the SGLang method and local engine do
        kw.update(w13_comp_weight=rac_weight_columns(w13[0], w13[1], c13),
                  w2_comp_weight=rac_weight_columns(w2[0], w2[1], c2))
    out = w4a4_fused_moe(x, *w13, *w2, tw, ti, **kw, configs=configs, **TRITON)
    cpu = lambda ts: [t_.cpu() for t_ in ts]  # noqa: E731
    kw_cpu = dict(act_mode=mode, w13_comp_index=c13.cpu(), w2_comp_index=c2.cpu())
    ref = reference.w4a4_fused_moe(x.cpu(), *cpu(w13), *cpu(w2), tw.cpu(), ti.cpu(), **kw_cpu)
    assert out.shape == (t, h) and torch.isfinite(out).all()
    assert rel(out.cpu(), ref) < (tol or (1.5 * FP32_TOL[mode] if dtype == torch.float32
                                          else 8e-3))


@cpu_kernels
@pytest.mark.parametrize("mode,dtype,t,per_expert,prebuilt", [
    ("w4a4_rac", torch.float32, 7, True, False),
    ("w4a4_rac", torch.float32, 3, False, True),   # stored columns, one fc2 set, empty experts
    ("w4a4_rac", torch.bfloat16, 6, True, True),
    ("w4a4", torch.bfloat16, 1, False, False),   # one token
    ("w4a16", torch.bfloat16, 5, False, False),
])
def test_fused_moe_matches_reference_cpu(mode, dtype, t, per_expert, prebuilt):
    _check_moe("cpu", mode, dtype, t, 64, 48, 5, 2, per_expert, prebuilt=prebuilt)


@cpu_kernels
@pytest.mark.parametrize("mode,dtype", [("w4a4_rac", torch.float32), ("w4a4", torch.bfloat16)])
def test_fused_moe_split_k_cpu(mode, dtype):
    """The grouped GEMM on ModelOpt-order codes with K split in three (K = 96 of 32-wide steps for fc1 and
    fc2): the partials of every split, routing weights and the RAC residual once."""
    cfg = GemmConfig(16, 16, 32, 4, 1, 8, True, split_k=3)
    _check_moe("cpu", mode, dtype, 2, 96, 96, 5, 2, True, configs=(cfg, cfg))


def _reversed_runs(topk_ids, block_m, num_experts):
    """The argsort routing with every expert's rows in reverse order, as an op that places rows by
    atomics (SGLang's CUDA moe_align_block_size) may leave them."""
    sorted_ids, expert_ids, npost = reference.moe_align_block_size(topk_ids, block_m, num_experts)
    real = sorted_ids < topk_ids.numel()
    owner = expert_ids.repeat_interleave(block_m)[: sorted_ids.numel()]
    out = sorted_ids.clone()
    for e in owner[real].unique():
        where = real & (owner == e)
        out[where] = sorted_ids[where].flip(0)
    return out, expert_ids, npost


@cpu_kernels
def test_fused_moe_takes_an_align_op_in_any_row_order_cpu():
    """`align_block_size=` replaces the routing launches (SGLang's op in its server): with each
    expert's rows reversed the output is the default routing's, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    x = activations(6, 64, torch.float32, "cpu", gen)
    w13, w2 = packed((4, 64, 64), "cpu", gen=gen), packed((4, 64, 32), "cpu", gen=gen)
    tw, ti = torch.topk(torch.randn(6, 4, generator=gen).softmax(-1), 2)
    kw = dict(act_mode="w4a4_rac", w13_comp_index=comp(64, 16, gen), w2_comp_index=comp(32, 16, gen, 4),
              backend="triton")
    want = w4a4_fused_moe(x, *w13, *w2, tw, ti.int(), **kw)
    got = w4a4_fused_moe(x, *w13, *w2, tw, ti.int(), **kw, align_block_size=_reversed_runs)
    assert _reversed_runs(ti.int(), 16, 4)[0].tolist() != reference.moe_align_block_size(ti.int(), 16, 4)[0].tolist()
    assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("mode,dtype,t", [("w4a4_rac", torch.float32, 3),
                                          ("w4a4_rac", torch.bfloat16, 300),
                                          ("w4a4", torch.bfloat16, 40),
                                          ("w4a16", torch.bfloat16, 100)])
def test_fused_moe_matches_reference_gpu(mode, dtype, t):
    _check_moe("cuda", mode, dtype, t, 512, 384, 16, 4, True)


@gpu
@pytest.mark.parametrize("mode,dtype,t", [("w4a4_rac", torch.float32, 16),
                                          ("w4a4_rac", torch.bfloat16, 16),
                                          ("w4a4_rac", torch.float32, 1024),
                                          ("w4a4_rac", torch.bfloat16, 4096),
                                          ("w4a4_rac", torch.float32, 4096),
                                          ("w4a4", torch.float32, 64),
                                          ("w4a16", torch.float32, 256)])
def test_fused_moe_full_size_random_routing_gpu(mode, dtype, t):
    """Qwen3-30B-A3B's layer (128 experts, hidden 2048, FFN 768, top-8, k = 64) with random
    routing (at 16 tokens ~80 experts are hit, the rest get no rows) and the stored RAC columns,
    against the torch reference run on the GPU at the fp32-accumulation level (fp32 inputs)."""
    dev, e, h, f, topk, k = "cuda", 128, 2048, 768, 8, 64
    gen = torch.Generator(device=dev).manual_seed(t)
    w13, w2 = random_packed(e, 2 * f, h, dev, gen), random_packed(e, h, f, dev, gen)
    x = (torch.randn(t, h, device=dev, generator=gen) * 2).to(dtype)
    tw, ti = torch.topk(torch.randn(t, e, device=dev, generator=gen).softmax(-1), topk)
    tw, ti = tw / tw.sum(-1, keepdim=True), ti.int()
    if t == 16:
        assert ti.unique().numel() < e  # some experts have no tokens
    cg = torch.Generator().manual_seed(t)
    c13, c2 = comp(h, k, cg).to(dev), comp(f, k, cg, e).to(dev)
    kw = dict(act_mode=mode, w13_comp_index=c13, w2_comp_index=c2)
    cols = dict(w13_comp_weight=rac_weight_columns(w13[0], w13[1], c13),
                w2_comp_weight=rac_weight_columns(w2[0], w2[1], c2)) if mode == "w4a4_rac" else {}
    out = w4a4_fused_moe(x, *w13, *w2, tw, ti, **kw, **cols, **TRITON)
    ref = reference.w4a4_fused_moe(x, *w13, *w2, tw, ti, **kw)
    assert torch.isfinite(out).all()
    if dtype == torch.float32 and mode != "w4a16":  # activation codes may flip with fc1's summation order
        ok, stats = reference.w4a4_moe_agreement(out, ref, 1.5 * FP32_TOL[mode])
        assert ok, stats
    else:
        assert rel(out, ref) < (1.5 * FP32_TOL[mode] if dtype == torch.float32 else 8e-3)


# ---- dispatch ---------------------------------------------------------------------------
def _count_launches(monkeypatch):
    from quads_megatron.kernels import ops

    calls = []
    real = ops.launch_gemm  # the GEMM launches
    monkeypatch.setattr(ops, "launch_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@cpu_kernels
def test_backend_choice_reaches_the_kernels_cpu(monkeypatch):
    """CPU default and backend="torch": the reference; backend="triton" or QUADS_BACKEND=triton:
    the kernels; the explicit argument wins over the variable."""
    calls = _count_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    x = activations(2, 32, torch.float32, "cpu", gen)
    wd, ws, ws2 = packed((16, 32), "cpu", gen=gen)
    w13, w2 = packed((2, 32, 32), "cpu", gen=gen), packed((2, 32, 16), "cpu", gen=gen)
    tw, ti = torch.full((2, 1), 1.0), torch.tensor([[0], [1]], dtype=torch.int32)
    monkeypatch.delenv("QUADS_BACKEND", raising=False)

    def run(**kw):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4", **kw)
        w4a4_fused_moe(x, *w13, *w2, tw, ti, act_mode="w4a4", **kw)

    run()
    run(backend="torch")
    assert calls == []
    run(backend="triton")
    assert len(calls) == 3  # linear + fc1 + fc2
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    run()
    assert len(calls) == 6
    run(backend="torch")
    assert len(calls) == 6
    with pytest.raises(ValueError, match="unknown compute backend"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4", backend="cuda")


def test_routing_sorts_by_expert_and_pads():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 2]], dtype=torch.int32)  # expert 3 empty
    r = moe_align_block_size(ids, 4, 4)
    n = int(r.num_tokens_post_padded)
    flat = ids.flatten()
    assert n == 4 + 4 + 8  # experts 0, 1, 2 padded to 4, 4, 8 (2 + 1 + 5 rows)
    seen = []
    for b in range(n // 4):
        block = r.sorted_ids[4 * b: 4 * b + 4]
        real = block[block < flat.numel()]
        assert (flat[real.long()] == r.expert_ids[b]).all()
        seen += real.tolist()
    assert sorted(seen) == list(range(flat.numel()))
    assert (r.sorted_ids[n:] == flat.numel()).all()


DEVICES = [pytest.param("cpu", marks=cpu_kernels), pytest.param("cuda", marks=gpu)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("tokens,topk,experts,block_m", [(3, 2, 4, 4), (40, 8, 128, 16), (37, 4, 5, 64), (300, 2, 6, 16), (700, 2, 40, 64)])
def test_routing_matches_the_argsort_definition(dev, tokens, topk, experts, block_m):
    """The three launches equal the stable-argsort torch definition exactly, over several chunks of rows
    (300 x 2 > 128), empty experts (128 experts for 320 rows) and E not a power of two."""
    _check_routing(dev, tokens, topk, experts, block_m)


@gpu
@pytest.mark.parametrize("tokens,block_m", [(16, 16), (1024, 64), (4096, 128)])
def test_routing_full_size_gpu(tokens, block_m):
    _check_routing("cuda", tokens, 8, 128, block_m)


def _check_routing(dev, tokens, topk, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    ids[: tokens // 2] = ids[: tokens // 2] % max(1, experts // 3)  # uneven loads, some experts empty
    ids = ids.to(torch.int32).to(dev)
    got = moe_align_block_size(ids, block_m, experts)
    want = reference.moe_align_block_size(ids, block_m, experts)
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_tokens_post_padded"), got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w), name


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_sum_matches_a_float64_sum(dev, dtype):
    """out[t] = sum over t's top-k rows, summed in fp32 and rounded once: within one rounding of the exact
    (float64) sum (half an ulp of the output dtype, plus fp32 summation error)."""
    from quads_megatron.kernels.combine import topk_sum

    gen = torch.Generator().manual_seed(1)
    rows = (torch.randn(5 * 3, 40, generator=gen) * 4).to(dtype)
    got = topk_sum(rows.to(dev), 3).cpu()
    exact = rows.double().view(5, 3, 40).sum(1)
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert got.dtype == dtype and got.shape == (5, 40)
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-5 * exact.abs() + 1e-30).all()
    with pytest.raises(ValueError, match="rows"):
        topk_sum(rows[:14].to(dev), 3)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,f", [(7, 40), (3, 1100)])  # 1100: two column blocks, the last partial
def test_silu_and_mul_matches_a_float64_definition(dev, dtype, m, f):
    """h = SiLU(gate) * up over [gate | up] rows: within half an ulp of the output dtype of the exact
    (float64) value of the same inputs, plus fp32 evaluation error."""
    from quads_megatron.kernels.silu_mul import silu_and_mul

    gen = torch.Generator().manual_seed(2)
    gu = (torch.randn(m, 2 * f, generator=gen) * 3).to(dtype)
    got = silu_and_mul(gu.to(dev)).cpu()
    g, u = gu.double()[:, :f], gu.double()[:, f:]
    exact = g / (1 + torch.exp(-g)) * u
    ulp = torch.finfo(dtype).eps * exact.abs()
    assert got.dtype == dtype and got.shape == (m, f)
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-6 * exact.abs() + 1e-30).all()
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(gu[:, :-1].to(dev))


# ---- bad input -------------------------------------------------------------------------
def test_bad_inputs_give_clear_errors():
    gen = torch.Generator().manual_seed(0)
    wd, ws, ws2 = packed((32, 64), "cpu", gen=gen)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="uint8"):
        w4a4_linear(x, torch.randn(32, 64).bfloat16(), ws, ws2, act_mode="w4a4")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w4a4_linear(x, wd, ws.float(), ws2, act_mode="w4a4")
    with pytest.raises(ValueError, match="does not match"):
        w4a4_linear(torch.randn(4, 48), wd, ws, ws2, act_mode="w4a4")
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a4_linear(torch.randn(4, 24), wd[:, :12], ws[:, :1], ws2, act_mode="w4a4")
    with pytest.raises(ValueError, match="bfloat16/float16/float32"):
        w4a4_linear(x.to(torch.int32), wd, ws, ws2, act_mode="w4a4")
    with pytest.raises(ValueError, match="act_mode"):
        w4a4_linear(x, wd, ws, ws2, act_mode="fp8")
    with pytest.raises(ValueError, match="needs compensation"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac")
    with pytest.raises(ValueError, match="out of range"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac",
                    comp_index=torch.arange(50, 66, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac",
                    comp_index=torch.arange(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="sorted"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac",
                    comp_index=torch.arange(16, dtype=torch.int32).flip(0))
    # check_inputs=False skips the value checks (host syncs) of the kernel path, not the
    # shape checks (the torch path's quads_megatron.rac still checks the values)
    if interpreting() and not CUDA:
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac", check_inputs=False, backend="triton",
                    comp_index=torch.arange(16, dtype=torch.int32).flip(0))
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac", check_inputs=False,
                    comp_index=torch.arange(8, dtype=torch.int32))
    w13 = packed((3, 64, 64), "cpu", gen=gen)
    w2 = packed((3, 64, 32), "cpu", gen=gen)
    tw = torch.full((4, 2), 0.5)
    with pytest.raises(ValueError, match="expert id out of range"):
        w4a4_fused_moe(x, *w13, *w2, tw, torch.tensor([[0, 3]] * 4, dtype=torch.int32),
                       act_mode="w4a4")
    w4a4_fused_moe(x, *w13, *w2, tw, torch.tensor([[0, 3]] * 4, dtype=torch.int32),
                   act_mode="w4a4", check_inputs=False)
    with pytest.raises(ValueError, match="RAC weight columns as fp16"):
        w4a4_fused_moe(x, *w13, *w2, tw, torch.zeros(4, 2, dtype=torch.int32), act_mode="w4a4_rac",
                       w13_comp_index=torch.arange(16, dtype=torch.int32),
                       w2_comp_index=torch.arange(16, dtype=torch.int32),
                       w13_comp_weight=torch.zeros(3, 64, 16), check_inputs=False)
    with pytest.raises(ValueError, match="RAC weight columns as fp16"):
        w4a4_linear(x, wd, ws, ws2, act_mode="w4a4_rac", comp_index=torch.arange(16, dtype=torch.int32),
                    comp_weight=torch.zeros(32, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="one set per layer"):
        w4a4_fused_moe(x, *w13, *w2, tw, torch.zeros(4, 2, dtype=torch.int32),
                       act_mode="w4a4_rac",
                       w13_comp_index=torch.arange(16, dtype=torch.int32).repeat(3, 1),
                       w2_comp_index=torch.arange(16, dtype=torch.int32))


def test_moe_agreement_allows_rare_code_flips_but_not_spread_error():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(200, 64, generator=g)
    assert reference.w4a4_moe_agreement(ref + 1e-8 * torch.randn(200, 64, generator=g), ref, 3e-6)[0]
    flipped = ref.clone()
    flipped[7] += 0.01 * ref[7]            # one token off by one code flip (~1e-2)
    assert reference.w4a4_moe_agreement(flipped, ref, 3e-6)[0]
    assert not reference.w4a4_moe_agreement(ref * (1 + 1e-4), ref, 3e-6)[0]    # every token off
    many = ref.clone()
    many[:10] += 0.01 * ref[:10]           # 5% of tokens: not rare
    assert not reference.w4a4_moe_agreement(many, ref, 3e-6)[0]
    few = ref[:16].clone()
    few[5] += 0.01 * ref[5]                # one token of 16 (6%): a single flip is still rare
    assert reference.w4a4_moe_agreement(few, ref[:16], 3e-6)[0]
    few[6] += 0.01 * ref[6]                # two of 16: not
    assert not reference.w4a4_moe_agreement(few, ref[:16], 3e-6)[0]
    big = ref.clone()
    big[3] += 0.2 * ref[3]                 # one token far beyond a flip
    assert not reference.w4a4_moe_agreement(big, ref, 3e-6)[0]
