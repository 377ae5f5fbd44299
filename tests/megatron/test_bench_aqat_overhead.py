"""tools/bench_aqat_overhead.py at tiny size on CPU: the layer it times computes the MoE it claims
(against a per-token loop), the cached and uncached AQAT forwards it compares compute the same
thing, and the numbers it reports are consistent with each other and with argv."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from quads_megatron import nvfp4


@pytest.fixture(scope="module")
def bench(load_tool):
    return load_tool("bench_aqat_overhead")


def _moe_loop(layer, x, w13, w2):
    """sum_j p_j * fc2_e(SiLU(gate_e) * up_e) token by token, fp32 (the definition of the layer)."""
    probs, ids = torch.topk(torch.softmax(x.float() @ layer.router.t(), -1), layer.topk, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    out = torch.zeros(x.shape[0], layer.H)
    for t in range(x.shape[0]):
        for j in range(layer.topk):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ w13[e].float().t()).chunk(2)
            out[t] += probs[t, j] * ((F.silu(gate) * up) @ w2[e].float().t())
    return out


def test_layer_is_the_moe_and_cached_equals_uncached(bench):
    layer = bench.MoELayer(8, 64, 32, 2, torch.device("cpu"))
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    routing = layer.route(x)
    y = layer.forward(x, routing, layer.w13, layer.w2)
    want = _moe_loop(layer, x, layer.w13.detach(), layer.w2.detach())
    torch.testing.assert_close(y.float(), want, rtol=0.05, atol=0.02 * float(want.abs().max()))
    cached = bench.WeightFakeQuant("w13", layer.w13, cache=True)
    uncached = bench.WeightFakeQuant("w13", layer.w13, cache=False)
    q2 = bench.WeightFakeQuant("w2", layer.w2, cache=False)
    first = layer.forward(x, routing, cached(layer.w13), q2(layer.w2))
    again = layer.forward(x, routing, cached(layer.w13), q2(layer.w2))   # served from the cache
    plain = layer.forward(x, routing, uncached(layer.w13), q2(layer.w2))
    assert torch.equal(first, again) and torch.equal(first, plain)
    # the weights it times are NVFP4 (per expert), not the BF16 masters
    w13q = torch.stack([nvfp4.dequantize(nvfp4.quantize(w), torch.bfloat16) for w in layer.w13.detach()])
    assert torch.equal(cached(layer.w13), w13q)
    assert not torch.equal(first, y)


def test_reported_numbers_are_consistent(bench, monkeypatch, capsys, tmp_path):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--device", "cpu", "--tiny", "--tokens", "32", "64",
                                      "--micro-batches", "4", "--iters", "1", "--json", str(out)])
    bench.main()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["tokens"] for r in rows] == [32, 64]
    assert data["layer"].startswith("8 experts, hidden 128, ffn 64, top-2, cpu")   # --tiny
    assert len({r["refresh_ms"] for r in rows}) == 1            # one refresh timing for the step
    for r in rows:
        assert r["micro_batches"] == 4
        assert min(r["bf16_ms"], r["aqat_uncached_ms"], r["aqat_cached_ms"], r["w4a4_naive_ms"]) > 0
        amortised = (4 * r["aqat_cached_ms"] + r["refresh_ms"]) / (4 * r["bf16_ms"]) - 1
        assert r["amortised_overhead"] == pytest.approx(amortised, rel=1e-12)
    # the table prints the JSON's rows: header + one line per token count
    assert [ln.split("|")[1].strip() for ln in lines[1:]] == ["32", "64"]
    for ln, r in zip(lines[1:], rows):
        cells = [c.strip() for c in ln.split("|")[1:-1]]
        assert float(cells[1]) == pytest.approx(r["bf16_ms"], abs=5e-4)
        assert cells[5] == f"{r['amortised_overhead'] * 100:+.1f}%"
