"""``RolloutModel``: the model a rollout serves, built from the plan: HF Qwen3-MoE + the plan's NVFP4 modules.

The local engine generates with it; the exporter builds one from its HF weights to calibrate
the checkpoint's activation side on the same modules the engine runs, so both calibrate the
model as served (``plan.calibration``) and agree bit for bit for the same weights and prompts.
"""

from __future__ import annotations

import copy
import re
from typing import Iterable

import torch
from tqdm import tqdm

from quads_megatron.plan import QuantPlan, quantize_scale_groups
from quads_megatron.plan.calibration import Calibration, Calibrator
from quads_megatron.plan.expert_layers import QuantizedExperts
from quads_megatron.plan.layout import EXPERT_FC1, RolloutLayout
from quads_megatron.rollout.modules import (_ErrorMeter, apply_calibration, attach_calibrator, detach_calibrator,
                                            error_report, graph_safe, group_weights, install_nvfp4_modules,
                                            load_quantized)

CALIBRATION_DTYPE = torch.float32
CALIBRATION_BATCH_TOKENS = 8192  # tokens per calibration forward, padding included (fp32 activations)
_EXPERT_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _stacked(mats) -> torch.Tensor:
    return mats if isinstance(mats, torch.Tensor) else torch.stack(list(mats))


def _materialize(model, device) -> None:
    """Allocate (zeros) every parameter and buffer still on the meta device; recompute the rotary frequencies."""
    made = {}  # tied parameters (lm_head / embed_tokens) stay one tensor
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.zeros_like(p, device=device), requires_grad=False)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros_like(b, device=device)
    rotary = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(model.config)  # non-persistent inv_freq: computed, never loaded


def calibration_batches(prompts, device, batch_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``prompts`` in order as left-padded (input ids [B, P], attention mask [B, P]) batches of at most
    ``batch_tokens`` tokens B * P (a longer prompt goes alone)."""
    seqs = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    if any(s.numel() == 0 for s in seqs):
        raise ValueError("calibration: an empty prompt (expected at least one token each)")
    groups, cur = [], []
    for s in seqs:
        if cur and (len(cur) + 1) * max(s.numel(), *(c.numel() for c in cur)) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    out = []
    for group in groups:
        P = max(s.numel() for s in group)
        ids = torch.zeros(len(group), P, dtype=torch.long)
        mask = torch.zeros(len(group), P, dtype=torch.long)
        for i, s in enumerate(group):
            ids[i, P - s.numel():], mask[i, P - s.numel():] = s, 1
        out.append((ids.to(device), mask.to(device)))
    return out


class RolloutModel:
    """An HF Qwen3MoeForCausalLM of ``hf_config`` whose plan-NVFP4 units run ``quads_megatron.kernels``."""

    def __init__(self, hf_config, plan: QuantPlan, *, dtype: torch.dtype, device: torch.device,
                 kernel_layout: bool = True):
        """kernel_layout: NVFP4 codes held in the kernels' byte order where the shapes fit (the modules decide
        by shape); False for a model that only calibrates and forwards its NVFP4 bytes as they are (the SGLang
        sync's and the exporter's calibration models: their buffers are read after the stream, in ModelOpt
        order, and they never run the kernels)."""
        from transformers import AutoModelForCausalLM

        self.plan, self.dtype, self.device = plan, dtype, torch.device(device)
        self.kernel_layout = kernel_layout
        self.layout = RolloutLayout(plan)
        cfg = copy.deepcopy(hf_config)
        # BF16 experts: transformers' grouped_mm path on a GPU (no host syncs, so decode can be graph-captured)
        if hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager" if self.device.type == "cpu" else "grouped_mm"
        cfg._attn_implementation = "eager" if self.device.type == "cpu" else "sdpa"
        self.hf_config = cfg
        # Built on the meta device: the weights the NVFP4 modules replace are never allocated (a real MoE's
        # experts in fp32 would not fit); the rest is allocated (zeros) and filled by load_weights.
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.modules = install_nvfp4_modules(self.model, plan, device=self.device, dtype=dtype,
                                            kernel_layout=kernel_layout)
        _materialize(self.model, self.device)
        self.calibration: Calibration | None = None  # the last calibrate()'s result
        self._twin: RolloutModel | None = None  # the fp32 calibration copy (_calibration_twin)

    @property
    def graph_safe(self) -> bool:
        """True when a forward has no host syncs, so a CUDA graph can capture the decode step: every NVFP4
        module is sync-free, and transformers' own experts (units the plan keeps BF16) run in bf16, the one
        dtype whose grouped_mm is sync-free on the GPU (others fall back to a host-synchronising path)."""
        hf_experts = [n for n, _ in self.model.named_modules() if n.endswith("mlp.experts") and n not in self.modules]
        return all(graph_safe(m) for m in self.modules.values()) and (not hf_experts or self.dtype == torch.bfloat16)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], measure_error: bool = False) -> bool:
        """Load HF-named high-precision tensors; the plan's NVFP4 weights are quantized and written in place.

        measure_error: also accumulate each module's weight error (an extra dequantize per weight).
        Returns True when a RAC column tensor had to be rebound (graphs captured before must not replay).
        """
        for _ in self.load_groups(named_tensors, measure_error):
            pass
        return self.rac_rebound

    def load_groups(self, named_tensors: Iterable[tuple[str, torch.Tensor]], measure_error: bool = False):
        """``load_weights`` as a stream: yields each ``quantize_scale_groups`` item (``(names, tensors,
        quantized)``, or a layer's ``QuantizedExperts`` for an ``ExpertsLayer`` input) once it is in place,
        so a caller that forwards the weights (the SGLang sync) reuses the
        NVFP4 tensors built here instead of quantizing twice or holding the whole stream. Exhaust it: the
        tied embeddings, RAC columns (``rac_rebound``) and the kernel layout are settled after the last item;
        an item's NVFP4 tensors may be views of the modules' buffers, ModelOpt order only until then (a
        caller that holds them past the stream builds the model with kernel_layout=False)."""
        params = dict(self.model.named_parameters())
        if measure_error:
            for m in self.modules.values():
                m.meter = _ErrorMeter()
        seen = set()
        buffers = {b.untyped_storage().data_ptr() for b in self.model.buffers()}

        def destination(layer, role, experts):
            """The experts' NVFP4 buffers of this layer, for the grouped kernel to write (no copy)."""
            m = self.modules.get(f"model.layers.{layer}.mlp.experts")
            return m.grouped_buffers(role, experts) if hasattr(m, "grouped_buffers") else None

        for item in quantize_scale_groups(named_tensors, self.plan, destination=destination):
            if isinstance(item, QuantizedExperts):  # a whole layer's experts, normally already in the buffers
                self._load_experts_layer(item, buffers, measure_error)
                seen.add(item.source.prefix)
                yield item
                continue
            names, tensors, quantized = item
            for i, (name, t) in enumerate(zip(names, tensors)):
                if quantized is not None and quantized[i].data.untyped_storage().data_ptr() in buffers:
                    if measure_error:
                        load_quantized(self.modules, name, t, quantized[i], measure_error, store=False)
                elif quantized is not None:
                    load_quantized(self.modules, name, t, quantized[i].to(self.device), measure_error)
                else:
                    dst = self._destination(params, name)
                    if tuple(dst.shape) != tuple(t.shape):
                        raise ValueError(f"weight sync: {name} has shape {tuple(t.shape)}, the rollout model "
                                         f"expects {tuple(dst.shape)}")
                    dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
                seen.add(name)
            yield item
        if not seen:
            raise ValueError("weight sync: no tensors received")
        if getattr(self.model.config, "tie_word_embeddings", False) and "lm_head.weight" not in seen:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        self.rac_rebound = self._settle_loads()

    def _settle_loads(self) -> bool:
        """After a load's last write: each module's RAC columns from its ModelOpt codes, then what the load
        wrote into the kernel layout, in place; True when a RAC column tensor had to be rebound."""
        rebound = False
        for m in self.modules.values():
            if hasattr(m, "settle_load"):
                rebound |= m.settle_load()
        return rebound

    def _load_experts_layer(self, q: QuantizedExperts, buffers: set, measure_error: bool) -> None:
        """Copy a layer's quantized experts into its module unless the kernel wrote them there; meter the error."""
        m = self.modules.get(q.source.prefix)
        if m is None or not hasattr(m, "load_layer"):
            raise KeyError(f"weight sync: {q.source.prefix} experts are NVFP4 in the plan but the rollout model has "
                           f"no NVFP4 experts module for them")
        if q.fc1.data.untyped_storage().data_ptr() not in buffers:
            m.load_layer(q.source.experts, q.fc1.to(self.device), q.fc2.to(self.device))
        if measure_error:
            m.meter.add(_stacked(q.source.fc1), q.fc1)
            m.meter.add(_stacked(q.source.fc2), q.fc2)

    def _destination(self, params: dict, name: str) -> torch.Tensor:
        """The HF model parameter (or the slice of a fused expert parameter) that ``name`` fills."""
        m = _EXPERT_RE.match(name)
        if not m:
            return self._param(params, name, name)
        pre, e, proj = m["pre"], int(m["e"]), m["proj"]
        if proj not in EXPERT_FC1:
            return self._param(params, f"{pre}.down_proj", name)[e]
        full = self._param(params, f"{pre}.gate_up_proj", name)
        f = full.shape[1] // 2
        return full[e, :f] if proj == EXPERT_FC1[0] else full[e, f:]

    @staticmethod
    def _param(params: dict, key: str, src: str) -> torch.Tensor:
        if key not in params:
            raise KeyError(f"weight sync: {src} maps to {key}, which the rollout model does not have")
        return params[key].data

    def refresh_rac_columns(self) -> bool:
        """Rebuild every module's RAC weight columns from its current weights and channels (in place
        after the first time); True when a column tensor had to be (re)bound."""
        rebound = False
        for m in self.modules.values():
            if hasattr(m, "refresh_rac_columns"):
                rebound |= m.refresh_rac_columns()
        return rebound

    # ------------------------------------------------------------------ calibration
    @torch.no_grad()
    def calibrate(self, prompts, progress: bool = False, batch_tokens: int = CALIBRATION_BATCH_TOKENS) -> bool:
        """Calibrate the activation side on ``prompts`` (token id lists or 1-D tensors), the plan's one rule
        (``plan.calibration``), and write input scales (static) and RAC channels into the modules.

        The prompts run in left-padded batches of at most ``batch_tokens`` tokens (padding included);
        padding tokens reach no statistic. The result stays in ``self.calibration``. Returns True when a
        channel, scale or RAC column tensor had to be rebound (graphs captured before must not replay).
        """
        calibrator = Calibrator(self.layout)
        if not calibrator.groups:
            self.calibration = calibrator.finish(lambda g: None)
            return False
        runner = self if self.dtype == CALIBRATION_DTYPE else self._calibration_twin()
        batches = calibration_batches(prompts, runner.device, batch_tokens)
        attach_calibrator(runner.modules, calibrator, self.layout)
        try:
            for index in range(calibrator.num_passes):
                calibrator.start_pass(index)
                for ids, mask in tqdm(batches, desc=f"calibrate ({index + 1}/{calibrator.num_passes})",
                                      disable=not progress, unit="batch"):
                    calibrator.valid_tokens = mask.reshape(-1).bool()
                    runner.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        finally:
            calibrator.valid_tokens = None
            detach_calibrator(runner.modules)
        self.calibration = calibrator.finish(lambda g: group_weights(runner.modules, g))
        rebound = apply_calibration(self.modules, self.calibration, self.layout, observed=runner.modules)
        return self.refresh_rac_columns() or rebound

    def activation_tensors(self):
        """``(checkpoint name, tensor)`` of the last calibration's activation side (``input_scale``,
        ``input_comp_index`` of every activation-quantized weight): what the exporter writes, and what a
        live weight sync sends an SGLang server."""
        for g in self.layout:
            for m in g.members:
                for suffix, value in self.calibration.for_weight(m).items():
                    yield f"{m[: -len('.weight')]}.{suffix}", value

    def _calibration_twin(self) -> "RolloutModel":
        """An fp32 copy of this model (built once, refilled on every call): the calibration runs in fp32."""
        if self._twin is None:
            self._twin = RolloutModel(self.hf_config, self.plan, dtype=CALIBRATION_DTYPE, device=self.device,
                                      kernel_layout=self.kernel_layout)  # the buffers are copied byte for byte
        twin = self._twin
        ours = dict(self.model.named_parameters())
        for name, p in twin.model.named_parameters():
            p.data.copy_(ours[name].data)  # BF16 -> fp32 is exact
        ours = dict(self.model.named_buffers())
        for prefix, m in twin.modules.items():
            for name, b in m.named_buffers():
                b.copy_(ours[f"{prefix}.{name}"])
        return twin

    def quant_error_report(self) -> dict[str, float]:
        return error_report(self.modules)
