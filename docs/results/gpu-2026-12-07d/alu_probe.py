"""Dev: per-SM throughput of F2FP (cvt.rn.f16x2.e4m3x2), LOP3, PRMT, HMUL2 on this GPU (chains, ILP 8)."""
# Kept with the numbers of docs/benchmarks.md section 5 (2026-12-07, eleventh session); run from the repo root on a CUDA GPU.
import torch
import triton
import triton.language as tl

BODIES = {
    # one instruction per element per iteration (checked in SASS offline)
    "f2fp": ("{.reg .b16 l, h; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 $0, l;}", 1),
    "lop3": ("{lop3.b32 $0, $1, 0x9C9C9C9C, 0x12345678, 0x6A;}", 1),
    "prmt": ("{prmt.b32 $0, $1, 0x76543210, 0x5140;}", 1),
    "hmul2": ("{.reg .b32 c; mov.b32 c, 0x3C013C01; mul.rn.f16x2 $0, $1, c;}", 1),
    "shf_lop": ("{.reg .b32 t; shr.b32 t, $1, 3; lop3.b32 $0, $1, t, 0x0E000E00, 0xEA;}", 2),
}


def make(body):
    @triton.jit
    def kern(x_ptr, o_ptr, N_ITER: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs)
        for _ in range(N_ITER):
            v = tl.inline_asm_elementwise(BODY, "=r,r", [v], dtype=tl.uint32, is_pure=True, pack=1)  # noqa: F821
        tl.store(o_ptr + offs, v)
    kern.fn.__globals__["BODY"] = tl.constexpr(body)
    return kern


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = sms * 16 * 1024 * 4   # many resident warps
    x = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device=dev).view(torch.uint32)
    o = torch.empty_like(x)
    res = {}
    for name, (body, per) in BODIES.items():
        k = make(body)
        ms = []
        for it in (64, 576):
            f = lambda: k[(n // 1024,)](x, o, N_ITER=it, BLOCK=1024, num_warps=4)
            f()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            ts = []
            for _ in range(5):
                a.record()
                f()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            ms.append(sorted(ts)[2])
        dt = (ms[1] - ms[0]) / 1e3
        ops = n * 512 * per
        res[name] = ops / dt / sms / 1e9  # thread-instr per ns per SM
        print(f"{name:8s} {ms[0]:.3f} / {ms[1]:.3f} ms; {res[name]:.1f} thread-instr/ns/SM "
              f"(~{res[name] / 1.755:.0f}/clk at 1.755 GHz, {res[name] / 1.98:.0f}/clk at 1.98)", flush=True)
    return res


if __name__ == "__main__":
    main()
