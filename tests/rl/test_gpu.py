"""GRPO on CUDA: Megatron trainer on GPU, local engine on the Triton W4A4(+RAC) kernels (skipped without CUDA)."""

import math

import pytest

from quads_megatron.rl.loop import main


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "w4a16", "w16a4", "w4a4", "quads"])
def test_grpo_on_gpu(tiny_args, precision):
    out = main(tiny_args("--train-iters", "3", "--bf16", "--rollout-precision", precision))
    for h in out["history"]:
        assert math.isfinite(h["reward"]) and math.isfinite(h["gap"])
        assert h["gap"] < 0.1, h  # BF16 trainer vs BF16/NVFP4 rollout: small, not a sync bug
