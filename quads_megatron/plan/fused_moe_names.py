"""A weight stream as SGLang wire ``(name, tensor)`` pairs: per expert, or one tensor per FusedMoE parameter.

SGLang's Qwen3MoE ``load_weights`` makes one ``weight_loader`` call per name: the per-expert HF / ModelOpt
names cost 9 calls per expert for the NVFP4 triples, plus the activation side (``input_scale``,
``input_comp_index``) of every projection. A server whose quads MoE layers hold every expert unsharded
(tp_size 1) also takes each layer's experts under the FusedMoE parameters' own names
(``model.layers.N.mlp.experts.w13_weight`` [E, 2F, H/2], ``w13_weight_scale``, ``w13_weight_scale_2`` [E, 2],
``w13_input_scale`` [E, 2], ``w13_input_comp_index`` [E, 2, k], ``w2_*``): one call per layer parameter.
The weights go out as the layer stream's own buffers; only the tiny per-expert scale / index tensors
are stacked here.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from quads_megatron.plan.expert_layers import ExpertsLayer, QuantizedExperts
from quads_megatron.plan.layout import EXPERT_FC1, EXPERT_FC2

Named = Tuple[str, torch.Tensor]
_ACTIVATION = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.(input_scale|input_comp_index)$")
_PARAM = {p: "w13" for p in EXPERT_FC1} | {EXPERT_FC2[0]: "w2"}


def sglang_named(stream: Iterable, stacked: bool = False, num_experts: Optional[int] = None) -> Iterator[Named]:
    """``stream`` (``(name, tensor)`` pairs, ``ExpertsLayer`` / ``QuantizedExperts`` items) as wire pairs.

    stacked=False: the per-expert names (HF for ``ExpertsLayer``, ModelOpt triples for ``QuantizedExperts``).
    stacked=True: a layer item of experts ``0..E-1`` as its FusedMoE parameters, and the per-expert
    activation tensors of a layer, when all ``num_experts`` (default: the experts seen) of every projection
    came, stacked at the end of the stream; anything else keeps its per-expert names."""
    activation: Dict[Tuple[str, str], Dict[Tuple[int, str], torch.Tensor]] = {}
    for entry in stream:
        if isinstance(entry, (ExpertsLayer, QuantizedExperts)):
            if stacked and entry.stackable:
                yield from entry.stacked_items()
            else:
                yield from entry.hf_items() if isinstance(entry, ExpertsLayer) else entry.rollout_items()
            continue
        name, tensor = entry
        m = _ACTIVATION.match(name) if stacked else None
        if m is None or m.group(3) not in _PARAM:
            yield entry
            continue
        prefix, e, proj, key = m.groups()
        activation.setdefault((prefix, key), {})[(int(e), proj)] = tensor
    for (prefix, key), parts in activation.items():
        yield from _stack_activation(prefix, key, parts, num_experts)


def _stack_activation(prefix: str, key: str, parts: dict, num_experts: Optional[int]) -> Iterator[Named]:
    """One layer's ``input_scale`` / ``input_comp_index`` as ``w13_<key>`` [E, 2, ...] and ``w2_<key>`` [E, ...]
    when every expert's gate, up and down came; else the per-expert pairs as they came."""
    n = num_experts if num_experts is not None else 1 + max(e for e, _ in parts)
    want = {(e, p) for e in range(n) for p in _PARAM}
    if set(parts) != want:
        for (e, proj), t in parts.items():
            yield f"{prefix}.{e}.{proj}.{key}", t
        return
    for which, projs in (("w13", EXPERT_FC1), ("w2", EXPERT_FC2)):
        rows = [torch.stack([parts[(e, p)].reshape(-1) for p in projs]) for e in range(n)]
        t = torch.stack(rows)  # [E, len(projs), 1 or k]
        if key == "input_scale":
            t = t.reshape(n, len(projs)) if which == "w13" else t.reshape(n)
        elif which == "w2":
            t = t.reshape(n, -1)
        yield f"{prefix}.{which}_{key}", t
