"""Rollout routing replay (R3) on Megatron-Core's own mechanism: ``TransformerConfig.moe_enable_routing_replay``
gives every TopKRouter a ``RouterReplay``; this drives them per forward and measures routing disagreement.

Routes come in the rollout's layout, batch-first ``[B, S, L, K]`` (row t: the experts of token t in
layer l). Megatron's router sees the tokens of ``[s, b]`` hidden states flattened s-major, and under
sequence parallelism only this TP rank's chunk of s; ``to_router_order`` makes that layout.
With replay, the router gathers its scores at the given ids (REPLAY_FORWARD, and REPLAY_BACKWARD for
an activation recompute), so the gate probabilities of the replayed experts are still differentiated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class RecordingRouterReplay(RouterReplay):
    """Megatron's RouterReplay that, while replaying the forward, also records the top-k the router would
    have chosen itself (on the same scores), so the disagreement is measured with replay on as well."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
            self.record_indices(own)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


def moe_routers(model) -> list:
    """(global layer index, TopKRouter) of every MoE layer of this pipeline stage, in layer order."""
    out = []
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))
    return out


def to_router_order(routes: torch.Tensor, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False):
    """[B, S, K] batch-first ids -> [S_local * B, K] int64 in the router's token order ([s, b] flattened,
    this rank's s-chunk under sequence parallelism)."""
    sb = routes.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        sb = sb.chunk(tp_size, dim=0)[tp_rank]
    return sb.reshape(-1, routes.shape[-1]).long()


class RoutingReplay:
    """Per-forward control of the model's RouterReplay instances (Megatron's), swapped for RecordingRouterReplay."""

    def __init__(self, model):
        from megatron.core import parallel_state

        self.config = model.config
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("RoutingReplay: the model has no MoE router")
        for _, router in self.routers:
            if router.router_replay is None:
                raise ValueError("RoutingReplay: the model was built without TransformerConfig."
                                 "moe_enable_routing_replay=True, its routers have no RouterReplay")
            old = router.router_replay
            if old in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(old)
            router.router_replay = RecordingRouterReplay()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self._targets: list[torch.Tensor] | None = None

    def _local(self, routes: torch.Tensor, layer: int, device) -> torch.Tensor:
        return to_router_order(routes[:, :, layer], self.tp_rank, self.tp_size,
                               self.config.sequence_parallel).to(device)

    def begin(self, routes: torch.Tensor | None, replay: bool, device) -> None:
        """Before a forward: ``routes`` [B, S, L, K] (None: route freely, record nothing). replay: the routers
        use these ids (and record their own choice); otherwise they route freely and record it."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
        if routes is None:
            if replay:
                raise ValueError("routing replay: no rollout routes for this batch (the rollout engine "
                                 "returned no routed experts)")
            self._targets = None
            for _, router in self.routers:
                router.router_replay.clear_router_replay_action()
            return
        L = routes.shape[2]
        if max(layer for layer, _ in self.routers) >= L:
            raise ValueError(f"routing replay: routes hold {L} layers, the model has MoE layer "
                             f"{max(layer for layer, _ in self.routers)}")
        self._targets = [self._local(routes, layer, device) for layer, _ in self.routers]
        action = RouterReplayAction.REPLAY_FORWARD if replay else RouterReplayAction.RECORD
        for (_, router), target in zip(self.routers, self._targets):
            if replay:
                router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(action)

    def end(self, batch: int, seq: int) -> torch.Tensor | None:
        """After the forward: which (token, layer) pairs the router's own top-k set differs from the routes'
        as bool [batch, seq, L_local] (gathered over the sequence-parallel ranks); None without routes.
        The replay ids stay queued for a backward recompute (REPLAY_BACKWARD) until the next ``begin``."""
        if self._targets is None:
            return None
        diffs = []
        for (_, router), target in zip(self.routers, self._targets):
            rr = router.router_replay
            own = rr.get_recorded_indices()
            if own is None:
                raise RuntimeError("routing replay: a router recorded nothing (a fused router bypasses "
                                   "RouterReplay: moe_router_fusion must be off)")
            same = own.sort(-1).values == target.to(own.device).sort(-1).values
            diffs.append(~same.all(-1))
            if rr.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                rr.clear_router_replay_action()
        diff = torch.stack(diffs, -1).to(torch.uint8)  # [S_local * B, L] (uint8: gloo gathers no bool)
        diff = diff.view(-1, batch, diff.shape[-1])
        if self.config.sequence_parallel and self.tp_size > 1:
            parts = [torch.empty_like(diff) for _ in range(self.tp_size)]
            dist.all_gather(parts, diff.contiguous(), group=self.tp_group)
            diff = torch.cat(parts, 0)
        return diff[:seq].transpose(0, 1).bool()

    def clear(self) -> None:
        """Drop every queued id and action (after the backward)."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        self._targets = None
