"""The paper's measurements in miniature: rollout-trainer gaps, per-layer errors, RAC sweeps, decode speed.

Each ``tools/paper_*.py`` command is a thin argparse front end over these functions and writes its
numbers as JSON and its plot as PNG (``docs/results.md`` cites them). They build the same trainer,
quantization plan and local rollout engine as the GRPO job; nothing here re-derives a scale.
"""
