"""TE bridge: on a GPU with Transformer Engine NVFP4, TE's fake quant equals quads_megatron.nvfp4's bit for bit."""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.megatron import te_bridge


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_te_fake_quant_matches_ours(block_shape):
    ok, reason = te_bridge.te_nvfp4_status()
    if not ok:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 512, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    ours = nvfp4.dequantize(nvfp4.quantize(w, block_shape=block_shape), torch.bfloat16)
    assert torch.equal(te_bridge.te_fake_quantize(w, block_shape), ours)


def test_te_backend_without_te_is_a_clear_error():
    if te_bridge.te_nvfp4_status()[0]:
        pytest.skip("Transformer Engine NVFP4 is available here")
    with pytest.raises(RuntimeError, match="backend='te'.*Transformer Engine NVFP4"):
        te_bridge.require_te_nvfp4()
