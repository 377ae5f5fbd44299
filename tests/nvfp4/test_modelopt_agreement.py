"""We follow TE; NVIDIA ModelOpt computes the same format in another order. They agree on
every code and scale except where the exact value sits on an E4M3 or E2M1 rounding tie."""

import pytest
import torch

from quads_megatron import nvfp4

modelopt_nvfp4 = pytest.importorskip(
    "modelopt.torch.quantization.qtensor.nvfp4_tensor",
    reason="nvidia-modelopt (installed --no-deps by tools/setup_venv.sh) is not importable")
NVFP4QTensor = modelopt_nvfp4.NVFP4QTensor

E4M3_GRID = torch.tensor([0.0] + [m * 2.0 ** -9 for m in range(1, 8)]
                         + [(1 + m / 8) * 2.0 ** e for e in range(-6, 9) for m in range(8)],
                         dtype=torch.float64)
E4M3_MIDPOINTS = (E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def _near(values, points, rel=1e-5):
    d = (values.unsqueeze(-1) - points).abs()
    return (d <= rel * points.abs().clamp(min=1e-30)).any(-1)


def _codes(data):
    return torch.stack((data & 0xF, data >> 4), -1).reshape(*data.shape[:-1], -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_codes_and_scales_equal_modelopt_except_at_ties(seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(256, 512, generator=g) * torch.exp2(torch.randint(-6, 6, (256, 1),
                                                                       generator=g))).bfloat16()
    ours = nvfp4.quantize(x)
    mo, mo_scale, mo_scale_2 = NVFP4QTensor.quantize(x, 16)

    amax = x.abs().amax().double()
    xb = x.double().view(256, 32, 16)
    exact_scale = xb.abs().amax(-1) * 448.0 / amax          # the real-number block scale
    s_ours, s_mo = ours.scale.view(torch.uint8), mo_scale.view(torch.uint8)
    scale_diff = s_ours != s_mo
    assert scale_diff.float().mean() < 0.02
    assert torch.all(_near(exact_scale[scale_diff], E4M3_MIDPOINTS)), \
        "a block scale differs from ModelOpt away from an E4M3 tie"

    same_scale = ~scale_diff
    exact_scaled = xb.abs() / (ours.scale.double() * amax / 2688.0).unsqueeze(-1)
    code_diff = (_codes(ours.data) != _codes(mo._quantized_data)).view(256, 32, 16)
    code_diff &= same_scale.unsqueeze(-1)
    assert code_diff.float().mean() < 0.02
    assert torch.all(_near(exact_scaled[code_diff], E2M1_MIDPOINTS)), \
        "an E2M1 code differs from ModelOpt away from a rounding tie"
    # the two global scales are the same number up to fp32 rounding of amax / 2688
    assert torch.allclose(ours.global_scale, mo_scale_2, rtol=2e-7, atol=0)


def test_modelopt_dequantizes_our_checkpoint_view_to_our_values():
    """ModelOpt decodes e2m1 * (sf * S_dec): one extra fp32 rounding versus our
    (e2m1 * sf) * S_dec, whose first product is exact. So: equal to an fp32 ulp."""
    torch.manual_seed(3)
    w = torch.randn(64, 128).bfloat16()
    view = nvfp4.quantize(w).to_modelopt()
    mo = NVFP4QTensor(w.shape, torch.float32, view["weight"])
    theirs = mo.dequantize(dtype=torch.float32, scale=view["weight_scale"],
                           double_scale=view["weight_scale_2"], block_sizes={-1: 16})
    ours = nvfp4.dequantize(nvfp4.quantize(w), torch.float32)
    assert torch.allclose(theirs, ours, rtol=2.5e-7, atol=0)
