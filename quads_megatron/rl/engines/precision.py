"""Rollout precision of the local engine: swap HF Qwen3-MoE experts (and optionally attention linears) to NVFP4 kernels.

bf16 keeps the model as is; w4a16 / w4a4 / quads (= W4A4 + RAC) quantize the weights with
`quads_megatron.nvfp4` (gate and up of an expert share one global scale, as the converters
export them for SGLang) and run `sglang_ext.kernels` (Triton on CUDA, the torch reference on
CPU). RAC channels come from `quads_megatron.rac` on calibration prompts.
"""

from __future__ import annotations

import torch
from torch import nn

from quads_megatron import nvfp4

PRECISIONS = {"bf16": None, "w4a16": "w4a16", "w4a4": "w4a4", "quads": "w4a4_rac"}
_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _kernels():
    """The kernel entry points: Triton dispatch on CUDA, the plain-torch reference on CPU."""
    if torch.cuda.is_available():
        import sglang_ext.kernels as k

        return k.w4a4_linear, k.w4a4_fused_moe
    from sglang_ext.kernels import reference as r

    return r.w4a4_linear, r.w4a4_fused_moe


def _pack(tensors: list[torch.Tensor], block_shape) -> list[dict]:
    """ModelOpt triples for one linear (or gate+up with a shared global scale)."""
    qs = (nvfp4.quantize_with_shared_scale(tensors, block_shape=tuple(block_shape)) if len(tensors) > 1
          else [nvfp4.quantize(tensors[0], block_shape=tuple(block_shape))])
    return [q.to_modelopt() for q in qs]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30))


class NVFP4Experts(nn.Module):
    """Drop-in for Qwen3MoeExperts: forward(hidden, top_k_index, top_k_weights) on w4a4_fused_moe."""

    def __init__(self, experts: nn.Module, act_mode: str, block_shape=(1, 16)):
        super().__init__()
        self.act_mode = act_mode
        E, F = experts.num_experts, experts.intermediate_dim
        gu, dn = experts.gate_up_proj.data.float(), experts.down_proj.data.float()
        w13, s13, g13, w2, s2, g2 = [], [], [], [], [], []
        for e in range(E):
            g, u = _pack([gu[e, :F], gu[e, F:]], block_shape)
            d, = _pack([dn[e]], block_shape)
            w13.append(torch.cat([g["weight"], u["weight"]]))
            s13.append(torch.cat([g["weight_scale"], u["weight_scale"]]))
            g13.append(g["weight_scale_2"].reshape(()))
            w2.append(d["weight"]), s2.append(d["weight_scale"]), g2.append(d["weight_scale_2"].reshape(()))
        for name, ts in (("w13", w13), ("w13_scale", s13), ("w13_scale_2", g13),
                         ("w2", w2), ("w2_scale", s2), ("w2_scale_2", g2)):
            self.register_buffer(name, torch.stack(ts), persistent=False)
        self.w13_comp_index = None
        self.w2_comp_index = None
        self.weight_rel_err = (_rel_err(gu, self._deq("w13")) + _rel_err(dn, self._deq("w2"))) / 2
        self.stats = None  # (fc1 ActivationStats, fc2 per-expert ActivationStats) while calibrating
        self.act_err = {}

    def _deq(self, which: str) -> torch.Tensor:
        from sglang_ext.kernels.reference import dequantize_weight

        return dequantize_weight(getattr(self, which), getattr(self, f"{which}_scale"), getattr(self, f"{which}_scale_2"))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.stats is not None:
            return self._calibration_forward(hidden_states, top_k_index, top_k_weights)
        if self.act_mode == "w4a4_rac" and self.w13_comp_index is None:
            raise RuntimeError("quads rollout precision: RAC channels not calibrated (call LocalEngine.calibrate)")
        _, moe = _kernels()
        return moe(hidden_states, self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale,
                   self.w2_scale_2, top_k_weights, top_k_index, act_mode=self.act_mode,
                   w13_comp_index=self.w13_comp_index, w2_comp_index=self.w2_comp_index)

    @torch.no_grad()
    def _calibration_forward(self, x, ids, weights):
        """W4A16 forward that records fc1/fc2 input statistics per expert (RAC calibration)."""
        s13, s2 = self.stats
        s13.update(x)
        w13f, w2f = self._deq("w13"), self._deq("w2")
        F = w2f.shape[-1]
        out = torch.zeros_like(x, dtype=torch.float32)
        xf = x.float()
        for e in range(w13f.shape[0]):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gu = xf[tok] @ w13f[e].t()
            h = nn.functional.silu(gu[:, :F]) * gu[:, F:]
            s2.update(h, torch.full((h.shape[0],), e, dtype=torch.long))
            out.index_add_(0, tok, (h @ w2f[e].t()) * weights[tok, slot, None].float())
        self._x.append(xf)
        return out.to(x.dtype)


class NVFP4Linear(nn.Module):
    """Drop-in for an attention nn.Linear (no bias) on w4a4_linear."""

    def __init__(self, linear: nn.Linear, act_mode: str, block_shape=(1, 16)):
        super().__init__()
        self.act_mode = act_mode
        w = linear.weight.data.float()
        q, = _pack([w], block_shape)
        for k, v in q.items():
            self.register_buffer(k, v, persistent=False)
        self.bias = linear.bias
        self.comp_index = None
        self.stats = None
        self.weight_rel_err = _rel_err(w, self._deq())

    def _deq(self):
        from sglang_ext.kernels.reference import dequantize_weight

        return dequantize_weight(self.weight, self.weight_scale, self.weight_scale_2)

    def forward(self, x):
        if self.stats is not None:
            self.stats.update(x)
            return (x.float() @ self._deq().t()).to(x.dtype)
        if self.act_mode == "w4a4_rac" and self.comp_index is None:
            raise RuntimeError("quads rollout precision: RAC channels not calibrated (call LocalEngine.calibrate)")
        lin, _ = _kernels()
        return lin(x, self.weight, self.weight_scale, self.weight_scale_2, act_mode=self.act_mode,
                   comp_index=self.comp_index, bias=self.bias)


def _bf16_layers(recipe, num_layers: int) -> set[int]:
    """Layers the recipe keeps in BF16 (its first/last-layer carve-outs)."""
    if recipe is None:
        return set()
    first = set(range(min(recipe.bf16_first_layers, num_layers)))
    last = set(range(max(0, num_layers - recipe.bf16_last_layers), num_layers))
    return first | last


def restore_bf16_experts(model: nn.Module) -> None:
    """Put the original high-precision modules back (before loading new weights into them)."""
    for parent, attr, original in getattr(model, "_quads_swapped", []):
        setattr(parent, attr, original)
    model._quads_swapped = []


@torch.no_grad()
def apply_precision(model: nn.Module, precision: str, rac_channels: int = 16, quantize_attention: bool = False,
                    recipe=None) -> dict:
    """Swap modules for the precision; return {layer index: {name: swapped module}} ({} for bf16)."""
    act_mode = PRECISIONS[precision]
    restore_bf16_experts(model)
    if act_mode is None:
        return {}
    block = tuple(recipe.block_shape) if recipe is not None else (1, 16)
    layers = model.model.layers
    keep = _bf16_layers(recipe, len(layers))
    swapped, out = [], {}
    for i, layer in enumerate(layers):
        if i in keep:
            continue
        mods = {}
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            q = NVFP4Experts(experts, act_mode, block)
            swapped.append((layer.mlp, "experts", experts))
            layer.mlp.experts = q
            mods["experts"] = q
        if quantize_attention:
            for name in _ATTN_PROJ:
                lin = getattr(layer.self_attn, name)
                q = NVFP4Linear(lin, act_mode, block)
                swapped.append((layer.self_attn, name, lin))
                setattr(layer.self_attn, name, q)
                mods[f"self_attn.{name}"] = q
        out[i] = mods
    model._quads_swapped = swapped
    model._quads_rac_channels = rac_channels
    return out


@torch.no_grad()
def calibrate_rac(model: nn.Module, quantized: dict, run_forward, rac_channels: int = 16, **_):
    """Run calibration prompts, pick RAC channels per GEMM, and record activation errors for the report."""
    from quads_megatron.rac import ActivationStats, calibrate_comp_channels, compensated_activation, weight_column_norm_sq

    if not quantized:
        return
    for mods in quantized.values():
        for m in mods.values():
            if isinstance(m, NVFP4Experts):
                E, H = m.w13.shape[0], m.w13.shape[2] * 2
                m.stats = (ActivationStats(H), ActivationStats(m.w2.shape[2] * 2, num_groups=E))
                m._x = []
            else:
                m.stats = ActivationStats(m.weight.shape[1] * 2)
    try:
        run_forward()
    finally:
        stats = {}
        for mods in quantized.values():
            for m in mods.values():
                stats[id(m)] = m.stats
                m.stats = None
    for mods in quantized.values():
        for m in mods.values():
            st = stats[id(m)]
            if isinstance(m, NVFP4Experts):
                s13, s2 = st
                k13 = min(rac_channels, s13.num_channels)
                k2 = min(rac_channels, s2.num_channels)
                m.w13_comp_index = calibrate_comp_channels(
                    s13, weight_column_norm_sq(m._deq("w13"), per_expert=False), k13) if k13 else None
                m.w2_comp_index = calibrate_comp_channels(
                    s2, weight_column_norm_sq(m._deq("w2"), per_expert=True), k2) if k2 else None
                x = torch.cat(m._x) if m._x else None
                if x is not None and x.numel():
                    xq, _ = compensated_activation(x, None)
                    m.act_err = {"act_rel_err": _rel_err(x, xq)}
                    if m.w13_comp_index is not None:
                        xq, rq = compensated_activation(x, m.w13_comp_index)
                        xc = xq.clone()
                        xc[:, m.w13_comp_index.long()] += rq
                        m.act_err["act_rel_err_rac"] = _rel_err(x, xc)
                m._x = []
            else:
                k = min(rac_channels, st.num_channels)
                m.comp_index = calibrate_comp_channels(st, weight_column_norm_sq(m._deq()), k) if k else None


def error_report(quantized: dict | None) -> dict[str, float]:
    """Per-layer NVFP4 relative errors: expert weights, and fc1 activations (plain and with RAC)."""
    out = {}
    for i, mods in (quantized or {}).items():
        for name, m in mods.items():
            tag = name.replace("self_attn.", "attn_")
            out[f"layer{i}/{tag}_weight_rel_err"] = m.weight_rel_err
            for k, v in getattr(m, "act_err", {}).items():
                out[f"layer{i}/{tag}_{k}"] = v
    return out
