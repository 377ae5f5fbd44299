"""The `quantization_config` of a QUADS NVFP4 checkpoint: schema, parser and writer (no SGLang import).

A QUADS checkpoint is a ModelOpt NVFP4 checkpoint (HF safetensors with `weight` uint8,
`weight_scale` float8_e4m3fn, `weight_scale_2` / `input_scale` float32 per linear) plus, for
RAC, an int32 `input_comp_index` [k] next to each quantized linear's `input_scale`. Its
config.json carries::

    "quantization_config": {
        "quant_method": "quads",
        "quant_algo": "NVFP4",                  # weight format, ModelOpt's name for it
        "group_size": 16,
        "activation_mode": "w4a4_rac",          # w4a4 | w4a4_rac | w4a16
        "activation_scaling": "per_token",      # per_token | static (uses input_scale)
        "rac_num_channels": 64,                 # k (% 16 == 0), needed for w4a4_rac
        "rac_index_tensor": "input_comp_index", # tensor name next to input_scale
        "exclude_modules": ["lm_head", "*.mlp.gate"]   # stay BF16 (ModelOpt patterns)
    }

MoE experts store the indices per expert under HF names (`...experts.{e}.gate_proj.input_comp_index`,
`up_proj`, `down_proj`): fc1 reads the same hidden states for every expert, so gate and up of
all experts of a layer carry one shared set; fc2 (`down_proj`) carries one set per expert.

The exporter also writes `hf_quant_config.json`: ModelOpt's summary under "quantization" plus
this block under "quads" (read when config.json carries no `quantization_config`).
A plain ModelOpt NVFP4 checkpoint (config.json `quant_method: "modelopt"` or an
`hf_quant_config.json`) is read too: W4A4 with its static `input_scale` (ModelOpt's own
semantics), W4A16 for `W4A16_NVFP4`, RAC off. The environment variables
`QUADS_ACTIVATION_MODE`, `QUADS_ACTIVATION_SCALING` and `QUADS_RAC_NUM_CHANNELS` override the
checkpoint's choice (SGLang's spawned scheduler processes inherit them).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

QUANT_METHOD = "quads"
WEIGHT_FORMAT = "NVFP4"
GROUP_SIZE = 16
ACTIVATION_MODES = ("w4a4", "w4a4_rac", "w4a16")
ACTIVATION_SCALINGS = ("per_token", "static")
COMP_INDEX_TENSOR = "input_comp_index"
ENV_ACTIVATION_MODE = "QUADS_ACTIVATION_MODE"
ENV_ACTIVATION_SCALING = "QUADS_ACTIVATION_SCALING"
ENV_RAC_NUM_CHANNELS = "QUADS_RAC_NUM_CHANNELS"
MODELOPT_NVFP4_ALGOS = {"NVFP4": "w4a4", "W4A16_NVFP4": "w4a16"}


@dataclass
class QuadsSettings:
    """What the `quads` method needs to know about a checkpoint (see the module docstring)."""

    activation_mode: str = "w4a4_rac"
    activation_scaling: str = "per_token"
    rac_num_channels: int = 0
    exclude_modules: List[str] = field(default_factory=list)
    group_size: int = GROUP_SIZE
    weight_format: str = WEIGHT_FORMAT
    rac_index_tensor: str = COMP_INDEX_TENSOR
    source: str = QUANT_METHOD  # "quads" or "modelopt": which checkpoint format was read

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a clear ValueError for any field outside what the kernels support."""
        if self.weight_format.upper() != WEIGHT_FORMAT:
            raise ValueError(f"quantization_config.quant_algo: expected {WEIGHT_FORMAT!r}, "
                             f"got {self.weight_format!r}")
        if self.group_size != GROUP_SIZE:
            raise ValueError(f"quantization_config.group_size: NVFP4 uses {GROUP_SIZE}, got "
                             f"{self.group_size!r}")
        if self.activation_mode not in ACTIVATION_MODES:
            raise ValueError(f"quantization_config.activation_mode: expected one of "
                             f"{ACTIVATION_MODES}, got {self.activation_mode!r}")
        if self.activation_scaling not in ACTIVATION_SCALINGS:
            raise ValueError(f"quantization_config.activation_scaling: expected one of "
                             f"{ACTIVATION_SCALINGS}, got {self.activation_scaling!r}")
        k = self.rac_num_channels
        if not isinstance(k, int) or k < 0 or k % GROUP_SIZE:
            raise ValueError(f"quantization_config.rac_num_channels: expected a multiple of "
                             f"{GROUP_SIZE} >= 0, got {k!r}")
        if self.activation_mode == "w4a4_rac" and k == 0:
            raise ValueError("quantization_config: activation_mode 'w4a4_rac' needs "
                             "rac_num_channels > 0 (and input_comp_index tensors in the checkpoint)")
        if not isinstance(self.exclude_modules, list) or not all(
                isinstance(m, str) for m in self.exclude_modules):
            raise ValueError(f"quantization_config.exclude_modules: expected a list of module "
                             f"name patterns, got {self.exclude_modules!r}")

    @property
    def uses_rac(self) -> bool:
        """True when linears carry compensation channel indices."""
        return self.activation_mode == "w4a4_rac"

    @property
    def static_activation_scale(self) -> bool:
        """True when activations use the checkpoint's per-tensor `input_scale`."""
        return self.activation_scaling == "static" and self.activation_mode != "w4a16"

    def to_quantization_config(self) -> Dict[str, Any]:
        """The `quantization_config` block a QUADS exporter writes into config.json."""
        return {
            "quant_method": QUANT_METHOD,
            "quant_algo": self.weight_format,
            "group_size": self.group_size,
            "activation_mode": self.activation_mode,
            "activation_scaling": self.activation_scaling,
            "rac_num_channels": self.rac_num_channels,
            "rac_index_tensor": self.rac_index_tensor,
            "exclude_modules": list(self.exclude_modules),
        }

    def to_dict(self) -> Dict[str, Any]:
        """All fields (for logs and tests)."""
        return asdict(self)


def _modelopt_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """ModelOpt's nested hf_quant_config.json keeps the fields under "quantization"."""
    nested = config.get("quantization")
    return nested if isinstance(nested, Mapping) else config


def _from_modelopt(config: Mapping[str, Any]) -> QuadsSettings:
    section = _modelopt_section(config)
    algo = str(section.get("quant_algo") or "").upper()
    if algo not in MODELOPT_NVFP4_ALGOS:
        raise ValueError(f"quantization_config: --quantization quads reads ModelOpt NVFP4 "
                         f"checkpoints (quant_algo one of {sorted(MODELOPT_NVFP4_ALGOS)}), got "
                         f"quant_algo {section.get('quant_algo')!r}")
    exclude = section.get("exclude_modules", section.get("ignore",
                                                         section.get("modules_to_not_convert")))
    return QuadsSettings(
        activation_mode=MODELOPT_NVFP4_ALGOS[algo],
        activation_scaling="static",
        rac_num_channels=0,
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


def parse_quantization_config(config: Mapping[str, Any], env: Optional[Mapping[str, str]] = None
                              ) -> QuadsSettings:
    """QuadsSettings from a config.json `quantization_config` or an hf_quant_config.json dict.

    `env` (default os.environ) supplies the QUADS_* overrides.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"quantization_config: expected a JSON object, got {type(config).__name__}")
    if isinstance(config.get(QUANT_METHOD), Mapping):
        # hf_quant_config.json of a QUADS export: the ModelOpt summary plus the full quads block
        config = config[QUANT_METHOD]
    method = str(config.get("quant_method", "")).lower()
    if method == QUANT_METHOD:
        try:
            settings = QuadsSettings(
                activation_mode=config.get("activation_mode", "w4a4_rac"),
                activation_scaling=config.get("activation_scaling", "per_token"),
                rac_num_channels=config.get("rac_num_channels", 0),
                exclude_modules=list(config.get("exclude_modules", config.get("ignore", []))),
                group_size=config.get("group_size", GROUP_SIZE),
                weight_format=str(config.get("quant_algo", WEIGHT_FORMAT)),
                rac_index_tensor=config.get("rac_index_tensor", COMP_INDEX_TENSOR),
            )
        except TypeError as e:
            raise ValueError(f"quantization_config: malformed quads config: {e}") from None
    elif is_modelopt_nvfp4(config):
        settings = _from_modelopt(config)
    else:
        raise ValueError(f"quantization_config: expected quant_method 'quads' or a ModelOpt NVFP4 "
                         f"config, got quant_method {config.get('quant_method')!r} / quant_algo "
                         f"{_modelopt_section(config).get('quant_algo')!r}")
    return apply_env_overrides(settings, os.environ if env is None else env)


def apply_env_overrides(settings: QuadsSettings, env: Mapping[str, str]) -> QuadsSettings:
    """Apply QUADS_ACTIVATION_MODE / QUADS_ACTIVATION_SCALING / QUADS_RAC_NUM_CHANNELS."""
    fields = settings.to_dict()
    if env.get(ENV_ACTIVATION_MODE):
        fields["activation_mode"] = env[ENV_ACTIVATION_MODE]
    if env.get(ENV_ACTIVATION_SCALING):
        fields["activation_scaling"] = env[ENV_ACTIVATION_SCALING]
    if env.get(ENV_RAC_NUM_CHANNELS):
        try:
            fields["rac_num_channels"] = int(env[ENV_RAC_NUM_CHANNELS])
        except ValueError:
            raise ValueError(f"{ENV_RAC_NUM_CHANNELS}: expected an integer, got "
                             f"{env[ENV_RAC_NUM_CHANNELS]!r}") from None
    return QuadsSettings(**fields)
