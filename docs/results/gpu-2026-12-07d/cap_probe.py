"""Dev: the 64-token swap-AB tile uncapped (2 CTAs/SM) vs capped at 168 registers (3 CTAs/SM), whole layer."""
# Kept with the numbers of docs/benchmarks.md section 5 (2026-12-07, eleventh session); run from the repo root on a CUDA GPU.
import sys
import torch
sys.path.insert(0, "tools")
sys.path.insert(0, ".")
import bench_moe_layer as b
from quads_megatron.kernels.gemm import GemmConfig as C

args = b.parse_args([])
args.device = "cuda"
gen = torch.Generator().manual_seed(0)
dev = torch.device("cuda")
w = b.build_experts(args, gen, dev)
cfgs = {"uncapped": C(64, 128, 128, 4, 3, 8, True), "cap168": C(64, 128, 128, 4, 3, 8, True, max_regs=168)}
with torch.no_grad():
    for t in (768, 1024, 2048, 4096):
        tw, ti = b.random_routing(t, 128, 8, gen, dev)
        x = b.activations(t, 2048, gen, dev)
        line = [f"T={t}"]
        for mode in ("w4a4", "w4a4_rac"):
            outs = {}
            for name, c in cfgs.items():
                layer = b.quads_layer(mode, configs=(c, c), kernel="v3")
                outs[name] = layer(x, tw, ti, w)
                ms = b.layer_ms(lambda: layer(x, tw, ti, w), dev, 20, 10)
                line.append(f"{mode} {name} {ms:.4f}")
            line.append("equal" if torch.equal(outs["uncapped"], outs["cap168"]) else "DIFF")
        print(" | ".join(line), flush=True)
