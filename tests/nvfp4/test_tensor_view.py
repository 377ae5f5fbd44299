"""The ModelOpt checkpoint view and the shared gate/up global scale."""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.nvfp4 import NVFP4Tensor


def test_modelopt_names_round_trip():
    w = torch.randn(32, 64).bfloat16()
    q = nvfp4.quantize(w)
    view = q.to_modelopt()
    assert set(view) == {"weight", "weight_scale", "weight_scale_2"}
    assert view["weight"].dtype == torch.uint8 and view["weight"].shape == (32, 32)
    assert view["weight_scale"].dtype == torch.float8_e4m3fn and view["weight_scale"].shape == (32, 4)
    assert view["weight_scale_2"].dtype == torch.float32 and view["weight_scale_2"].shape == ()
    assert q.weight is q.data and q.weight_scale is q.scale and q.weight_scale_2 is q.global_scale
    back = NVFP4Tensor.from_modelopt(**view)
    assert back.shape == w.shape
    assert torch.equal(back.dequantize(), q.dequantize())


def test_from_modelopt_names_the_bad_tensor():
    view = nvfp4.quantize(torch.randn(8, 32)).to_modelopt()
    with pytest.raises(ValueError, match="layers.0.w: expected packed uint8"):
        NVFP4Tensor.from_modelopt(view["weight"].float(), view["weight_scale"],
                                  view["weight_scale_2"], name="layers.0.w")
    with pytest.raises(ValueError, match="w_scale: expected shape"):
        NVFP4Tensor.from_modelopt(view["weight"], view["weight_scale"][:, :1],
                                  view["weight_scale_2"], name="w")


def test_gate_and_up_share_one_global_scale():
    gate, up = torch.randn(48, 64), torch.randn(48, 64) * 5
    qg, qu = nvfp4.quantize_with_shared_scale([gate, up])
    assert torch.equal(qg.global_scale, qu.global_scale)
    assert torch.equal(qu.global_scale, nvfp4.quantize(up).global_scale)  # up holds the max
    fused = nvfp4.quantize(torch.cat([gate, up]))
    assert torch.equal(torch.cat([qg.data, qu.data]), fused.data)


def test_per_expert_global_scales_via_amax_shape():
    w = torch.randn(4, 32, 64) * torch.tensor([1.0, 2.0, 3.0, 4.0]).view(4, 1, 1)
    amax = w.abs().amax(dim=(1, 2), keepdim=True)
    q = nvfp4.quantize(w, amax=amax)
    assert q.global_scale.shape == (4, 1, 1)
    for e in range(4):
        qe = nvfp4.quantize(w[e])
        assert torch.equal(qe.data, q.data[e]) and torch.equal(qe.global_scale, q.global_scale[e, 0, 0])
    assert torch.equal(nvfp4.dequantize(q)[2], nvfp4.dequantize(nvfp4.quantize(w[2])))
