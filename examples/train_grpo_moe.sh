''':'
# GRPO on a Qwen3-MoE: Megatron-Core trainer (AQAT) + QUADS NVFP4 rollouts, logged to TensorBoard.
#
# This file is both a bash script and a Python program, so all of these work:
#   torchrun examples/train_grpo_moe.sh                                   # tiny default, 1 process
#   torchrun --nproc-per-node 2 examples/train_grpo_moe.sh --expert-model-parallel-size 2
#   bash examples/train_grpo_moe.sh [flags]     # launches torchrun (NPROC_PER_NODE, default 1)
#   python examples/train_grpo_moe.sh --help    # every flag
# The bash part below re-runs this file under torchrun with the repository's .venv if present.
# A user error ends with one line per rank and exit code 2 (torchrun's own failure report and
# traceback are left out: the ranks already said what failed); a signal ends with 128 + N.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3 || command -v python)"; fi
fi
exec "$PY" -c '
import logging, sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run
logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
try:
    run(get_args_parser().parse_args(sys.argv[1:]))
except ChildFailedError as e:
    code = e.get_first_failure()[1].exitcode
    sys.exit(128 - code if code < 0 else code)
except SignalException as e:
    sys.exit(128 + int(e.sigval))
' --standalone --nproc-per-node "${NPROC_PER_NODE:-1}" "${BASH_SOURCE[0]}" "$@"
'''
"""GRPO on a Qwen3-MoE with QUADS NVFP4 rollouts (see the comment above for how to launch)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns processes that re-import __main__
    from quads_megatron.rl.loop import run

    sys.exit(run(sys.argv[1:]))
