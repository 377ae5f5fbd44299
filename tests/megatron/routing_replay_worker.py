"""torchrun worker for test_routing_replay_distributed.py: routing replay under TP=2 (sequence parallel), EP=2
and TP=2 x EP=2 (one launch, gloo).

  torchrun --nproc-per-node 2 tests/megatron/routing_replay_worker.py OUT_DIR

Each rank writes OUT_DIR/rank{r}.json: per layout, whether every router dispatched the given routes, the
replayed loss, and whether the disagreement matches a by-hand count against the free routing.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 256, 16, 2


def _dispatched(model, forward):
    """Run forward(); return the experts [B, S, L, K] (sorted) each router dispatched, gathered over SP ranks."""
    from megatron.core import parallel_state

    from quads_megatron.megatron.routing_replay import moe_routers

    maps, handles = {}, []
    for layer, r in moe_routers(model):
        handles.append(r.register_forward_hook(lambda m, i, o, layer=layer: maps.__setitem__(layer, o[1].detach())))
    out = forward()
    for h in handles:
        h.remove()
    per_layer = []
    for layer in sorted(maps):
        m = maps[layer]
        ids = m.nonzero()[:, 1].view(m.shape[0], -1).view(-1, BATCH, 2)  # [S_local, B, K]
        if model.config.sequence_parallel:
            g = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, ids.contiguous(), group=g)
            ids = torch.cat(parts, 0)
        per_layer.append(ids.transpose(0, 1))
    return torch.stack(per_layer, 2), out


def check(tp, ep, etp):
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.parallel import initialize_distributed
    from quads_megatron.megatron.presets import qwen3_moe_config
    from quads_megatron.megatron.routing_replay import RoutingReplay

    initialize_distributed(tp=tp, ep=ep, etp=etp)
    cfg = qwen3_moe_config("tiny", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                           expert_tensor_parallel_size=etp, moe_enable_routing_replay=True)
    model = build_gpt_model(cfg, VOCAB, SEQ)
    rr = RoutingReplay(model)
    g = torch.Generator().manual_seed(5)  # the same tokens and routes on every rank
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    L, E, K = cfg.num_layers, cfg.num_moe_experts, cfg.moe_router_topk
    routes = torch.rand(BATCH, SEQ, L, E, generator=g).argsort(-1)[..., :K].to(torch.int32)

    def forward(r, replay):
        rr.begin(r, replay, torch.device("cpu"))
        with torch.no_grad():
            loss = model(tokens, pos, None, labels=torch.roll(tokens, -1, 1)).float().mean()
        return loss, rr.end(BATCH, SEQ)

    free, _ = _dispatched(model, lambda: forward(None, False))
    _, (_, diff) = _dispatched(model, lambda: forward(routes, False))  # record: the routers route freely
    by_hand = (free != routes.long().sort(-1).values).any(-1)
    got, (loss, _) = _dispatched(model, lambda: forward(routes, True))
    rr.clear()
    return {"dispatched": bool(torch.equal(got, routes.long().sort(-1).values)),
            "some_free_differ": bool(by_hand.any()),
            "diff_by_hand": bool(torch.equal(diff, by_hand)), "loss": float(loss)}


def main():
    out_dir = sys.argv[1]
    from quads_megatron.megatron.parallel import initialize_distributed

    initialize_distributed()
    results = {f"tp{tp}_ep{ep}": check(tp, ep, etp) for tp, ep, etp in ((1, 1, None), (2, 1, None), (1, 2, None),
                                                                         (2, 2, 1))}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
