"""`python -m quads_megatron.rl [flags]`: the GRPO job (same as examples/train_grpo_moe.sh)."""

import sys

from quads_megatron.rl.loop import main

if __name__ == "__main__":
    main(sys.argv[1:])
