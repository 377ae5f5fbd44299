"""CPU smoke run of tools/bench_moe_layer.py (--device cpu --tiny): every variant runs, every check passes, JSON has the numbers.

The speed numbers come from the H200 runs in docs/benchmarks.md; on CPU the kernels run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and nothing is graph-captured.
"""

import json

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU (interpreter) path")
def test_bench_moe_layer_tiny_cpu(load_tool, tmp_path, capsys):
    out = tmp_path / "moe.json"
    rc = load_tool("bench_moe_layer").main(["--device", "cpu", "--tiny", "--tokens", "1", "--iters", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0
    assert data["meta"]["num_experts"] == 8 and data["meta"]["rac_channels"] == 16 and not data["meta"]["graphs"]
    assert data["meta"]["kernels"] == ["v2", "v3"]
    assert [r["tokens"] for r in data["rows"]] == [1]
    for r in data["rows"]:
        assert set(r["ms"]) == {"bf16", "fp8"} | {f"{k} {m}" for k in ("v2", "v3")
                                                  for m in ("w4a16", "w4a4", "w4a4_rac")}
        assert all(isinstance(v, float) and v > 0 for v in r["ms"].values()), r["ms"]
        for variant, cases in r["checks"].items():
            for case, (err, tol) in cases.items():
                assert err < tol, (variant, case, err, tol)
        assert 1 <= r["experts_hit"] <= min(8, 2 * r["tokens"])
        # bytes read per hit expert, by hand (hidden 128, FFN 128, k 16): fc1 [256, 128] + fc2 [128, 128]
        # at 0.5625 B per weight (codes + e4m3 scales) = 27648 B; RAC columns fp16 [256 + 128, 16] = 12288 B
        assert r["weight_bytes"] == r["experts_hit"] * 27648
        assert r["rac_weight_bytes"] == r["experts_hit"] * (27648 + 12288)
    assert data["rows"][0]["experts_hit"] <= 2  # one token, top-2: some experts get no rows
    table = capsys.readouterr().out
    assert "| tokens | experts hit | BF16 ms | FP8 ms |" in table and "| 1 |" in table
    assert "v3 RAC vs FP8" in table and "v3 RAC vs v2 RAC" in table
