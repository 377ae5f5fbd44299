"""The one calibration of the rollout's activation side: input amax, static input scales, RAC channels.

The exporter, the local engine (after every weight sync) and so, through the checkpoint, the
SGLang methods get their ``input_scale`` and ``input_comp_index`` from here, keyed by the
layout's ``ActivationGroup`` s (``plan.layout``).  ``quads_megatron.rollout.RolloutModel`` runs the
forward that feeds it; this module holds the rules:

* **The model as served.**  Activations come from a forward of the rollout model itself: the
  plan's NVFP4 weights dequantized (the values the rollout GEMMs multiply), everything in fp32,
  activations left unquantized (so the statistics measure the error of quantizing the activation
  the served model would see, without compounding earlier layers' activation noise).  Prompts
  go through in left-padded batches; padding tokens reach no statistic (``valid_tokens``: not
  observed, not routed to an expert).  The exporter builds that model from its HF weights, the
  local engine calibrates its own modules (an fp32 twin when it serves in BF16), so both see the
  same numbers for the same weights and prompts.
* **Routed tokens only.**  An expert's fc2 statistics use the tokens routed to it, as served;
  an expert no calibration token reached falls back to the layer's pooled fc2 statistics.
* **One static scale per input.**  ``amax`` is the max |x| over every token the group reads
  (fc2: over all experts, since the fused kernel applies one static scale per layer), and
  ``input_scale = amax / 2688`` (``nvfp4.global_decode_scale``).
* **RAC channels under the served scaling.**  The per-channel error E[(x - xq)^2] is measured
  under the static ``input_scale`` when the scaling is static (a second pass, after the amax is
  known), under per-token scaling otherwise; the set is the top k of
  E[(x - xq)_c^2] * ||Wq[:, c]||^2 (``quads_megatron.rac``), column norms summed over every
  weight that shares the set (fc1: all experts' gate and up rows; q/k/v: their stacked rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from quads_megatron import nvfp4, rac
from quads_megatron.plan.layout import (COMP_INDEX, COMP_INDEX_DTYPE, INPUT_SCALE, ActivationGroup,
                                        RolloutLayout)


@dataclass
class GroupCalibration:
    """The calibrated activation side of one ``ActivationGroup``."""

    amax: torch.Tensor                  # fp32 [], max |x| of the group's input
    input_scale: torch.Tensor           # fp32 [], amax / 2688
    comp_index: Optional[torch.Tensor]  # int32 [k] (shared) or [members, k] (per member); None without RAC


class Calibration(dict):
    """``{group name: GroupCalibration}`` with lookups by HF weight name (through the layout)."""

    def __init__(self, layout: RolloutLayout, groups: Dict[str, GroupCalibration]):
        super().__init__(groups)
        self.layout = layout

    def for_weight(self, weight_name: str) -> Dict[str, torch.Tensor]:
        """``{suffix: tensor}`` of the activation-side checkpoint tensors of one quantized weight."""
        g = self.layout.group_of(weight_name)
        if g is None:
            return {}
        c = self[g.name]
        out = {INPUT_SCALE: c.input_scale.clone()}
        if c.comp_index is not None:
            idx = c.comp_index[g.member_index(weight_name)] if g.per_member_rac else c.comp_index
            out[COMP_INDEX] = idx.to(COMP_INDEX_DTYPE).contiguous().clone()
        return out


class Calibrator:
    """Accumulates a rollout model's activations, group by group, over ``num_passes`` forwards.

    The model's calibration forward calls ``observe(group, x, member)`` with the fp32 input rows of
    each group (``member``: the expert of the rows, for per-expert groups); ``finish(weights)``
    returns the ``Calibration``.  Two passes when a static-scaled group needs RAC statistics (they
    are measured under the scale the first pass finds), else one.  Everything accumulates on the
    activations' device, with no host sync, until ``finish``.
    """

    def __init__(self, layout: RolloutLayout):
        self.layout = layout
        self.groups = {g.name: g for g in layout}
        self.num_passes = 2 if any(g.static and g.uses_rac for g in layout) else 1
        self.pass_index = 0
        self.amax = {n: torch.zeros((), dtype=torch.float32) for n in self.groups}
        self.stats: Dict[str, rac.ActivationStats] = {}
        # bool [tokens] of the forward running now, flattened (False: a padding token); None: all real
        self.valid_tokens: Optional[torch.Tensor] = None

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows [T', K] of ``x`` [..., K] (the current forward's tokens, flattened) that are not padding."""
        rows = x.reshape(-1, x.shape[-1])
        if self.valid_tokens is None:
            return rows
        if self.valid_tokens.shape != rows.shape[:1]:
            raise ValueError(f"calibration: {rows.shape[0]} input rows for a batch of "
                             f"{self.valid_tokens.shape[0]} tokens")
        return rows[self.valid_tokens]

    def start_pass(self, index: int) -> None:
        """Begin pass ``index``; the last pass collects the RAC statistics."""
        self.pass_index = index
        if index != self.num_passes - 1:
            return
        for name, g in self.groups.items():
            if not g.uses_rac:
                continue
            scale = nvfp4.global_decode_scale(self.amax[name]) if g.static else None
            self.stats[name] = rac.ActivationStats(g.in_features, num_groups=len(g.members) if g.per_member_rac else None,
                                                   input_scale=scale)

    @torch.no_grad()
    def observe(self, group: str, x: torch.Tensor, member: Optional[int] = None) -> None:
        """Record input rows ``x`` [T, K] of ``group`` (real tokens only: ``real_rows``; ``member``: the
        member index, per-member groups)."""
        rows = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return
        if self.pass_index == 0:
            amax = nvfp4.amax_of(rows).to(torch.float32)
            self.amax[group] = torch.maximum(self.amax[group].to(amax.device), amax)
        stats = self.stats.get(group)
        if stats is not None:
            stats.update(rows, None if stats.num_groups is None else member)

    def finish(self, weights: Callable[[ActivationGroup], torch.Tensor]) -> Calibration:
        """The calibration; ``weights(group)``: the group's dequantized fp32 weights as served,
        [..., N, K] summed over leading dims for a shared set, [members, N, K] for per-member sets."""
        out = {}
        for name, g in self.groups.items():
            amax = self.amax[name].detach().to("cpu", copy=True)
            comp = None
            if g.uses_rac:
                comp = self._channels(g, weights(g)).cpu()
            out[name] = GroupCalibration(amax=amax, input_scale=nvfp4.global_decode_scale(amax).reshape(()),
                                         comp_index=comp)
        return Calibration(self.layout, out)

    def _channels(self, g: ActivationGroup, w: torch.Tensor) -> torch.Tensor:
        stats = self.stats[g.name]
        k = g.rac_channels
        if not g.per_member_rac:
            return rac.calibrate_comp_channels(stats, rac.weight_column_norm_sq(w, per_expert=False), k)
        sq = stats.mean_sq_err()
        empty = stats.count == 0
        if bool(empty.any()):  # experts no calibration token reached: the layer's pooled statistics
            pooled = (stats.sq_err_sum.sum(0) / stats.count.sum().clamp(min=1)).to(torch.float32)
            sq[empty] = pooled
        return rac.calibrate_comp_channels(sq, rac.weight_column_norm_sq(w, per_expert=True), k)
