"""Flags for a few-second GRPO run of the tiny model (shared by the RL tests)."""

TINY = ["--task", "sort:3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--max-new-tokens", "5",
        "--seq-length", "16", "--sft-iters", "3", "--sft-batch-size", "8", "--eval-interval", "2",
        "--quant-error-interval", "2", "--no-progress"]
