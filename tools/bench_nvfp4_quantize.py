"""Bandwidth of the NVFP4 Triton kernels against a device copy measured in the same run.

    PYTHONPATH=. python3 tools/bench_nvfp4_quantize.py [--rows 8192 --cols 8192]

Bytes counted: each input read once, each output written once (bf16 in: 2 B/elt; packed
out: 0.5 B + 1/16 B of scales per elt). Median of CUDA-event timings after warm-up,
rotating over several input buffers so the 60 MB L2 does not serve repeats.
"""

import argparse

import torch

from quads_megatron import nvfp4
from quads_megatron.nvfp4 import core, triton_kernels


def bench(fn, iters=100):
    """Median ms per call (the benchmarks' one timer, CUDA events per call after 50 warm-up calls)."""
    from quads_megatron.apps.study.timing import time_ms

    return time_ms(fn, device="cuda", iters=iters, warmup=50, mode="events")


def grouped_rows(row):
    """The grouped kernels on one Qwen3-30B-A3B layer's fc1: 128 separate [1536, 2048] bf16 expert weights
    (amax inside the launch); bytes: read + write bf16 (fake) or read bf16 + write codes (quantize)."""
    experts = [torch.randn(1536, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(128)]
    ge = 128 * 1536 * 2048
    ref = nvfp4.fake_quantize(experts[5], check_finite=False)
    got = nvfp4.fake_quantize_grouped(experts)
    assert torch.equal(got[5].view(torch.int16), ref.view(torch.int16)), "grouped kernel != fake_quantize"
    amax, bad = nvfp4.amax_grouped(experts)
    # a thread owns whole 16-element blocks: tiles with rows x K/16 >= 32 x warps blocks keep every thread busy
    tiles = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 256, 4), (16, 512, 8), (2, 1024, 4),
             (4, 1024, 4), (4, 256, 4)]
    for br, bk, w in tiles:
        t = {"block_r": br, "block_k": bk, "num_warps": w}
        row(f"grouped fake-quant fc1, amax given, {br}x{bk} w{w}",
            lambda t=t: triton_kernels.grouped(experts, 1, mode=triton_kernels.AMAX_GIVEN, fake=True, amax=amax,
                                               bad=bad, tile=t), 4 * ge)
    row("grouped fake-quant fc1 (amax + quantize launches)", lambda: nvfp4.fake_quantize_grouped(experts), 4 * ge)
    row("grouped quantize fc1 (default tile)", lambda: nvfp4.quantize_grouped(experts), 2.5625 * ge)
    want = triton_kernels.grouped(experts, 1, mode=triton_kernels.AMAX_GIVEN, amax=amax, bad=bad)
    # (32-bit code stores, four bytes packed in registers, measured 1.7x slower: removed)
    for br, bk, w in tiles:
        t = {"block_r": br, "block_k": bk, "num_warps": w}
        got = triton_kernels.grouped(experts, 1, mode=triton_kernels.AMAX_GIVEN, amax=amax, bad=bad, tile=t)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
        row(f"grouped quantize fc1, amax given, {br}x{bk} w{w}",
            lambda t=t: triton_kernels.grouped(experts, 1, mode=triton_kernels.AMAX_GIVEN, amax=amax, bad=bad,
                                               tile=t), 2.5625 * ge)
    # the refit: fake-quantized bf16 and packed codes + scales from one read (4.5625 B/element)
    fake_want = nvfp4.fake_quantize_grouped(experts, amax=amax, nonfinite=bad)
    for br, bk, w in tiles:
        t = {"block_r": br, "block_k": bk, "num_warps": w}
        got = triton_kernels.grouped(experts, 1, mode=triton_kernels.AMAX_GIVEN, fake=True, pack=True, amax=amax,
                                     bad=bad, tile=t)
        assert torch.equal(got[0].view(torch.int16), fake_want.view(torch.int16)) and torch.equal(
            got[1], want[0]) and torch.equal(got[2].view(torch.uint8), want[1].view(torch.uint8)), f"refit {t}"
        row(f"grouped refit fc1 (fake + pack), amax given, {br}x{bk} w{w}",
            lambda t=t: triton_kernels.grouped(experts, 1, mode=triton_kernels.AMAX_GIVEN, fake=True, pack=True,
                                               amax=amax, bad=bad, tile=t), 4.5625 * ge)
    for br, bk, w in [(8, 512, 4), (16, 512, 4), (8, 1024, 4), (4, 1024, 4), (16, 1024, 8)]:
        t = {"block_r": br, "block_k": bk, "num_warps": w}
        row(f"grouped amax fc1 {br}x{bk} w{w}", lambda t=t: triton_kernels.grouped(
            experts, 1, mode=triton_kernels.AMAX_ONLY, tile=t), 2 * ge)
    row("grouped amax only fc1", lambda: nvfp4.amax_grouped(experts), 2 * ge)
    stacked = torch.stack(experts)
    row("grouped fake-quant fc1, one [E, N, K] tensor", lambda: nvfp4.fake_quantize_grouped(stacked), 4 * ge)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--no-grouped", action="store_true", help="the element kernels only (no grouped fc1 rows)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    n = args.rows * args.cols
    xs = [torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
          for _ in range(args.buffers)]
    outs = [torch.empty_like(x) for x in xs]
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % args.buffers
        return it["i"]

    amax = [nvfp4.amax_of(x) for x in xs]
    s_enc = [core.global_encode_scale(a) for a in amax]
    s_dec = [torch.div(1.0, s) for s in s_enc]
    packed = [triton_kernels.quantize(x, e, d) for x, e, d in zip(xs, s_enc, s_dec)]

    # correctness on this data first
    ref = core.quantize_reference(xs[0], s_enc[0], s_dec[0])
    assert torch.equal(packed[0][0], ref[0]) and torch.equal(
        packed[0][1].view(torch.uint8), ref[1].view(torch.uint8)), "kernel != torch reference"
    fake_ref = core.dequantize_reference(*ref, s_dec[0], dtype=torch.bfloat16)
    assert torch.equal(triton_kernels.fake_quantize(xs[0], s_enc[0], s_dec[0]).view(torch.int16),
                       fake_ref.view(torch.int16)), "fake_quantize kernel != torch reference"

    rows = []

    def row(name, fn, nbytes):
        ms = bench(fn)
        rows.append((name, ms, nbytes / ms / 1e6))

    row("copy (read+write bf16)", lambda: outs[nxt()].copy_(xs[it["i"]]), 4 * n)
    row("quantize kernel (global scale given)",
        lambda: triton_kernels.quantize(xs[nxt()], s_enc[it["i"]], s_dec[it["i"]]), 2.5625 * n)
    row("quantize per-token (amax + kernel)",
        lambda: nvfp4.quantize(xs[nxt()], per_row=True, check_finite=False, backend="triton"), 2.5625 * n)
    row("quantize per-tensor (amax + kernel)",
        lambda: nvfp4.quantize(xs[nxt()], check_finite=False, backend="triton"), 2.5625 * n)
    row("dequantize kernel -> bf16",
        lambda: triton_kernels.dequantize(*packed[nxt()], s_dec[it["i"]]), 2.5625 * n)
    row("fake_quantize kernel (bf16 -> bf16)",
        lambda: triton_kernels.fake_quantize(xs[nxt()], s_enc[it["i"]], s_dec[it["i"]]), 4 * n)
    # a thread owns whole 16-element blocks: rows x K/16 = 32 x warps blocks is one per thread, twice that two
    for br, bk, w in [(1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 512, 4), (4, 1024, 4),
                      (8, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 8), (16, 128, 4), (32, 128, 8)]:
        t = {"block_r": br, "block_k": bk, "num_warps": w}
        got = triton_kernels.quantize(xs[0], s_enc[0], s_dec[0], tile=t)
        assert torch.equal(got[0], packed[0][0]) and torch.equal(got[1], packed[0][1]), f"quantize tile {t}"
        row(f"  quantize kernel tile {br}x{bk} w{w}",
            lambda t=t: triton_kernels.quantize(xs[nxt()], s_enc[it["i"]], s_dec[it["i"]],
                                                tile=t), 2.5625 * n)
        row(f"  fake_quantize kernel tile {br}x{bk} w{w}",
            lambda t=t: triton_kernels.fake_quantize(xs[nxt()], s_enc[it["i"]], s_dec[it["i"]],
                                                     tile=t), 4 * n)
        row(f"  dequantize kernel tile {br}x{bk} w{w}",
            lambda t=t: triton_kernels.dequantize(*packed[nxt()], s_dec[it["i"]], tile=t),
            2.5625 * n)
    row("amax kernel per-tensor", lambda: triton_kernels.amax(xs[nxt()]), 2 * n)
    row("amax kernel per-row", lambda: triton_kernels.amax(xs[nxt()], True), 2 * n)
    if not args.no_grouped:
        for buffers in (xs, outs, packed):
            buffers.clear()  # free the 8192^2 buffers
        grouped_rows(row)
    copy_bw = rows[0][2]
    print(f"\nNVFP4 kernels, {args.rows}x{args.cols} bf16, {torch.cuda.get_device_name()}")
    print(f"{'what':42s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}")
    for name, ms, bw in rows:
        print(f"{name:42s} {ms:8.4f} {bw:8.0f} {bw / copy_bw:8.1%}")


if __name__ == "__main__":
    main()
