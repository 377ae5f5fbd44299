"""tools/kernel_sass_report.py's occupancy arithmetic against what ncu measured on an H100 (docs/results/gpu-2026-12-07d)."""

import pytest


@pytest.mark.parametrize("regs,smem,warps,want", [
    (85, 36864, 4, 5),    # ncu: the 16-token tile, "Block Limit Registers 5"
    (215, 73728, 4, 2),   # ncu: the 64-token tile, "Block Limit Registers 2", "Block Limit Shared Mem 3"
    (32, 73728, 4, 3),    # shared memory binds: 3 x (72 + 1) KB of the 228 KB carveout
    (24, 0, 4, 16),       # warps bind: 64 per SM
    (24, 0, 1, 32),       # CTAs bind: 32 per SM
])
def test_ctas_per_sm(load_tool, regs, smem, warps, want):
    assert load_tool("kernel_sass_report").ctas_per_sm(regs, smem, warps) == want


def test_spills_are_read_from_the_stack_frame(load_tool):
    """cuobjdump of the 32-token tile capped at 128 registers (Triton 3.6, ptxas of CUDA 12.8): its spills
    are the 80-byte stack frame, LOCAL stays 0."""
    line = "  REG:128 STACK:80 SHARED:1024 LOCAL:0 CONSTANT[0]:736 TEXTURE:0 SURFACE:0 SAMPLER:0"
    tool = load_tool("kernel_sass_report")
    assert tool.parse_res_usage(line) == dict(regs=128, spill_bytes=80)
    assert tool.parse_res_usage("  REG:85 STACK:0 SHARED:0 LOCAL:0")["spill_bytes"] == 0
