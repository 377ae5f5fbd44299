"""Rollout compute for QUADS: W4A4 / W4A4+RAC / W4A16 NVFP4 GEMMs (dense and fused MoE) in Triton.

`w4a4_linear` and `w4a4_fused_moe` are the public ops (docs/interfaces.md); `reference`
holds their plain-torch definitions.
"""

from .ops import w4a4_fused_moe, w4a4_linear

__all__ = ["w4a4_linear", "w4a4_fused_moe"]
