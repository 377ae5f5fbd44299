"""tools/bench_aqat_overhead.py runs end to end at tiny size on CPU and prints its table."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_runs_tiny_on_cpu(monkeypatch, capsys, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_aqat_overhead", os.path.join(ROOT, "tools", "bench_aqat_overhead.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--device", "cpu", "--tiny", "--tokens", "64",
                                      "--iters", "1", "--json", str(out)])
    bench.main()
    text = capsys.readouterr().out
    assert "| 64 |" in text and "aqat cached" in text
    assert out.exists()
