"""The local engine's NVFP4 layers: HF Qwen3-MoE experts / attention linears on ``quads_megatron.kernels``.

Which layers are NVFP4 and at which precision comes from the ``QuantPlan`` (the trainer's and
the exporter's plan); the weights arrive already quantized by ``quantize_named_params`` (the
SGLang sync's step) and are written into fixed buffers in place, so the modules keep their
identity across weight updates.  RAC channels and static activation scales come from
``quads_megatron.rac`` on calibration prompts, as the exporter calibrates them.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from quads_megatron import nvfp4
from quads_megatron.plan import QuantPlan
from quads_megatron.vocab import ActivationScaling, Precision, Scope

_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _dequantize(weight, scale, scale_2) -> torch.Tensor:
    """fp32 [..., N, K] of ModelOpt NVFP4 buffers (one global scale per leading index)."""
    from quads_megatron.kernels.reference import dequantize_weight

    return dequantize_weight(weight, scale, scale_2)


class _ErrorMeter:
    """Accumulates ||w - dq(q(w))||^2 and ||w||^2 of the weights loaded into one module."""

    def __init__(self):
        self.err, self.ref = 0.0, 0.0

    def add(self, w: torch.Tensor, q: nvfp4.NVFP4Tensor) -> None:
        w = w.float()
        self.err += float((w - q.dequantize(torch.float32).to(w.device)).pow(2).sum())
        self.ref += float(w.pow(2).sum())

    @property
    def rel(self) -> float:
        return (self.err / self.ref) ** 0.5 if self.ref > 0 else 0.0


def _kernels():
    from quads_megatron import kernels

    return kernels


class _QuantExperts(nn.Module):
    """What the calibration needs of a quantized Qwen3MoeExperts drop-in: fp32 weights and a recording forward."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, precision: Precision):
        super().__init__()
        self.precision, self.num_experts, self.hidden, self.ffn = precision, num_experts, hidden, ffn
        self.w13_comp_index = self.w2_comp_index = None
        self.w13_comp_weight = self.w2_comp_weight = None  # RAC weight columns (NVFP4Experts.refresh_rac_columns)
        self.w13_input_scale = self.w2_input_scale = None
        self.meter = _ErrorMeter()
        self.stats = None  # (fc1 ActivationStats, fc2 per-expert ActivationStats) while calibrating
        self.act_err = {}

    def dequantized(self, which: str) -> torch.Tensor:
        """fp32 [E, N, K] weights of 'w13' (gate; up) or 'w2' (down), as the GEMMs see them."""
        raise NotImplementedError

    @torch.no_grad()
    def _calibration_forward(self, x, ids, weights):
        """Forward on high-precision activations that records fc1/fc2 input statistics per expert."""
        s13, s2 = self.stats
        s13.update(x)
        w13f, w2f = self.dequantized("w13"), self.dequantized("w2")
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
            self._amax[1] = torch.maximum(self._amax[1], nvfp4.amax_of(h).cpu())
            out.index_add_(0, tok, (h @ w2f[e].t()) * weights[tok, slot, None].float())
        self._amax[0] = torch.maximum(self._amax[0], nvfp4.amax_of(xf).cpu())
        self._x.append(xf)
        return out.to(x.dtype)


class ActQuantExperts(_QuantExperts):
    """``w16a4``: Qwen3MoeExperts with its BF16 weights (same parameter names) and NVFP4-quantized GEMM inputs.

    Isolates the activation error for the paper's ablation; the activation quantizer is the one
    the W4A4 kernels' reference uses (``quads_megatron.rac.compensated_activation`` without RAC).
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, precision: Precision, device, dtype):
        super().__init__(num_experts, hidden, ffn, precision)
        E, H, F = num_experts, hidden, ffn
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * F, H, device=device, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(E, H, F, device=device, dtype=dtype), requires_grad=False)

    def dequantized(self, which: str) -> torch.Tensor:
        return (self.gate_up_proj if which == "w13" else self.down_proj).float()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from quads_megatron.rac import compensated_activation

        if self.stats is not None:
            return self._calibration_forward(hidden_states, top_k_index, top_k_weights)
        xq = compensated_activation(hidden_states, None, self.w13_input_scale)[0]
        out = torch.zeros_like(xq)
        F = self.ffn
        for e in top_k_index.unique().tolist():
            tok, slot = (top_k_index == e).nonzero(as_tuple=True)
            gu = xq[tok] @ self.gate_up_proj[e].float().t()
            h = nn.functional.silu(gu[:, :F]) * gu[:, F:]
            hq = compensated_activation(h, None, self.w2_input_scale)[0]  # per-token: chunking is exact
            out.index_add_(0, tok, (hq @ self.down_proj[e].float().t()) * top_k_weights[tok, slot, None].float())
        return out.to(hidden_states.dtype)


class ActQuantLinear(nn.Linear):
    """``w16a4`` attention linear: BF16 weight (parameter ``weight``), NVFP4-quantized input."""

    def __init__(self, in_features: int, out_features: int, precision: Precision, device, dtype):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.requires_grad_(False)
        self.precision = precision
        self.comp_index = self.input_scale = None
        self.meter = _ErrorMeter()
        self.stats = None

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x):
        from quads_megatron.rac import compensated_activation

        if self.stats is not None:
            self.stats.update(x)
            self._amax = torch.maximum(self._amax, nvfp4.amax_of(x.float()).cpu())
            return super().forward(x)
        xq = compensated_activation(x, None, self.input_scale)[0]
        return (xq @ self.weight.float().t()).to(x.dtype)


class NVFP4Experts(_QuantExperts):
    """Drop-in for Qwen3MoeExperts: forward(hidden, top_k_index, top_k_weights) on ``w4a4_fused_moe``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, precision: Precision, device):
        super().__init__(num_experts, hidden, ffn, precision)
        E, H, F = num_experts, hidden, ffn
        shapes = {"w13": ((E, 2 * F, H // 2), torch.uint8), "w13_scale": ((E, 2 * F, H // 16), torch.float8_e4m3fn),
                  "w13_scale_2": ((E,), torch.float32), "w2": ((E, H, F // 2), torch.uint8),
                  "w2_scale": ((E, H, F // 16), torch.float8_e4m3fn), "w2_scale_2": ((E,), torch.float32)}
        for name, (shape, dtype) in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @torch.no_grad()
    def load(self, proj: str, expert: int, q: nvfp4.NVFP4Tensor) -> None:
        """Write one expert projection's NVFP4 triple into the buffers in place."""
        t = q.to_modelopt()
        F = self.ffn
        if proj == "down_proj":
            self.w2[expert].copy_(t["weight"])
            self.w2_scale[expert].copy_(t["weight_scale"])
            self.w2_scale_2[expert].copy_(t["weight_scale_2"].reshape(()))
            return
        rows = slice(0, F) if proj == "gate_proj" else slice(F, 2 * F)
        self.w13[expert, rows].copy_(t["weight"])
        self.w13_scale[expert, rows].copy_(t["weight_scale"])
        self.w13_scale_2[expert].copy_(t["weight_scale_2"].reshape(()))  # gate and up share it

    def grouped_buffers(self, role: tuple, experts: list):
        """(data, scale, S_dec) views that ``nvfp4.quantize_grouped`` fills for all experts in place:
        w13 as [2E, F, H/2] for role (gate_proj, up_proj), w2 for (down_proj,); None for a partial set."""
        if experts != list(range(self.num_experts)):
            return None
        E, F, H = self.num_experts, self.ffn, self.hidden
        if tuple(role) == ("gate_proj", "up_proj"):
            return (self.w13.view(2 * E, F, H // 2), self.w13_scale.view(2 * E, F, H // 16), self.w13_scale_2)
        if tuple(role) == ("down_proj",):
            return self.w2, self.w2_scale, self.w2_scale_2
        return None

    def dequantized(self, which: str) -> torch.Tensor:
        return _dequantize(getattr(self, which), getattr(self, f"{which}_scale"), getattr(self, f"{which}_scale_2"))

    def refresh_rac_columns(self) -> bool:
        """Store the RAC weight columns Wq[:, S] the kernels' residual K-steps read, in place (captured
        graphs keep reading them). The engine calls this after every weight load and calibration, as
        SGLang's process_weights_after_loading does; a no-op until the channels are calibrated.
        True when a column tensor had to be (re)bound."""
        if not (self.precision.uses_rac and self.w13_comp_index is not None):
            return False
        from quads_megatron.kernels.rac_columns import rac_weight_columns

        a = _store(self, "w13_comp_weight", rac_weight_columns(self.w13, self.w13_scale, self.w13_comp_index))
        return _store(self, "w2_comp_weight", rac_weight_columns(self.w2, self.w2_scale, self.w2_comp_index)) or a

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.stats is not None:
            return self._calibration_forward(hidden_states, top_k_index, top_k_weights)
        if self.precision.uses_rac and self.w13_comp_index is None:
            raise RuntimeError("w4a4_rac rollout: RAC channels not calibrated (call LocalEngine.calibrate)")
        return _kernels().w4a4_fused_moe(
            hidden_states, self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale,
            self.w2_scale_2, top_k_weights, top_k_index, act_mode=self.precision.value,
            w13_comp_index=self.w13_comp_index, w2_comp_index=self.w2_comp_index,
            w13_input_scale=self.w13_input_scale, w2_input_scale=self.w2_input_scale,
            w13_comp_weight=self.w13_comp_weight, w2_comp_weight=self.w2_comp_weight)


class NVFP4Linear(nn.Module):
    """Drop-in for an attention nn.Linear (no bias) on ``w4a4_linear``."""

    def __init__(self, out_features: int, in_features: int, precision: Precision, device):
        super().__init__()
        self.precision, self.in_features, self.out_features = precision, in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                   device=device), persistent=False)
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // 16,
                                                         dtype=torch.float8_e4m3fn, device=device),
                             persistent=False)
        self.register_buffer("weight_scale_2", torch.zeros((), dtype=torch.float32, device=device),
                             persistent=False)
        self.comp_index = self.input_scale = None
        self.comp_weight = None  # RAC weight columns (refresh_rac_columns)
        self.meter = _ErrorMeter()
        self.stats = None

    @torch.no_grad()
    def load(self, q: nvfp4.NVFP4Tensor) -> None:
        for name, t in q.to_modelopt().items():
            getattr(self, name).copy_(t.reshape(getattr(self, name).shape))

    def dequantized(self) -> torch.Tensor:
        return _dequantize(self.weight, self.weight_scale, self.weight_scale_2)

    def forward(self, x):
        if self.stats is not None:
            self.stats.update(x)
            self._amax = torch.maximum(self._amax, nvfp4.amax_of(x.float()).cpu())
            return (x.float() @ self.dequantized().t()).to(x.dtype)
        if self.precision.uses_rac and self.comp_index is None:
            raise RuntimeError("w4a4_rac rollout: RAC channels not calibrated (call LocalEngine.calibrate)")
        return _kernels().w4a4_linear(x, self.weight, self.weight_scale, self.weight_scale_2,
                                      act_mode=self.precision.value, comp_index=self.comp_index,
                                      input_scale=self.input_scale, comp_weight=self.comp_weight)

    def refresh_rac_columns(self) -> bool:
        """As `NVFP4Experts.refresh_rac_columns`: Wq[:, S] stored in place after a load or calibration."""
        if not (self.precision.uses_rac and self.comp_index is not None):
            return False
        from quads_megatron.kernels.rac_columns import rac_weight_columns

        return _store(self, "comp_weight", rac_weight_columns(self.weight, self.weight_scale, self.comp_index))


def graph_safe(module) -> bool:
    """True when the module's forward has no host syncs, so a CUDA graph can capture it (all but w16a4's loops)."""
    return isinstance(module, (NVFP4Experts, NVFP4Linear))


def install_nvfp4_modules(model: nn.Module, plan: QuantPlan) -> dict:
    """Replace the plan's rollout-NVFP4 units of an HF Qwen3-MoE; return {HF module prefix: module}."""
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    d = plan.dims
    modules = {}
    for i, layer in enumerate(model.model.layers):
        prec = plan.layer_precision(i, Scope.ROUTED_EXPERTS)
        if prec.quantizes_weights:
            layer.mlp.experts = NVFP4Experts(d.num_experts, d.hidden_size, d.moe_ffn, prec, device)
        elif prec.quantizes_activations:
            layer.mlp.experts = ActQuantExperts(d.num_experts, d.hidden_size, d.moe_ffn, prec, device, dtype)
        if prec.quantizes_weights or prec.quantizes_activations:
            modules[f"model.layers.{i}.mlp.experts"] = layer.mlp.experts
        for proj in _ATTN_PROJ:
            t = plan[f"model.layers.{i}.self_attn.{proj}.weight"]
            if t.rollout.quantizes_weights or t.rollout.quantizes_activations:
                lin = getattr(layer.self_attn, proj)
                if lin.bias is not None:
                    raise ValueError(f"{t.name}: NVFP4 attention linears have no bias")
                m = (NVFP4Linear(lin.out_features, lin.in_features, t.rollout, device) if t.rollout.quantizes_weights
                     else ActQuantLinear(lin.in_features, lin.out_features, t.rollout, device, dtype))
                setattr(layer.self_attn, proj, m)
                modules[t.module] = m
    return modules


def load_quantized(modules: dict, name: str, original: torch.Tensor, q: nvfp4.NVFP4Tensor,
                   measure_error: bool = False, store: bool = True) -> None:
    """Route one HF weight's NVFP4 tensor to its module (``install_nvfp4_modules``' dict).

    store=False: the tensor is already in the module's buffers (written there by the grouped
    kernel); only the error meter is updated."""
    module_name = name[: -len(".weight")]
    if module_name in modules:
        m = modules[module_name]
        if store:
            m.load(q)
    else:
        prefix, expert, proj = module_name.rsplit(".", 2)
        m = modules.get(prefix)
        if m is None:
            raise KeyError(f"weight sync: {name} is NVFP4 in the plan but the rollout model has no "
                           f"NVFP4 module for it")
        if store:
            m.load(proj, int(expert), q)
    if measure_error:
        m.meter.add(original, q)


def _store(m, attr: str, value) -> bool:
    """Set ``m.attr`` to ``value``, in place when a tensor of the same shape, dtype and device is there (so a
    captured CUDA graph that reads it stays valid); return True when the attribute had to be rebound."""
    old = getattr(m, attr)
    if old is value:
        return False
    if (isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape
            and old.dtype == value.dtype and old.device == value.device):
        old.copy_(value)
        return False
    setattr(m, attr, value)
    return True


@torch.no_grad()
def calibrate(modules: dict, plan: QuantPlan, run_forward) -> bool:
    """Run calibration prompts; set RAC channels (w4a4_rac) and static input scales; record activation errors.

    Channels and scales are written in place after the first calibration; returns True when any
    of them was (re)bound instead, so graphs captured before must not be replayed.
    """
    from quads_megatron.rac import ActivationStats, calibrate_comp_channels, compensated_activation, weight_column_norm_sq

    k = plan.rac_channels
    static = plan.activation_scaling is ActivationScaling.STATIC
    active = {n: m for n, m in modules.items() if m.precision.quantizes_activations}
    if not active:
        return False
    rebound = False
    for m in active.values():
        if isinstance(m, _QuantExperts):
            m.stats = (ActivationStats(m.hidden), ActivationStats(m.ffn, num_groups=m.num_experts))
            m._x, m._amax = [], [torch.zeros(()), torch.zeros(())]
        else:
            m.stats, m._amax = ActivationStats(m.in_features), torch.zeros(())
    try:
        run_forward()
    finally:
        stats = {n: m.stats for n, m in active.items()}
        for m in active.values():
            m.stats = None
    for n, m in active.items():
        st = stats[n]
        if isinstance(m, _QuantExperts):
            s13, s2 = st
            if static:
                dev = next(itertools.chain(m.parameters(), m.buffers())).device
                for attr, a in zip(("w13_input_scale", "w2_input_scale"), m._amax):
                    rebound |= _store(m, attr, nvfp4.global_decode_scale(a).to(dev).reshape(()))
            if m.precision.uses_rac:
                dev = m.w13.device  # the statistics live on the CPU; the kernels want the indices beside x
                rebound |= _store(m, "w13_comp_index", calibrate_comp_channels(
                    s13, weight_column_norm_sq(m.dequantized("w13"), per_expert=False), k).to(dev))
                rebound |= _store(m, "w2_comp_index", calibrate_comp_channels(
                    s2, weight_column_norm_sq(m.dequantized("w2"), per_expert=True), k).to(dev))
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
            if static:
                rebound |= _store(m, "input_scale", nvfp4.global_decode_scale(m._amax).to(m.weight.device).reshape(()))
            if m.precision.uses_rac and not n.endswith(("k_proj", "v_proj")):
                # q/k/v read one input: one set ranked on their stacked columns (as the exporter does)
                parts = [active.get(n[: -len("q_proj")] + p) for p in ("q_proj", "k_proj", "v_proj")] \
                    if n.endswith("q_proj") else [m]
                w = torch.cat([p.dequantized() for p in parts if p is not None])
                rebound |= _store(m, "comp_index",
                                  calibrate_comp_channels(st, weight_column_norm_sq(w), k).to(m.weight.device))
    return _share_qkv_channels(active, plan) or rebound


def _share_qkv_channels(modules: dict, plan: QuantPlan) -> bool:
    """q/k/v read one input: give them one RAC set and one static scale, as the exporter and SGLang's QKV layer do."""
    rebound = False
    for i in range(plan.dims.num_layers):
        qkv = [modules.get(f"model.layers.{i}.self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj")]
        if not all(qkv):
            continue
        q = qkv[0]
        for m in qkv[1:]:
            rebound |= _store(m, "comp_index", q.comp_index)
            rebound |= _store(m, "input_scale", q.input_scale)
    return rebound


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30))


def error_report(modules: dict) -> dict[str, float]:
    """Per-layer NVFP4 relative errors: weights, and expert fc1 activations (plain and with RAC)."""
    out = {}
    for name, m in modules.items():
        layer, rest = name[len("model.layers."):].split(".", 1)
        tag = rest.replace("self_attn.", "attn_").replace("mlp.", "")
        out[f"layer{layer}/{tag}_weight_rel_err"] = m.meter.rel
        for k, v in getattr(m, "act_err", {}).items():
            out[f"layer{layer}/{tag}_{k}"] = v
    return out
