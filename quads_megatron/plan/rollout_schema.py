"""The ``quantization_config`` of a QUADS NVFP4 rollout checkpoint: schema, writer input and parser.

A QUADS checkpoint is a ModelOpt NVFP4 checkpoint (HF safetensors with ``weight`` uint8,
``weight_scale`` float8_e4m3fn, ``weight_scale_2`` / ``input_scale`` float32 per linear) plus,
for RAC, an int32 ``input_comp_index`` [k] next to each quantized linear's ``input_scale``.
Its config.json carries (written from ``QuantPlan.rollout_config()``)::

    "quantization_config": {
        "quant_method": "quads",
        "quant_algo": "NVFP4",                  # weight format, ModelOpt's name for it
        "group_size": 16,
        "precision": "w4a4_rac",                # quads_megatron.vocab.Precision: w4a16 | w4a4 | w4a4_rac
        "activation_scaling": "per_token",      # per_token | static (uses input_scale)
        "rac_channels": 64,                     # k (% 16 == 0), needed for w4a4_rac
        "rac_index_tensor": "input_comp_index", # tensor name next to input_scale
        "exclude_modules": ["lm_head", "*.mlp.gate"],  # stay BF16 (ModelOpt patterns)
        "recipe": {...}                         # the QuadsRecipe the plan was resolved from
    }

MoE experts store the indices per expert under HF names (``...experts.{e}.gate_proj.input_comp_index``,
``up_proj``, ``down_proj``): fc1 reads the same hidden states for every expert, so gate and up of
all experts of a layer carry one shared set; fc2 (``down_proj``) carries one set per expert.
Attention stores one set for q/k/v (they read the same input) and one for o_proj.

The exporter also writes ``hf_quant_config.json``: ModelOpt's summary under "quantization" plus
this block under "quads" (read when config.json carries no ``quantization_config``).
A plain ModelOpt NVFP4 checkpoint (config.json ``quant_method: "modelopt"`` or an
``hf_quant_config.json``) is read too: W4A4 with its static ``input_scale`` (ModelOpt's own
semantics), W4A16 for ``W4A16_NVFP4``, RAC off.  A serving process may override the
checkpoint's choice with ``QUADS_PRECISION``, ``QUADS_ACTIVATION_SCALING`` and
``QUADS_RAC_CHANNELS`` (SGLang's spawned scheduler processes inherit them); they are read
here and nowhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from quads_megatron import vocab
from quads_megatron.vocab import ActivationScaling, Precision

QUANT_METHOD = "quads"
WEIGHT_FORMAT = "NVFP4"
GROUP_SIZE = 16
COMP_INDEX_TENSOR = "input_comp_index"
ENV_PRECISION = "QUADS_PRECISION"
ENV_ACTIVATION_SCALING = "QUADS_ACTIVATION_SCALING"
ENV_RAC_CHANNELS = "QUADS_RAC_CHANNELS"
MODELOPT_NVFP4_ALGOS = {"NVFP4": Precision.W4A4, "W4A16_NVFP4": Precision.W4A16}


@dataclass
class RolloutQuantConfig:
    """What a rollout engine needs to know about a checkpoint's NVFP4 layers (module docstring)."""

    precision: Precision = Precision.W4A4_RAC
    activation_scaling: ActivationScaling = ActivationScaling.PER_TOKEN
    rac_channels: int = 0
    exclude_modules: List[str] = field(default_factory=list)
    group_size: int = GROUP_SIZE
    weight_format: str = WEIGHT_FORMAT
    rac_index_tensor: str = COMP_INDEX_TENSOR
    source: str = QUANT_METHOD  # "quads" or "modelopt": which checkpoint format was read

    def __post_init__(self) -> None:
        self.precision = vocab.parse_precision(self.precision, "quantization_config.precision")
        self.activation_scaling = vocab.parse_scaling(self.activation_scaling,
                                                      "quantization_config.activation_scaling")
        self.validate()

    def validate(self) -> None:
        """Raise a clear ValueError for any field outside what the kernels support."""
        if not isinstance(self.weight_format, str) or self.weight_format.upper() != WEIGHT_FORMAT:
            raise ValueError(f"quantization_config.quant_algo: expected {WEIGHT_FORMAT!r}, "
                             f"got {self.weight_format!r}")
        if self.group_size != GROUP_SIZE:
            raise ValueError(f"quantization_config.group_size: NVFP4 uses {GROUP_SIZE}, got "
                             f"{self.group_size!r}")
        if not self.precision.quantizes_weights:
            raise ValueError("quantization_config.precision: 'bf16' is not a quantized checkpoint "
                             "(drop quantization_config, or use w4a16 / w4a4 / w4a4_rac)")
        k = self.rac_channels
        if not isinstance(k, int) or isinstance(k, bool) or k < 0 or k % GROUP_SIZE:
            raise ValueError(f"quantization_config.rac_channels: expected a multiple of "
                             f"{GROUP_SIZE} >= 0, got {k!r}")
        if self.precision.uses_rac and k == 0:
            raise ValueError("quantization_config: precision 'w4a4_rac' needs rac_channels > 0 "
                             "(and input_comp_index tensors in the checkpoint)")
        if not isinstance(self.exclude_modules, list) or not all(
                isinstance(m, str) for m in self.exclude_modules):
            raise ValueError(f"quantization_config.exclude_modules: expected a list of module "
                             f"name patterns, got {self.exclude_modules!r}")

    @property
    def uses_rac(self) -> bool:
        """True when linears carry compensation channel indices."""
        return self.precision.uses_rac

    @property
    def static_activation_scale(self) -> bool:
        """True when activations use the checkpoint's per-tensor ``input_scale``."""
        return (self.activation_scaling is ActivationScaling.STATIC
                and self.precision.quantizes_activations)

    def to_quantization_config(self) -> Dict[str, Any]:
        """The ``quantization_config`` block a QUADS exporter writes into config.json."""
        return {
            "quant_method": QUANT_METHOD,
            "quant_algo": self.weight_format,
            "group_size": self.group_size,
            "precision": self.precision.value,
            "activation_scaling": self.activation_scaling.value,
            "rac_channels": self.rac_channels,
            "rac_index_tensor": self.rac_index_tensor,
            "exclude_modules": list(self.exclude_modules),
        }

    def to_dict(self) -> Dict[str, Any]:
        """All fields as plain values (for logs and tests)."""
        return {**self.to_quantization_config(), "source": self.source}


def _modelopt_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """ModelOpt's nested hf_quant_config.json keeps the fields under "quantization"."""
    nested = config.get("quantization")
    return nested if isinstance(nested, Mapping) else config


def _from_modelopt(config: Mapping[str, Any]) -> RolloutQuantConfig:
    section = _modelopt_section(config)
    algo = str(section.get("quant_algo") or "").upper()
    if algo not in MODELOPT_NVFP4_ALGOS:
        raise ValueError(f"quantization_config: --quantization quads reads ModelOpt NVFP4 "
                         f"checkpoints (quant_algo one of {sorted(MODELOPT_NVFP4_ALGOS)}), got "
                         f"quant_algo {section.get('quant_algo')!r}")
    exclude = section.get("exclude_modules", section.get("ignore",
                                                         section.get("modules_to_not_convert")))
    if isinstance(exclude, str):
        exclude = [exclude]
    return RolloutQuantConfig(
        precision=MODELOPT_NVFP4_ALGOS[algo],
        activation_scaling=ActivationScaling.STATIC,
        rac_channels=0,
        exclude_modules=list(exclude or []),
        group_size=int(section.get("group_size", GROUP_SIZE)),
        source="modelopt",
    )


def is_modelopt_nvfp4(config: Optional[Mapping[str, Any]]) -> bool:
    """True for a ModelOpt NVFP4 quantization config (flat, nested, or SGLang-parsed)."""
    if not config:
        return False
    section = _modelopt_section(config)
    return (str(section.get("quant_algo") or "").upper() in MODELOPT_NVFP4_ALGOS
            and str(config.get("quant_method", "modelopt")).lower() != QUANT_METHOD)


_QUADS_KEYS = {"quant_method", "quant_algo", "group_size", "precision", "activation_scaling",
               "rac_channels", "rac_index_tensor", "exclude_modules", "producer", "recipe",
               "calibration"}


def _from_quads(config: Mapping[str, Any]) -> RolloutQuantConfig:
    unknown = sorted(set(config) - _QUADS_KEYS)
    if unknown:
        raise ValueError(f"quantization_config: unknown quads keys {unknown} (written by another "
                         f"version? known: {sorted(_QUADS_KEYS)})")
    if "precision" not in config:
        raise ValueError("quantization_config: quant_method 'quads' without 'precision' "
                         "(expected one of w4a16, w4a4, w4a4_rac)")
    exclude = config.get("exclude_modules", [])
    if isinstance(exclude, str):
        raise ValueError(f"quantization_config.exclude_modules: expected a list of module "
                         f"patterns, got the string {exclude!r}")
    return RolloutQuantConfig(
        precision=config["precision"],
        activation_scaling=config.get("activation_scaling", ActivationScaling.PER_TOKEN.value),
        rac_channels=config.get("rac_channels", 0),
        exclude_modules=list(exclude),
        group_size=config.get("group_size", GROUP_SIZE),
        weight_format=config.get("quant_algo", WEIGHT_FORMAT),
        rac_index_tensor=config.get("rac_index_tensor", COMP_INDEX_TENSOR),
    )


def parse_quantization_config(config: Mapping[str, Any], env: Optional[Mapping[str, str]] = None
                              ) -> RolloutQuantConfig:
    """RolloutQuantConfig from a config.json ``quantization_config`` or an hf_quant_config.json dict.

    ``env`` (default os.environ) supplies the serving-time overrides (module docstring).
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"quantization_config: expected a JSON object, got {type(config).__name__}")
    if isinstance(config.get(QUANT_METHOD), Mapping):
        # hf_quant_config.json of a QUADS export: the ModelOpt summary plus the full quads block
        config = config[QUANT_METHOD]
    method = str(config.get("quant_method", "")).lower()
    if method == QUANT_METHOD:
        parsed = _from_quads(config)
    elif is_modelopt_nvfp4(config):
        parsed = _from_modelopt(config)
    else:
        raise ValueError(f"quantization_config: expected quant_method 'quads' or a ModelOpt NVFP4 "
                         f"config, got quant_method {config.get('quant_method')!r} / quant_algo "
                         f"{_modelopt_section(config).get('quant_algo')!r}")
    return apply_env_overrides(parsed, os.environ if env is None else env)


def apply_env_overrides(cfg: RolloutQuantConfig, env: Mapping[str, str]) -> RolloutQuantConfig:
    """Apply QUADS_PRECISION / QUADS_ACTIVATION_SCALING / QUADS_RAC_CHANNELS."""
    fields = dict(precision=cfg.precision, activation_scaling=cfg.activation_scaling,
                  rac_channels=cfg.rac_channels, exclude_modules=list(cfg.exclude_modules),
                  group_size=cfg.group_size, weight_format=cfg.weight_format,
                  rac_index_tensor=cfg.rac_index_tensor, source=cfg.source)
    if env.get(ENV_PRECISION):
        fields["precision"] = vocab.parse_precision(env[ENV_PRECISION], ENV_PRECISION)
    if env.get(ENV_ACTIVATION_SCALING):
        fields["activation_scaling"] = vocab.parse_scaling(env[ENV_ACTIVATION_SCALING],
                                                           ENV_ACTIVATION_SCALING)
    if env.get(ENV_RAC_CHANNELS):
        try:
            fields["rac_channels"] = int(env[ENV_RAC_CHANNELS])
        except ValueError:
            raise ValueError(f"{ENV_RAC_CHANNELS}: expected an integer, got "
                             f"{env[ENV_RAC_CHANNELS]!r}") from None
    return RolloutQuantConfig(**fields)
