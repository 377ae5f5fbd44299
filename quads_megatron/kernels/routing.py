"""Expert-sorted routing for the grouped GEMM, like SGLang's moe_align_block_size, in three Triton launches.

The routed rows (token t, slot j) -> flat id t * topk + j are sorted by expert (stable), each
expert's run is padded to a multiple of block_m with the pad id T * topk, and every block of
block_m sorted ids gets its expert id. Sizes are the static upper bound
T * topk + E * (block_m - 1), so nothing waits for the GPU (CUDA-graph safe); the GEMM skips
blocks past `num_tokens_post_padded`.

Three launches instead of the ~25 small torch kernels of a sort-based form (each costs a few
microseconds even inside a CUDA graph, which at decode is a sizeable share of the layer):
  1. per chunk of CHUNK routed rows, the row count of every expert;
  2. one program: padded expert starts, and every chunk's start within each expert (an exclusive
     prefix over chunks), num_tokens_post_padded;
  3. per chunk, each row's slot = its chunk's start in its expert + its rank among the earlier
     rows of the chunk with the same expert; per group of blocks, each block's expert id and the
     pad id in its slots past that expert's rows.
(A one-program form for up to 512 rows was removed: on the H100 it took 15-48 us against these
three launches' 9-15 us inside a CUDA graph, docs/benchmarks.md section 5.)
The torch definition (argsort-based) is `reference.moe_align_block_size`; they agree exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, pdl_prologue

CHUNK = 128  # routed rows per program of launches 1 and 3 (rank by a CHUNK x CHUNK comparison)
FILL = 1024  # padded slots (whole blocks) given expert ids and pad ids per program of launch 3


class Routing(NamedTuple):
    """sorted_ids int32 [max_padded], expert_ids int32 [max_padded // block_m],
    num_tokens_post_padded int32 [1]."""
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


@triton.jit
def _count_kernel(ids_ptr, M, counts_ptr, E, CHUNK: tl.constexpr, E_POW: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    """counts[c, e] = rows of chunk c routed to expert e."""
    pdl_prologue(USE_PDL)
    c = tl.program_id(0)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + idx, mask=idx < M, other=E)
    experts = tl.arange(0, E_POW)
    n = tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E + experts, n, mask=experts < E)


@triton.jit
def _offsets_kernel(counts_ptr, NC, E, starts_ptr, totals_ptr, npost_ptr, BLOCK_M: tl.constexpr,
                    E_POW: tl.constexpr, CB: tl.constexpr, USE_PDL: tl.constexpr = False):
    """counts [NC, E] -> in place each chunk's first slot per expert; padded starts, totals and
    num_tokens_post_padded (one program)."""
    pdl_prologue(USE_PDL)
    experts = tl.arange(0, E_POW)
    emask = experts < E
    total = tl.zeros((E_POW,), tl.int32)
    for c0 in range(0, NC, CB):
        ch = c0 + tl.arange(0, CB)
        m = (ch < NC)[:, None] & emask[None, :]
        total += tl.sum(tl.load(counts_ptr + ch[:, None] * E + experts[None, :], mask=m, other=0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(starts_ptr + experts, start, mask=emask)
    tl.store(totals_ptr + experts, total, mask=emask)
    tl.store(npost_ptr, tl.sum(padded, axis=0))
    running = start
    for c0 in range(0, NC, CB):
        ch = c0 + tl.arange(0, CB)
        m = (ch < NC)[:, None] & emask[None, :]
        ptrs = counts_ptr + ch[:, None] * E + experts[None, :]
        cnt = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(cnt, axis=0) - cnt + running[None, :], mask=m)
        running += tl.sum(cnt, axis=0)


@triton.jit
def _place_kernel(ids_ptr, M, base_ptr, E, starts_ptr, totals_ptr, npost_ptr, sorted_ptr,
                  expert_ids_ptr, NC, NUM_BLOCKS, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  FILL_BLOCKS: tl.constexpr, E_POW: tl.constexpr, USE_PDL: tl.constexpr = False):
    """sorted[base[c, e] + rank] = flat id for the rows of chunk c; for FILL_BLOCKS blocks of slots:
    their expert id, and the pad id in their slots past the expert's rows."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if pid < NC:
        i = tl.arange(0, CHUNK)
        idx = pid * CHUNK + i
        valid = idx < M
        e = tl.load(ids_ptr + idx, mask=valid, other=E)
        earlier = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(base_ptr + pid * E + e, mask=valid, other=0)
        tl.store(sorted_ptr + base + rank, idx, mask=valid)
    # blocks b of this program: expert = experts whose padded run ends at or before b's first slot
    experts = tl.arange(0, E_POW)
    emask = experts < E
    start = tl.load(starts_ptr + experts, mask=emask, other=0)
    total = tl.load(totals_ptr + experts, mask=emask, other=0)
    end = tl.where(emask, start + (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 2147483647)
    b = pid * FILL_BLOCKS + tl.arange(0, FILL_BLOCKS)
    bmask = b < NUM_BLOCKS
    first = b * BLOCK_M
    owner = tl.minimum(tl.sum((end[None, :] <= first[:, None]).to(tl.int32), axis=1), E - 1)
    tl.store(expert_ids_ptr + b, owner, mask=bmask)
    mine = experts[None, :] == owner[:, None]
    rows_end = tl.sum(tl.where(mine, (start + total)[None, :], 0), axis=1)
    rows_end = tl.where(first < tl.load(npost_ptr), rows_end, 0)
    p = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = bmask[:, None] & (p >= rows_end[:, None])
    tl.store(sorted_ptr + p, tl.zeros((FILL_BLOCKS, BLOCK_M), tl.int32) + M, mask=pad)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> Routing:
    """Sort routed rows by expert and pad each expert's rows to a multiple of block_m."""
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    flat = flat.contiguous()
    m, dev = flat.numel(), flat.device
    max_padded = triton.cdiv(m + num_experts * (block_m - 1), block_m) * block_m
    num_blocks = max_padded // block_m
    nc = max(1, triton.cdiv(m, CHUNK))
    e_pow = triton.next_power_of_2(num_experts + 1)  # + 1: the id of masked rows
    work = torch.empty(nc * num_experts + 2 * num_experts + 1, dtype=torch.int32, device=dev)
    counts = work[:nc * num_experts]
    starts = work[nc * num_experts:(nc + 1) * num_experts]
    totals = work[(nc + 1) * num_experts:(nc + 2) * num_experts]
    npost = work[-1:]
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    pdl = pdl_options(dev)
    _count_kernel[(nc,)](flat, m, counts, num_experts, CHUNK=CHUNK, E_POW=e_pow, num_warps=4, **pdl)
    _offsets_kernel[(1,)](counts, nc, num_experts, starts, totals, npost, BLOCK_M=block_m,
                          E_POW=e_pow, CB=max(1, min(64, 16384 // e_pow)), num_warps=8, **pdl)
    fill_blocks = max(1, FILL // block_m)
    grid = (max(nc, triton.cdiv(num_blocks, fill_blocks)),)
    _place_kernel[grid](flat, m, counts, num_experts, starts, totals, npost, sorted_ids, expert_ids,
                        nc, num_blocks, BLOCK_M=block_m, CHUNK=CHUNK, FILL_BLOCKS=fill_blocks,
                        E_POW=e_pow, num_warps=4, **pdl)
    return Routing(sorted_ids, expert_ids, npost)
