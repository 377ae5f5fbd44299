"""Dev: run the v3 layer at T tokens a few times without PDL (for ncu to capture its GEMM launches)."""
# Kept with the numbers of docs/benchmarks.md section 5 (2026-12-07, eleventh session); run from the repo root on a CUDA GPU.
import sys
import torch
sys.path.insert(0, "tools")
sys.path.insert(0, ".")
import bench_moe_layer as b
from quads_megatron.kernels import pdl

t, mode = int(sys.argv[1]), sys.argv[2]
args = b.parse_args(["--tokens", str(t)])
args.device = "cuda"
gen = torch.Generator().manual_seed(0)
dev = torch.device("cuda")
w = b.build_experts(args, gen, dev)
tw, ti = b.random_routing(t, 128, 8, gen, dev)
x = b.activations(t, 2048, gen, dev)
layer = b.quads_layer(mode, kernel="v3")
with torch.no_grad(), pdl.disabled():
    for _ in range(3):
        layer(x, tw, ti, w)
    torch.cuda.synchronize()
print("done")
