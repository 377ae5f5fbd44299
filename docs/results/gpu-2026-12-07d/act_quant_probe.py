"""Dev: act_quant launch configs at the MoE layer's fc1 / fc2 pre-pass shapes (CUDA graphs), bit-checked vs the default."""
# Kept with the numbers of docs/benchmarks.md section 5 (2026-12-07, eleventh session); run from the repo root on a CUDA GPU.
import sys
import torch
import triton
sys.path.insert(0, ".")
from quads_megatron.kernels import act_quant as aq
from quads_megatron.apps.study.timing import time_ms


def launch(x, comp, groups, silu, block_m, block_k, warps):
    m_rows, k_in = x.shape
    k = k_in // 2 if silu else k_in
    dev = x.device
    kr = comp.shape[-1]
    data = torch.empty(m_rows, k // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(m_rows, k // 16, dtype=torch.uint8, device=dev)
    s_dec = torch.empty(m_rows, dtype=torch.float32, device=dev)
    values = torch.empty(m_rows, k, dtype=torch.float16, device=dev)
    r_data = torch.empty(m_rows, kr // 2, dtype=torch.uint8, device=dev)
    r_scale = torch.empty(m_rows, kr // 16, dtype=torch.uint8, device=dev)
    r_s_dec = torch.empty(m_rows, dtype=torch.float32, device=dev)
    r_values = torch.empty(m_rows, kr, dtype=torch.float16, device=dev)
    grp = groups if comp.ndim == 2 else s_dec
    aq._act_quant_kernel[(triton.cdiv(m_rows, block_m),)](
        x, x.stride(0), m_rows, k, s_dec, data, scale, s_dec, values, comp,
        comp.stride(0) if comp.ndim == 2 else 0, grp, r_data, r_scale, r_s_dec, r_values, kr,
        WRITE_F16=True, FRAG=True, STATIC=False, SILU_MUL=silu, HAS_RES=True, HAS_GROUP=comp.ndim == 2,
        BLOCK_M=block_m, BLOCK_K=min(block_k, triton.next_power_of_2(k)), BLOCK_KR=kr, num_warps=warps,
        enable_fp_fusion=False)
    return values, r_values, s_dec, r_s_dec


def main():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    comp1 = torch.randperm(2048, device=dev)[:64].sort().values.to(torch.int32)
    comp2 = torch.stack([torch.randperm(768, device=dev)[:64].sort().values for _ in range(128)]).to(torch.int32)
    cfgs = [(1, 1024, 4), (1, 512, 4), (1, 256, 2), (1, 1024, 8), (2, 512, 4), (2, 1024, 4), (4, 256, 4),
            (4, 512, 4), (4, 256, 8), (8, 256, 4), (8, 128, 4), (16, 128, 4), (8, 256, 8)]
    for t in (16, 64, 256, 512, 1024, 4096):
        x1 = torch.randn(t, 2048, device=dev, generator=g).to(torch.bfloat16)
        x2 = torch.randn(t * 8, 1536, device=dev, generator=g).to(torch.bfloat16)
        groups = torch.randint(0, 128, (t * 8,), device=dev, generator=g, dtype=torch.int32)
        for name, x, comp, silu in (("fc1", x1, comp1, False), ("fc2", x2, comp2, True)):
            ref = aq.quantize_activation_rac(x, comp, groups=groups if comp.ndim == 2 else None, silu_mul=silu,
                                             fragment_order=True)
            dflt = time_ms(lambda: aq.quantize_activation_rac(x, comp, groups=groups if comp.ndim == 2 else None,
                                                               silu_mul=silu, fragment_order=True),
                           device=dev, iters=20, mode="graph", reps=20)
            line = [f"T={t} {name} rows={x.shape[0]} default {dflt * 1e3:.1f} us |"]
            for bm, bk, w in cfgs:
                try:
                    out = launch(x, comp, groups, silu, bm, bk, w)
                    same = all(torch.equal(a, b) for a, b in zip(out, (ref.values, ref.r_values, ref.s_dec, ref.r_s_dec)))
                    us = time_ms(lambda: launch(x, comp, groups, silu, bm, bk, w), device=dev, iters=20, mode="graph", reps=20) * 1e3
                    line.append(f"{bm}x{bk}w{w} {us:.1f}{'' if same else ' DIFF'}")
                except Exception as e:  # noqa
                    line.append(f"{bm}x{bk}w{w} ERR {type(e).__name__}")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
