"""`fragment_layout`'s byte permutations in one Triton pass each: each input byte read once, each output word
written once. Codes: `convert_fragment_order`; block scales: `convert_scale_order`.

One program converts the 64-row strip of a contiguous [..., N, K//2] uint8 tensor (all its K/128
atoms, or a block of them), as 32-bit words. For row r = 16q + 8h + g of the strip and 16-byte
group w of atom S, the words X (bytes 16w + 4s .. of the row) and Y (bytes 16w + 8 + 4s ..) hold,
in their 16-bit halves e, the codes of columns 32w + 4t + (0..3) and 32w + 16 + 4t + (0..3) with
t = 2s + e: exactly the codes of fragment word h*512 + q*128 + g*16 + 4t + w of atom S, which is
one AND/shift/OR expression of those two halves (`_to_fragment`; `_from_fragment` undoes it).
An atom's fragment words lie in its strip (atoms are stored [N/64][K/128]), so a program that
reads the whole strip, waits for its threads (a CTA barrier), then writes, may write in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ATOMS = 16  # atoms (128 columns each) per program: 16384 words, K <= 2048 converts in place directly
MAX_STEPS = 64  # scale steps (8 scales of a row, one 8-byte word) per program: K <= 8192 converts in place directly


@triton.jit
def _to_fragment(u, v):
    """Halves u (b = 0) and v (b = 1), codes j0..j3 at bits 4j: byte 2jj + b gets code A = j(jj) of
    u or v at bits {7, 4..2} and code B = j(jj + 2) at bits {5, 6, 1..0}."""
    a = (u & 0xF) | ((v & 0xF) << 8) | ((u & 0xF0) << 12) | ((v & 0xF0) << 20)
    b = ((u >> 8) & 0xF) | (v & 0xF00) | ((u & 0xF000) << 4) | ((v & 0xF000) << 12)
    return ((((a & 0x08080808) | (b & 0x04040404)) << 4)
            | (((a & 0x07070707) | (b & 0x08080808)) << 2) | (b & 0x03030303))


@triton.jit
def _from_fragment(word):
    """The inverse of `_to_fragment`: a fragment word -> its halves (u, v)."""
    a = ((word >> 4) & 0x08080808) | ((word >> 2) & 0x07070707)
    b = ((word >> 2) & 0x08080808) | ((word >> 4) & 0x04040404) | (word & 0x03030303)
    u = (a & 0xF) | ((a >> 12) & 0xF0) | ((b & 0xF) << 8) | ((b >> 4) & 0xF000)
    v = ((a >> 8) & 0xF) | ((a >> 20) & 0xF0) | (b & 0xF00) | ((b >> 12) & 0xF000)
    return u, v


@triton.jit
def _fragment_convert_kernel(src_ptr, dst_ptr, n_atoms, row_words, INVERSE: tl.constexpr,
                             BLOCK_ATOMS: tl.constexpr, SYNC: tl.constexpr):
    """One 64-row strip's codes (BLOCK_ATOMS atoms of it) as 32-bit words, ModelOpt order to fragment order or
    back (INVERSE); SYNC: a barrier between the reads and the writes, so the strip converts in place."""
    A: tl.constexpr = BLOCK_ATOMS
    base = tl.program_id(0).to(tl.int64) * 64 * row_words  # the strip's first word
    a0 = tl.program_id(1) * A
    r = tl.arange(0, 64)[:, None]
    c = tl.arange(0, A * 16)[None, :]
    mask = a0 + c // 16 < n_atoms  # [1, A * 16]: loads and stores broadcast it over the rows
    # ModelOpt side: row r's words 16 * atom + (4w + 2 half + s): [64, A, 4 (w), 2 (X, Y), 2 (s)]
    row_off = base + r * row_words + a0 * 16 + c
    # fragment side: atom's words h*512 + q*128 + g*16 + (4t + w), t = 2s + e: [64, A, 2, 2, 4]
    frag_off = (base + (a0 + c // 16) * 1024 + ((r // 8) % 2) * 512 + (r // 16) * 128
                + (r % 8) * 16 + c % 16)
    if INVERSE:
        words = tl.load(src_ptr + frag_off, mask=mask).to(tl.uint32, bitcast=True)
        lo, hi = tl.split(tl.permute(tl.reshape(words, (64, A, 2, 2, 4)), (0, 1, 2, 4, 3)))
        u0, v0 = _from_fragment(lo)                        # [64, A, 2 (s), 4 (w)]
        u1, v1 = _from_fragment(hi)
        xy = tl.join(u0 | (u1 << 16), v0 | (v1 << 16))     # [64, A, s, w, X/Y]
        out = tl.reshape(tl.permute(xy, (0, 1, 3, 4, 2)), (64, A * 16))
        dst_off = row_off
    else:
        words = tl.load(src_ptr + row_off, mask=mask).to(tl.uint32, bitcast=True)
        x, y = tl.split(tl.permute(tl.reshape(words, (64, A, 4, 2, 2)), (0, 1, 4, 2, 3)))
        lo = _to_fragment(x & 0xFFFF, y & 0xFFFF)          # [64, A, 2 (s), 4 (w)]
        hi = _to_fragment(x >> 16, y >> 16)
        out = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 2, 4, 3)), (64, A * 16))
        dst_off = frag_off
    if SYNC:
        tl.debug_barrier()  # every thread has read the strip before any writes it
    tl.store(dst_ptr + dst_off, out.to(tl.int32, bitcast=True), mask=mask)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the bytes of a and b (both contiguous) share memory."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


def _readable_source(src: torch.Tensor, out: torch.Tensor, whole_strips: bool, align: int) -> tuple:
    """(the source a launch reads, whether it converts in place): a strided source through a contiguous copy; one
    that overlaps `out` without being it, whose strips one program cannot hold whole, or whose data is off an
    `align`-byte boundary (the kernels move words) through a fresh copy."""
    src = src.contiguous()
    in_place = _overlap(src, out)
    if (in_place and (src.data_ptr() != out.data_ptr() or not whole_strips)) or src.data_ptr() % align:
        return src.clone(), False
    return src, in_place


def convert_fragment_order(src: torch.Tensor, out: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Write `fragment_layout.to_fragment_order(src)` (or, inverse=True, `from_fragment_order(src)`)
    into `out`, in one launch. Both uint8 [..., N, K//2] of one shape, N % 64 == 0, K % 128 == 0
    (the caller checks); `out` contiguous and either disjoint from `src` or `src` itself."""
    k = src.shape[-1] * 2
    if not out.is_contiguous() or out.shape != src.shape:
        raise ValueError(f"out: expected a contiguous uint8 {tuple(src.shape)}, got {tuple(out.shape)} "
                         f"stride {out.stride()}")
    if src.numel() == 0:
        return out
    n_atoms, row_words = k // 128, k // 8
    block = min(MAX_ATOMS, triton.next_power_of_2(n_atoms))
    src, in_place = _readable_source(src, out, block >= n_atoms, 4)
    strips = src.numel() // (64 * k // 2)
    grid = (strips, triton.cdiv(n_atoms, block))
    _fragment_convert_kernel[grid](src.view(torch.int32), out.view(torch.int32), n_atoms, row_words,
                                   INVERSE=inverse, BLOCK_ATOMS=block, SYNC=in_place,
                                   num_warps=max(4, block))
    return out


@triton.jit
def _scale_convert_kernel(src_ptr, dst_ptr, steps, INVERSE: tl.constexpr, BLOCK_S: tl.constexpr,
                          SYNC: tl.constexpr):
    """One 64-row strip of block scales as 8-byte words (a row's 8 scales of one 128-column step): word (r, s)
    of ModelOpt's row-major strip goes to s * 64 + 32 h + 8 q + g of the fragment order, r = 16 q + 8 h + g.
    Both sides are addressed contiguously ([64, S] rows, [S, 64] steps) and the words permuted in registers,
    so loads and stores stay coalesced."""
    base = tl.program_id(0).to(tl.int64) * 64 * steps
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    r = tl.arange(0, 64)
    rows = base + r[:, None] * steps + s[None, :]     # [64 (q h g), S]
    frag = base + s[:, None] * 64 + r[None, :]        # [S, 64 (h q g)]
    rmask = (s < steps)[None, :]                      # (loads and stores broadcast a mask to their pointers)
    fmask = (s < steps)[:, None]
    if INVERSE:
        words = tl.load(src_ptr + frag, mask=fmask)                                   # [S, h, q, g]
        out = tl.reshape(tl.permute(tl.reshape(words, (BLOCK_S, 2, 4, 8)), (2, 1, 3, 0)), (64, BLOCK_S))
    else:
        words = tl.load(src_ptr + rows, mask=rmask)                                   # [q, h, g, S]
        out = tl.reshape(tl.permute(tl.reshape(words, (4, 2, 8, BLOCK_S)), (3, 1, 0, 2)), (BLOCK_S, 64))
    if SYNC:
        tl.debug_barrier()  # every thread has read the strip before any writes it
    if INVERSE:
        tl.store(dst_ptr + rows, out, mask=rmask)
    else:
        tl.store(dst_ptr + frag, out, mask=fmask)


def convert_scale_order(src: torch.Tensor, out: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Write `fragment_layout.to_fragment_scale_order(src)` (or, inverse=True, its inverse) into `out`, in one
    launch. Both one byte per scale [..., N, K//16] of one shape, N % 64 == 0, K % 128 == 0 (the caller checks);
    `out` contiguous and either disjoint from `src` or `src` itself."""
    if not out.is_contiguous() or out.shape != src.shape or out.element_size() != 1 or out.data_ptr() % 8:
        raise ValueError(f"out: expected contiguous one-byte scales {tuple(src.shape)} on an 8-byte boundary (the "
                         f"kernel moves 8-byte words), got {out.dtype} {tuple(out.shape)} stride {out.stride()} "
                         f"at {out.data_ptr():#x}")
    if src.numel() == 0:
        return out
    steps = src.shape[-1] // 8
    block = min(MAX_STEPS, triton.next_power_of_2(steps))
    src, in_place = _readable_source(src, out, block >= steps, 8)
    strips = src.numel() // (64 * steps * 8)
    _scale_convert_kernel[(strips, triton.cdiv(steps, block))](
        src.view(torch.uint8).view(torch.int64), out.view(torch.uint8).view(torch.int64), steps,
        INVERSE=inverse, BLOCK_S=block, SYNC=in_place, num_warps=4)
    return out
