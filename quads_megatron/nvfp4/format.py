"""Constants of the NVFP4 format: E2M1 values, E4M3 block scales, FP32 tensor scales."""

import torch

BLOCK_SIZE = 16
"""Consecutive elements along the last dimension that share one E4M3 scale."""

FP4_MAX = 6.0
"""Largest E2M1 magnitude."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude (block scales saturate here)."""

GLOBAL_SCALE_NUMERATOR = FP4_MAX * E4M3_MAX  # 2688: S_enc = 2688 / amax
FLT_MAX = torch.finfo(torch.float32).max

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit code; bit 3 is the sign."""

# Rounding boundaries on |x| (after scaling and clamping to [-6, 6]): code magnitude
# grows by one past each boundary. Boundaries that are ties round to the even code,
# so `>` is used where the lower code is even and `>=` where the upper code is even
# (exactly Transformer Engine's cast_to_fp4x2 thresholds).
E2M1_BOUNDS_GT = (0.25, 1.25, 2.5, 5.0)   # ties round down (to codes 0, 2, 4, 6)
E2M1_BOUNDS_GE = (0.75, 1.75, 3.5)        # ties round up   (to codes 2, 4, 6)


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16-entry code -> value lookup table."""
    return torch.tensor(E2M1_VALUES, device=device, dtype=dtype)
