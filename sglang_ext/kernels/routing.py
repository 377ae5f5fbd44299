"""Expert-sorted routing for the grouped GEMM, like SGLang's moe_align_block_size, in sync-free torch ops.

The routed rows (token t, slot j) -> flat id t * topk + j are sorted by expert (stable), each
expert's run is padded to a multiple of block_m with the pad id T * topk, and every block of
block_m sorted ids gets its expert id. Sizes are the static upper bound
T * topk + E * (block_m - 1), so nothing waits for the GPU (CUDA-graph safe); the kernel
skips blocks past `num_tokens_post_padded`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """sorted_ids int32 [max_padded], expert_ids int32 [max_padded // block_m],
    num_tokens_post_padded int32 [1]."""
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> Routing:
    """Sort routed rows by expert and pad each expert's rows to a multiple of block_m."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel, dev = flat.numel(), flat.device
    max_padded = numel + num_experts * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_exp = flat[order]
    pos = torch.arange(numel, device=dev) - cnt_start[sorted_exp]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids[pad_start[sorted_exp] + pos] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_starts, right=True)
    expert_ids = expert_ids.clamp(max=num_experts - 1).to(torch.int32)
    return Routing(sorted_ids, expert_ids, pad_end[-1:].to(torch.int32))
