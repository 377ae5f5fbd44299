"""End-to-end GRPO on the tiny Qwen3-MoE with the local engine (CPU, one process)."""

import math

import pytest

from quads_megatron.rl.loop import main

SCALARS = ["reward/mean", "reward/std", "eval/pass@1", "response/length_mean", "policy/entropy", "loss/policy",
           "optim/grad_norm", "policy/pg_clipfrac", "mismatch/train_rollout_logprob_abs_diff",
           "mismatch/train_rollout_kl", "mismatch/tis_weight_mean", "mismatch/tis_clipfrac", "mismatch/ess_ratio", "time/rollout",
           "time/train", "time/sync", "throughput/rollout_tokens_per_s", "quant/layer0/experts_weight_rel_err",
           "quant/layer0/experts_act_rel_err"]


def _events(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_grpo_quads_smoke(tiny_args, tmp_path):
    out = main(tiny_args("--train-iters", "2", "--rollout-precision", "quads", "--quads-train", "aqat"))
    assert out["steps"] == 2
    for h in out["history"]:
        assert math.isfinite(h["reward"]) and 0 <= h["reward"] <= 1
        assert math.isfinite(h["gap"]) and h["gap"] > 0  # W4A4 activations: a real (small) mismatch
    acc = _events(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in SCALARS if t not in tags]
    assert not missing, f"scalars missing from the event file: {missing}"
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert all(math.isfinite(e.value) for t in SCALARS for e in acc.Scalars(t))
    assert "mismatch/logprob_gap" in acc.Tags()["histograms"]
    assert (tmp_path / "tb" / "summary.json").is_file()


@pytest.mark.parametrize("train,rollout", [("bf16", "bf16"), ("aqat", "w4a16")])
def test_rollout_logprobs_equal_trainer_logprobs(tiny_args, train, rollout):
    """Same weights, no activation quantization: rollout and trainer log-probs agree to fp32 tolerance.

    CPU runs fp32 on both sides; (aqat, w4a16) also checks that the synced NVFP4 expert weights are
    exactly the trainer's fake-quantized ones. A sync or token-indexing bug gives gaps of ~1e-1.
    """
    out = main(tiny_args("--train-iters", "2", "--quads-train", train, "--rollout-precision", rollout))
    for h in out["history"]:
        assert h["gap"] < 1e-5, h


def test_several_optimizer_steps_per_rollout(tiny_args, tmp_path):
    """--global-batch-size below the rollout size: PPO ratios move off 1 on the later optimizer steps."""
    out = main(tiny_args("--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "4",
                         "--quads-train", "bf16", "--rollout-precision", "bf16", "--lr", "1e-2"))
    acc = _events(tmp_path / "tb")
    ratios = [e.value for e in acc.Scalars("policy/ppo_ratio_mean")]
    assert len(ratios) == 2 and all(math.isfinite(r) for r in ratios)
    assert any(abs(r - 1.0) > 1e-6 for r in ratios)
    assert all(h["gap"] < 1e-5 for h in out["history"])  # mismatch is measured before the updates
