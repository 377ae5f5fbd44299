"""The quantization plan: which weights are NVFP4 and how, the rollout checkpoint schema, and the
one step that quantizes (HF name, tensor) streams for export and weight sync.

* ``QuantPlan.resolve(recipe, dims, tp=, etp=)`` / ``TensorPlan``: ``quant_plan``.
* ``quantize_named_params(named_tensors, plan)``: ``named_params``.
* ``ExpertsLayer`` / ``QuantizedExperts``: ``expert_layers`` (a layer's experts as one stream item, the refit's unit).
* ``RolloutQuantConfig`` / ``parse_quantization_config``: ``rollout_schema`` (config.json).
* ``RolloutLayout``: ``layout`` (the rollout tensors: names, shapes, dtypes, which share a scale, an input, a RAC set).
* ``Calibrator`` / ``Calibration``: ``calibration`` (THE calibration of the rollout's activation side).
"""

from quads_megatron.plan.calibration import Calibration, Calibrator
from quads_megatron.plan.expert_layers import ExpertsLayer, QuantizedExperts, quantize_experts_layer
from quads_megatron.plan.layout import ActivationGroup, RolloutLayout
from quads_megatron.plan.named_params import quantize_named_params, quantize_scale_groups
from quads_megatron.plan.quant_plan import (EXPERT_TENSOR_PARALLEL, TENSOR_PARALLEL, QuantPlan,
                                            TensorPlan)
from quads_megatron.plan.rollout_schema import RolloutQuantConfig, parse_quantization_config

__all__ = ["QuantPlan", "TensorPlan", "quantize_named_params", "quantize_scale_groups",
           "RolloutQuantConfig", "parse_quantization_config", "TENSOR_PARALLEL",
           "EXPERT_TENSOR_PARALLEL", "RolloutLayout", "ExpertsLayer", "QuantizedExperts",
           "quantize_experts_layer", "ActivationGroup", "Calibrator", "Calibration"]
