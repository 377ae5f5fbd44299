"""Grouped NVFP4: quantize or fake-quantize many equal-shape matrices (a layer's experts) in one launch.

``mats`` is a contiguous ``[M, R, K]`` tensor or a list of M contiguous ``[R, K]`` tensors (the
per-expert weights of a Megatron ``SequentialMLP``, or gate/up/down from a weight stream, with no
copy into a stack). Consecutive runs of ``scale_group`` matrices share one global scale (gate and
up of one expert: 2; one expert's ``[gate; up]`` fc1 or its down projection: 1), so the results are
bit-identical to ``core.quantize(x, amax=shared amax)`` per group. The amax is one launch before the
quantize launch unless given (a TP-sharded weight's amax is all-reduced first: ``amax_grouped`` then
``amax=``). No host sync: a group holding NaN/Inf gets a NaN global scale (the group then decodes
to NaN, never to finite garbage); callers that must refuse it check the scales once, later.
Backends as everywhere (``resolve_backend``): the Triton kernel, or the torch reference.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from quads_megatron.errors import InputError

from .backend import resolve_backend
from .core import dequantize_reference, global_encode_scale, quantize_reference
from .format import BLOCK_SIZE
from .tensor import NVFP4Tensor

Mats = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = ["amax_grouped", "fake_quantize_grouped", "quantize_grouped", "refit_grouped"]


def _check(mats: Mats, scale_group: int, name: str) -> tuple:
    """(M, R, K, dtype, device) of valid grouped input; InputError naming what is wrong."""
    if isinstance(mats, torch.Tensor):
        if mats.ndim != 3:
            raise InputError(f"{name}: expected [M, R, K] matrices, got shape {tuple(mats.shape)}")
        if not mats.is_contiguous():
            raise InputError(f"{name}: the [M, R, K] tensor must be contiguous")
        m, r, k = mats.shape
        first = mats
    else:
        mats = list(mats)
        if not mats:
            raise InputError(f"{name}: no matrices given")
        first = mats[0]
        if not isinstance(first, torch.Tensor) or first.ndim != 2:
            raise InputError(f"{name}[0]: expected a 2-D tensor, got "
                             f"{tuple(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__}")
        shape, dtype, device = first.shape, first.dtype, first.device
        for i, t in enumerate(mats):  # one cheap pass (a layer has hundreds of experts); details on failure
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
                raise InputError(f"{name}[{i}]: expected a 2-D tensor, got {type(t).__name__}")
            if t.shape != shape or t.dtype != dtype or t.device != device:
                raise InputError(f"{name}[{i}]: {t.dtype} {tuple(t.shape)} on {t.device}; every matrix must "
                                 f"match {name}[0] ({first.dtype} {tuple(first.shape)} on {first.device})")
            if not t.is_contiguous():
                raise InputError(f"{name}[{i}]: must be contiguous")
        m, (r, k) = len(mats), first.shape
    if first.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"{name}: expected float32, bfloat16 or float16 matrices, got {first.dtype}")
    if k % BLOCK_SIZE or r == 0:
        raise InputError(f"{name}: K = {k} must be a positive multiple of {BLOCK_SIZE} (NVFP4 blocks), "
                         f"R = {r} positive")
    if scale_group < 1 or m % scale_group:
        raise InputError(f"{name}: {m} matrices do not split into scale groups of {scale_group}")
    return m, r, k, first.dtype, first.device


def _stacked(mats: Mats, groups: int) -> torch.Tensor:
    x = mats if isinstance(mats, torch.Tensor) else torch.stack(list(mats))
    return x.reshape(groups, -1, x.shape[-1])                               # [G, group * R, K]


def _torch_amax(x: torch.Tensor) -> tuple:
    finite = torch.isfinite(x).flatten(1).all(dim=1)
    return x.abs().flatten(1).amax(dim=1).to(torch.float32), (~finite).to(torch.int32)


def _triton():
    from . import triton_kernels

    return triton_kernels


def amax_grouped(mats: Mats, *, scale_group: int = 1, backend: Optional[str] = None,
                 name: str = "weights") -> Tuple[torch.Tensor, torch.Tensor]:
    """(amax fp32 [G], nonfinite int32 [G]) of each scale group, one read of the data."""
    m, r, k, _, device = _check(mats, scale_group, name)
    if resolve_backend(device, backend) == "triton":
        tk = _triton()
        return tk.grouped(mats, scale_group, mode=tk.AMAX_ONLY)
    return _torch_amax(_stacked(mats, m // scale_group))


def _given(amax, nonfinite, groups: int, device) -> tuple:
    amax = torch.as_tensor(amax, dtype=torch.float32, device=device).reshape(-1)
    if amax.numel() != groups:
        raise InputError(f"amax: expected {groups} values (one per scale group), got {amax.numel()}")
    bad = (torch.zeros(groups, dtype=torch.int32, device=device) if nonfinite is None
           else torch.as_tensor(nonfinite, device=device).reshape(groups).to(torch.int32))
    return amax, bad


def _prepare(mats, scale_group, amax, nonfinite, groups, device, backend) -> tuple:
    """(amax, nonfinite, triton launch or None). On Triton: one pointer table, the amax pass when no
    amax is given (its own launch, no host sync), and a function running the quantize pass."""
    given = amax is not None
    if given:
        amax, nonfinite = _given(amax, nonfinite, groups, device)
    if resolve_backend(device, backend) != "triton":
        return amax, nonfinite, None
    tk = _triton()
    table = tk.pointer_table(mats)
    if not given:
        amax, nonfinite = tk.grouped(table, scale_group, mode=tk.AMAX_ONLY)

    def launch(fake, out, pack=None, out_fake=None):
        return tk.grouped(table, scale_group, mode=tk.AMAX_GIVEN, fake=fake, amax=amax, bad=nonfinite, out=out,
                          pack=pack, out_fake=out_fake)

    return amax, nonfinite, launch


def _torch_scales(x, amax, nonfinite):
    """(S_enc [G,1,1], S_dec [G,1,1], S_dec with NaN for non-finite groups [G])."""
    if amax is None:
        amax, nonfinite = _torch_amax(x)
    s_enc = global_encode_scale(amax).view(-1, 1, 1)
    s_dec = torch.div(1.0, s_enc)
    poisoned = torch.where((nonfinite > 0) | torch.isnan(amax), torch.full_like(amax, float("nan")),
                           s_dec.view(-1))
    return s_enc, s_dec, poisoned


def _packed_into(out: Optional[tuple], data: torch.Tensor, scale: torch.Tensor, s_dec: torch.Tensor) -> tuple:
    """The torch path's (data, scale, S_dec), copied into ``out``'s buffers when given (their views returned)."""
    if out is None:
        return data, scale, s_dec
    data_out, scale_out, s_out = out
    return data_out.copy_(data), scale_out.copy_(scale), s_out.copy_(s_dec)


def quantize_grouped(mats: Mats, *, scale_group: int = 1, amax=None, nonfinite=None,
                     out: Optional[tuple] = None, backend: Optional[str] = None,
                     name: str = "weights") -> NVFP4Tensor:
    """NVFP4 of M matrices: an ``[M, R, K]`` NVFP4Tensor with one global scale per matrix (``[M, 1, 1]``,
    equal within a scale group).

    amax / nonfinite: given per-group amax ([G], e.g. all-reduced over TP) and NaN/Inf flags.
    out: (data uint8 [M, R, K/2], scale e4m3 [M, R, K/16], S_dec fp32 [G]) to write in place (a rollout
    engine's weight buffers); the result's fields are views of them.
    """
    m, r, k, _, device = _check(mats, scale_group, name)
    groups = m // scale_group
    amax, nonfinite, triton = _prepare(mats, scale_group, amax, nonfinite, groups, device, backend)
    if triton:
        data, scale, s_dec = triton(fake=False, out=out)
    else:
        x = _stacked(mats, groups)
        s_enc, s_dec3, s_dec = _torch_scales(x, amax, nonfinite)
        d, sc = quantize_reference(x, s_enc, s_dec3)
        data, scale, s_dec = _packed_into(out, d.view(m, r, k // 2), sc.view(m, r, k // BLOCK_SIZE), s_dec)
    per_matrix = s_dec.repeat_interleave(scale_group).view(m, 1, 1)
    return NVFP4Tensor._trusted(data, scale, per_matrix, torch.Size((m, r, k)), (1, BLOCK_SIZE))


def fake_quantize_grouped(mats: Mats, *, scale_group: int = 1, amax=None, nonfinite=None,
                          out: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                          name: str = "weights") -> torch.Tensor:
    """dequantize(quantize(.)) of M matrices as one ``[M, R, K]`` tensor in their dtype (no gradient:
    the trainer's straight-through wrapper owns that). out: the [M, R, K] buffer to fill."""
    m, r, k, dtype, device = _check(mats, scale_group, name)
    groups = m // scale_group
    amax, nonfinite, triton = _prepare(mats, scale_group, amax, nonfinite, groups, device, backend)
    if triton:
        return triton(fake=True, out=out)[0]
    x = _stacked(mats, groups)
    s_enc, s_dec3, s_dec = _torch_scales(x, amax, nonfinite)
    d, sc = quantize_reference(x, s_enc, s_dec3)
    y = dequantize_reference(d, sc, s_dec.view(-1, 1, 1), dtype).view(m, r, k)
    if out is None:
        return y
    return out.copy_(y)


def refit_grouped(mats: Mats, *, scale_group: int = 1, amax=None, nonfinite=None, out: Optional[tuple] = None,
                  out_fake: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                  name: str = "weights") -> Tuple[torch.Tensor, NVFP4Tensor]:
    """Both results of a refit from one read of the weights: (fake-quantized ``[M, R, K]`` in their dtype,
    the trainer's AQAT value; NVFP4Tensor, the rollout's weights), each bit-identical to
    ``fake_quantize_grouped`` / ``quantize_grouped`` of the same arguments. out: the packed buffers (as in
    ``quantize_grouped``); out_fake: the [M, R, K] buffer of the fake-quantized values."""
    m, r, k, dtype, device = _check(mats, scale_group, name)
    groups = m // scale_group
    amax, nonfinite, triton = _prepare(mats, scale_group, amax, nonfinite, groups, device, backend)
    if triton:
        fake, data, scale, s_dec = triton(fake=True, out=out, pack=True, out_fake=out_fake)
    else:
        x = _stacked(mats, groups)
        s_enc, s_dec3, s_dec = _torch_scales(x, amax, nonfinite)
        d, sc = quantize_reference(x, s_enc, s_dec3)
        fake = dequantize_reference(d, sc, s_dec.view(-1, 1, 1), dtype).view(m, r, k)
        fake = fake if out_fake is None else out_fake.copy_(fake)
        data, scale, s_dec = _packed_into(out, d.view(m, r, k // 2), sc.view(m, r, k // BLOCK_SIZE), s_dec)
    per_matrix = s_dec.repeat_interleave(scale_group).view(m, 1, 1)
    return fake, NVFP4Tensor._trusted(data, scale, per_matrix, torch.Size((m, r, k)), (1, BLOCK_SIZE))
