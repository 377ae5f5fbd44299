"""2-rank gloo checks of routing replay: the rollout's routes reach every router in Megatron's [s, b] order under
TP=2 with sequence parallelism, EP=2 and TP=2 x EP=2 (one torchrun launch of routing_replay_worker.py)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = ("tp1_ep1", "tp2_ep1", "tp1_ep2", "tp2_ep2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay_dist")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "megatron", "routing_replay_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_router_dispatches_the_replayed_routes(results, layout):
    for rank in results:
        assert rank[layout]["dispatched"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disagreement_is_the_by_hand_count_against_free_routing(results, layout):
    for rank in results:
        assert rank[layout]["some_free_differ"] and rank[layout]["diff_by_hand"]


def test_the_replayed_model_computes_the_single_rank_loss(results):
    ref = results[0]["tp1_ep1"]["loss"]
    for rank in results:
        for layout in LAYOUTS:
            assert rank[layout]["loss"] == pytest.approx(ref, rel=1e-5, abs=1e-6), layout
