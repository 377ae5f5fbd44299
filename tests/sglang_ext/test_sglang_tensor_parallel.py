"""TP = 2 on CPU: two gloo ranks load full checkpoint tensors through SGLang's sharding loaders.

Each rank (tests/sglang_ext/sglang_tp2_worker.py) checks its QKV (column-parallel, RAC),
row-parallel (all-reduced; RAC there is refused), expert-TP FusedMoE and, re-published as
EP = 2, expert-parallel FusedMoE with RAC (other ranks' experts as SGLang's -1 ids) against
the kernel reference on its share of the checkpoint.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed")

HERE = Path(__file__).resolve().parent


def test_two_rank_sharded_loading_matches_reference():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    env.pop("SGLANG_PLUGINS", None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "sglang_tp2_worker.py"), str(r), str(port)],
                              env=env, cwd=HERE.parents[1], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{out[-4000:]}"
        assert f"rank {r}: ok" in out
