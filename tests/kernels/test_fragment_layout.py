"""The v3 (fragment-order) weight layout and its GEMM main loop.

Layout: bit-exact round trip, and hand-placed codes at the byte and bits the layout defines.
Decode: every E2M1 code in every byte slot times every finite E4M3 scale, bit-exact against
`e2m1_decode` * `e4m3_decode` * 2^-6 (plain Triton in the CPU interpreter; the inline asm on a
GPU). GEMMs: the ops with weight_layout="fragment" against the torch reference on ModelOpt weights.
"""

import pytest
import torch
import triton
import triton.language as tl

from quads_megatron.kernels import reference, w4a4_fused_moe, w4a4_linear
from quads_megatron.kernels.act_quant import quantize_activation_rac
from quads_megatron.kernels.fragment_layout import (fragment_columns, from_fragment_order, from_fragment_scale_order,
                                                    to_fragment_order, to_fragment_scale_order)
from quads_megatron.kernels.gemm import GemmConfig, decode_fragments, fragment_config, interpreting, launch_gemm
from quads_megatron.kernels.rac_columns import rac_weight_columns
from quads_megatron.nvfp4.core import dequantize_reference

from tests.kernels.test_w4a4_kernels import FP32_TOL, activations, comp, packed, random_packed, rel

CUDA = torch.cuda.is_available()
cpu_kernels = pytest.mark.skipif(CUDA or not interpreting(),
                                 reason="CPU kernel tests need TRITON_INTERPRET=1 and no GPU")
gpu = pytest.mark.gpu


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., K] -> ModelOpt bytes [..., K//2] (element 2i in the low nibble)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


# ---- layout --------------------------------------------------------------------------------
def test_round_trip_is_bit_exact():
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 128, 128), (64, 64), (2, 192, 192)]:
        w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        f = to_fragment_order(w)
        assert f.shape == w.shape and f.dtype == torch.uint8
        assert torch.equal(from_fragment_order(f), w)
        assert torch.equal(to_fragment_order(from_fragment_order(f)), f)
        assert not torch.equal(f, w)


def hand_placed_case():
    """(ModelOpt bytes, fragment-order bytes) [128, 128] of codes put at (row, column) and the byte
    and bits derived by hand from the layout: word h*512 + q*128 + g*16 + t*4 + w of atom
    (row // 64, col // 128), byte 2j + b for pairs j < 2 (sign -> bit 7, e e m -> bits 4..2) and
    2(j - 2) + b for j >= 2 (sign -> bit 5, e1 -> bit 6, e0 m -> bits 1..0), with
    row = 16q + 8h + g, col = 16(2w + b) + 4t + j."""
    n, k = 128, 256
    codes = torch.zeros(n, k, dtype=torch.int32)
    frag = torch.zeros(n * k // 2, dtype=torch.uint8)
    # row 9 = q0 h1 g1, col 37 = w1 b0 t1 j1 -> word 512 + 16 + 4 + 1, byte 2; code 1011 -> 0x8C
    codes[9, 37] = 0b1011
    frag[533 * 4 + 2] = 0x8C
    # row 50 = q3 h0 g2, col 19 = w0 b1 t0 j3 -> word 384 + 32, byte 3; code 0110 -> 0x42
    codes[50, 19] = 0b0110
    frag[416 * 4 + 3] = 0x42
    # the same as the first in atom (1, 1), stored third ([N/64][K/128]): row 73, col 165
    codes[73, 165] = 0b1111
    frag[3 * 4096 + 533 * 4 + 2] = 0x9C
    return _pack(codes), frag.reshape(n, k // 2)


def test_hand_placed_codes():
    codes, frag = hand_placed_case()
    assert torch.equal(to_fragment_order(codes), frag)
    assert torch.equal(from_fragment_order(frag), codes)


def test_fragment_columns_is_the_layout_k_order():
    p = fragment_columns(256)
    assert torch.equal(torch.sort(p).values, torch.arange(256))
    # p = 32 w + 8 j + 2 t + b holds column 16 (2w + b) + 4 t + j
    assert p[0:4].tolist() == [0, 16, 4, 20] and p[8].item() == 1 and p[32].item() == 32
    assert torch.equal(p[128:], p[:128] + 128)


def test_layout_errors_name_the_tensor():
    with pytest.raises(ValueError, match="weight: the fragment layout needs N a multiple of 64"):
        to_fragment_order(torch.zeros(48, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K a multiple of 128"):
        to_fragment_order(torch.zeros(64, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        to_fragment_order(torch.zeros(64, 64, dtype=torch.int32))
    x = torch.zeros(4, 128)
    w = torch.zeros(64, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="weight: the fragment layout"):
        w4a4_linear(x[:, :64], w, torch.zeros(64, 4, dtype=torch.float8_e4m3fn),
                    torch.ones(()), act_mode="w4a16", weight_layout="fragment", backend="torch")
    with pytest.raises(ValueError, match="weight_layout: expected one of"):
        w4a4_linear(x, torch.zeros(64, 64, dtype=torch.uint8),
                    torch.zeros(64, 8, dtype=torch.float8_e4m3fn), torch.ones(()),
                    act_mode="w4a16", weight_layout="marlin", backend="torch")


def test_scale_order_round_trip_and_hand_placed_bytes():
    """Block scales: same shape and dtype, exact round trip (uint8 and float8_e4m3fn, in place too), and
    scales put at (row, block) found at the byte derived by hand: strip row // 64, step block // 8,
    offset (strip * K/128 + step) * 512 + 256 h + 64 q + 8 g + block % 8 with row % 64 = 16q + 8h + g."""
    gen = torch.Generator().manual_seed(5)
    s = torch.randint(0, 256, (2, 128, 32), dtype=torch.uint8, generator=gen)  # N = 128, K = 512
    f = to_fragment_scale_order(s)
    assert f.shape == s.shape and f.dtype == s.dtype and not torch.equal(f, s)
    assert torch.equal(from_fragment_scale_order(f), s)
    # row 9 = q0 h1 g1 of strip 0, block 3 of step 0 -> 256 + 8 + 3
    # row 114 = strip 1, row 50 = q3 h0 g2, block 17 = step 2, block 1 -> (1 * 4 + 2) * 512 + 192 + 16 + 1
    for (row, blk), off in (((9, 3), 267), ((114, 17), 3281)):
        assert f[1].reshape(-1)[off] == s[1, row, blk]
    e4 = s.view(torch.float8_e4m3fn).clone()
    assert to_fragment_scale_order(e4, out=e4) is e4 and e4.dtype == torch.float8_e4m3fn
    assert torch.equal(e4.view(torch.uint8), f)
    # a view whose rows are not 8-byte aligned (the byte path) permutes the same bytes as a contiguous copy
    rows = torch.randint(0, 256, (128, 33), dtype=torch.uint8, generator=gen)[:, 1:]
    assert torch.equal(to_fragment_scale_order(rows), to_fragment_scale_order(rows.contiguous()))
    back = rows.clone()
    assert torch.equal(from_fragment_scale_order(to_fragment_scale_order(rows), out=back), rows)
    with pytest.raises(ValueError, match="w2_scale: the fragment layout needs N a multiple of 64"):
        to_fragment_scale_order(torch.zeros(48, 8, dtype=torch.uint8), name="w2_scale")
    with pytest.raises(ValueError, match="K/16 of 8"):
        to_fragment_scale_order(torch.zeros(64, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one byte each"):
        to_fragment_scale_order(torch.zeros(64, 8, dtype=torch.float32))


def test_act_quant_fragment_order_permutes_the_values_only():
    if not interpreting() and not CUDA:
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    dev = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(3)
    x = activations(6, 256, torch.float32, dev, gen)
    ci = comp(256, 32, gen).to(dev)
    a = quantize_activation_rac(x, ci)
    b = quantize_activation_rac(x, ci, fragment_order=True)
    assert torch.equal(b.values, a.values[:, fragment_columns(256, dev)])
    for name in ("data", "scale", "s_dec", "r_data", "r_scale", "r_s_dec", "r_values"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ---- decode: exhaustive, bit-exact -----------------------------------------------------------
@triton.jit
def _fragment_probe(w_ptr, s_ptr, out_ptr, ASM: tl.constexpr):
    """One 64 x 128 atom: the main loop's loads, `decode_fragments`, the tile stored row-major."""
    slot = tl.arange(0, 256)[:, None]
    ww = tl.arange(0, 4)[None, :]
    tt, gg, qq, hh = slot % 4, (slot // 4) % 8, (slot // 32) % 4, slot // 128
    words = tl.load(w_ptr + hh * 512 + qq * 128 + gg * 16 + tt * 4 + ww)
    sc = tl.load(s_ptr + hh * 128 + qq * 32 + gg * 4 + ww)   # `to_fragment_scale_order`: [h][q][g][4 pairs]
    tile = decode_fragments(words, sc, 64, ASM)
    tl.store(out_ptr + tl.arange(0, 64)[:, None] * 128 + tl.arange(0, 128)[None, :], tile)


def _check_decode_exhaustive(device, asm):
    gen = torch.Generator().manual_seed(7)
    # every byte value in every byte slot of a word, every finite E4M3 scale (0x7F / 0xFF: NaN)
    codes = torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64) % 256
    codes = codes[torch.randperm(64, generator=gen)][:, torch.randperm(64, generator=gen)]
    w = codes.to(torch.uint8)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    s = finite[torch.arange(64 * 8) % finite.numel()][torch.randperm(512, generator=gen)]
    s = s.reshape(64, 8)
    want = dequantize_reference(w, s.view(torch.float8_e4m3fn), torch.ones(()), torch.float32)
    want = (want * 2.0 ** -6).to(torch.float16)[:, fragment_columns(128)]
    out = torch.empty(64, 128, dtype=torch.float16, device=device)
    _fragment_probe[(1,)](to_fragment_order(w).to(device).view(torch.int32),
                          to_fragment_scale_order(s).to(device).view(torch.uint16), out, ASM=asm)
    got = out.cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@cpu_kernels
def test_fragment_decode_exhaustive_cpu():
    _check_decode_exhaustive("cpu", False)


@gpu
def test_fragment_decode_exhaustive_gpu():
    """The inline-asm decode (and/shift, cvt.rn.f16x2.e4m3x2, mul.rn.f16x2), bit for bit."""
    _check_decode_exhaustive("cuda", True)


# ---- GEMMs -------------------------------------------------------------------------------
def _frag(w):
    return to_fragment_order(w[0]), to_fragment_scale_order(w[1]), w[2]


def _check_moe(device, mode, dtype, t, h, f, e, topk, prebuilt, configs=None, full=False):
    gen = torch.Generator().manual_seed(t + h)
    x = activations(t, h, dtype, device, gen)
    if full:
        g = torch.Generator(device=device).manual_seed(t)
        w13, w2 = random_packed(e, 2 * f, h, device, g), random_packed(e, h, f, device, g)
    else:
        w13, w2 = packed((e, 2 * f, h), device, gen=gen), packed((e, h, f), device, gen=gen)
    logits = torch.randn(t, e, generator=gen)
    logits[:, e - 1] = -1e4  # one expert gets no tokens
    tw, ti = torch.topk(logits.softmax(-1), topk)
    tw, ti = tw.to(device), ti.int().to(device)
    c13, c2 = comp(h, 64 if full else 16, gen).to(device), comp(f, 64 if full else 16, gen, e).to(device)
    kw = dict(act_mode=mode, w13_comp_index=c13, w2_comp_index=c2)
    if prebuilt:  # the RAC columns built from the ModelOpt weights, as a loader does
        kw.update(w13_comp_weight=rac_weight_columns(w13[0], w13[1], c13),
                  w2_comp_weight=rac_weight_columns(w2[0], w2[1], c2))
    out = w4a4_fused_moe(x, *_frag(w13), *_frag(w2), tw, ti, **kw, backend="triton",
                         weight_layout="fragment", configs=configs)
    ref = reference.w4a4_fused_moe(x, *w13, *w2, tw, ti, act_mode=mode, w13_comp_index=c13,
                                   w2_comp_index=c2)
    assert out.shape == (t, h) and torch.isfinite(out).all()
    if device == "cuda" and dtype == torch.float32 and mode != "w4a16":
        # per token: fc1's summation order may move a rare code of fc2's input (reference docs)
        ok, stats = reference.w4a4_moe_agreement(out, ref, 1.5 * FP32_TOL[mode])
        assert ok, stats
    else:
        assert rel(out, ref) < (1.5 * FP32_TOL[mode] if dtype == torch.float32 else 8e-3)


@cpu_kernels
@pytest.mark.parametrize("mode,dtype,t,prebuilt,swap", [
    ("w4a4_rac", torch.float32, 7, False, True),    # per-call RAC columns from the inverse layout
    ("w4a4_rac", torch.bfloat16, 5, True, False),   # prefill tile: the decoded tile as operand B
    ("w4a4", torch.bfloat16, 1, False, True),
    ("w4a16", torch.float32, 5, False, True),
])
def test_fragment_fused_moe_cpu(mode, dtype, t, prebuilt, swap):
    # a register cap (Triton's maxnreg) is a launch option: the interpreter leaves it, the GPU applies it
    cfg = GemmConfig(16, 64, 128, 4, 1, 8, swap, max_regs=96 if t == 1 else None)
    _check_moe("cpu", mode, dtype, t, 128, 128, 4, 2, prebuilt, configs=(cfg, cfg))


@cpu_kernels
def test_fragment_fused_moe_256_rows_cpu():
    """A tile of 256 weight rows (4 atoms of 64; 8 warps on the GPU) where fc2's N of 384 is not a multiple of
    256: the last tile's atoms past N clamp to the last one and their rows are not stored."""
    cfg = GemmConfig(16, 256, 128, 8, 1, 8, True)
    _check_moe("cpu", "w4a4_rac", torch.float32, 6, 384, 128, 4, 2, False, configs=(cfg, cfg))


@cpu_kernels
@pytest.mark.parametrize("mode", ["w4a4", "w4a4_rac", "w4a16"])
def test_fragment_linear_with_bias_cpu(mode):
    gen = torch.Generator().manual_seed(1)
    x = activations(5, 256, torch.float32, "cpu", gen)
    w = packed((128, 256), "cpu", gen=gen)
    ci, b = comp(256, 32, gen), torch.randn(128, generator=gen)
    y = w4a4_linear(x, *_frag(w), act_mode=mode, comp_index=ci, bias=b, backend="triton",
                    weight_layout="fragment")
    assert rel(y, reference.w4a4_linear(x, *w, act_mode=mode, comp_index=ci, bias=b)) < 2e-6


@cpu_kernels
def test_fragment_split_k_cpu():
    """Dense split-K (fp32 partials): every split starts at its own 128-wide atom column."""
    gen = torch.Generator().manual_seed(2)
    x = activations(3, 512, torch.float32, "cpu", gen)
    w = packed((64, 512), "cpu", gen=gen)
    qa = quantize_activation_rac(x, None, fragment_order=True)
    out = torch.empty(3, 64)
    launch_gemm(qa.values, qa.s_dec, to_fragment_order(w[0]).unsqueeze(0), to_fragment_scale_order(w[1]).unsqueeze(0),
                w[2].reshape(1), out, m=3, config=GemmConfig(16, 64, 128, 4, 1, 8, True, 2),
                fragment_layout=True)
    assert rel(out, reference.w4a4_linear(x, *w, act_mode="w4a4")) < 2e-6


@cpu_kernels
@pytest.mark.parametrize("mode,dtype", [("w4a4_rac", torch.float32), ("w4a4", torch.bfloat16),
                                        ("w4a16", torch.float32)])
def test_fragment_grouped_split_k_cpu(mode, dtype):
    """The grouped GEMM with K split in two (decode batch 1-2): fc1's two K-steps one per split, fc2's one
    K-step all in split 0 (split 1 stores a zero partial); routing weights and the RAC residual once."""
    cfg = GemmConfig(16, 64, 128, 4, 1, 8, True, split_k=2)
    _check_moe("cpu", mode, dtype, 3, 256, 128, 4, 2, False, configs=(cfg, cfg))


def test_grouped_split_k_fills_the_machine_at_batch_one():
    """min(rows, E) x N-tiles programs at decode, split until 2 x SMs, >= 4 K-steps per split (Qwen3-30B-A3B)."""
    from quads_megatron.kernels.gemm import grouped_split_k

    tile = GemmConfig(16, 128, 128, 4, 3, 8, True)
    assert grouped_split_k(8, 128, 1536, 2048, tile, 132) == 4    # batch 1 fc1: 96 programs, 16 K-steps
    assert grouped_split_k(16, 128, 1536, 2048, tile, 132) == 2   # batch 2: 192 programs
    assert grouped_split_k(64, 128, 1536, 2048, tile, 132) == 1   # batch 8: 768 programs
    assert grouped_split_k(8, 128, 2048, 768, tile, 132) == 1     # fc2: 6 K-steps, too few to split
    assert grouped_split_k(8, 128, 1536, 2048, tile, 0) == 1      # CPU / interpreter


def test_torch_backend_reads_fragment_weights_back():
    gen = torch.Generator().manual_seed(4)
    x = activations(4, 128, torch.float32, "cpu", gen)
    w = packed((64, 128), "cpu", gen=gen)
    y = w4a4_linear(x, *_frag(w), act_mode="w4a16", backend="torch", weight_layout="fragment")
    assert torch.equal(y, reference.w4a4_linear(x, *w, act_mode="w4a16"))


@gpu
@pytest.mark.parametrize("mode,dtype,t", [("w4a4_rac", torch.float32, 16),
                                          ("w4a4_rac", torch.bfloat16, 16),
                                          ("w4a4_rac", torch.float32, 384),
                                          ("w4a4_rac", torch.float32, 768),
                                          ("w4a4_rac", torch.float32, 1024),
                                          ("w4a4_rac", torch.bfloat16, 4096),
                                          ("w4a4", torch.float32, 64),
                                          ("w4a16", torch.bfloat16, 256)])
def test_fragment_fused_moe_full_size_gpu(mode, dtype, t):
    """Qwen3-30B-A3B's layer (128 experts, hidden 2048, FFN 768, top-8, k = 64) on fragment-order
    weights with `fragment_config`'s tiles, against the torch reference on the ModelOpt weights."""
    _check_moe("cuda", mode, dtype, t, 2048, 768, 128, 8, True, full=True)


# the v3 tiles checked against the reference on the GPU: `fragment_config`'s defaults and the
# bench sweep's main alternatives
SWEEP_TILES = [(16, 64, 128, 4, 4, 8, True), (16, 128, 128, 4, 4, 8, True),
               (16, 128, 128, 8, 4, 8, True), (32, 64, 128, 4, 4, 8, True),
               (64, 128, 128, 8, 3, 8, False), (128, 128, 128, 8, 3, 8, False),
               (16, 64, 128, 4, 3, 8, True, 1, 96), (16, 128, 128, 4, 3, 8, True, 1, 96),
               (16, 128, 128, 4, 3, 8, True, 4, 96), (32, 128, 128, 4, 3, 8, True, 1, 96),
               (32, 128, 128, 4, 3, 8, True, 1, 128), (32, 64, 128, 4, 3, 8, True, 1, 128),
               (32, 128, 128, 8, 3, 8, True), (64, 128, 128, 4, 3, 8, True),
               (64, 128, 128, 8, 3, 8, True), (128, 64, 128, 4, 3, 8, False),
               (128, 128, 128, 8, 3, 8, True), (64, 128, 128, 4, 4, 8, True),
               (32, 128, 128, 4, 3, 8, True, 1, 168),
               # 256 weight rows on 8 warps (N of 1536 and 2048 are multiples of 256, 320 is not)
               (16, 256, 128, 8, 3, 8, True, 1, 96), (32, 256, 128, 8, 3, 8, True, 1, 128),
               (32, 256, 128, 8, 3, 8, True, 1, 168), (64, 256, 128, 8, 3, 8, True)]


def test_default_tiles_are_gpu_tested():
    """Each tile `fragment_config` picks (grouped and dense, 1 to 512 rows per expert, N a multiple of
    128 or only of 64) is one `test_fragment_configs_gpu` checks on the GPU."""
    tested = {GemmConfig(*c) for c in SWEEP_TILES}
    for rows in (1, 8, 16, 17, 24, 32, 33, 48, 64, 65, 100, 128, 129, 256, 512):
        for n in (1536, 2048, 320):
            for dense in (False, True):
                assert fragment_config(rows, n, 2048, dense=dense) in tested, (rows, n, dense)


@gpu
@pytest.mark.parametrize("cfg", SWEEP_TILES)
@pytest.mark.parametrize("mode,dtype", [("w4a4_rac", torch.float32), ("w4a16", torch.bfloat16)])
def test_fragment_configs_gpu(cfg, mode, dtype):
    """Every tile of SWEEP_TILES gives the reference's answer."""
    c = GemmConfig(*cfg)
    _check_moe("cuda", mode, dtype, 40, 512, 384, 16, 4, True, configs=(c, c))


@gpu
@pytest.mark.parametrize("mode,dtype", [("w4a4_rac", torch.float32), ("w4a4", torch.bfloat16),
                                        ("w4a16", torch.bfloat16)])
@pytest.mark.parametrize("m", [1, 16, 24, 48, 100, 300])
def test_fragment_linear_gpu(mode, dtype, m):
    """The dense form (split-K at decode M) on fragment-order weights, bias included."""
    gen = torch.Generator().manual_seed(m)
    x = activations(m, 2048, dtype, "cuda", gen)
    w = packed((1536, 2048), "cuda", gen=gen)
    ci, b = comp(2048, 64, gen).cuda(), torch.randn(1536, generator=gen).cuda()
    y = w4a4_linear(x, *_frag(w), act_mode=mode, comp_index=ci, bias=b, backend="triton",
                    weight_layout="fragment",
                    comp_weight=rac_weight_columns(w[0], w[1], ci) if mode == "w4a4_rac" else None)
    ref = reference.w4a4_linear(x.cpu(), *(t.cpu() for t in w), act_mode=mode, comp_index=ci.cpu(),
                                bias=b.cpu())
    assert rel(y.cpu(), ref) < (FP32_TOL[mode] if dtype == torch.float32 else 4e-3)
