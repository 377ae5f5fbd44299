"""plan.kernel_layout: the one load-time conversion of rollout NVFP4 codes and block scales to the kernels' byte order."""

import pytest
import torch

from quads_megatron.kernels import reference, w4a4_fused_moe
from quads_megatron.kernels.ops import WEIGHT_LAYOUTS
from quads_megatron.nvfp4 import quantize
from quads_megatron.plan.kernel_layout import (KERNEL_WEIGHT_LAYOUT, from_kernel_layout, kernel_layout_fits,
                                               rows_to_kernel_layout, scales_from_kernel_layout,
                                               scales_to_kernel_layout, to_kernel_layout)


def _codes(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_in_place_reload_keeps_the_buffer_and_round_trips():
    ckpt = _codes(4, 128, 128)
    buf = ckpt.clone()
    ptr = buf.data_ptr()
    out = to_kernel_layout(buf, out=buf)            # a reload into the buffer a CUDA graph reads
    assert out.data_ptr() == ptr and buf.data_ptr() == ptr
    assert not torch.equal(buf, ckpt)
    assert torch.equal(from_kernel_layout(buf), ckpt)
    fresh = ckpt.clone()
    to_kernel_layout(_codes(4, 128, 128, seed=1), out=buf)  # the next weight update, same buffer
    to_kernel_layout(fresh, out=fresh)
    assert buf.data_ptr() == ptr and not torch.equal(buf, fresh)


def test_row_tiles_convert_independently():
    """Gate and up halves, one expert, an N shard: each converts alone to the same bytes."""
    w13 = _codes(3, 256, 64)     # [E, 2F, H/2] with F = 128, H = 128
    whole = to_kernel_layout(w13)
    assert torch.equal(whole[1], to_kernel_layout(w13[1]))
    assert torch.equal(whole[:, 128:], to_kernel_layout(w13[:, 128:]))
    assert torch.equal(whole[2, 64:192], to_kernel_layout(w13[2, 64:192]))


def test_a_partial_load_converts_each_written_row_once():
    """Experts' rows written in ModelOpt order over kernel-layout bytes: overlapping marks convert once."""
    old, new = _codes(3, 256, 64, seed=1), _codes(3, 256, 64, seed=2)
    buf = to_kernel_layout(old)
    buf[1, 128:] = new[1, 128:]           # expert 1's up half
    buf[2] = new[2]                       # all of expert 2
    rows_to_kernel_layout(buf, {1: range(128, 256), 2: list(range(0, 128)) + list(range(64, 256))})
    want = old.clone()
    want[1, 128:], want[2] = new[1, 128:], new[2]
    assert torch.equal(buf, to_kernel_layout(want))
    # the same on a strided view of the experts (converted expert by expert)
    big = torch.cat([to_kernel_layout(old), to_kernel_layout(old)], dim=-1)
    view = big[..., :64]
    view[1, 128:], view[2] = new[1, 128:], new[2]
    rows_to_kernel_layout(view, {1: range(128, 256), 2: range(256)})
    assert torch.equal(view, to_kernel_layout(want)) and torch.equal(big[..., 64:], to_kernel_layout(old))


def test_fits_and_errors():
    assert kernel_layout_fits(1536, 2048) and kernel_layout_fits(2048, 768)
    assert not kernel_layout_fits(96, 2048) and not kernel_layout_fits(64, 64)
    with pytest.raises(ValueError, match="w2: the fragment layout needs N a multiple of 64"):
        to_kernel_layout(_codes(32, 64), name="w2")
    with pytest.raises(ValueError, match="w13: out must be uint8"):
        to_kernel_layout(_codes(64, 64), out=torch.zeros(64, 32, dtype=torch.uint8), name="w13")
    with pytest.raises(ValueError, match=r"w13\[1, 0:32\]: the fragment layout needs N a multiple of 64"):
        rows_to_kernel_layout(_codes(2, 128, 64), {1: range(32)}, name="w13")
    with pytest.raises(ValueError, match=r"w13\[0, 96:128\]: the fragment layout"):  # a run across experts
        rows_to_kernel_layout(_codes(2, 128, 64), {0: range(96, 128), 1: range(32)}, name="w13")


def test_the_ops_read_converted_weights():
    """The layout name is one the ops take, and the op on converted weights is the op on ModelOpt's
    (torch backend: it reads them back; the Triton path is tested in tests/kernels)."""
    assert KERNEL_WEIGHT_LAYOUT in WEIGHT_LAYOUTS
    gen = torch.Generator().manual_seed(2)
    e, h, f, t = 2, 128, 128, 3
    qs13 = [quantize(torch.randn(2 * f, h, generator=gen) * 0.05) for _ in range(e)]
    qs2 = [quantize(torch.randn(h, f, generator=gen) * 0.05) for _ in range(e)]
    w13 = [torch.stack([getattr(q, a) for q in qs13]) for a in ("data", "scale")]
    w2 = [torch.stack([getattr(q, a) for q in qs2]) for a in ("data", "scale")]
    g13 = torch.stack([q.global_scale.reshape(()) for q in qs13])
    g2 = torch.stack([q.global_scale.reshape(()) for q in qs2])
    x = torch.randn(t, h, generator=gen)
    tw, ti = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), 1)
    ref = reference.w4a4_fused_moe(x, w13[0], w13[1], g13, w2[0], w2[1], g2, tw, ti.int(),
                                   act_mode="w4a16")
    out = w4a4_fused_moe(x, to_kernel_layout(w13[0]), scales_to_kernel_layout(w13[1]), g13,
                         to_kernel_layout(w2[0]), scales_to_kernel_layout(w2[1]),
                         g2, tw, ti.int(), act_mode="w4a16", backend="torch",
                         weight_layout=KERNEL_WEIGHT_LAYOUT)
    assert torch.equal(out, ref)


def test_pending_rows_convert_what_was_written_once():
    """PendingRows (every loader's bookkeeping): a whole-buffer write reads back as the buffer itself and
    converts whole; a partial write converts only its tiles (each once, however often written), the
    rest keeps its kernel-layout bytes; reading back in between returns the ModelOpt codes."""
    from quads_megatron.plan.kernel_layout import PendingRows

    old, new = _codes(3, 128, 64, seed=2), _codes(3, 128, 64, seed=3)
    buf, pending = old.clone(), PendingRows()
    pending.mark(range(3), 0, 64)
    pending.mark(range(3), 64, 128)              # two halves make the whole buffer
    assert pending.covers(buf) and pending.modelopt(buf) is buf
    pending.settle(buf)
    assert torch.equal(from_kernel_layout(buf), old) and not pending.spans
    buf[1, 64:128] = new[1, 64:128]              # a partial reload: expert 1's second tile, written twice
    pending.mark([1], 64, 128)
    pending.mark([1], 64, 128)
    assert not pending.covers(buf)
    want = old.clone()
    want[1, 64:128] = new[1, 64:128]
    assert torch.equal(pending.modelopt(buf), want)   # settled first, then read back
    assert torch.equal(from_kernel_layout(buf), want) and not pending.spans
    pending.settle(buf)                          # nothing pending: no second conversion
    assert torch.equal(from_kernel_layout(buf), want)
    flat = old[0].clone()                        # a dense [N, K/2] weight is one expert
    pending.mark([0], 0, 128)
    pending.settle(flat)
    assert torch.equal(flat, to_kernel_layout(old[0]))


def test_pending_scale_rows_convert_as_the_scale_layout():
    """PendingRows(scales=True) settles and reads back block scales [E, N, K/16] (float8_e4m3fn, as SGLang
    holds them) with the scales' permutation: a partial write converts its 64-row tiles alone."""
    from quads_megatron.plan.kernel_layout import PendingRows

    old, new = _codes(2, 128, 16, seed=4), _codes(2, 128, 16, seed=5)
    buf, pending = old.clone().view(torch.float8_e4m3fn), PendingRows(scales=True)
    pending.mark(range(2), 0, 128)
    pending.settle(buf)
    assert torch.equal(buf.view(torch.uint8), scales_to_kernel_layout(old))
    buf.view(torch.uint8)[1, 0:64] = new[1, 0:64]   # expert 1's first tile rewritten in ModelOpt order
    pending.mark([1], 0, 64)
    want = old.clone()
    want[1, 0:64] = new[1, 0:64]
    assert torch.equal(pending.modelopt(buf).view(torch.uint8), want)
    assert torch.equal(scales_from_kernel_layout(buf).view(torch.uint8), want)
    part = old.clone()                              # rows_to_kernel_layout: one tile of one expert alone
    rows_to_kernel_layout(part, {0: range(64, 128)}, name="w2_weight_scale", scales=True)
    assert torch.equal(part[0, 64:128], scales_to_kernel_layout(old[0, 64:128]))
    assert torch.equal(part[0, :64], old[0, :64]) and torch.equal(part[1], old[1])
