"""Server-side NVFP4 quantization of BF16 expert weights pushed by an RL weight sync (``--sglang-weight-sync tensor-bf16``).

The trainer may send the high-precision HF expert weights (``experts.{e}.gate_proj.weight`` ...)
instead of their NVFP4 triples, as NeMo RL does. QuadsMoEMethod's loader then stages each tensor
(a reference: no copy), and ``quantize_staged`` -- run from ``process_weights_after_loading`` at the
end of the update -- quantizes all staged experts of the layer in grouped launches with the numbers
of ``quads_megatron.nvfp4`` (gate and up share one global scale computed on the full, unsharded
weights, so every TP rank matches the trainer's export bit for bit) and writes them into the
layer's NVFP4 parameters in place.
"""

from __future__ import annotations

import torch

from quads_megatron import nvfp4
from quads_megatron.errors import CheckpointError
from quads_megatron.plan.layout import packed_cols



def stage(layer: torch.nn.Module, name: str, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
    """Keep one BF16 expert projection until the end of the update; check its full HF shape."""
    h, f_full = layer.quads_dims
    want = (h, f_full) if shard_id == "w2" else (f_full, h)
    if tuple(loaded.shape) != want:
        raise CheckpointError(f"{name}: a high-precision expert weight must have the full shape {want}, "
                              f"got {tuple(loaded.shape)} ({loaded.dtype})")
    if loaded.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise CheckpointError(f"{name}: expected packed uint8 NVFP4 codes or a bf16/fp16/fp32 weight, got {loaded.dtype}")
    layer.__dict__.setdefault("quads_staged", {})[(expert_id, shard_id)] = (name, loaded)


def quantize_staged(layer: torch.nn.Module, local_slots, tensor_name, fc1_shards: tuple) -> None:
    """Quantize every staged expert of ``layer`` into its NVFP4 parameters (grouped launches).

    fc1_shards: SGLang's shard ids of the rollout layout's fc1 pair (gate, up), which share one
    weight_scale_2 (``quads_megatron.plan.layout.EXPERT_FC1``), in the order of w13's rows."""
    staged = layer.__dict__.pop("quads_staged", None)
    if not staged:
        return
    experts = sorted({e for e, _ in staged})
    for e in experts:
        have = {sid for x, sid in staged if x == e}
        missing = [sid for sid in (*fc1_shards, "w2") if sid not in have]
        if missing:
            raise CheckpointError(f"{tensor_name(layer, e, missing[0], 'w13_weight' if missing[0] != 'w2' else 'w2_weight')}: "
                                  f"missing from the BF16 weight update (the other projections of this expert came)")
    pairs = [(slot, e) for e in experts for slot in local_slots(layer, e)]
    if not pairs:
        return
    device = layer.w13_weight.device
    slots = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
    owned = [e for _, e in pairs]
    tp, rank = layer.moe_tp_size, layer.moe_tp_rank
    h, f_full = layer.quads_dims
    f = f_full // tp
    rows = slice(rank * f, (rank + 1) * f)

    def get(e, sid):
        return staged[(e, sid)][1].to(device)

    # fc1: gate and up of one expert share the amax of their full weights; this rank quantizes its rows
    full13 = [get(e, sid) for e in owned for sid in fc1_shards]
    share = len(fc1_shards)  # the plan's scale group: gate and up of one expert
    amax13, bad13 = nvfp4.amax_grouped(full13, scale_group=share, name="gate_proj/up_proj weights")
    q13 = nvfp4.quantize_grouped([t[rows] for t in full13], scale_group=share, amax=amax13, nonfinite=bad13)
    n = len(owned)
    layer.w13_weight.data.index_copy_(0, slots, q13.data.view(n, share * f, packed_cols(h)))
    layer.w13_weight_scale.data.view(torch.uint8).index_copy_(0, slots, q13.scale.view(torch.uint8).view(n, 2 * f, -1))
    s13 = q13.global_scale.view(n, share)
    layer.w13_weight_scale_2.data.index_copy_(0, slots, s13)
    # fc2: the down projection's K is sharded over TP ranks; its amax is the full weight's
    full2 = [get(e, "w2") for e in owned]
    amax2, bad2 = nvfp4.amax_grouped(full2, name="down_proj weights")
    q2 = nvfp4.quantize_grouped([t[:, rows].contiguous() for t in full2], amax=amax2, nonfinite=bad2)
    layer.w2_weight.data.index_copy_(0, slots, q2.data)
    layer.w2_weight_scale.data.view(torch.uint8).index_copy_(0, slots, q2.scale.view(torch.uint8))
    layer.w2_weight_scale_2.data.index_copy_(0, slots, q2.global_scale.view(n))
    bad = torch.cat([bad13, bad2]).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        e, sid = (owned[i], "w1") if i < n else (owned[i - n], "w2")
        raise CheckpointError(f"{staged[(e, sid)][0]}: NaN or Inf in the BF16 weight update; NVFP4 can only "
                              f"encode finite values")
    from sglang_ext.moe_method import mark_written  # (moe_method imports this module)

    for pname, sids in (("w13_weight", fc1_shards), ("w13_weight_scale", fc1_shards), ("w2_weight", ("w2",)),
                        ("w2_weight_scale", ("w2",))):
        mark_written(layer, pname, [(s, sid) for s, _ in pairs for sid in sids])
