"""The model a rollout serves: the plan's NVFP4 drop-in modules on an HF Qwen3-MoE, its weight loading and
its calibration forward.  The local engine (``rl.engines.local``) generates with it, the exporter
(``convert.rollout_export``) calibrates the checkpoint on it, so both calibrate the same model.

* ``RolloutModel``: ``model``.
* ``RoutedExpertsRecorder`` / ``sample_routed_experts`` (the routers' top-k ids, SGLang's layout): ``routing``.
* ``NVFP4Experts`` / ``NVFP4Linear`` / ``ActQuantExperts`` / ``ActQuantLinear``, ``install_nvfp4_modules``: ``modules``.
"""

from quads_megatron.rollout.model import CALIBRATION_DTYPE, RolloutModel
from quads_megatron.rollout.modules import (ActQuantExperts, ActQuantLinear, NVFP4Experts, NVFP4Linear, graph_safe,
                                            install_nvfp4_modules, load_quantized)
from quads_megatron.rollout.routing import RoutedExpertsRecorder, sample_routed_experts

__all__ = ["RolloutModel", "CALIBRATION_DTYPE", "NVFP4Experts", "NVFP4Linear", "ActQuantExperts", "ActQuantLinear",
           "graph_safe", "install_nvfp4_modules", "load_quantized", "RoutedExpertsRecorder", "sample_routed_experts"]
