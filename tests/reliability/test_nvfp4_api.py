"""Bad input to the nvfp4 API: every malformed NVFP4Tensor field, NaN/Inf input, and check_finite=False.

Each case builds its own bad tensor and checks the named error (InputError / ConfigError /
NonFiniteError) and the field it names; the non-finite cases with check_finite=False check
that the damage is NaN (visible), not finite garbage, and that the finite rows are untouched.
"""

import re

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.errors import ConfigError, InputError, NonFiniteError
from quads_megatron.nvfp4 import NVFP4Tensor

HF = "model.layers.0.mlp.experts.1.up_proj.weight"


def _x(rows=4, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g)


def _fields(rows=4, k=64):
    q = nvfp4.quantize(_x(rows, k))
    return dict(data=q.data, scale=q.scale, global_scale=q.global_scale, shape=q.shape)


# --- quantize: NaN / Inf ------------------------------------------------------------------
@pytest.mark.parametrize("bad,word", [(float("inf"), "Inf"), (float("-inf"), "Inf"), (float("nan"), "NaN")])
def test_quantize_names_the_tensor_holding_nan_or_inf(bad, word):
    x = _x()
    x[2, 5] = bad
    with pytest.raises(NonFiniteError, match=rf"^{HF}: contains {word} \(1 of 256 elements, first at \(2, 5\)\)"):
        nvfp4.quantize(x, name=HF)


def test_check_finite_false_inf_gives_nan_rows_not_2688():
    """Per-row: the row with Inf decodes to NaN; every other row equals quantizing it alone."""
    x = _x()
    x[1, 3] = float("inf")
    q = nvfp4.quantize(x, per_row=True, check_finite=False)
    y = nvfp4.dequantize(q, torch.float32)
    assert bool(torch.isnan(y[1]).all())
    assert not bool((y == 2688).any())
    for r in (0, 2, 3):
        alone = nvfp4.dequantize(nvfp4.quantize(x[r:r + 1], per_row=True), torch.float32)
        assert torch.equal(y[r:r + 1], alone)


def test_check_finite_false_inf_per_tensor_is_all_nan():
    x = _x()
    x[0, 0] = float("-inf")
    y = nvfp4.dequantize(nvfp4.quantize(x, check_finite=False), torch.float32)
    assert bool(torch.isnan(y).all())


def test_check_finite_false_per_expert_amax_marks_only_that_expert():
    w = torch.randn(3, 16, 32)
    amax = w.abs().amax(dim=(1, 2), keepdim=True)
    w[1, 4, 7] = float("nan")
    q = nvfp4.quantize(w, amax=amax, check_finite=False)
    assert q.global_scale.shape == (3, 1, 1)
    assert torch.isnan(q.global_scale).flatten().tolist() == [False, True, False]


def test_check_finite_false_is_bit_identical_on_finite_input():
    x = _x(8, 128, seed=3)
    for per_row in (False, True):
        a = nvfp4.quantize(x, per_row=per_row)
        b = nvfp4.quantize(x, per_row=per_row, check_finite=False)
        assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        assert torch.equal(a.global_scale, b.global_scale)


# --- quantize: bad arguments --------------------------------------------------------------
@pytest.mark.parametrize("block_shape", [(7, 7), (1, 32), (16,), "ab"])
def test_quantize_refuses_an_unsupported_block_shape(block_shape):
    with pytest.raises(ConfigError, match=r"block_shape: expected one of \[\(1, 16\), \(16, 16\)\]"):
        nvfp4.quantize(_x(), block_shape=block_shape)


@pytest.mark.parametrize("x,match", [
    (torch.ones(4, 64, dtype=torch.int32), r"^w: expected a float32, bfloat16 or float16 tensor, got torch.int32"),
    (torch.ones(4, 40), r"^w: the last dimension must be a multiple of 16"),
    (torch.ones(0, 64), r"^w: cannot quantize an empty tensor"),
])
def test_quantize_refuses_bad_input_tensors(x, match):
    with pytest.raises(InputError, match=match):
        nvfp4.quantize(x, name="w")


# --- NVFP4Tensor: every field ---------------------------------------------------------------
def test_valid_fields_construct_and_decode_like_quantize():
    f = _fields()
    q = NVFP4Tensor(**f)
    assert torch.equal(nvfp4.dequantize(q), nvfp4.dequantize(nvfp4.quantize(_x())))


@pytest.mark.parametrize("field,bad,exc,match", [
    ("scale", lambda f: f["scale"][:, :1], InputError,
     r"NVFP4Tensor.scale: expected shape \(4, 4\) .*no broadcasting\), got \(4, 1\)"),
    ("scale", lambda f: f["scale"].view(torch.uint8), InputError,
     r"NVFP4Tensor.scale: expected float8_e4m3fn block scales, got torch.uint8 .*view\(torch.float8_e4m3fn\)"),
    ("scale", lambda f: f["scale"].float(), InputError, r"NVFP4Tensor.scale: expected float8_e4m3fn"),
    ("scale", lambda f: _set_byte(f["scale"], 0x7F), InputError, r"NVFP4Tensor.scale: 1 block scales are NaN"),
    ("scale", lambda f: _set_byte(f["scale"], 0xFF), InputError, r"NVFP4Tensor.scale: 1 block scales are NaN"),
    ("scale", lambda f: _set_byte(f["scale"], 0xB8), InputError, r"NVFP4Tensor.scale: 1 block scales are negative"),
    ("global_scale", lambda f: -f["global_scale"], InputError, r"NVFP4Tensor.global_scale: expected finite values > 0"),
    ("global_scale", lambda f: torch.tensor(float("nan")), InputError, r"NVFP4Tensor.global_scale: .*found nan"),
    ("global_scale", lambda f: torch.tensor(float("inf")), InputError, r"NVFP4Tensor.global_scale: .*found inf"),
    ("global_scale", lambda f: torch.tensor(0.0), InputError, r"NVFP4Tensor.global_scale: .*found 0.0"),
    ("global_scale", lambda f: f["global_scale"].double(), InputError,
     r"NVFP4Tensor.global_scale: expected a float32 tensor"),
    ("global_scale", lambda f: torch.ones(3), InputError, r"NVFP4Tensor.global_scale: shape \(3,\) does not broadcast"),
    ("data", lambda f: f["data"].to(torch.int8), InputError, r"NVFP4Tensor.data: expected packed uint8"),
    ("data", lambda f: f["data"][:, :16], InputError, r"NVFP4Tensor.data: expected shape \(4, 32\)"),
    ("shape", lambda f: torch.Size((4, 40)), InputError, r"NVFP4Tensor.shape: the last dimension must be"),
])
def test_construction_refuses_each_bad_field(field, bad, exc, match):
    f = _fields()
    f[field] = bad(f)
    with pytest.raises(exc, match=match):
        NVFP4Tensor(**f)


def _set_byte(scale, byte):
    bits = scale.view(torch.uint8).clone()
    bits[1, 2] = byte
    return bits.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("block_shape", [(7, 7), (16, 1)])
def test_construction_refuses_an_unsupported_block_shape(block_shape):
    with pytest.raises(ConfigError, match=r"block_shape: .*got " + re.escape(str(block_shape))):
        NVFP4Tensor(**_fields(), block_shape=block_shape)


def test_16x16_blocks_need_rows_in_multiples_of_16():
    with pytest.raises(InputError, match=r"NVFP4Tensor.shape: 16x16 blocks need"):
        NVFP4Tensor(**_fields(rows=4), block_shape=(16, 16))


def test_dequantize_rechecks_a_replaced_field_and_refuses_other_types():
    q = nvfp4.quantize(_x())
    q.scale = q.scale[:, :2]
    with pytest.raises(InputError, match=r"NVFP4Tensor.scale: expected shape \(4, 4\)"):
        nvfp4.dequantize(q)
    with pytest.raises(InputError, match=r"dequantize expects an NVFP4Tensor, got Tensor"):
        nvfp4.dequantize(_x())


# --- from_modelopt: checkpoint tensors ------------------------------------------------------
def test_from_modelopt_reinterprets_uint8_scale_bytes():
    view = nvfp4.quantize(_x()).to_modelopt()
    as_bytes = view["weight_scale"].view(torch.uint8).clone()
    q = NVFP4Tensor.from_modelopt(view["weight"], as_bytes, view["weight_scale_2"], name=HF)
    # expected: the original E4M3 scales, byte for byte (a by-value cast would turn 0x38 into 56.0)
    assert torch.equal(q.scale.view(torch.uint8), view["weight_scale"].view(torch.uint8))


@pytest.mark.parametrize("key,bad,match", [
    ("weight_scale_2", lambda v: torch.tensor(float("inf")), rf"{HF}.global_scale: .*found inf"),
    ("weight_scale_2", lambda v: torch.tensor(1), rf"{HF}_scale_2: expected a float32 per-tensor scale"),
    ("weight_scale", lambda v: _set_byte(v["weight_scale"], 0x7F), rf"{HF}.scale: 1 block scales are NaN"),
    ("weight_scale", lambda v: v["weight_scale"].to(torch.bfloat16), rf"{HF}_scale: expected float8_e4m3fn"),
])
def test_from_modelopt_names_the_checkpoint_tensor(key, bad, match):
    view = nvfp4.quantize(_x()).to_modelopt()
    view[key] = bad(view)
    with pytest.raises(InputError, match=match):
        NVFP4Tensor.from_modelopt(**view, name=HF)
