"""CPU smoke runs of the tools/paper_*.py commands on the tiny preset: they run and their JSON has the fields.

The paper's numbers come from the GPU runs in docs/results.md; here only the plumbing and a few
properties that hold at any size (a BF16 rollout of a BF16 trainer has no gap; AQAT's trainer and a
W4A16 rollout see the same weights; k = K compensates every channel, so calibrated == random).
"""

import importlib.util
import json
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SMALL = ["--task", "sort:3", "--seq-length", "16", "--max-new-tokens", "5", "--num-prompts", "4",
         "--n-samples-per-prompt", "2", "--sft-iters", "2"]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _outs(tmp_path, stem):
    return ["--out-json", str(tmp_path / f"{stem}.json"), "--out-png", str(tmp_path / f"{stem}.png")]


def _check_files(tmp_path, stem):
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"date", "device", "torch"} <= set(data["env"])
    return data


def test_activation_error(tmp_path):
    _tool("paper_activation_error").main(SMALL + _outs(tmp_path, "ae"))
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


def test_rac_sweep(tmp_path):
    _tool("paper_rac_sweep").main(SMALL + ["--ks", "0,16,64,128", "--layer-tokens", "8"] + _outs(tmp_path, "rs"))
    data = _check_files(tmp_path, "rs")
    assert data["skipped_ks"] == [128]  # tiny: K = 64
    rows = {(r["k"], r["channels"]): r for r in data["results"]}
    assert set(rows) == {(0, "none"), (16, "calibrated"), (16, "random"), (64, "calibrated"), (64, "random")}
    assert rows[64, "calibrated"]["mean_abs"] == pytest.approx(rows[64, "random"]["mean_abs"], rel=1e-6)
    assert all(r["moe_layer_ms"] > 0 for r in rows.values())


def test_throughput(tmp_path):
    _tool("paper_throughput").main(SMALL + ["--batch-size", "2", "--prefill-tokens", "8", "--repeats", "1",
                                            "--precisions", "bf16,w4a4"] + _outs(tmp_path, "tp"))
    data = _check_files(tmp_path, "tp")
    assert [r["precision"] for r in data["results"]] == ["bf16", "w4a4"]
    for r in data["results"]:
        assert r["tokens"] == 2 * 5 and r["decode_tokens_per_s"] > 0  # stops disabled: every row decodes 5


def test_rl_stability(tmp_path):
    _tool("paper_rl_stability").main(SMALL + _outs(tmp_path, "rl") + [
        "--", "--train-iters", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--eval-interval", "2"])
    data = _check_files(tmp_path, "rl")
    assert [r["rollout"] for r in data["runs"]] == ["bf16", "w4a4", "w4a4_rac"]
    for r in data["runs"]:
        assert [h["step"] for h in r["history"]] == [1, 2] and r["pass@1_after"] is not None
