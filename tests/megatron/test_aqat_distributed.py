"""2-rank gloo checks of AQAT under TP=2, EP=2, and TP=2 x EP=2 with expert-TP=1 (one torchrun launch)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = ("tp2_ep1_etp2", "tp1_ep2_etp1", "tp2_ep2_etp1")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("aqat_dist")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "megatron", "dist_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    ranks[0]["ckpt_dir"] = str(out / "ckpt")
    return ranks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gathered_fake_quant_is_bitwise_full_weight_quant(results, layout):
    for rank in results:
        r = rank[layout]
        assert r["checked"] > 0 and r["finite_loss"]
        assert r["bitwise"], f"{layout}: gathered fake-quant != dequantize(quantize(full))"
        assert r["logical"], f"{layout}: sharded experts are not the layout-independent weights"
        assert r["group_size_ok"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gate_and_up_share_one_global_scale(results, layout):
    for rank in results:
        assert rank[layout]["shared_scale"]


def test_expert_tp_amax_reduction_is_needed(results):
    assert any(rank["tp2_ep1_etp2"]["local_differs"] for rank in results)
    assert any(rank["tp2_ep1_etp2"]["naive_differs"] for rank in results)


def test_tp2_model_computes_the_single_rank_loss(results):
    """Same logical weights and one global scale per expert: TP=2 AQAT loss = TP=1 AQAT loss (rank 0's batch)."""
    tp1, tp2 = results[0]["tp1_ep1_etp1"]["loss"], results[0]["tp2_ep1_etp2"]["loss"]
    assert abs(tp1 - tp2) <= 1e-5 * abs(tp1), (tp1, tp2)


def test_ep_layouts_compute_the_single_rank_loss(results):
    """The builder's layout-independent init: EP=2 (and TP=2 x EP=2) is the same model as TP=1."""
    for rank in results:  # same data-parallel rank, same batch
        for layout, ref in (("tp1_ep2_etp1", "tp1_ep1_etp1"), ("tp2_ep2_etp1", "tp2_ep1_etp2")):
            a, b = rank[layout]["loss"], rank[ref]["loss"]
            assert abs(a - b) <= 1e-5 * abs(b), (layout, a, ref, b)


def test_per_token_activation_scale_spans_the_k_shards(results):
    """train_precision='w4a4' under expert-TP=2: gathered fc2 GEMM input = fake_quantize(full input)."""
    for rank in results:
        assert rank["act_tp2"]["checked"] > 0 and rank["act_tp2"]["bitwise"]


def test_dist_checkpoint_resume_is_identical(results):
    for rank in results:
        r = rank["resume"]
        assert r["fresh_differed"], "the fresh model must start from other weights"
        assert r["masters_equal"] and r["fp32_masters"], "master weights not restored unquantized"
        assert r["recipe_equal"], "the recipe did not round-trip through the checkpoint"
        assert r["resumed"] == r["after"], f"resumed losses {r['resumed']} != {r['after']}"


def test_checkpoint_recipe_is_readable_and_checked(results):
    """The stored recipe reads back in a plain process; a model converted otherwise refuses to load."""
    from quads_megatron.megatron.aqat import apply_quads
    from quads_megatron.errors import CheckpointError
    from quads_megatron.megatron.checkpoint import load_checkpoint, load_recipe, save_checkpoint
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.parallel import initialize_distributed
    from quads_megatron.megatron.presets import qwen3_moe_config
    from quads_megatron.recipe import QuadsRecipe

    ckpt = results[0]["ckpt_dir"]
    assert load_recipe(ckpt) == QuadsRecipe(bf16_last_layers=1, activation_scaling="static")
    initialize_distributed()
    model = apply_quads(build_gpt_model(qwen3_moe_config("tiny"), 256, 16), QuadsRecipe())
    with pytest.raises(ValueError, match="was saved with recipe"):
        load_checkpoint(model, ckpt)
    with pytest.raises(CheckpointError, match="not empty"):
        save_checkpoint(model, ckpt)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load_recipe(ckpt + "_missing")
