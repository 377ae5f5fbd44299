"""The rollout model's own routing decisions: per token, per MoE layer, the top-k expert ids its routers chose.

The layout is SGLang's routed-experts capture (``return_routed_experts``): one int32 row
``[num_layers, top_k]`` per fed position of a sample, so ``len(prompt) + len(response) - 1`` rows (the
last sampled token is never fed). The trainer replays them (``--use-rollout-routing-replay``) and
measures how often its own top-k differs (``mismatch/routing_disagreement``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

_ROUTER_RE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.mlp\.gate$")


class RoutedExpertsRecorder:
    """Forward hooks on every Qwen3-MoE router (``layers.N.mlp.gate``) that keep its top-k ids.

    Eager forwards keep a copy per layer (``take``); a CUDA-graph decode step writes into a static
    ``[num_layers, batch, top_k]`` buffer set with ``static`` before the capture (``copy_`` is
    graph-safe), so every replay refreshes it.
    """

    def __init__(self, model: nn.Module):
        self.num_layers = model.config.num_hidden_layers
        self.top_k = model.config.num_experts_per_tok
        self.buffer: torch.Tensor | None = None  # the static [L, B, K] target of the decode step
        self.eager: list[torch.Tensor | None] = [None] * self.num_layers
        self.enabled = False
        self._handles = []
        for name, module in model.named_modules():
            m = _ROUTER_RE.search(name)
            if m is not None:
                self._handles.append(module.register_forward_hook(self._hook(int(m.group("layer")))))
        if len(self._handles) != self.num_layers:
            raise ValueError(f"RoutedExpertsRecorder: found {len(self._handles)} routers (layers.N.mlp.gate) "
                             f"in a model of {self.num_layers} layers; every layer must be MoE")

    def _hook(self, layer: int):
        def record(module, inputs, output):
            if not self.enabled:
                return
            ids = output[2]  # (router_logits, top-k weights, top-k ids [tokens, K])
            if self.buffer is not None:
                self.buffer[layer].copy_(ids)
            else:
                self.eager[layer] = ids.detach().to(torch.int32).clone()
        return record

    def take(self, batch: int) -> torch.Tensor:
        """The last eager forward's ids as [batch, tokens, L, K] int32 (cleared afterwards)."""
        if any(t is None for t in self.eager):
            raise RuntimeError("RoutedExpertsRecorder.take: no eager forward was recorded")
        out = torch.stack(self.eager, 1).view(batch, -1, self.num_layers, self.top_k)
        self.eager = [None] * self.num_layers
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def sample_routed_experts(prefill: torch.Tensor, decode: list[torch.Tensor], prompt_len: int,
                          response_len: int) -> torch.Tensor:
    """One sample's rows [prompt_len + response_len - 1, L, K] from its left-padded prefill rows [P, L, K]
    and the decode steps' rows ([L, K] each, step j fed response token j)."""
    rows = [prefill[prefill.shape[0] - prompt_len:]]
    if response_len > 1:
        rows.append(torch.stack(decode[:response_len - 1], 0))
    return torch.cat(rows, 0).to(torch.int32).cpu()
