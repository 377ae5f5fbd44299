"""CPU runs of the tools/paper_*.py commands on the tiny preset: their JSON is consistent with argv
and has the relations that hold at any size.

The paper's numbers come from the GPU runs in docs/results.md. Here: a BF16 rollout of a BF16 trainer
has no gap; AQAT's trainer and a W4A16 rollout see the same weights; the tiny model's hidden size is
64, so k = 64 compensates every fc1 channel (calibrated == random, and the RAC gap falls to the
weight-only floor, far below W4A4's); k3 = e^d - 1 - d is never negative; throughput is tokens / time.
"""

import json
from pathlib import Path

import pytest

SMALL = ["--task", "sort:3", "--seq-length", "16", "--max-new-tokens", "5", "--num-prompts", "4",
         "--n-samples-per-prompt", "2", "--sft-iters", "2"]


def _outs(tmp_path, stem):
    return ["--out-json", str(tmp_path / f"{stem}.json"), "--out-png", str(tmp_path / f"{stem}.png")]


def _check_files(tmp_path, stem):
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"date", "device", "torch"} <= set(data["env"])
    return data


def test_activation_error(load_tool, tmp_path):
    load_tool("paper_activation_error").main(SMALL + _outs(tmp_path, "ae"))
    data = _check_files(tmp_path, "ae")
    by = {(r["trainer"], r["rollout"]): r for r in data["results"]}
    assert len(by) == 10
    for r in data["results"]:
        assert {"mean_abs", "k3_kl", "tokens", "layer_rel_err"} <= set(r) and len(r["layer_rel_err"]) == 2
    assert by["bf16", "w4a4_rac"]["rac_channels"] == 64 and by["bf16", "w4a4"]["rac_channels"] == 0  # --rac-channels
    assert by["bf16", "bf16"]["mean_abs"] < 1e-4           # same weights, same precision
    assert by["w4a16", "w4a16"]["mean_abs"] < 1e-4         # AQAT: the trainer sees the rollout's weights
    assert by["bf16", "w4a4"]["mean_abs"] > 5 * by["bf16", "bf16"]["mean_abs"]
    assert all(e > 0 for e in by["bf16", "w16a4"]["layer_rel_err"])  # activations quantized, weights not
    cfg = data["config"]
    assert set(by) == {(t, r) for t in cfg["trainers"].split(",") for r in cfg["precisions"].split(",")}
    assert all(r["k3_kl"] >= 0 for r in data["results"])
    for trainer in ("bf16", "w4a16"):
        assert by[trainer, "bf16"]["layer_rel_err"] == [0.0, 0.0]      # the rollout layer is the BF16 one
        # the rollout that matches the trainer has the smallest gap of its row
        others = [r["mean_abs"] for (t, p), r in by.items() if t == trainer and p != trainer]
        assert by[trainer, trainer]["mean_abs"] < min(others)
        # both error sources together exceed either alone, in every layer
        for i, e in enumerate(by[trainer, "w4a4"]["layer_rel_err"]):
            assert e > max(by[trainer, "w4a16"]["layer_rel_err"][i], by[trainer, "w16a4"]["layer_rel_err"][i])
        # RAC (k = K on fc1) removes activation error: below W4A4 in every layer and in the gap
        rac, w4a4 = by[trainer, "w4a4_rac"], by[trainer, "w4a4"]
        assert all(a < b for a, b in zip(rac["layer_rel_err"], w4a4["layer_rel_err"]))
        assert rac["mean_abs"] < w4a4["mean_abs"]
    # an AQAT trainer against a RAC rollout: only the fc2 residual error is left
    assert by["w4a16", "w4a4_rac"]["mean_abs"] < 0.2 * by["w4a16", "w4a4"]["mean_abs"]


def test_rac_sweep(load_tool, tmp_path):
    load_tool("paper_rac_sweep").main(SMALL + ["--ks", "0,16,64,128", "--layer-tokens", "8"] + _outs(tmp_path, "rs"))
    data = _check_files(tmp_path, "rs")
    assert data["skipped_ks"] == [128]  # tiny: K = 64
    rows = {(r["k"], r["channels"]): r for r in data["results"]}
    assert set(rows) == {(0, "none"), (16, "calibrated"), (16, "random"), (64, "calibrated"), (64, "random")}
    assert rows[64, "calibrated"]["mean_abs"] == pytest.approx(rows[64, "random"]["mean_abs"], rel=1e-6)
    assert all(r["k3_kl"] >= 0 and r["tokens"] == rows[0, "none"]["tokens"] for r in rows.values())
    assert not any(r["cuda_graph"] for r in rows.values())          # CPU: no graph to replay
    # more compensated channels, less gap; k = K compensates all of fc1
    assert rows[64, "calibrated"]["mean_abs"] < 0.2 * rows[0, "none"]["mean_abs"]
    assert rows[16, "calibrated"]["mean_abs"] < rows[0, "none"]["mean_abs"]


def test_throughput(load_tool, tmp_path):
    load_tool("paper_throughput").main(SMALL + ["--batch-size", "2", "--prefill-tokens", "8", "--repeats", "1",
                                            "--precisions", "bf16,w4a4"] + _outs(tmp_path, "tp"))
    data = _check_files(tmp_path, "tp")
    assert [r["precision"] for r in data["results"]] == ["bf16", "w4a4"]
    assert (data["config"]["batch_size"], data["config"]["prefill_tokens"], data["config"]["repeats"]) == (2, 8, 1)
    for r in data["results"]:
        assert r["tokens"] == 2 * 5  # stops disabled: every row decodes 5
        assert r["decode_tokens_per_s"] == pytest.approx(r["tokens"] / r["generate_s"], rel=1e-9)
        assert r["rac_channels"] == 0 and r["moe_layer_cuda_graph"] is False


def test_rl_stability(load_tool, tmp_path):
    argv = SMALL + _outs(tmp_path, "rl") + ["--work-dir", str(tmp_path / "work"), "--save-interval", "0", "--",
                                            "--train-iters", "2", "--rollout-batch-size", "2",
                                            "--n-samples-per-prompt", "2", "--eval-interval", "2"]
    load_tool("paper_rl_stability").main(argv)
    data = _check_files(tmp_path, "rl")
    rows = [(r["train"], r["rollout"], r["routing_replay"]) for r in data["runs"]]
    # naive W4A4 vs QUADS' AQAT trainer, each also with rollout routing replay (R3)
    assert rows == [("bf16", "bf16", False), ("bf16", "w4a4", False), ("w4a16", "w4a4_rac", False),
                    ("bf16", "w4a4", True), ("w4a16", "w4a4_rac", True)]
    for r in data["runs"]:
        assert [h["step"] for h in r["history"]] == [1, 2] and r["pass@1_after"] is not None
        assert r["seed"] == data["config"]["seed"] and 0 <= r["pass@1_after"] <= 1
        for h in r["history"]:
            assert 0 <= h["routing_disagreement"] <= 1 and h["gap_p99"] >= 0
            assert h["kl"] >= 0 and h["grad_norm"] >= 0
    runs = {r["rollout"]: r for r in data["runs"] if not r["routing_replay"]}
    # the mismatch QUADS exists to remove: none for BF16, far less for AQAT + RAC than naive W4A4
    assert runs["bf16"]["mean_gap"] < 1e-6 and runs["bf16"]["mean_routing_disagreement"] <= 0.01
    assert runs["bf16"]["mean_gap"] < runs["w4a4_rac"]["mean_gap"] < 0.2 * runs["w4a4"]["mean_gap"]
    # resumable: a second invocation reads the finished runs back instead of rerunning them
    again = load_tool("paper_rl_stability").main(argv)
    assert [r["wall_time_s"] for r in again["runs"]] == [r["wall_time_s"] for r in data["runs"]]
    # a study cut short: a run without its record is plotted up to its last step, read back from TensorBoard
    tool = load_tool("paper_rl_stability")
    cut = data["runs"][1]
    (tmp_path / "work" / f"{tool._slug(cut['config'], cut['seed'])}.json").unlink()
    part = tool.main(SMALL + _outs(tmp_path / "cut", "rl") + ["--work-dir", str(tmp_path / "work"), "--plot-only"])
    assert (tmp_path / "cut" / "rl.png").stat().st_size > 0
    assert [r.get("unfinished", False) for r in part["runs"]] == [False, True, False, False, False]
    read = part["runs"][1]
    assert read["config"] == cut["config"] and [h["step"] for h in read["history"]] == [1, 2]
    assert [h["gap"] for h in read["history"]] == pytest.approx([h["gap"] for h in cut["history"]], rel=1e-6)
    assert read["pass@1_after"] == pytest.approx(cut["pass@1_after"], rel=1e-6)


def test_rl_stability_runs_concurrently(load_tool, tmp_path):
    """--jobs: each run in its own process, the parent reads the records back; a run's history is the one the
    same run gives in-process (same seed, same flags)."""
    rows = ["--rows", "BF16 rollout,naive W4A4 (BF16 trainer)"]
    job = ["--", "--train-iters", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--eval-interval", "2"]
    tool = load_tool("paper_rl_stability")
    par = tool.main(SMALL + _outs(tmp_path / "par", "rl") + rows + ["--jobs", "2", "--work-dir",
                                                                      str(tmp_path / "w1"), "--save-interval", "0"] + job)
    assert [r["config"] for r in par["runs"]] == ["BF16 rollout", "naive W4A4 (BF16 trainer)"]
    assert all((tmp_path / "w1" / f"{tool._slug(r['config'], r['seed'])}.log").exists() for r in par["runs"])
    seq = tool.main(SMALL + _outs(tmp_path / "seq", "rl") + ["--rows", "BF16 rollout", "--work-dir",
                                                             str(tmp_path / "w2"), "--save-interval", "0"] + job)
    assert par["runs"][0]["history"] == seq["runs"][0]["history"]


def test_rl_stability_child_flags(load_tool):
    tool = load_tool("paper_rl_stability")
    argv = ["--hf-checkpoint", "ck", "--rows", "a,b", "--jobs", "3", "--out-json=x.json", "--seeds", "1,2",
            "--task", "sort:10", "--", "--train-iters", "300", "--rows", "kept"]
    got = tool.child_argv(argv, "BF16 rollout", 2, Path("/w"))
    assert got == ["--hf-checkpoint", "ck", "--task", "sort:10", "--rows", "BF16 rollout", "--seeds", "2",
                   "--naive-seeds", "2", "--work-dir", "/w", "--out-json", "/w/bf16_rollout_seed2.summary.json",
                   "--out-png", "/w/bf16_rollout_seed2.png", "--", "--train-iters", "300", "--rows", "kept"]


def test_rl_stability_trailing_mean(load_tool):
    tool = load_tool("paper_rl_stability")
    assert tool.trailing_mean([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert tool.trailing_mean([4.0, 0.0, 2.0], 3) == [2.0]
    assert tool.trailing_mean([5], 1) == [5.0]


def test_rl_stability_summary_table(load_tool):
    """Reward of the first / last span steps, the rest over the whole history and its last 4 spans."""
    tool = load_tool("paper_rl_stability")
    h = [{"step": i + 1, "reward": float(i), "gap": 0.01 * (i + 1), "gap_p99": 0.1, "kl": 0.002,
          "routing_disagreement": None if i == 0 else 0.5, "grad_norm": 2.0, "pass": None} for i in range(4)]
    run = {"config": "naive W4A4 (BF16 trainer)", "seed": 2, "history": h, "pass@1_before": 0.25,
           "pass@1_after": None}
    table = tool.summary_table([run], span=1).splitlines()
    # span 1: reward of step 1 (0) and step 4 (3); last 4 steps = all 4: gap mean 0.025; disagreement of 3 steps
    assert table[2] == ("| naive W4A4 (BF16 trainer), seed 2 | 4 | 0.000 -> 3.000 | 0.250 -> n/a | 2.50e-02 / 2.50e-02 "
                        "| 1.00e-01 | 2.00e-03 | 0.5000 / 0.5000 | 2.00 |")
