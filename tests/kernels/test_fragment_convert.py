"""The one-pass Triton conversion to and from the v3 fragment order (`kernels.fragment_convert`).

Against the layout's plain-torch definition and against the layout written out element by element
from its docstring (every code's word, byte and bits), out of place and in place, with leading
expert dims, atom counts that are not powers of two, more atoms than one program holds, and the
row sub-ranges a partial load converts. CPU: the Triton interpreter; `-m gpu`: the real sizes.
"""

import pytest
import torch

from quads_megatron.kernels.fragment_convert import (MAX_ATOMS, MAX_STEPS, convert_fragment_order,
                                                     convert_scale_order)
from quads_megatron.kernels.fragment_layout import (_from_fragment_order_torch, _to_fragment_order_torch,
                                                    from_fragment_order, from_fragment_scale_order,
                                                    to_fragment_order, to_fragment_scale_order)
from quads_megatron.kernels.gemm import interpreting
from quads_megatron.plan.kernel_layout import rows_to_kernel_layout

from tests.kernels.test_fragment_layout import hand_placed_case

CUDA = torch.cuda.is_available()
cpu_kernels = pytest.mark.skipif(CUDA or not interpreting(),
                                 reason="CPU kernel tests need TRITON_INTERPRET=1 and no GPU")
gpu = pytest.mark.gpu


def _both_ways(convert, x, want):
    """`convert(src, out, inverse)` gives `want` from `x` and back, into a new tensor and in place."""
    assert torch.equal(convert(x, torch.empty_like(x)), want)
    assert torch.equal(convert(want, torch.empty_like(x), inverse=True), x)
    buf = x.clone()
    assert convert(buf, buf) is buf and torch.equal(buf, want)
    convert(buf, buf, inverse=True)
    assert torch.equal(buf, x)


def _triton(x, inverse=False, out=None):
    return convert_fragment_order(x, torch.empty_like(x) if out is None else out, inverse)


def _spelled_out(packed: torch.Tensor) -> torch.Tensor:
    """The fragment order from the layout's docstring, one code at a time: code (row, col) of atom
    (R, S) goes to word h*512 + q*128 + g*16 + 4t + w of atom R * K/128 + S, byte 2(j % 2) + b,
    as A (j < 2: sign -> bit 7, e e m -> 4..2) or B (sign -> 5, e1 -> 6, e0 m -> 1..0)."""
    n, k = packed.shape[-2], packed.shape[-1] * 2
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(-1, n, k).long()
    row, col = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    r, c = row % 64, col % 128
    q, h, g = r // 16, (r // 8) % 2, r % 8
    w, b, t, j = c // 32, (c // 16) % 2, (c // 4) % 4, c % 4
    word = ((row // 64) * (k // 128) + col // 128) * 1024 + h * 512 + q * 128 + g * 16 + 4 * t + w
    byte = 4 * word + 2 * (j % 2) + b
    a_bits = lambda x: ((x & 8) << 4) | ((x & 7) << 2)                      # noqa: E731
    b_bits = lambda x: ((x & 8) << 2) | ((x & 4) << 4) | (x & 3)            # noqa: E731
    out = torch.zeros(codes.shape[0], n * k // 2, dtype=torch.long)
    for e in range(codes.shape[0]):
        bits = torch.where(j < 2, a_bits(codes[e]), b_bits(codes[e]))
        out[e].index_add_(0, byte.flatten(), bits.flatten())  # two codes per byte, disjoint bits
    return out.to(torch.uint8).reshape(packed.shape)


def test_torch_definition_matches_the_spelled_out_layout():
    gen = torch.Generator().manual_seed(11)
    w = torch.randint(0, 256, (2, 128, 192), dtype=torch.uint8, generator=gen)
    assert torch.equal(to_fragment_order(w), _spelled_out(w))


def test_out_and_in_place_on_cpu_use_the_definition():
    gen = torch.Generator().manual_seed(12)
    w = torch.randint(0, 256, (2, 64, 128), dtype=torch.uint8, generator=gen)
    want = _spelled_out(w)
    buf = w.clone()
    assert to_fragment_order(buf, out=buf) is buf and torch.equal(buf, want)
    assert from_fragment_order(buf, out=buf) is buf and torch.equal(buf, w)
    with pytest.raises(ValueError, match="w13: out must be uint8"):
        to_fragment_order(w, out=torch.empty(2, 64, 64, dtype=torch.uint8), name="w13")


# ---- the Triton kernel in the CPU interpreter ------------------------------------------------
SHAPES = [(64, 64),            # one atom
          (3, 128, 128),       # leading expert dim, 2 x 2 atoms per expert
          (2, 192, 384),       # 6 atoms per strip (K = 768, the FFN of Qwen3-30B-A3B): masked block
          (1, 64, 64 * MAX_ATOMS),          # the most atoms converted in place directly (K = 2048)
          (1, 64, 64 * (MAX_ATOMS + 3))]    # more atoms than one program holds: through a copy


@cpu_kernels
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_definition_cpu(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    _both_ways(convert_fragment_order, w, _to_fragment_order_torch(w))


@cpu_kernels
def test_triton_spelled_out_and_hand_placed_cpu():
    codes, frag = hand_placed_case()
    assert torch.equal(_triton(codes), frag) and torch.equal(_triton(frag, inverse=True), codes)
    gen = torch.Generator().manual_seed(13)
    w = torch.randint(0, 256, (2, 128, 192), dtype=torch.uint8, generator=gen)
    assert torch.equal(_triton(w), _spelled_out(w))


@cpu_kernels
def test_triton_row_ranges_in_place_cpu():
    """The views a partial load converts (`rows_to_kernel_layout`): rows [r0, r1) of one expert,
    in place; the other rows keep their bytes."""
    gen = torch.Generator().manual_seed(14)
    w = torch.randint(0, 256, (3, 256, 192), dtype=torch.uint8, generator=gen)
    buf = w.clone()
    for e, r0, r1 in [(0, 64, 192), (2, 0, 64), (2, 192, 256)]:
        part = buf[e, r0:r1]
        convert_fragment_order(part, part)
    want = w.clone()
    want[0, 64:192] = _to_fragment_order_torch(w[0, 64:192])
    want[2, 0:64] = _to_fragment_order_torch(w[2, 0:64])
    want[2, 192:256] = _to_fragment_order_torch(w[2, 192:256])
    assert torch.equal(buf, want)


@cpu_kernels
def test_triton_strided_and_overlapping_sources_cpu():
    gen = torch.Generator().manual_seed(15)
    big = torch.randint(0, 256, (128, 128), dtype=torch.uint8, generator=gen)
    src = big[:, :64]                                      # strided rows: read through a copy
    assert torch.equal(_triton(src), _to_fragment_order_torch(src.contiguous()))
    flat = torch.randint(0, 256, (192 * 64,), dtype=torch.uint8, generator=gen)
    src, out = flat[: 128 * 64].view(128, 64), flat[64 * 64:].view(128, 64)  # out overlaps src
    want = _to_fragment_order_torch(src.clone())
    convert_fragment_order(src, out)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="out: expected a contiguous uint8"):
        convert_fragment_order(big[:, :64], big[:, 64:])


# ---- the GPU: dispatch and the real sizes ----------------------------------------------------
@gpu
@pytest.mark.parametrize("shape", [(128, 1536, 1024),    # Qwen3-30B-A3B w13: [E, 2F, H/2]
                                   (128, 2048, 384),     # w2: [E, H, F/2] (6 atoms per strip)
                                   (4, 4096, 2048),      # K = 4096: 32 atoms, through a copy
                                   (1, 64, 64)])
def test_cuda_conversion_is_bit_exact_gpu(shape):
    """The Triton pass on CUDA against the torch definition on the same bytes: new tensor, in place,
    and the inverse (the check that lets it become the CUDA path of to/from_fragment_order)."""
    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    w = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    frag = _to_fragment_order_torch(w)
    assert torch.equal(convert_fragment_order(w, torch.empty_like(w)), frag)
    assert torch.equal(convert_fragment_order(frag, torch.empty_like(frag), inverse=True), w)
    buf = w.clone()
    ptr = buf.data_ptr()
    convert_fragment_order(buf, buf)
    assert buf.data_ptr() == ptr and torch.equal(buf, frag)
    convert_fragment_order(buf, buf, inverse=True)
    assert torch.equal(buf, w)
    assert torch.equal(_from_fragment_order_torch(frag), w)


@gpu
def test_cuda_row_ranges_in_place_gpu():
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randint(0, 256, (8, 1536, 1024), dtype=torch.uint8, device="cuda", generator=g)
    buf = w.clone()
    written = {1: range(64, 320), 7: list(range(0, 64)) + list(range(1024, 1536))}
    rows_to_kernel_layout(buf, written, name="w13")
    want = w.clone()
    for e, r0, r1 in [(1, 64, 320), (7, 0, 64), (7, 1024, 1536)]:
        want[e, r0:r1] = _to_fragment_order_torch(w[e, r0:r1])
    assert torch.equal(buf, want)


@gpu
def test_layout_functions_take_the_triton_pass_on_cuda_gpu(monkeypatch):
    """to/from_fragment_order on CUDA tensors run `convert_fragment_order` (new tensor, in place, and
    into a strided `out`), bit-exact against the torch definition."""
    from quads_megatron.kernels import fragment_convert

    calls = []
    real = fragment_convert.convert_fragment_order
    monkeypatch.setattr(fragment_convert, "convert_fragment_order",
                        lambda *a, **k: calls.append(a[2] if len(a) > 2 else k.get("inverse", False)) or real(*a, **k))
    g = torch.Generator(device="cuda").manual_seed(6)
    w = torch.randint(0, 256, (4, 128, 384), dtype=torch.uint8, device="cuda", generator=g)
    want = _to_fragment_order_torch(w)
    assert torch.equal(to_fragment_order(w), want)
    assert torch.equal(from_fragment_order(want), w)
    wide = torch.zeros(4, 128, 768, dtype=torch.uint8, device="cuda")
    out = wide[..., :384]                                   # strided: converted through a contiguous buffer
    assert to_fragment_order(w, out=out) is out and torch.equal(out, want) and not wide[..., 384:].any()
    buf = w.clone()
    assert to_fragment_order(buf, out=buf) is buf and torch.equal(buf, want)
    assert calls == [False, True, False, False]


# ---- the block scales' pass (`convert_scale_order`) ------------------------------------------
SCALE_SHAPES = [(64, 8),               # one strip, one step
                (3, 128, 16),          # leading expert dim, 2 steps (K = 256)
                (2, 192, 48),          # 6 steps (K = 768, the FFN of Qwen3-30B-A3B): masked block
                (1, 64, 8 * MAX_STEPS),            # the most steps converted in place directly
                (1, 64, 8 * (MAX_STEPS + 3))]      # more than one program holds: through a copy


def _scale_definition(s):
    """The permutation spelled out per scale: scale (n, j) of ModelOpt's order goes to byte
    ((R * K/128 + S) * 64 + 32 h + 8 q + g) * 8 + j % 8 of its expert, n = 64 R + 16 q + 8 h + g, S = j // 8."""
    n, kb = s.shape[-2], s.shape[-1]
    row, col = torch.meshgrid(torch.arange(n), torch.arange(kb), indexing="ij")
    r = row % 64
    pos = (((row // 64) * (kb // 8) + col // 8) * 64 + ((r // 8) % 2) * 32 + (r // 16) * 8 + r % 8) * 8 + col % 8
    flat = s.reshape(-1, n * kb)
    out = torch.empty_like(flat)
    out[:, pos.flatten()] = flat
    return out.reshape(s.shape)


@cpu_kernels
@pytest.mark.parametrize("shape", SCALE_SHAPES)
def test_scale_pass_matches_definition_cpu(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    s = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    frag = _scale_definition(s)
    assert torch.equal(frag, to_fragment_scale_order(s))           # the torch path: the same permutation
    _both_ways(convert_scale_order, s, frag)


@cpu_kernels
def test_scale_pass_views_cpu():
    """A strided source goes through a copy; a source off an 8-byte boundary too; an out there is refused."""
    gen = torch.Generator().manual_seed(16)
    big = torch.randint(0, 256, (128, 33), dtype=torch.uint8, generator=gen)
    src = big[:, 1:17]
    assert torch.equal(convert_scale_order(src, torch.empty(128, 16, dtype=torch.uint8)), _scale_definition(src))
    flat = torch.randint(0, 256, (64 * 8 + 8,), dtype=torch.uint8, generator=gen)
    odd = flat[1:1 + 64 * 8].view(64, 8)
    assert torch.equal(convert_scale_order(odd, torch.empty(64, 8, dtype=torch.uint8)), _scale_definition(odd))
    with pytest.raises(ValueError, match="8-byte boundary"):
        convert_scale_order(torch.zeros(64, 8, dtype=torch.uint8), odd)


@gpu
@pytest.mark.parametrize("shape", [(128, 1536, 128), (128, 2048, 48), (4, 128, 8 * (MAX_STEPS + 3))])
def test_cuda_scale_conversion_is_bit_exact_gpu(shape):
    """On CUDA `to_fragment_scale_order` runs the pass: new tensor, in place (e4m3 too), and the inverse,
    against the permutation spelled out on the CPU."""
    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    s = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    frag = _scale_definition(s.cpu())
    assert torch.equal(to_fragment_scale_order(s).cpu(), frag)
    e4 = s.clone().view(torch.float8_e4m3fn)
    ptr = e4.data_ptr()
    assert to_fragment_scale_order(e4, out=e4) is e4 and e4.data_ptr() == ptr
    assert torch.equal(e4.view(torch.uint8).cpu(), frag)
    assert torch.equal(from_fragment_scale_order(e4, out=e4).view(torch.uint8), s)
