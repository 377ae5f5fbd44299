"""Compile the grouped NVFP4 GEMM for sm_90 without a GPU and report its main loop: shared-memory
round trips of the decoded tile and SASS instructions per weight (SASS), wgmma's operand sources (PTX).

Run it with the Triton of the GPU image first on the path (a CPU machine can compile for sm_90):
  pip download triton==3.6.0 --no-deps --python-version 3.11 --only-binary=:all: \
      --platform manylinux_2_27_x86_64 -d /tmp/t36
  pip install --no-deps --target /tmp/triton36 /tmp/t36/triton-3.6.0-*.whl
  PYTHONPATH=/tmp/triton36:$PWD python tools/kernel_sass_report.py --v2 --v3
Each row: the tile config, the main loop's SASS instruction count per thread and step, weights per
thread and step, instructions per weight (all, and the decode's LOP3/SHF/PRMT/F2FP/HMUL2/IMAD.SHL
alone), the shared-memory stores, ldmatrix and shuffles inside the K loop (a round trip of the
decoded tile shows there: v2's convert_layout to the dot operand lowers to STS + LDSM; v3 loads
words and scales by cp.async straight into the fragment layout and has none in swap-AB tiles), and
whether every wgmma takes A from registers, registers per thread, spilled bytes, shared memory per CTA and
the CTAs an SM holds (ncu's occupancy limits, offline).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DECODE_OPS = ("LOP3", "SHF", "PRMT", "F2FP", "HMUL2", "HFMA2", "SHL", "I2F", "F2F")  # + IMAD.SHL
POINTERS = {"a_ptr": "*fp16", "asdec_ptr": "*fp32", "rv_ptr": "*fp16", "rsdec_ptr": "*fp32",
            "rw_ptr": "*fp16", "w32_ptr": "*i32", "ws2_ptr": "*fp32", "c_ptr": "*u16",
            "bias_ptr": "*fp32", "topk_w_ptr": "*fp32", "sorted_ptr": "*i32",
            "expert_ptr": "*i32", "npost_ptr": "*i32"}
ALIGNED = ("stride_am", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_cm", "N", "K", "KR",
           "stride_rwe", "stride_rwn")


def compile_gemm(cfg, frag: bool, w4a16: bool = False, rac: bool = False):
    """triton.compile of `_w4a4_gemm_kernel` for sm_90 (routed, bf16 out) -> CompiledKernel.
    rac: the RAC form too (its K-steps over the stored fp16 weight columns)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quads_megatron.kernels import gemm

    kern = gemm._w4a4_gemm_kernel
    names = kern.arg_names
    consts = dict(SPLIT_K=1, ROUTED=True, MUL_WEIGHT=False, HAS_BIAS=False, HAS_RES=rac,
                  W4A16=w4a16, DOT_F32=False, EVEN_K=True, EVEN_KR=True, SWAP_AB=cfg.swap_ab,
                  FRAG=frag, FRAG_ASM=frag, OUT_BF16=True, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_KR=64, GROUP_M=cfg.group_m)
    ptrs = dict(POINTERS, ws_ptr="*u16" if frag else "*u8",
                a_ptr="*bf16" if w4a16 else "*fp16")
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in list(ptrs) + list(ALIGNED)}
    src = ASTSource(fn=kern, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_regs is not None:
        opts["maxnreg"] = cfg.max_regs
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=opts)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump `flag` (-sass, -res-usage) of a cubin, with the cuobjdump Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True,
                              text=True).stdout


def parse_res_usage(usage: str) -> dict:
    """cuobjdump -res-usage text -> registers per thread and the bytes spilled per thread: ptxas of CUDA 12+
    puts register spills in the stack frame (STACK), older ones in LOCAL; a Triton kernel has no other use
    of either, so their sum is what spilled."""
    def field(name):
        m = re.search(name + r":(\d+)", usage)
        return int(m.group(1)) if m else 0
    regs = re.search(r"REG:(\d+)", usage)
    return dict(regs=int(regs.group(1)) if regs else None, spill_bytes=field("STACK") + field("LOCAL"))


def resources(cubin: bytes) -> dict:
    """Registers per thread and spilled bytes per thread of the kernel (`parse_res_usage`)."""
    return parse_res_usage(cuobjdump(cubin, "-res-usage"))


def ctas_per_sm(regs: int, smem_bytes: int, num_warps: int) -> int:
    """CTAs one sm_90 SM holds: registers (per warp, rounded up to 256; 64 K per SM), shared memory (the
    228 KB carveout, 1 KB reserved per CTA; the driver may pick a smaller one, as ncu's "Block Limit Shared
    Mem" shows) and warps (64 per SM), at most 32."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (65536 // per_warp) // num_warps
    by_smem = 233472 // (smem_bytes + 1024)
    return min(by_regs, by_smem, 64 // num_warps, 32)


def mma_loops(sass: str) -> list[list[str]]:
    """Opcodes of every backward-branch loop that issues HGMMA, the K loop (most HGMMA) first; a RAC
    form with stored columns has a second one, its residual steps."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            toks = m.group(2).split()
            ins.append((int(m.group(1), 16), toks[1] if toks[0].startswith("@") else toks[0],
                        m.group(2)))
    loops = []
    for addr, op, text in ins:
        target = re.search(r"0x([0-9a-f]+)", text) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            if any(o.startswith("HGMMA") for o in body):
                loops.append(body)
    return sorted(loops, key=lambda b: (-sum(o.startswith("HGMMA") for o in b), len(b)))


def report(cfg, frag: bool, w4a16: bool = False, args_top: int = 12, rac: bool = False) -> dict:
    c = compile_gemm(cfg, frag, w4a16, rac)
    loops = mma_loops(cuobjdump(c.asm["cubin"], "-sass"))
    ops = collections.Counter(loops[0] if loops else [])
    residual = collections.Counter(loops[1]) if len(loops) > 1 else None
    total = sum(ops.values())
    decode = sum(v for k, v in ops.items()
                 if k.split(".")[0] in DECODE_OPS or k.startswith("IMAD.SHL"))
    threads = 32 * cfg.num_warps
    per_thread = cfg.block_n * cfg.block_k // threads
    ptx = c.asm["ptx"]
    res = resources(c.asm["cubin"])
    wgmma = re.findall(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*(\{|%rd)", ptx)
    mode = "w4a16" if w4a16 else ("w4a4_rac" if rac else "w4a4")
    return dict(layout="v3 fragment" if frag else "v2 row-major", mode=mode,
                config=tuple(cfg[:7]), loop_instructions=total, weights_per_thread=per_thread,
                per_weight=round(total / per_thread, 2), decode_per_weight=round(decode / per_thread, 2),
                loop_sts_ldsm_shfl=sum(v for k, v in ops.items()
                                       if k.startswith(("STS", "LDSM", "SHFL"))),
                wgmma_a_from_registers=bool(wgmma) and all(w == "{" for w in wgmma),
                **res, smem_bytes=c.metadata.shared,
                ctas_per_sm=ctas_per_sm(res["regs"], c.metadata.shared, cfg.num_warps) if res["regs"] else None,
                residual_loop=None if residual is None else
                dict(instructions=sum(residual.values()), ldg_u16=residual["LDG.E.U16"],
                     sts=sum(v for k, v in residual.items() if k.startswith("STS"))),
                ops=dict(ops.most_common(args_top)))


def main() -> None:
    from quads_megatron.kernels.gemm import GemmConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v2", action="store_true", help="the row-major (v2) main loop")
    ap.add_argument("--v3", action="store_true", help="the fragment-layout (v3) main loop")
    ap.add_argument("--config", type=int, nargs=6, action="append",
                    metavar=("BM", "BN", "BK", "WARPS", "STAGES", "SWAP"),
                    help="tile(s) to compile (default: the decode tile 16 64 128 4 4 1)")
    ap.add_argument("--w4a16", action="store_true", help="the W4A16 form (bf16 activations)")
    ap.add_argument("--rac", action="store_true", help="also the RAC form (K-steps over stored fp16 columns)")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per row")
    ap.add_argument("--max-regs", type=int, default=None, help="GemmConfig.max_regs (Triton's maxnreg) of every tile")
    args = ap.parse_args()
    cfgs = [GemmConfig(*c[:5], 8, bool(c[5]), max_regs=args.max_regs) for c in args.config or [(16, 64, 128, 4, 4, 1)]]
    import triton

    print(f"triton {triton.__version__}, sm_90")
    for cfg in cfgs:
        for frag in [f for f, on in ((False, args.v2), (True, args.v3 or not args.v2)) if on]:
            for rac in (False, True) if args.rac and not args.w4a16 else (False,):
                r = report(cfg, frag, args.w4a16, args.top, rac)
                print(" | ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
