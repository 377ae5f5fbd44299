"""The byte orders the fragment-layout GEMM (`gemm.launch_gemm(..., fragment_layout=True)`) reads its E2M1 codes and E4M3 scales in.

ModelOpt stores a weight's codes row-major, two per byte ([.., N, K//2], low nibble first). The
Hopper kernel instead loads, per thread and 128-wide K step, exactly the codes of its wgmma
register fragment (rows n and n + 8, 32 of the 128 columns) with one 16-byte load, and decodes
each 32-bit word to four f16x2 registers with one AND, a shift pair and four `cvt.e4m3x2`:
byte i of a word carries code A_i at bits {7, 4..2} (an E4M3 byte equal to the value * 2^-6)
and code B_i at bits {5, 6, 1..0} (moved to the same form by (w << 2) & 0x8C | (w >> 2) & 0x10).

Tile atom: 64 rows x 128 columns of one expert = 1024 words, ordered [h 2][q 4][g 8][t 4][w 4]
with row 16q + 8h + g and, for pair j (0-3) of word w and half b (0-1), column
16 (2w + b) + 4t + j: the two halves of a pair sit in the 16-column blocks 2w and 2w + 1, so one
f16x2 of the scales (s[2w], s[2w + 1]) scales the whole word. Atoms are stored [N/64][K/128], so a
64-row tile streams contiguously along K. The block scales move with them
(`to_fragment_scale_order`): an atom's 64 rows x 8 scales are stored [h 2][q 4][g 8][8], so the 8
rows a warp loads per step are 64 contiguous bytes (in ModelOpt's layout they are 8 rows, 8
cache lines, apart). Both permutations keep shape and dtype. `to_fragment_order` and
`from_fragment_order` are exact inverses on every byte, in the plain-torch definition below (the
CPU path); CUDA tensors go through one-pass Triton forms (`fragment_convert`, in place, codes and
scales), checked bit-exactly against the definitions in the interpreter and, under `-m gpu`, on the GPU; the
codes' pass runs at ~1.4x a device copy of the bytes (docs/benchmarks.md section 3).
"""

from __future__ import annotations

from typing import Optional

import torch


ROWS = 64   # rows of one atom (a wgmma m64 tile of one warpgroup)
COLS = 128  # columns of one atom (one K step of the kernel)
_GEOMETRY = (4, 2, 8)        # n = 16 q + 8 h + g   -> dims (q, h, g)
_COLUMNS = (4, 2, 4, 4)      # c = 32 w + 16 b + 4 t + j -> dims (w, b, t, j)


def fragment_columns(k: int, device=None) -> torch.Tensor:
    """Column order of the kernel's K axis: position p of a 128-wide step (p = 32 w + 8 j + 2 t + b)
    multiplies weight column 16 (2w + b) + 4t + j of the step, so an activation enters the
    fragment GEMM as x[:, fragment_columns(K)] (act_quant writes its fp16 values so directly)."""
    if k % COLS:
        raise ValueError(f"K = {k}: the fragment layout needs a multiple of {COLS}")
    p = torch.arange(k, device=device)
    return (p // 32) * 32 + (p % 2) * 16 + ((p // 2) % 4) * 4 + (p // 8) % 4


def _tile_multiples(t: torch.Tensor, name: str, cols_per_element: int) -> tuple:
    """(N, K) of a weight-shaped tensor [..., N, K / cols_per_element], checked to tile into 64 x 128 atoms."""
    n, k = t.shape[-2], t.shape[-1] * cols_per_element
    if n % ROWS or k % COLS:
        unit = f"K/{cols_per_element}"
        raise ValueError(f"{name}: the fragment layout needs N a multiple of {ROWS} and K a multiple of {COLS} "
                         f"({unit} of {COLS // cols_per_element}), got N = {n}, {unit} = {t.shape[-1]} "
                         f"(shape {tuple(t.shape)})")
    return n, k


def check_fragment_shape(codes: torch.Tensor, name: str = "weight") -> tuple:
    """(N, K) of packed codes [..., N, K//2] uint8 that the fragment layout can hold."""
    if codes.dtype != torch.uint8 or codes.ndim < 2:
        raise ValueError(f"{name}: expected packed NVFP4 codes as uint8 [..., N, K//2], got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    return _tile_multiples(codes, name, 2)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (twice the packed bytes, not 8x as int32)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def _check_out(out: torch.Tensor, like: torch.Tensor, name: str) -> None:
    if out.shape != like.shape or out.dtype != torch.uint8 or out.device != like.device:
        raise ValueError(f"{name}: out must be uint8 {tuple(like.shape)} on {like.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _convert(x: torch.Tensor, out: Optional[torch.Tensor], inverse: bool, torch_form) -> torch.Tensor:
    """CUDA: one Triton pass into `out` (a new tensor if none; may be `x` itself); elsewhere the
    torch definition, copied into `out` if one is given."""
    if x.is_cuda:
        from quads_megatron.kernels.fragment_convert import convert_fragment_order

        dst = out if out is not None and out.is_contiguous() else torch.empty(x.shape, dtype=x.dtype,
                                                                               device=x.device)
        convert_fragment_order(x, dst, inverse)
        return dst if out is None or dst is out else out.copy_(dst)
    y = torch_form(x)
    return y if out is None else out.copy_(y)


def to_fragment_order(codes: torch.Tensor, out: Optional[torch.Tensor] = None,
                      name: str = "weight") -> torch.Tensor:
    """ModelOpt packed codes [..., N, K//2] uint8 -> the same bytes in the kernel's fragment order
    (same shape and dtype: a new contiguous tensor, or written into `out`, which may be `codes`)."""
    check_fragment_shape(codes, name)
    if out is not None:
        _check_out(out, codes, name)
    return _convert(codes, out, False, _to_fragment_order_torch)


def from_fragment_order(frag: torch.Tensor, out: Optional[torch.Tensor] = None,
                        name: str = "fragment-order weight") -> torch.Tensor:
    """The exact inverse of `to_fragment_order`: fragment-order bytes -> ModelOpt packed codes."""
    check_fragment_shape(frag, name)
    if out is not None:
        _check_out(out, frag, name)
    return _convert(frag, out, True, _from_fragment_order_torch)


SCALE_BLOCKS = COLS // 16  # E4M3 block scales of one atom row (16 columns each)


def check_fragment_scale_shape(scales: torch.Tensor, name: str = "weight_scale") -> tuple:
    """(N, K) of block scales [..., N, K//16] (one byte each: uint8 or float8_e4m3fn) that the layout can hold."""
    if scales.element_size() != 1 or scales.ndim < 2:
        raise ValueError(f"{name}: expected E4M3 block scales as one byte each [..., N, K//16], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    return _tile_multiples(scales, name, 16)


def to_fragment_scale_order(scales: torch.Tensor, out: Optional[torch.Tensor] = None,
                            name: str = "weight_scale") -> torch.Tensor:
    """ModelOpt block scales [..., N, K//16] -> the same bytes as the fragment GEMM reads them (same shape
    and dtype): per 64-row strip and 128-column step, the 64 rows' 8 scales in the atom's row order
    [h 2][q 4][g 8] (row 16q + 8h + g), steps [N/64][K/128] like the codes' atoms, so one warp's load of
    its 8 rows is 64 contiguous bytes instead of 8 rows apart. A new tensor, or written into `out` (which
    may be `scales`)."""
    return _permute_scales(scales, out, name, inverse=False)


def from_fragment_scale_order(frag: torch.Tensor, out: Optional[torch.Tensor] = None,
                              name: str = "fragment-order weight_scale") -> torch.Tensor:
    """The exact inverse of `to_fragment_scale_order`."""
    return _permute_scales(frag, out, name, inverse=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _steps(t: torch.Tensor) -> Optional[torch.Tensor]:
    """uint8 scales [..., N, K/16] as int64 [..., N, K/128] (the 8 scales of one row and step as one word: an
    eighth of the elements to move), where the strides and offset allow the view; else None."""
    if t.stride(-1) != 1 or t.storage_offset() % 8 or any(st % 8 for st in t.stride()[:-1]):
        return None
    return t.view(torch.int64)


def _permute_scales(x: torch.Tensor, out: Optional[torch.Tensor], name: str, inverse: bool) -> torch.Tensor:
    """The scale permutation: on CUDA one Triton pass (`fragment_convert.convert_scale_order`, in place where `out`
    is `x`); elsewhere, or into an `out` the pass cannot write, the torch definition (`_scale_order_torch`)."""
    check_fragment_scale_shape(x, name)
    if out is not None and (out.shape != x.shape or out.element_size() != 1 or out.device != x.device):
        raise ValueError(f"{name}: out must be one byte per scale {tuple(x.shape)} on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    dst = None if out is None else _bytes(out)
    if x.is_cuda and (dst is None or (_steps(dst) is not None and dst.is_contiguous())):
        from quads_megatron.kernels.fragment_convert import convert_scale_order

        if dst is None:
            return convert_scale_order(_bytes(x), torch.empty(x.shape, dtype=torch.uint8, device=x.device),
                                       inverse).view(x.dtype)
        convert_scale_order(_bytes(x), dst, inverse)
        return out
    y = _scale_order_torch(x, inverse)
    if out is None:
        return y.view(x.dtype)
    dst.copy_(y)
    return out


def _scale_order_torch(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The scale permutation's definition in plain torch (any device): one permute into a new contiguous uint8
    tensor, on 8-byte words (a row's 8 scales of one step) where the strides allow, else on bytes."""
    n, k = x.shape[-2], x.shape[-1] * 16
    src = _bytes(x)
    words = _steps(src)
    src, unit = (words, 1) if words is not None else (src, SCALE_BLOCKS)
    lead = x.shape[:-2]
    d = len(lead)
    modelopt = (*lead, n // ROWS, 4, 2, 8, k // COLS, unit)   # lead, R, q, h, g, S, blocks
    frag = (*lead, n // ROWS, k // COLS, 2, 4, 8, unit)      # lead, R, S, h, q, g, blocks
    if inverse:   # lead, R, S, h, q, g, blocks -> lead, R, q, h, g, S, blocks
        y = src.reshape(frag).permute(*range(d), d, d + 3, d + 2, d + 4, d + 1, d + 5)
    else:         # lead, R, q, h, g, S, blocks -> lead, R, S, h, q, g, blocks
        y = src.reshape(modelopt).permute(*range(d), d, d + 4, d + 2, d + 1, d + 3, d + 5)
    return y.reshape(src.shape).contiguous().view(torch.uint8)


def _to_fragment_order_torch(codes: torch.Tensor) -> torch.Tensor:
    """The layout's definition in plain torch (any device; several passes over the bytes)."""
    n, k = codes.shape[-2], codes.shape[-1] * 2
    lead = codes.shape[:-2]
    c = _codes(codes.contiguous())
    c = c.reshape(*lead, n // ROWS, *_GEOMETRY, k // COLS, *_COLUMNS)
    d = len(lead)
    # dims: lead, R, q, h, g, S, w, b, t, j  ->  lead, R, S, h, q, g, t, w, j, b
    c = c.permute(*range(d), d, d + 4, d + 2, d + 1, d + 3, d + 7, d + 5, d + 8, d + 6)
    a = c[..., 0:2, :].flatten(-2)   # byte i = 2 j + b for pairs j = 0, 1
    b = c[..., 2:4, :].flatten(-2)   # and for pairs j = 2, 3
    byte = ((a & 8) << 4) | ((a & 7) << 2) | ((b & 8) << 2) | ((b & 4) << 4) | (b & 3)
    return byte.reshape(codes.shape)


def _from_fragment_order_torch(frag: torch.Tensor) -> torch.Tensor:
    """`_to_fragment_order_torch`'s inverse in plain torch."""
    n, k = frag.shape[-2], frag.shape[-1] * 2
    lead = frag.shape[:-2]
    d = len(lead)
    byte = frag.contiguous().reshape(
        *lead, n // ROWS, k // COLS, 2, 4, 8, 4, 4, 4)   # lead, R, S, h, q, g, t, w, byte i
    a = ((byte >> 4) & 8) | ((byte >> 2) & 7)
    b = ((byte >> 2) & 8) | ((byte >> 4) & 4) | (byte & 3)
    pair = lambda x: x.reshape(*x.shape[:-1], 2, 2)  # noqa: E731  (j, b)
    c = torch.cat((pair(a), pair(b)), dim=-2)        # lead, R, S, h, q, g, t, w, j, b
    # back to lead, R, q, h, g, S, w, b, t, j
    c = c.permute(*range(d), d, d + 3, d + 2, d + 4, d + 1, d + 6, d + 8, d + 5, d + 7)
    c = c.reshape(*lead, n, k)
    return c[..., 0::2] | (c[..., 1::2] << 4)
