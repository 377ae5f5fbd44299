"""Fake quantization through Transformer Engine's NVFP4Quantizer (1D or 2D blocks, no RHT, no stochastic rounding).

UNTESTED HERE: Transformer Engine cannot be installed on the CPU machines this project is
developed and tested on, so this path has never run.  It is guarded: asking for it
(``QuadsRecipe(backend="te")``) without a usable TE raises ``RuntimeError`` with the reason.
The global scale is TE's own: its amax, reduced with MAX over ``group`` (the expert
tensor-parallel group), which is the same quantity ``quads_megatron.nvfp4`` uses; the
``tests/megatron`` GPU test (marked ``gpu``) compares the two when TE is present.
"""

import functools
import inspect

import torch


@functools.lru_cache(maxsize=1)
def te_nvfp4_status():
    """(available, reason): TE importable with NVFP4 support on this machine."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer  # noqa: F401
    except Exception as exc:  # ImportError, or TE failing to load its CUDA library
        return False, f"transformer_engine with NVFP4 is not importable ({exc.__class__.__name__}: {exc})"
    check = getattr(te, "is_nvfp4_available", None)
    if check is not None:
        ok, reason = check(return_reason=True)
        if not ok:
            return False, f"transformer_engine reports NVFP4 unavailable: {reason}"
    return True, ""


def require_te_nvfp4():
    ok, reason = te_nvfp4_status()
    if not ok:
        raise RuntimeError(f"QuadsRecipe(backend='te') needs Transformer Engine NVFP4: {reason}. "
                           "Use backend='torch' (quads_megatron.nvfp4, the same numbers).")


@functools.lru_cache(maxsize=None)
def _quantizer(block_shape, group):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    wanted = dict(fp4_dtype=tex.DType.kFloat4E2M1, rowwise=True, columnwise=False,
                  with_amax_reduction=group is not None, amax_reduction_group=group,
                  with_rht=False, with_post_rht_amax=False,
                  with_2d_quantization=tuple(block_shape) == (16, 16), stochastic_rounding=False)
    accepted = inspect.signature(NVFP4Quantizer.__init__).parameters
    if tuple(block_shape) == (16, 16) and "with_2d_quantization" not in accepted:
        raise RuntimeError("this Transformer Engine's NVFP4Quantizer has no 2D (16x16) blocks")
    return NVFP4Quantizer(**{k: v for k, v in wanted.items() if k in accepted})


def te_fake_quantize(x: torch.Tensor, block_shape=(1, 16), group=None) -> torch.Tensor:
    """dequantize(quantize(x)) of a 2-D tensor by TE (amax all-reduced MAX over ``group``), no autograd."""
    require_te_nvfp4()
    if x.ndim != 2:
        raise ValueError(f"te_fake_quantize expects a 2-D weight, got shape {tuple(x.shape)}")
    q = _quantizer(tuple(block_shape), group)(x.detach().contiguous())
    return q.dequantize(dtype=x.dtype)
