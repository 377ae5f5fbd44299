"""Hand-computed NVFP4 vectors: every E2M1 tie, saturation, zero blocks, E4M3 ties, -0.0."""

import pytest
import torch

from quads_megatron import nvfp4

# With one element equal to 2688 the tensor amax gives S_enc = 2688 / 2688 = 1 exactly, so
# a block whose amax is 6 gets scale e4m3(1.0) and its values are their own scaled values.
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
TIE_CODES = [0, 2, 2, 4, 4, 6, 6, 7]  # round half to even on the E2M1 grid (TE's thresholds)


def _codes(q):
    d = q.data
    return torch.stack((d & 0xF, d >> 4), -1).reshape(*d.shape[:-1], -1)


def _with_anchor(blocks):
    """Rows of 16 values plus a first block [2688, 0...] that fixes S_enc = 1."""
    anchor = [2688.0] + [0.0] * 15
    return torch.tensor([anchor + b for b in blocks], dtype=torch.float32)


def test_global_scale_is_one_for_amax_2688():
    q = nvfp4.quantize(_with_anchor([[1.0] * 16]))
    assert q.global_scale.item() == 1.0
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == ()
    # the anchor block: 2688 -> scale 448 (0x7E), code 7 (= 6 * 448)
    assert q.scale.view(torch.uint8)[0, 0].item() == 0x7E
    assert _codes(q)[0, 0].item() == 7


def test_every_e2m1_tie_and_its_negative():
    block = TIES + [-t for t in TIES]
    q = nvfp4.quantize(_with_anchor([block]))
    assert q.scale.view(torch.uint8)[0, 1].item() == 0x38  # e4m3(1.0)
    expected = TIE_CODES + [c | 8 for c in TIE_CODES]
    assert _codes(q)[0, 16:].tolist() == expected
    # -0.25 rounds to -0 (code 8) as in TE; it decodes to -0.0
    dq = nvfp4.dequantize(q, torch.float32)[0, 16:]
    assert dq[8].item() == 0.0 and torch.signbit(dq[8])


def test_between_grid_points_and_saturation():
    block = [0.3, 0.7, 1.1, 1.4, 1.9, 2.7, 3.6, 4.9, 5.01, 5.5, 6.0, 0.2, -0.3, -5.2, 0.26, 4.0]
    q = nvfp4.quantize(_with_anchor([block]))
    assert _codes(q)[0, 16:].tolist() == [1, 1, 2, 3, 4, 5, 6, 6, 7, 7, 7, 0, 9, 15, 1, 6]


def test_block_scale_ties_and_clamp_above_six():
    # amax 6.375 -> 6.375/6 = 1.0625, the tie between e4m3 1.0 and 1.125: RNE picks 1.0,
    # so 6.375 scales to 6.375 > 6 and saturates to code 7.
    lo = [6.375] + [0.0] * 15
    # amax 7.125 -> 1.1875, the tie between 1.125 and 1.25: RNE picks 1.25 (0x3A).
    hi = [7.125] + [0.0] * 15
    q = nvfp4.quantize(_with_anchor([lo, hi]))
    s = q.scale.view(torch.uint8)
    assert s[0, 1].item() == 0x38 and _codes(q)[0, 16].item() == 7
    assert s[1, 1].item() == 0x3A
    assert nvfp4.dequantize(q, torch.float32)[0, 16].item() == 6.0


def test_zero_block_and_negative_zero():
    q = nvfp4.quantize(_with_anchor([[-0.0] * 16]))
    assert q.scale.view(torch.uint8)[0, 1].item() == 0x00  # TE: zero block -> scale byte 0
    assert _codes(q)[0, 16:].tolist() == [0] * 16  # -0.0 * enc is -0.0, not < 0: code 0


def test_all_zero_tensor_has_unit_global_scale():
    for per_row in (False, True):
        q = nvfp4.quantize(torch.zeros(2, 32), per_row=per_row)
        assert torch.all(q.global_scale == 1.0)
        assert torch.all(q.data == 0) and torch.all(q.scale.view(torch.uint8) == 0)
        assert torch.all(nvfp4.dequantize(q) == 0)


def test_per_row_global_scales():
    x = torch.randn(3, 32) * torch.tensor([[1.0], [100.0], [1e-3]])
    q = nvfp4.quantize(x, per_row=True)
    assert q.global_scale.shape == (3, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.equal(q.global_scale, torch.div(1.0, torch.div(torch.tensor(2688.0), amax)))
    for r in range(3):
        qr = nvfp4.quantize(x[r:r + 1])
        assert torch.equal(qr.data[0], q.data[r]) and torch.equal(qr.scale[0].view(torch.uint8),
                                                                  q.scale[r].view(torch.uint8))


def test_subnormal_block_scale():
    # block amax tiny relative to the tensor: scale is an e4m3 subnormal (k * 2^-9)
    x = _with_anchor([[3 * 2 ** -9 * 6] + [0.0] * 15])
    q = nvfp4.quantize(x)
    assert q.scale.view(torch.uint8)[0, 1].item() == 3
    assert _codes(q)[0, 16].item() == 7


def test_two_dimensional_blocks_share_scale_over_16_rows():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    w[5, 17] = 40.0  # dominates block (rows 0-15, cols 16-31)
    q = nvfp4.quantize(w, block_shape=(16, 16))
    s = q.scale.view(torch.uint8)
    assert s.shape == (32, 4)
    assert torch.equal(s[:16], s[0:1].expand(16, 4)) and torch.equal(s[16:], s[16:17].expand(16, 4))
    # the row-wise quantization of the same tensor differs in that block's rows
    q1 = nvfp4.quantize(w)
    assert not torch.equal(q1.scale.view(torch.uint8)[:16, 1], s[:16, 1])
    assert nvfp4.dequantize(q, torch.float32).shape == w.shape


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([[float("nan")] + [0.0] * 15]), "NaN"),
    (torch.tensor([[float("inf")] + [0.0] * 15]), "Inf"),
    (torch.randn(4, 24), "multiple of 16"),
    (torch.randint(0, 5, (4, 16)), "float32, bfloat16 or float16"),
    (torch.empty(0, 16), "empty"),
])
def test_bad_input_is_a_clear_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        nvfp4.quantize(bad)


def test_bad_options():
    with pytest.raises(ValueError, match="block_shape"):
        nvfp4.quantize(torch.randn(16, 16), block_shape=(1, 32))
    with pytest.raises(ValueError, match="second-to-last"):
        nvfp4.quantize(torch.randn(8, 16), block_shape=(16, 16))
    with pytest.raises(ValueError, match="per_row"):
        nvfp4.quantize(torch.randn(16, 16), block_shape=(16, 16), per_row=True)
    with pytest.raises(ValueError, match="amax"):
        nvfp4.quantize(torch.randn(4, 16), amax=torch.ones(3))
