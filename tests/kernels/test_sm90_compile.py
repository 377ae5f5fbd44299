"""The kernels' GPU forms compile for sm_90 (Hopper) on a CPU machine: the interpreter runs code that Triton's
compiler rejects (a constexpr branch left after an early `return` is still generated there), so the CPU suite
also builds the launch forms the GPU takes, with the installed Triton and its ptxas, in a process without
TRITON_INTERPRET."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import sys
sys.path[:0] = [ROOT, ROOT + "/tools"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel_sass_report
from quads_megatron.kernels import act_quant, fragment_convert
from quads_megatron.kernels.gemm import fragment_config


def compile_sm90(kern, consts, ptrs, num_warps=4):
    names = kern.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    triton.compile(ASTSource(fn=kern, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}),
                   target=GPUTarget("cuda", 90, 128), options=dict(num_warps=num_warps))


# the activation pre-pass with the RAC residual: fragment order or not, SiLU x up (fc2's) or not
ptrs = dict(x_ptr="*bf16", amax_ptr="*fp32", q_ptr="*u8", qs_ptr="*u8", sdec_ptr="*fp32", v_ptr="*fp16",
            comp_ptr="*i32", group_ptr="*i32", r_ptr="*u8", rs_ptr="*u8", rsdec_ptr="*fp32", rv_ptr="*fp16")
for frag, silu in ((True, True), (False, False), (True, False)):
    compile_sm90(act_quant._act_quant_kernel, dict(WRITE_F16=True, FRAG=frag, STATIC=False, SILU_MUL=silu,
                                                   HAS_RES=True, HAS_GROUP=silu, BLOCK_M=1, BLOCK_K=1024,
                                                   BLOCK_KR=64, USE_PDL=False), ptrs)
# the codes' and the block scales' conversion passes, both ways, in place (32- and 8-byte words)
for inverse in (False, True):
    compile_sm90(fragment_convert._fragment_convert_kernel, dict(INVERSE=inverse, BLOCK_ATOMS=16, SYNC=True),
                 dict(src_ptr="*i32", dst_ptr="*i32"), num_warps=16)
    compile_sm90(fragment_convert._scale_convert_kernel, dict(INVERSE=inverse, BLOCK_S=16, SYNC=True),
                 dict(src_ptr="*i64", dst_ptr="*i64"))
# the v3 GEMM: every default tile of the grouped layer and the dense op
tiles = {fragment_config(r, 2048, 2048, dense=d) for r in (1, 8, 32, 40, 128) for d in (False, True)}
for cfg in tiles:
    kernel_sass_report.compile_gemm(cfg, frag=True, rac=True)
print("compiled", len(tiles), "GEMM tiles")
"""


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "tools", "kernel_sass_report.py")), reason="tools/ absent")
def test_gpu_forms_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.replace("ROOT", repr(ROOT))], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled 7 GEMM tiles" in proc.stdout
