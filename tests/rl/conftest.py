"""Shared helpers for the RL tests: a tiny, fast flag set for the GRPO job."""

import pytest

TINY = ["--task", "sort:3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--max-new-tokens", "5",
        "--seq-length", "16", "--sft-iters", "3", "--sft-batch-size", "8", "--eval-interval", "2",
        "--quant-error-interval", "2", "--no-tqdm"]


@pytest.fixture
def tiny_args(tmp_path):
    """Build flags for a few-second GRPO run writing under tmp_path."""
    def make(*extra, tb="tb"):
        return TINY + ["--tensorboard-dir", str(tmp_path / tb)] + list(extra)
    return make
