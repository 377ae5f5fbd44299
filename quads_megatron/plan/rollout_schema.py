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
semantics), W4A16 for ``W4A16_NVFP4``, RAC off.  The checkpoint is the only switch: no
environment variable or server flag changes precision, RAC width or scaling (a server flag
that names another quantization method than the checkpoint's is a ``ConfigError``,
``check_server_quantization``).

Every bad field is a ``CheckpointError`` naming the file and the field (``config.json
quantization_config.rac_channels: ...``): wrong types, unknown values, unknown quads keys, a
flat config without ``quant_method``, a ``quads`` block that is not ``quant_method: "quads"``,
an ``exclude_modules`` string (refused, not read as a list of one: write ``["lm_head"]``), a
``rac_index_tensor`` other than ``input_comp_index`` (the only name the loader reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from quads_megatron import vocab
from quads_megatron.errors import CheckpointError, ConfigError
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.plan.layout import COMP_INDEX
from quads_megatron.vocab import ActivationScaling, Precision

QUANT_METHOD = "quads"
WEIGHT_FORMAT = "NVFP4"
COMP_INDEX_TENSOR = COMP_INDEX
MODELOPT_NVFP4_ALGOS = {"NVFP4": Precision.W4A4, "W4A16_NVFP4": Precision.W4A16}
MODELOPT_METHODS = ("modelopt", "modelopt_fp4")
DEFAULT_ORIGIN = "quantization_config"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class RolloutQuantConfig:
    """What a rollout engine needs to know about a checkpoint's NVFP4 layers (module docstring)."""

    precision: Precision = Precision.W4A4_RAC
    activation_scaling: ActivationScaling = ActivationScaling.PER_TOKEN
    rac_channels: int = 0
    exclude_modules: List[str] = field(default_factory=list)
    group_size: int = BLOCK_SIZE
    weight_format: str = WEIGHT_FORMAT
    rac_index_tensor: str = COMP_INDEX_TENSOR
    source: str = QUANT_METHOD  # "quads" or "modelopt": which checkpoint format was read
    origin: str = field(default=DEFAULT_ORIGIN, compare=False, repr=False)  # "<file> <section>" for errors

    def __post_init__(self) -> None:
        self.precision = self._enum(vocab.parse_precision, self.precision, "precision")
        self.activation_scaling = self._enum(vocab.parse_scaling, self.activation_scaling, "activation_scaling")
        self.validate()

    def _enum(self, parse, value, name: str):
        """Parse an enum field; an unknown value or a non-string is a CheckpointError naming the field."""
        try:
            return parse(value, f"{self.origin}.{name}")
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def _fail(self, name: str, message: str) -> None:
        raise CheckpointError(f"{self.origin}.{name}: {message}")

    def validate(self) -> None:
        """Raise a CheckpointError naming the field for anything outside what the kernels support."""
        if not isinstance(self.weight_format, str) or self.weight_format.upper() != WEIGHT_FORMAT:
            self._fail("quant_algo", f"expected {WEIGHT_FORMAT!r}, got {self.weight_format!r}")
        if not _is_int(self.group_size) or self.group_size != BLOCK_SIZE:
            self._fail("group_size", f"NVFP4 uses the integer {BLOCK_SIZE}, got {self.group_size!r}")
        if not self.precision.quantizes_weights:
            self._fail("precision", f"{self.precision.value!r} has no NVFP4 weights, so it is not a quantized "
                                    "checkpoint (drop quantization_config, or use w4a16 / w4a4 / w4a4_rac)")
        k = self.rac_channels
        if not _is_int(k) or k < 0 or k % BLOCK_SIZE:
            self._fail("rac_channels", f"expected an integer multiple of {BLOCK_SIZE} >= 0, got {k!r}")
        if self.precision.uses_rac and k == 0:
            self._fail("rac_channels", "precision 'w4a4_rac' needs rac_channels > 0 (and input_comp_index "
                                       "tensors in the checkpoint), got 0")
        if isinstance(self.exclude_modules, str):
            self._fail("exclude_modules", f"expected a list of module name patterns, got the string "
                                          f"{self.exclude_modules!r} (write [{self.exclude_modules!r}])")
        if not isinstance(self.exclude_modules, list) or not all(isinstance(m, str) for m in self.exclude_modules):
            self._fail("exclude_modules", f"expected a list of module name patterns, got {self.exclude_modules!r}")
        if self.rac_index_tensor != COMP_INDEX_TENSOR:
            self._fail("rac_index_tensor", f"the quads loader reads RAC channels from tensors named "
                                           f"{COMP_INDEX_TENSOR!r} only, got {self.rac_index_tensor!r}")

    def check_input_size(self, k_in: int, layer: str) -> None:
        """rac_channels must fit the input of every RAC layer (k <= K): CheckpointError naming the layer."""
        if self.uses_rac and self.rac_channels > k_in:
            self._fail("rac_channels", f"{self.rac_channels} exceeds the {k_in} input channels of {layer}")

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


def _is_nested(config: Mapping[str, Any]) -> bool:
    return isinstance(config.get("quantization"), Mapping)


def _from_modelopt(config: Mapping[str, Any], origin: str) -> RolloutQuantConfig:
    section = _modelopt_section(config)
    where = f"{origin}.quantization" if _is_nested(config) else origin
    algo = section.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_NVFP4_ALGOS:
        raise CheckpointError(f"{where}.quant_algo: --quantization quads reads ModelOpt NVFP4 checkpoints "
                              f"(one of {sorted(MODELOPT_NVFP4_ALGOS)}), got {algo!r}")
    keys = [k for k in ("exclude_modules", "ignore", "modules_to_not_convert") if k in section]
    exclude = section[keys[0]] if keys else []
    if exclude is None:
        exclude = []
    return RolloutQuantConfig(
        precision=MODELOPT_NVFP4_ALGOS[algo.upper()],
        activation_scaling=ActivationScaling.STATIC,
        rac_channels=0,
        exclude_modules=exclude if not isinstance(exclude, (list, tuple)) else list(exclude),
        group_size=section.get("group_size", BLOCK_SIZE),
        source="modelopt",
        origin=where,
    )


def is_modelopt_nvfp4(config: Optional[Mapping[str, Any]]) -> bool:
    """True for a ModelOpt NVFP4 quantization config (flat with a modelopt quant_method, nested, or SGLang-parsed)."""
    if not config or not isinstance(config, Mapping):
        return False
    section = _modelopt_section(config)
    algo = section.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_NVFP4_ALGOS:
        return False
    method = config.get("quant_method")
    if method is None:
        return _is_nested(config)  # ModelOpt's hf_quant_config.json names no quant_method
    return isinstance(method, str) and method.lower() in MODELOPT_METHODS


_QUADS_KEYS = {"quant_method", "quant_algo", "group_size", "precision", "activation_scaling",
               "rac_channels", "rac_index_tensor", "exclude_modules", "producer", "recipe",
               "calibration"}


def _from_quads(config: Mapping[str, Any], origin: str) -> RolloutQuantConfig:
    unknown = sorted(set(config) - _QUADS_KEYS)
    if unknown:
        raise CheckpointError(f"{origin}: unknown quads keys {unknown} (written by another version? "
                              f"known: {sorted(_QUADS_KEYS)})")
    if "precision" not in config:
        raise CheckpointError(f"{origin}.precision: missing (quant_method 'quads' needs one of w4a16, w4a4, w4a4_rac)")
    return RolloutQuantConfig(
        precision=config["precision"],
        activation_scaling=config.get("activation_scaling", ActivationScaling.PER_TOKEN.value),
        rac_channels=config.get("rac_channels", 0),
        exclude_modules=config.get("exclude_modules", []),
        group_size=config.get("group_size", BLOCK_SIZE),
        weight_format=config.get("quant_algo", WEIGHT_FORMAT),
        rac_index_tensor=config.get("rac_index_tensor", COMP_INDEX_TENSOR),
        origin=origin,
    )


def parse_quantization_config(config: Mapping[str, Any], origin: str = DEFAULT_ORIGIN) -> RolloutQuantConfig:
    """RolloutQuantConfig from a config.json ``quantization_config`` or an hf_quant_config.json dict.

    ``origin`` names the file and section in errors (``"<dir>/config.json quantization_config"``).
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{origin}: expected a JSON object, got {type(config).__name__}")
    if QUANT_METHOD in config:
        # hf_quant_config.json of a QUADS export: the ModelOpt summary plus the full quads block
        config, origin = config[QUANT_METHOD], f"{origin}.{QUANT_METHOD}"
        if not isinstance(config, Mapping):
            raise CheckpointError(f"{origin}: expected a JSON object, got {type(config).__name__}")
        if config.get("quant_method") != QUANT_METHOD:
            raise CheckpointError(f"{origin}.quant_method: the quads block must say {QUANT_METHOD!r}, got "
                                  f"{config.get('quant_method')!r}")
    method = config.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise CheckpointError(f"{origin}.quant_method: expected a string, got {method!r}")
    if isinstance(method, str) and method.lower() == QUANT_METHOD:
        return _from_quads(config, origin)
    if is_modelopt_nvfp4(config) or (isinstance(method, str) and method.lower() in MODELOPT_METHODS):
        return _from_modelopt(config, origin)
    if method is None and not _is_nested(config):
        raise CheckpointError(f"{origin}.quant_method: missing (expected 'quads', or 'modelopt' with quant_algo "
                              f"NVFP4); refusing to guess the format")
    raise CheckpointError(f"{origin}.quant_method: expected 'quads' or a ModelOpt NVFP4 config, got "
                          f"quant_method {method!r} / quant_algo {_modelopt_section(config).get('quant_algo')!r}")


def checkpoint_method(config: Optional[Mapping[str, Any]]) -> Optional[str]:
    """What a checkpoint's quantization config says it is: "quads", "modelopt_fp4" (ModelOpt NVFP4, which the
    quads method serves as it is), another method's name, or None for an unquantized checkpoint."""
    if not config:
        return None
    method = config.get("quant_method") if isinstance(config, Mapping) else None
    if isinstance(method, str) and method.lower() == QUANT_METHOD:
        return QUANT_METHOD
    if isinstance(config, Mapping) and isinstance(config.get(QUANT_METHOD), Mapping):
        return QUANT_METHOD  # hf_quant_config.json of a QUADS export
    if is_modelopt_nvfp4(config):
        return "modelopt_fp4"
    if isinstance(method, str):
        return method.lower()
    algo = _modelopt_section(config).get("quant_algo") if isinstance(config, Mapping) else None
    return f"modelopt ({algo})" if algo is not None else "unknown"


def check_server_quantization(config: Optional[Mapping[str, Any]], flag: Optional[str],
                              origin: str = DEFAULT_ORIGIN) -> Optional[str]:
    """The method a server serves a checkpoint with: the checkpoint decides; an explicit ``--quantization``
    flag must agree with it.

    ``--quantization quads`` serves a QUADS or a ModelOpt NVFP4 checkpoint (the plan of a ModelOpt checkpoint
    is its own: W4A4, static input_scale, no RAC). Returns "quads" when the quads method serves it, None
    when the checkpoint is not ours and no quads flag was given. ConfigError naming both values for
    ``--quantization quads`` on another method's checkpoint (or an unquantized one), or another
    ``--quantization`` on a QUADS checkpoint.
    """
    method = checkpoint_method(config)
    if flag is not None and flag.lower() == QUANT_METHOD:
        if method in (QUANT_METHOD, "modelopt_fp4"):
            return QUANT_METHOD
        found = "no quantization_config (an unquantized checkpoint)" if method is None else f"quant_method {method!r}"
        raise ConfigError(f"--quantization {flag}: the checkpoint ({origin}) says {found}; the quads method "
                          f"serves QUADS or ModelOpt NVFP4 checkpoints (export one with quads-export-rollout)")
    if method == QUANT_METHOD:
        if flag is not None:
            raise ConfigError(f"--quantization {flag}: the checkpoint ({origin}) says quant_method 'quads'; its "
                              f"precision, RAC width and scaling come from the checkpoint, so drop the flag or "
                              f"pass --quantization quads")
        return QUANT_METHOD
    return None
