"""One Qwen3-30B-A3B layer's experts through the grouped NVFP4 kernel, each launch against copy bandwidth.

    PYTHONPATH=. python3 tools/bench_grouped_nvfp4.py [--label new]

fc1 (128 x [1536, 2048]) and fc2 (128 x [2048, 768]) as separate bf16 tensors (a Megatron SequentialMLP's
weights), the pointer tables built once (kernel time only, no host work): the refit launch (fake-quantized
bf16 and packed codes + scales from one read, 4.5625 B/element), fake-quant alone (4 B), pack alone
(2.5625 B) and the amax pass (2 B), each with its default launch shape. Two weight sets alternate so L2
does not serve repeats. For an A/B, run it again with PYTHONPATH at another checkout and another --label.
"""

import argparse

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="", help="a prefix for every printed row (which checkout ran)")
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=768)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from quads_megatron import nvfp4
    from quads_megatron.apps.study.timing import copy_bandwidth, time_ms
    from quads_megatron.nvfp4 import triton_kernels as tk

    E, H, F = a.num_experts, a.hidden_size, a.moe_ffn_hidden_size
    bw = copy_bandwidth("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)

    def weights(rows, cols):
        return [(torch.randn(rows, cols, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(E)]

    sets = [{"fc1": weights(2 * F, H), "fc2": weights(H, F)} for _ in range(2)]
    print(f"{a.label} {torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s")
    turn = [0]

    def alternate(fn):
        turn[0] ^= 1
        return fn(turn[0])

    for proj in ("fc1", "fc2"):
        mats = [s[proj] for s in sets]
        n = sum(t.numel() for t in mats[0])
        amax = [nvfp4.amax_grouped(m) for m in mats]
        tables = [tk.pointer_table(m) for m in mats]
        both = tk.grouped(tables[0], 1, mode=tk.AMAX_GIVEN, fake=True, pack=True, amax=amax[0][0], bad=amax[0][1])
        fake = nvfp4.fake_quantize_grouped(mats[0], amax=amax[0][0], nonfinite=amax[0][1])
        q = nvfp4.quantize_grouped(mats[0], amax=amax[0][0], nonfinite=amax[0][1])
        assert torch.equal(both[0].view(torch.int16), fake.view(torch.int16)) and torch.equal(both[1], q.data), proj
        for mode, is_fake, pack, per_elt in (("refit", True, True, 4.5625), ("fake", True, False, 4.0),
                                             ("pack", False, True, 2.5625)):
            ms = time_ms(lambda: alternate(lambda i: tk.grouped(tables[i], 1, mode=tk.AMAX_GIVEN, fake=is_fake,
                                                                  pack=pack, amax=amax[i][0], bad=amax[i][1])),
                         device="cuda", iters=30, warmup=5, mode="events")
            print(f"{a.label} {proj} {mode:5s}: {ms:.4f} ms {per_elt * n / ms / 1e9 / bw * 1e12:.1%} of copy")
        ms = time_ms(lambda: alternate(lambda i: tk.grouped(tables[i], 1, mode=tk.AMAX_ONLY)), device="cuda",
                     iters=30, warmup=5, mode="events")
        print(f"{a.label} {proj} amax : {ms:.4f} ms {2 * n / ms / 1e9 / bw * 1e12:.1%} of copy")


if __name__ == "__main__":
    main()
