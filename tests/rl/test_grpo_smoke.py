"""End-to-end GRPO on the tiny Qwen3-MoE with the local engine (CPU, one process).

What a broken loop fails here: the policy must learn (reward of the last steps clearly above the
first, with the default AQAT trainer and QUADS rollouts); the train/rollout log-prob gap must be
~0 where both sides compute the same thing (BF16, or W4A16 with synced fake-quant weights) and
clearly non-zero where the rollout quantizes activations (W4A4); the logs and summary.json must
hold every field, finite and matching what the run recorded step by step.
"""

import json
import math

import pytest

from quads_megatron.rl.loop import main
from tiny_flags import TINY

SCALARS = ["reward/mean", "reward/std", "eval/pass@1", "response/length_mean", "policy/entropy", "loss/policy",
           "optim/grad_norm", "policy/pg_clipfrac", "mismatch/train_rollout_logprob_abs_diff",
           "mismatch/train_rollout_kl", "mismatch/tis_weight_mean", "mismatch/tis_clipfrac", "mismatch/ess_ratio", "time/rollout",
           "time/train", "time/sync", "throughput/rollout_tokens_per_s", "quant/layer0/experts_weight_rel_err",
           "quant/layer0/experts_act_rel_err"]

# Long enough to learn sort:3 from a 40-step warm-up: 25 GRPO steps of 32 prompts x 4 samples.
# Measured (reward, mean of the first 5 -> last 5 steps): lr 1e-3 +0.18 / +0.16 (seeds 1234 / 7);
# the same runs with --lr 0 (no learning, same prompts) drift +0.035 / +0.002.
LEARN_STEPS = 25
LEARN = ["--sft-iters", "40", "--sft-batch-size", "64", "--rollout-batch-size", "32", "--n-samples-per-prompt", "4", "--lr", "1e-3",
         "--train-iters", str(LEARN_STEPS), "--eval-interval", str(LEARN_STEPS),
         "--quant-error-interval", str(LEARN_STEPS), "--train-precision", "aqat", "--rollout-precision", "quads"]
MIN_REWARD_GAIN = 0.08


def _events(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    tb = tmp_path_factory.mktemp("grpo_learn") / "tb"
    return main(TINY + ["--tensorboard-dir", str(tb)] + LEARN), tb


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """2-step runs of the tiny flags, one per (trainer, rollout) precision, shared by the tests."""
    cache = {}

    def run(train, rollout):
        if (train, rollout) not in cache:
            tb = tmp_path_factory.mktemp(f"grpo_{train}_{rollout}") / "tb"
            cache[train, rollout] = main(TINY + ["--tensorboard-dir", str(tb), "--train-iters", "2",
                                                 "--train-precision", train, "--rollout-precision", rollout])
        return cache[train, rollout]
    return run


def test_grpo_raises_the_reward(learning_run):
    out, _ = learning_run
    rewards = [h["reward"] for h in out["history"]]
    assert len(rewards) == LEARN_STEPS and all(0 <= r <= 1 for r in rewards)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first > MIN_REWARD_GAIN, rewards
    assert (out["reward_before"], out["reward_after"]) == pytest.approx((first, last))


def test_quads_rollout_has_a_small_real_mismatch(learning_run, short_run):
    # W4A4 + RAC activations in the rollout, BF16 activations in the trainer: a gap of ~1e-2 nats,
    # far above the ~0 of the same run with unquantized activations (see below)
    out, _ = learning_run
    gaps = [h["gap"] for h in out["history"]]
    assert all(1e-3 < g < 0.1 for g in gaps), gaps


def test_w4a4_gap_is_clearly_above_the_bf16_gap(short_run):
    bf16 = [h["gap"] for h in short_run("bf16", "bf16")["history"]]
    w4a4 = [h["gap"] for h in short_run("bf16", "w4a4")["history"]]
    assert all(g < 1e-4 for g in bf16), bf16
    assert all(3e-4 < g < 0.1 for g in w4a4), w4a4
    assert min(w4a4) > 30 * max(max(bf16), 1e-7), (bf16, w4a4)


@pytest.mark.parametrize("train,rollout", [("bf16", "bf16"), ("aqat", "w4a16")])
def test_rollout_logprobs_equal_trainer_logprobs(short_run, train, rollout):
    """Same weights, no activation quantization: rollout and trainer log-probs agree to fp32 tolerance.

    CPU runs fp32 on both sides; (aqat, w4a16) also checks that the synced NVFP4 expert weights are
    exactly the trainer's fake-quantized ones. A sync or token-indexing bug gives gaps of ~1e-1.
    """
    out = short_run(train, rollout)
    assert out["steps"] == 2
    for h in out["history"]:
        assert h["gap"] < 1e-5, h


def test_event_file_and_summary_json(learning_run):
    out, tb = learning_run
    acc = _events(tb)
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in SCALARS if t not in tags]
    assert not missing, f"scalars missing from the event file: {missing}"
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(1, LEARN_STEPS + 1))
    assert all(math.isfinite(e.value) for t in SCALARS for e in acc.Scalars(t))
    assert "mismatch/logprob_gap" in acc.Tags()["histograms"]
    # the event file and the summary's history are two records of the same steps
    assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx([h["reward"] for h in out["history"]])
    assert [e.value for e in acc.Scalars("mismatch/train_rollout_logprob_abs_diff")] == pytest.approx(
        [h["gap"] for h in out["history"]])
    assert [e.step for e in acc.Scalars("eval/pass@1")] == [0, LEARN_STEPS]

    summary = json.loads((tb / "summary.json").read_text())
    assert summary == {k: v for k, v in out.items() if k != "wall_time_s"}
    for key in ("reward_before", "reward_after", "pass@1_before", "pass@1_after", "mean_logprob_abs_diff"):
        v = summary[key]
        assert isinstance(v, float) and math.isfinite(v), (key, v)
    assert 0 <= summary["pass@1_before"] <= 1 and 0 <= summary["pass@1_after"] <= 1
    assert summary["pass@1_before"] == pytest.approx(acc.Scalars("eval/pass@1")[0].value)
    assert summary["pass@1_after"] == pytest.approx(acc.Scalars("eval/pass@1")[-1].value)
    gaps = [h["gap"] for h in summary["history"]]
    assert summary["mean_logprob_abs_diff"] == pytest.approx(sum(gaps) / len(gaps))
    assert (summary["steps"], summary["train_precision"], summary["rollout_precision"]) == (
        LEARN_STEPS, "w4a16", "w4a4_rac")   # the recipe's names: AQAT = W4A16 fake quant, quads = W4A4 + RAC


def test_history_reads_back_from_the_event_file(learning_run):
    """A run cut before its summary still has its history: read_history rebuilds, from the event file alone,
    the records the job kept in memory (float32, as TensorBoard stores them)."""
    from quads_megatron.rl.metrics import read_history

    out, tb = learning_run
    history, pass_before = read_history(tb)
    assert pass_before == pytest.approx(out["pass@1_before"], rel=1e-6)
    assert [h["step"] for h in history] == [h["step"] for h in out["history"]]
    for got, want in zip(history, out["history"]):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert (got[k] is None) if v is None else got[k] == pytest.approx(v, rel=1e-6, abs=1e-12), (k, got, want)


def test_several_optimizer_steps_per_rollout(tiny_args, tmp_path):
    """--global-batch-size below the rollout size: PPO ratios move off 1 on the later optimizer steps."""
    out = main(tiny_args("--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "4",
                         "--train-precision", "bf16", "--rollout-precision", "bf16", "--lr", "1e-2"))
    acc = _events(tmp_path / "tb")
    ratios = [e.value for e in acc.Scalars("policy/ppo_ratio_mean")]
    assert len(ratios) == 2 and all(math.isfinite(r) for r in ratios)
    assert any(abs(r - 1.0) > 1e-6 for r in ratios)
    assert all(h["gap"] < 1e-5 for h in out["history"])  # mismatch is measured before the updates
