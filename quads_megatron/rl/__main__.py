"""`python -m quads_megatron.rl [flags]`: the GRPO job (same as examples/train_grpo_moe.sh)."""

import sys

from quads_megatron.rl.loop import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
