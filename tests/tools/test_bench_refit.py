"""tools/bench_refit.py runs end to end at tiny size on CPU: its correctness check passes and it prints its table."""

import json
import sys


def test_bench_refit_runs_tiny_on_cpu(load_tool, monkeypatch, capsys, tmp_path):
    bench = load_tool("bench_refit")
    out = tmp_path / "refit.json"
    monkeypatch.setattr(sys, "argv", ["bench_refit", "--device", "cpu", "--tiny", "--json", str(out)])
    bench.main()
    text = capsys.readouterr().out
    assert "correctness: grouped refresh and build equal" in text and "(a) AQAT refresh" in text
    assert "correctness: the layer stream and the one-read refit pass write the old paths' bytes" in text
    rows = json.loads(out.read_text())
    assert rows["layers"] == 2 and rows["refresh"]["step_ms"] > 0
    # the old and the new path in one run, each with the bytes it moves by design (per parameter)
    assert rows["step_old"]["bytes_per_param"] == 10.5625 and rows["step_new"]["bytes_per_param"] == 6.5625
    assert rows["refit"]["floor_bytes_per_param"] == 4.5625 and rows["build_load_layer"]["step_ms"] > 0
    assert rows["refit_kernel_layout"]["bytes_per_param"] == 5.6875  # + codes and scales read and written once
    # wire size: BF16 is 2 B/parameter, NVFP4 0.5625 B + one fp32 scale per gate/up and down of each expert
    params = 3 * 8 * 128 * 64 * 2
    assert rows["wire_bytes"] == {"bf16": params * 2, "nvfp4": params * 0.5625 + 4 * 2 * 8 * 2}
    # the kernel-layout conversion alone (tiny: only w13 fits the layout), next to a copy of the same bytes
    assert "Kernel-layout conversion of one layer's codes" in text
    assert rows["conversion_to_kernel_layout"]["bytes"] == 8 * 128 * 64 and rows["conversion_copy"]["x_copy"] == 1
    assert "Kernel-layout conversion of one layer's block scales" in text
    assert rows["scale_conversion_to_kernel_layout"]["bytes"] == 8 * 128 * 8  # w13's scales [E, 2F, H/16]
    assert rows["scale_conversion_torch_to_kernel_layout"]["bytes"] == 8 * 128 * 8
