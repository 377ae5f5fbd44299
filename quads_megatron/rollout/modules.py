"""The rollout's NVFP4 layers: drop-ins for HF Qwen3-MoE experts / attention linears on ``quads_megatron.kernels``.

Which layers are NVFP4 and at which precision comes from the ``QuantPlan``; buffer names, shapes
and dtypes from its rollout layout (``plan.layout``).  The weights arrive already quantized by
``quantize_scale_groups`` (the SGLang sync's step) and are written into fixed buffers in place,
so the modules keep their identity across weight updates.  Where the shapes fit
(``plan.kernel_layout.kernel_layout_fits``) a module holds its packed codes in the v3 kernels'
byte order: each load writes ModelOpt bytes, ``settle_load`` converts exactly what was written
(same storage), and everything that reads weights (calibration, RAC columns, checks) goes
through ``modelopt_codes`` / ``modelopt_scales``.  While a ``plan.calibration.Calibrator``
is attached (``RolloutModel.calibrate``) they run the calibration forward instead: dequantized
weights, fp32, unquantized activations, each group's input rows handed to the calibrator.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from quads_megatron import nvfp4
from quads_megatron.plan import QuantPlan
from quads_megatron.plan.kernel_layout import (KERNEL_WEIGHT_LAYOUT, PendingRows, from_kernel_layout,
                                               kernel_layout_fits, scales_from_kernel_layout,
                                               scales_to_kernel_layout, to_kernel_layout)
from quads_megatron.plan.layout import (ATTN_QKV, ATTN_O, EXPERT_FC1, EXPERT_FC2, WEIGHT, WEIGHT_SCALE,
                                        WEIGHT_SCALE_2, block_scale_cols, experts_group_names, nvfp4_weight_specs,
                                        packed_cols)
from quads_megatron.vocab import Precision, Scope

_ATTN_PROJ = ATTN_QKV + ATTN_O


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


def _weight_layout(kernel_layout: bool, *shapes) -> str:
    """The `weight_layout=` a module's [N, K] NVFP4 weights take: the kernel layout when asked and every
    shape fits it, else ModelOpt's (the v2 main loop). Decided once, by shape, when the module is built."""
    if kernel_layout and all(kernel_layout_fits(n, k) for n, k in shapes):
        return KERNEL_WEIGHT_LAYOUT
    return "modelopt"


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
        self.calibrator = None  # (Calibrator, fc1 group, fc2 group) while calibrating
        self._x = []            # fc1 inputs of the last calibration pass (error report)
        self.act_err = {}

    def dequantized(self, which: str) -> torch.Tensor:
        """fp32 [E, N, K] weights of 'w13' (gate; up) or 'w2' (down), as the GEMMs see them."""
        raise NotImplementedError

    @torch.no_grad()
    def _calibration_forward(self, x, ids, weights):
        """fp32 forward on dequantized weights and unquantized activations; fc1 sees every real token, each
        expert's fc2 the real tokens routed to it (``plan.calibration``; padding goes to no expert). One host
        sync per layer (the experts' token counts)."""
        cal, fc1, fc2 = self.calibrator
        xf = x.float().reshape(-1, x.shape[-1])
        real = cal.real_rows(xf)
        cal.observe(fc1, real)
        w13f, w2f = self.dequantized("w13"), self.dequantized("w2")
        E, F, K = w13f.shape[0], w2f.shape[-1], ids.shape[-1]
        flat = ids.reshape(-1).long()
        if cal.valid_tokens is not None:
            flat = flat.masked_fill(~cal.valid_tokens.repeat_interleave(K), E)  # padding: past the last expert
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, each in row-major order
        counts = torch.bincount(flat, minlength=E + 1)[:E].tolist()
        out = torch.zeros_like(xf)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tok, slot = pairs // K, pairs % K
            gu = xf[tok] @ w13f[e].t()
            h = nn.functional.silu(gu[:, :F]) * gu[:, F:]
            cal.observe(fc2, h, member=e)
            out.index_add_(0, tok, (h @ w2f[e].t()) * weights[tok, slot, None].float())
        if cal.pass_index == cal.num_passes - 1:
            self._x.append(real)
        return out.to(x.dtype).view_as(x)


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

        if self.calibrator is not None:
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
        self.calibrator = None  # (Calibrator, group or None) while calibrating

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x):
        from quads_megatron.rac import compensated_activation

        if self.calibrator is not None:
            return _linear_calibration_forward(self, x)
        xq = compensated_activation(x, None, self.input_scale)[0]
        return (xq @ self.weight.float().t()).to(x.dtype)


class NVFP4Experts(_QuantExperts):
    """Drop-in for Qwen3MoeExperts: forward(hidden, top_k_index, top_k_weights) on ``w4a4_fused_moe``.

    kernel_layout: hold w13 / w2 in the kernels' byte order when their shapes fit (``weight_layout``);
    False keeps ModelOpt's (a model whose buffers are forwarded as they are, e.g. the sync's calibration model)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, precision: Precision, device,
                 kernel_layout: bool = True):
        super().__init__(num_experts, hidden, ffn, precision)
        E, H, F = num_experts, hidden, ffn
        self.weight_layout = _weight_layout(kernel_layout, (2 * F, H), (H, F))
        # rows written since the last settle_load, per buffer (codes and block scales)
        self._pending = {"w13": PendingRows(), "w2": PendingRows(),
                         "w13_scale": PendingRows(scales=True), "w2_scale": PendingRows(scales=True)}
        for which, (n, k) in (("w13", (2 * F, H)), ("w2", (H, F))):  # gate rows, then up; one scale_2 per expert
            specs = nvfp4_weight_specs(n, k, lead=(E,))
            for key, suffix in ((WEIGHT, ""), (WEIGHT_SCALE, "_scale"), (WEIGHT_SCALE_2, "_scale_2")):
                shape, dtype = specs[key]
                self.register_buffer(which + suffix, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @torch.no_grad()
    def load(self, proj: str, expert: int, q: nvfp4.NVFP4Tensor) -> None:
        """Write one expert projection's NVFP4 triple into the buffers in place."""
        t = q.to_modelopt()
        F = self.ffn
        if proj in EXPERT_FC2:
            self.w2[expert].copy_(t["weight"])
            self.w2_scale[expert].copy_(t["weight_scale"])
            self.w2_scale_2[expert].copy_(t["weight_scale_2"].reshape(()))
            self._mark("w2", [expert])
            return
        rows = slice(0, F) if proj == EXPERT_FC1[0] else slice(F, 2 * F)
        self.w13[expert, rows].copy_(t["weight"])
        self._mark("w13", [expert], rows.start, rows.stop)
        self.w13_scale[expert, rows].copy_(t["weight_scale"])
        self.w13_scale_2[expert].copy_(t["weight_scale_2"].reshape(()))  # gate and up share it

    @torch.no_grad()
    def load_layer(self, experts: list, fc1: nvfp4.NVFP4Tensor, fc2: nvfp4.NVFP4Tensor) -> None:
        """Write stacked NVFP4 experts (fc1 [E', 2F, H], fc2 [E', H, F] of expert indices ``experts``) in place."""
        idx = torch.as_tensor(experts, dtype=torch.long, device=self.w13.device)
        for which, q in (("w13", fc1), ("w2", fc2)):
            for suffix, t in (("", q.data), ("_scale", q.scale.view(torch.uint8)),
                              ("_scale_2", q.global_scale.reshape(-1))):
                buf = getattr(self, which + suffix)
                buf = buf.view(torch.uint8) if suffix == "_scale" else buf
                buf.index_copy_(0, idx, t.contiguous())
            self._mark(which, experts)

    def grouped_buffers(self, role: tuple, experts: list):
        """(data, scale, S_dec) views that ``nvfp4.quantize_grouped`` fills for all experts in place:
        w13 as [2E, F, H/2] for role (gate_proj, up_proj), w2 for (down_proj,); None for a partial set."""
        if experts != list(range(self.num_experts)):
            return None
        E, F, H = self.num_experts, self.ffn, self.hidden
        if tuple(role) in (EXPERT_FC1, EXPERT_FC2):  # the caller writes all of them (ModelOpt order)
            self._mark("w13" if tuple(role) == EXPERT_FC1 else "w2", experts)
        if tuple(role) == EXPERT_FC1:
            return (self.w13.view(2 * E, F, packed_cols(H)), self.w13_scale.view(2 * E, F, block_scale_cols(H)),
                    self.w13_scale_2)
        if tuple(role) == EXPERT_FC2:
            return self.w2, self.w2_scale, self.w2_scale_2
        return None

    def _mark(self, which: str, experts, row0: int = 0, row1: int | None = None) -> None:
        """Record rows just written in ModelOpt order (``settle_load`` converts them once)."""
        if self.weight_layout != "modelopt":
            for buf in (which, f"{which}_scale"):
                self._pending[buf].mark(experts, row0, getattr(self, which).shape[1] if row1 is None else row1)

    def _modelopt(self, name: str) -> torch.Tensor:
        """Buffer `name` in ModelOpt order: itself in the v2 layout, else as ``PendingRows.modelopt`` reads it."""
        buf = getattr(self, name)
        return buf if self.weight_layout == "modelopt" else self._pending[name].modelopt(buf, name)

    def modelopt_codes(self, which: str) -> torch.Tensor:
        """'w13' / 'w2' packed codes in ModelOpt order: what checks, RAC columns, calibration and re-sends read."""
        return self._modelopt(which)

    def modelopt_scales(self, which: str) -> torch.Tensor:
        """'w13' / 'w2' block scales in ModelOpt order, as `modelopt_codes` reads the codes."""
        return self._modelopt(f"{which}_scale")

    @torch.no_grad()
    def settle_load(self) -> bool:
        """After the last write of a load: the RAC columns from the ModelOpt codes, then exactly the rows
        this load wrote into the kernel layout (same storage: captured graphs stay valid). True when a RAC
        column tensor had to be rebound."""
        rebound = self.refresh_rac_columns()
        for name, pending in self._pending.items():
            pending.settle(getattr(self, name), name)
        return rebound

    def dequantized(self, which: str) -> torch.Tensor:
        return _dequantize(self.modelopt_codes(which), self.modelopt_scales(which),
                           getattr(self, f"{which}_scale_2"))

    def refresh_rac_columns(self) -> bool:
        """Store the RAC weight columns Wq[:, S] the kernels' residual K-steps read, in place (captured
        graphs keep reading them). The engine calls this after every weight load and calibration, as
        SGLang's process_weights_after_loading does; a no-op until the channels are calibrated.
        True when a column tensor had to be (re)bound."""
        if not (self.precision.uses_rac and self.w13_comp_index is not None):
            return False
        from quads_megatron.kernels.rac_columns import rac_weight_columns

        a = _store(self, "w13_comp_weight", rac_weight_columns(self.modelopt_codes("w13"),
                                                                self.modelopt_scales("w13"), self.w13_comp_index))
        return _store(self, "w2_comp_weight", rac_weight_columns(self.modelopt_codes("w2"), self.modelopt_scales("w2"),
                                                                 self.w2_comp_index)) or a

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.calibrator is not None:
            return self._calibration_forward(hidden_states, top_k_index, top_k_weights)
        if self.precision.uses_rac and self.w13_comp_index is None:
            raise RuntimeError("w4a4_rac rollout: RAC channels not calibrated (call LocalEngine.calibrate)")
        return _kernels().w4a4_fused_moe(
            hidden_states, self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale,
            self.w2_scale_2, top_k_weights, top_k_index, act_mode=self.precision.value,
            w13_comp_index=self.w13_comp_index, w2_comp_index=self.w2_comp_index,
            w13_input_scale=self.w13_input_scale, w2_input_scale=self.w2_input_scale,
            w13_comp_weight=self.w13_comp_weight, w2_comp_weight=self.w2_comp_weight,
            weight_layout=self.weight_layout)


class NVFP4Linear(nn.Module):
    """Drop-in for an attention nn.Linear (no bias) on ``w4a4_linear``."""

    def __init__(self, out_features: int, in_features: int, precision: Precision, device,
                 kernel_layout: bool = True):
        super().__init__()
        self.precision, self.in_features, self.out_features = precision, in_features, out_features
        self.weight_layout = _weight_layout(kernel_layout, (out_features, in_features))
        for name, (shape, dtype) in nvfp4_weight_specs(out_features, in_features).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.comp_index = self.input_scale = None
        self.comp_weight = None  # RAC weight columns (refresh_rac_columns)
        self.meter = _ErrorMeter()
        self.calibrator = None  # (Calibrator, group or None) while calibrating

    @torch.no_grad()
    def load(self, q: nvfp4.NVFP4Tensor) -> None:
        for name, t in q.to_modelopt().items():
            getattr(self, name).copy_(t.reshape(getattr(self, name).shape))
        if self.weight_layout != "modelopt":  # one write per load, complete: convert it now, in place
            to_kernel_layout(self.weight, out=self.weight, name="weight")
            scales_to_kernel_layout(self.weight_scale, out=self.weight_scale, name="weight_scale")

    def modelopt_codes(self) -> torch.Tensor:
        """The packed codes in ModelOpt order (the buffer itself in the v2 layout, else a copy)."""
        return self.weight if self.weight_layout == "modelopt" else from_kernel_layout(self.weight)

    def modelopt_scales(self) -> torch.Tensor:
        """The block scales in ModelOpt order (the buffer itself in the v2 layout, else a copy)."""
        return self.weight_scale if self.weight_layout == "modelopt" else scales_from_kernel_layout(self.weight_scale)

    def settle_load(self) -> bool:
        """After a load: the RAC columns (the codes were converted as they were written)."""
        return self.refresh_rac_columns()

    def dequantized(self) -> torch.Tensor:
        return _dequantize(self.modelopt_codes(), self.modelopt_scales(), self.weight_scale_2)

    def forward(self, x):
        if self.calibrator is not None:
            return _linear_calibration_forward(self, x)
        if self.precision.uses_rac and self.comp_index is None:
            raise RuntimeError("w4a4_rac rollout: RAC channels not calibrated (call LocalEngine.calibrate)")
        return _kernels().w4a4_linear(x, self.weight, self.weight_scale, self.weight_scale_2,
                                      act_mode=self.precision.value, comp_index=self.comp_index,
                                      input_scale=self.input_scale, comp_weight=self.comp_weight,
                                      weight_layout=self.weight_layout)

    def refresh_rac_columns(self) -> bool:
        """As `NVFP4Experts.refresh_rac_columns`: Wq[:, S] stored in place after a load or calibration."""
        if not (self.precision.uses_rac and self.comp_index is not None):
            return False
        from quads_megatron.kernels.rac_columns import rac_weight_columns

        return _store(self, "comp_weight", rac_weight_columns(self.modelopt_codes(), self.modelopt_scales(),
                                                              self.comp_index))


@torch.no_grad()
def _linear_calibration_forward(m, x):
    """fp32 ``x Wq^T`` on the dequantized weight; the group's first member hands its input to the calibrator."""
    cal, group = m.calibrator
    if group is not None:
        cal.observe(group, cal.real_rows(x.float()))
    return (x.float() @ m.dequantized().t()).to(x.dtype)


def graph_safe(module) -> bool:
    """True when the module's forward has no host syncs, so a CUDA graph can capture it (all but w16a4's loops)."""
    return isinstance(module, (NVFP4Experts, NVFP4Linear))


def install_nvfp4_modules(model: nn.Module, plan: QuantPlan, device=None, dtype=None,
                          kernel_layout: bool = True) -> dict:
    """Replace the plan's rollout-NVFP4 units of an HF Qwen3-MoE; return {HF module prefix: module}.

    device / dtype of the new modules: default, those of the model's first parameter; kernel_layout:
    NVFP4 weights in the kernels' byte order where the shapes fit (False: ModelOpt order everywhere)."""
    p0 = next(model.parameters())
    device = p0.device if device is None else device
    dtype = p0.dtype if dtype is None else dtype
    d = plan.dims
    modules = {}
    for i, layer in enumerate(model.model.layers):
        prec = plan.layer_precision(i, Scope.ROUTED_EXPERTS)
        if prec.quantizes_weights:
            layer.mlp.experts = NVFP4Experts(d.num_experts, d.hidden_size, d.moe_ffn, prec, device,
                                             kernel_layout)
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
                m = (NVFP4Linear(lin.out_features, lin.in_features, t.rollout, device, kernel_layout)
                     if t.rollout.quantizes_weights
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


def attach_calibrator(modules: dict, calibrator, layout) -> None:
    """Switch every activation-quantized module to its calibration forward, feeding ``calibrator``
    (a ``plan.calibration.Calibrator``) under the layout's group names; one member per shared input observes."""
    for name, m in modules.items():
        if not m.precision.quantizes_activations:
            continue
        if isinstance(m, _QuantExperts):
            m.calibrator, m._x = (calibrator, *experts_group_names(name)), []
            continue
        g = layout.group_of(f"{name}.weight")
        m.calibrator = (calibrator, g.name if g is not None and g.members[0] == f"{name}.weight" else None)


def detach_calibrator(modules: dict) -> None:
    for m in modules.values():
        m.calibrator = None


def group_weights(modules: dict, group) -> torch.Tensor:
    """The fp32 dequantized weights of an activation group as the rollout GEMMs see them:
    [E, N, K] for an experts group, the members' rows stacked [N, K] otherwise."""
    if group.experts:
        prefix = group.name.rsplit(".", 1)[0]
        fc1, _ = experts_group_names(prefix)
        return modules[prefix].dequantized("w13" if group.name == fc1 else "w2")
    return torch.cat([modules[n[: -len(".weight")]].dequantized() for n in group.members])


def apply_calibration(modules: dict, calibration, layout, observed: dict | None = None) -> bool:
    """Write a ``plan.calibration.Calibration`` into the modules: static input scales (static scaling only: the
    kernels use a given scale) and RAC channels, in place where possible; True when a tensor had to be rebound.
    observed: the modules that ran the calibration forward (an fp32 twin), default ``modules``."""
    observed = modules if observed is None else observed
    rebound = False
    for name, m in modules.items():
        if not m.precision.quantizes_activations:
            continue
        if isinstance(m, _QuantExperts):
            dev = next(itertools.chain(m.parameters(), m.buffers())).device
            for (attr_scale, attr_comp), gname in zip((("w13_input_scale", "w13_comp_index"),
                                                        ("w2_input_scale", "w2_comp_index")), experts_group_names(name)):
                c, g = calibration[gname], layout[gname]
                if g.static:
                    rebound |= _store(m, attr_scale, c.input_scale.to(dev).reshape(()))
                if c.comp_index is not None:
                    rebound |= _store(m, attr_comp, c.comp_index.to(dev))
            _record_activation_error(m, observed[name])
            continue
        g = layout.group_of(f"{name}.weight")
        c = calibration[g.name]
        dev = m.weight.device
        if g.static:
            rebound |= _store(m, "input_scale", c.input_scale.to(dev).reshape(()))
        if c.comp_index is not None:
            rebound |= _store(m, "comp_index", c.comp_index.to(dev))
    return rebound


def _record_activation_error(m, observed) -> None:
    """fc1 activation error of the last calibration's inputs (per-token NVFP4, and with the RAC channels)."""
    from quads_megatron.rac import compensated_activation

    x = torch.cat(observed._x) if observed._x else None
    observed._x = []
    if x is None or not x.numel():
        return
    xq, _ = compensated_activation(x, None)
    m.act_err = {"act_rel_err": _rel_err(x, xq)}
    if m.w13_comp_index is not None:
        idx = m.w13_comp_index.to(x.device)
        xq, rq = compensated_activation(x, idx)
        xc = xq.clone()
        xc[:, idx.long()] += rq
        m.act_err["act_rel_err_rac"] = _rel_err(x, xc)


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
