"""Grouped NVFP4 (a layer's experts in one launch) equals per-group `core.quantize` with the shared amax.

The expected values come from the torch reference applied one scale group at a time (the way the
trainer and exporter quantized before the grouped kernel existed), never from the grouped code.
"""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.errors import InputError
from quads_megatron.nvfp4 import triton_kernels

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_kernels.available(), reason="triton not installed"))]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _mats(m, r, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, r, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1, 1), generator=g).float())
    x[:, :2, :16] *= 1e-6  # subnormal block scales
    return x.to(dtype).to(device)


def _per_group_reference(x, group):
    """[M, R, K] -> (data, scale bytes, S_dec per matrix, fake-quantized) with core.quantize per group."""
    data, scale, sdec, fake = [], [], [], []
    for g0 in range(0, x.shape[0], group):
        members = list(x[g0:g0 + group])
        amax = nvfp4.shared_amax(members, backend="torch")
        for t in members:
            q = nvfp4.quantize(t, amax=amax, backend="torch")
            data.append(q.data)
            scale.append(q.scale.view(torch.uint8))
            sdec.append(q.global_scale.reshape(()))
            fake.append(nvfp4.dequantize(q, t.dtype, backend="torch"))
    return torch.stack(data), torch.stack(scale), torch.stack(sdec), torch.stack(fake)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, group, as_list", [(torch.bfloat16, 2, True), (torch.float32, 1, False),
                                                   (torch.float16, 2, False), (torch.bfloat16, 1, False)])
def test_grouped_matches_per_group_quantize(device, backend, dtype, group, as_list):
    x = _mats(6, 20, 48, dtype, device, seed=group * 7 + int(as_list))  # 20 rows: tiles straddle matrices
    mats = list(x) if as_list else x
    ref_data, ref_scale, ref_sdec, ref_fake = _per_group_reference(x, group)
    q = nvfp4.quantize_grouped(mats, scale_group=group, backend=backend)
    assert q.shape == x.shape and q.global_scale.shape == (6, 1, 1)
    assert torch.equal(q.data, ref_data)
    assert torch.equal(q.scale.view(torch.uint8), ref_scale)
    assert torch.equal(q.global_scale.view(-1), ref_sdec)
    fake = nvfp4.fake_quantize_grouped(mats, scale_group=group, backend=backend)
    assert torch.equal(_bits(fake), _bits(ref_fake))
    assert torch.equal(_bits(nvfp4.dequantize(q, dtype, backend="torch")), _bits(ref_fake))


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_amax_and_in_place_outputs(backend):
    x = _mats(4, 16, 32, torch.bfloat16, "cpu", seed=3)
    amax, bad = nvfp4.amax_grouped(x, scale_group=2, backend=backend)
    assert torch.equal(amax, x.view(2, -1).abs().amax(dim=1).float()) and not bad.any()
    doubled = amax * 2  # e.g. the max over a TP group: S_enc follows the given amax
    out = (torch.empty(4, 16, 16, dtype=torch.uint8), torch.empty(4, 16, 2, dtype=torch.float8_e4m3fn),
           torch.empty(2, dtype=torch.float32))
    q = nvfp4.quantize_grouped(x, scale_group=2, amax=doubled, out=out, backend=backend)
    assert q.data.data_ptr() == out[0].data_ptr() and q.scale.data_ptr() == out[1].data_ptr()
    for g in range(2):
        want = nvfp4.quantize(x[2 * g], amax=doubled[g], backend="torch")
        assert torch.equal(out[0][2 * g], want.data) and torch.equal(out[2][g], want.global_scale)
    fake_out = torch.empty_like(x)
    fake = nvfp4.fake_quantize_grouped(x, scale_group=2, amax=doubled, out=fake_out, backend=backend)
    assert fake.data_ptr() == fake_out.data_ptr()
    want = nvfp4.fake_quantize(x[1], amax=doubled[0], backend="torch")
    assert torch.equal(fake[1].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_group_gets_nan_scale_and_others_stay_exact(backend):
    x = _mats(4, 16, 32, torch.bfloat16, "cpu", seed=5)
    ref = _per_group_reference(x, 1)
    x[2, 7, 9] = float("inf")
    x[0, 1, 3] = float("nan")
    q = nvfp4.quantize_grouped(x, backend=backend)
    s = q.global_scale.view(-1)
    assert torch.isnan(s[0]) and torch.isnan(s[2])
    assert torch.equal(s[[1, 3]], ref[2][[1, 3]]) and torch.equal(q.data[[1, 3]], ref[0][[1, 3]])
    assert nvfp4.amax_grouped(x, backend=backend)[1].tolist() == [1, 0, 1, 0]
    fake = nvfp4.fake_quantize_grouped(x, backend=backend)
    assert torch.isnan(fake[0]).all() and torch.isnan(fake[2]).all() and torch.isfinite(fake[[1, 3]]).all()


def test_bad_input_is_named():
    x = torch.zeros(2, 16, 32)
    with pytest.raises(InputError, match="experts\\[1\\].*must match"):
        nvfp4.quantize_grouped([x[0], torch.zeros(8, 32)], name="experts")
    with pytest.raises(InputError, match="multiple of 16"):
        nvfp4.quantize_grouped(torch.zeros(2, 4, 24))
    with pytest.raises(InputError, match="scale groups of 2"):
        nvfp4.quantize_grouped(torch.zeros(3, 4, 32), scale_group=2)
    with pytest.raises(InputError, match="one per scale group"):
        nvfp4.quantize_grouped(x, amax=torch.ones(3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, group, as_list", [(torch.bfloat16, 1, True), (torch.bfloat16, 2, False),
                                                   (torch.float32, 1, False)])
def test_refit_grouped_writes_both_results_from_one_read(device, backend, dtype, group, as_list):
    """The refit's one pass: fake-quantized values AND packed codes/scales, each equal to the per-group reference,
    into given buffers (the AQAT cache and the rollout engine's) in place."""
    x = _mats(6, 20, 48, dtype, device, seed=11 + group)
    mats = list(x) if as_list else x
    ref_data, ref_scale, ref_sdec, ref_fake = _per_group_reference(x, group)
    fake, q = nvfp4.refit_grouped(mats, scale_group=group, backend=backend)
    assert torch.equal(_bits(fake), _bits(ref_fake)) and torch.equal(q.data, ref_data)
    assert torch.equal(q.scale.view(torch.uint8), ref_scale) and torch.equal(q.global_scale.view(-1), ref_sdec)
    out = (torch.zeros_like(ref_data), torch.zeros(ref_scale.shape, dtype=torch.float8_e4m3fn, device=device),
           torch.zeros(6 // group, device=device))
    out_fake = torch.zeros_like(x)
    amax = torch.stack([x[i:i + group].abs().amax().float() for i in range(0, 6, group)])
    fake2, q2 = nvfp4.refit_grouped(mats, scale_group=group, amax=amax, out=out, out_fake=out_fake, backend=backend)
    assert fake2.data_ptr() == out_fake.data_ptr() and q2.data.data_ptr() == out[0].data_ptr()
    assert torch.equal(_bits(out_fake), _bits(ref_fake)) and torch.equal(out[0], ref_data)
    assert torch.equal(out[1].view(torch.uint8), ref_scale) and torch.equal(out[2].repeat_interleave(group), ref_sdec)


@pytest.mark.parametrize("k", [16, 48, 768, 1536, 2048, 5120, 8192])
def test_grouped_tile_has_no_partly_masked_step_and_a_block_per_thread(k):
    """The launch shape's invariants (the kernel is exact with any shape; these are what make it fast):
    K splits into whole inner steps, and a step holds at least one 16-element block per thread."""
    for mode in (triton_kernels.AMAX_GIVEN, triton_kernels.AMAX_ONLY):
        t = triton_kernels.grouped_tile(k, mode)
        assert k % t["block_k"] == 0 and t["block_k"] <= 512
        assert t["block_r"] * t["block_k"] // 16 >= 32 * t["num_warps"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.skipif(not triton_kernels.available(), reason="triton not installed")
def test_rows_off_16_byte_boundaries_are_loaded_as_such(device):
    """Matrices that start 4 bytes past a 16-byte boundary: the kernel may not assume 128-bit-aligned rows,
    and its results still equal the per-group reference. 2 bytes past (an odd bf16 offset) is refused by name."""
    x = _mats(4, 20, 64, torch.bfloat16, device, seed=13)
    flat = torch.empty(x.numel() + 2, dtype=x.dtype, device=device)
    shifted = flat[2:].view(x.shape)
    shifted.copy_(x)
    mats = [shifted, list(shifted)]
    assert [triton_kernels.pointer_table(m)[-1] for m in mats] == [4, 4]
    ref_data, ref_scale, ref_sdec, ref_fake = _per_group_reference(x, 1)
    for m in mats:
        fake, q = nvfp4.refit_grouped(m, backend="triton")
        assert torch.equal(_bits(fake), _bits(ref_fake)) and torch.equal(q.data, ref_data)
        assert torch.equal(q.scale.view(torch.uint8), ref_scale) and torch.equal(q.global_scale.view(-1), ref_sdec)
    odd = flat[1:-1].view(x.shape)
    with pytest.raises(InputError, match="2-byte boundary, not a 4-byte one"):
        nvfp4.quantize_grouped(odd, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pointer_table_is_kept_per_address_set():
    """A refit's tables are reused while the weights keep their addresses, and follow them when they move."""
    mats = [torch.zeros(16, 32, device="cuda") for _ in range(3)]
    first = triton_kernels.pointer_table(mats)[0]
    assert triton_kernels.pointer_table(mats)[0] is first
    assert first.tolist() == [t.data_ptr() for t in mats]
    moved = [mats[0], torch.zeros(16, 32, device="cuda"), mats[2]]
    assert triton_kernels.pointer_table(moved)[0].tolist() == [t.data_ptr() for t in moved]
