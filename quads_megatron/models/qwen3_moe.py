"""Qwen3-MoE name/layout table between Hugging Face (``Qwen3MoeForCausalLM``) and Megatron-Core.

Why our own table: Megatron-Bridge (newest for Python 3.11: 0.3.1) pulls CUDA-only packages,
needs transformers 4.x and fails Megatron -> HF for SequentialMLP experts; mbridge 0.15.1
hard-codes the TE layer spec and grouped GEMM and breaks on transformers 5 (see
the conversion-bridges note of the project).  Neither runs on CPU with megatron-core 0.16.1 +
transformers 5.19, so -- as slime does -- this module keeps one small, data-like table per
architecture that a bridge can replace later.

Layouts (checked against megatron-core 0.16.1 ``SelfAttention.get_query_key_value_tensors``):
* ``linear_qkv.weight`` is interleaved per query group: for each of the ``ng`` KV groups,
  its ``np/ng`` query heads, then its key head, then its value head (rows of ``head_dim``).
  HF query head ``h`` belongs to group ``h // (np/ng)`` (``repeat_kv``).  TP splits the whole
  interleaved tensor into contiguous row chunks.
* ``linear_fc1.weight`` of an expert (SwiGLU) is ``[gate; up]`` = ``[2F, H]``; TP rank ``r``
  holds ``[gate_r; up_r]`` (each half chunked), not a contiguous chunk of the whole.
* Row-parallel ``linear_proj`` / ``linear_fc2`` split dim 1; embedding and output layer split
  the (possibly padded) vocabulary, dim 0; norms and the router are replicated.
HF names are the on-disk ones (``save_pretrained`` writes per-expert ``experts.N.*_proj``
even though transformers 5 keeps experts fused in memory).
"""

import dataclasses
import re

import torch

from quads_megatron.errors import CheckpointError, ConfigError

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_moe"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of."""

    megatron: str            # template; {layer} = global layer, {expert} = global expert
    hf: tuple                # HF templates, in the order the layout stacks them
    layout: str              # "copy" | "qkv" | "gate_up" | "vocab"
    split_dim: int | None    # dim sharded across tensor parallelism (None: replicated)
    expert: bool = False     # sharded by expert TP / EP instead of dense TP


_L = "model.layers.{layer}."
_ML = "decoder.layers.{layer}."
_EXP = _L + "mlp.experts.{expert}."
RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", 0),
    Rule(_ML + "input_layernorm.weight", (_L + "input_layernorm.weight",), "copy", None),
    Rule(_ML + "self_attention.linear_qkv.weight",
         (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
         "qkv", 0),
    Rule(_ML + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "copy", 1),
    Rule(_ML + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), "copy", None),
    Rule(_ML + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), "copy", None),
    Rule(_ML + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), "copy", None),
    Rule(_ML + "mlp.router.weight", (_L + "mlp.gate.weight",), "copy", None),
    Rule(_ML + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
         (_EXP + "gate_proj.weight", _EXP + "up_proj.weight"), "gate_up", 0, expert=True),
    Rule(_ML + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
         (_EXP + "down_proj.weight",), "copy", 1, expert=True),
)

# Transformer Engine spec spellings -> the local-spec names above.
TE_ALIASES = {
    _ML + "self_attention.linear_qkv.layer_norm_weight": _ML + "input_layernorm.weight",
    _ML + "mlp.experts.linear_fc1.weight{expert}": _ML + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
    _ML + "mlp.experts.linear_fc2.weight{expert}": _ML + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
}


def _template_regex(template: str):
    pattern = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(pattern + "$")


_MEGATRON_RES = [(_template_regex(r.megatron), r) for r in RULES]
_ALIAS_RES = [(_template_regex(alias), canonical) for alias, canonical in TE_ALIASES.items()]


def canonical_megatron_name(name: str) -> str:
    """Map a TE-spec parameter name onto the local-spec name used in ``RULES``."""
    for regex, canonical in _ALIAS_RES:
        m = regex.match(name)
        if m:
            return canonical.format(**m.groupdict())
    return name


def match_megatron(name: str):
    """``(rule, layer, expert)`` for a (global-index) Megatron name, or None when not in the table."""
    name = canonical_megatron_name(name)
    for regex, rule in _MEGATRON_RES:
        m = regex.match(name)
        if m:
            groups = m.groupdict()
            return rule, _int(groups.get("layer")), _int(groups.get("expert"))
    return None


def _int(value):
    return None if value is None else int(value)


def hf_names(rule: Rule, layer=None, expert=None) -> list:
    return [t.format(layer=layer, expert=expert) for t in rule.hf]


def megatron_name(rule: Rule, layer=None, expert=None) -> str:
    return rule.megatron.format(layer=layer, expert=expert)


# ---------------------------------------------------------------- the HF config


@dataclasses.dataclass(frozen=True)
class Dims:
    """The architecture numbers every layout transform needs, read from an HF config dict."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    moe_ffn: int
    tie_word_embeddings: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


_REQUIRED = object()


def _int_field(cfg: dict, key: str, source: str, default=_REQUIRED, minimum: int = 1) -> int:
    """``cfg[key]`` as a real int >= ``minimum`` (a string, float or bool is refused, not converted)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{source}: missing field {key!r}")
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: {key} must be an integer, found {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{source}: {key} must be >= {minimum}, found {value}")
    return value


def _float_field(cfg: dict, key: str, source: str, default: float, positive: bool = False) -> float:
    """``cfg[key]`` as a finite float (an int is fine; a string or bool is refused, not converted)."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            value in (float("inf"), float("-inf")):
        raise ConfigError(f"{source}: {key} must be a finite number, found {value!r} ({type(value).__name__})")
    if positive and value <= 0:
        raise ConfigError(f"{source}: {key} must be > 0, found {value}")
    return float(value)


def _bool_field(cfg: dict, key: str, source: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, found {value!r} ({type(value).__name__})")
    return value


def check_scalar_fields(cfg: dict, source: str = "config.json") -> None:
    """The non-shape fields the converters and the trainer read (norm epsilon, RoPE, router options,
    positions): each of the type it must have, or a ConfigError naming it."""
    _float_field(cfg, "rms_norm_eps", source, 1e-6, positive=True)
    _float_field(cfg, "router_aux_loss_coef", source, 1e-3)
    _bool_field(cfg, "norm_topk_prob", source)
    if cfg.get("intermediate_size") is not None:
        _int_field(cfg, "intermediate_size", source)
    if cfg.get("max_position_embeddings") is not None:
        _int_field(cfg, "max_position_embeddings", source)
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object, found {params!r}")
    _float_field(params or {}, "rope_theta", f"{source} rope_parameters", 10000.0, positive=True)
    _float_field(cfg, "rope_theta", source, 10000.0, positive=True)


def param_count(dims: "Dims") -> int:
    """Parameters of the model ``dims`` describes (embedding, output layer unless tied, attention, norms,
    router, experts): what building it allocates, before any activation."""
    H, D, F, E = dims.hidden_size, dims.head_dim, dims.moe_ffn, dims.num_experts
    attention = (dims.num_heads + 2 * dims.num_kv_heads) * D * H + H * dims.num_heads * D + 2 * D
    per_layer = attention + 2 * H + E * H + E * 3 * F * H
    vocab = dims.vocab_size * H * (1 if dims.tie_word_embeddings else 2)
    return vocab + H + dims.num_layers * per_layer


def hf_top_k(cfg: dict, source: str = "config.json") -> int:
    """``num_experts_per_tok``: an int in [1, number of experts]."""
    dims_from_hf_config(cfg, source)   # the range check against the experts
    return _int_field(cfg, "num_experts_per_tok", source)


def dims_from_hf_config(cfg: dict, source: str = "config.json") -> Dims:
    """Validate that ``cfg`` (config.json, named ``source`` in errors) is a Qwen3-MoE this table covers:
    every size a positive int (not a string), ``num_experts_per_tok`` within the experts; read its numbers."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: expected a JSON object, found {type(cfg).__name__}")
    if cfg.get("model_type") != HF_MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type {cfg.get('model_type')!r}, expected {HF_MODEL_TYPE!r}")
    arch = cfg.get("architectures") or [HF_ARCHITECTURE]
    if not isinstance(arch, list) or HF_ARCHITECTURE not in arch:
        raise CheckpointError(f"{source}: architectures {arch}, expected {HF_ARCHITECTURE}")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"{source}: dense (mlp_only_layers / decoder_sparse_step != 1) Qwen3-MoE "
                              "layers are not supported by this converter")
    if cfg.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true is not supported (Qwen3-MoE has none)")
    experts_key = "num_experts" if "num_experts" in cfg or "num_local_experts" not in cfg else "num_local_experts"
    heads = _int_field(cfg, "num_attention_heads", source)
    hidden = _int_field(cfg, "hidden_size", source)
    head_dim = _int_field(cfg, "head_dim", source) if cfg.get("head_dim") is not None else None
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"{source}: no head_dim and hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads}")
        head_dim = hidden // heads
    tie = _bool_field(cfg, "tie_word_embeddings", source)
    check_scalar_fields(cfg, source)
    dims = Dims(
        vocab_size=_int_field(cfg, "vocab_size", source), hidden_size=hidden,
        num_layers=_int_field(cfg, "num_hidden_layers", source), num_heads=heads,
        num_kv_heads=_int_field(cfg, "num_key_value_heads", source, default=heads),
        head_dim=head_dim, num_experts=_int_field(cfg, experts_key, source),
        moe_ffn=_int_field(cfg, "moe_intermediate_size", source), tie_word_embeddings=tie,
    )
    if dims.num_heads % dims.num_kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads={dims.num_heads} is not a multiple of "
                              f"num_key_value_heads={dims.num_kv_heads}")
    if "num_experts_per_tok" in cfg:
        top_k = _int_field(cfg, "num_experts_per_tok", source)
        if top_k > dims.num_experts:
            raise CheckpointError(f"{source}: num_experts_per_tok={top_k} is larger than {experts_key}="
                                  f"{dims.num_experts}")
    return dims


def dims_from_megatron_config(config, vocab_size: int, tie_word_embeddings: bool = False) -> Dims:
    """``Dims`` of a Megatron-Core ``TransformerConfig`` (``vocab_size``: the HF, unpadded, vocabulary)."""
    return Dims(
        vocab_size=int(vocab_size), hidden_size=config.hidden_size, num_layers=config.num_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels, num_experts=config.num_moe_experts or 0,
        moe_ffn=config.moe_ffn_hidden_size or 0, tie_word_embeddings=bool(tie_word_embeddings))


def hf_shapes(dims: Dims) -> dict:
    """``{HF name: shape}`` of every tensor a checkpoint with this config must hold."""
    H, D, F = dims.hidden_size, dims.head_dim, dims.moe_ffn
    per_layer = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (dims.num_heads * D, H), "self_attn.k_proj.weight": (dims.num_kv_heads * D, H),
        "self_attn.v_proj.weight": (dims.num_kv_heads * D, H), "self_attn.o_proj.weight": (H, dims.num_heads * D),
        "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
        "mlp.gate.weight": (dims.num_experts, H),
    }
    per_expert = {"gate_proj.weight": (F, H), "up_proj.weight": (F, H), "down_proj.weight": (H, F)}
    shapes = {"model.embed_tokens.weight": (dims.vocab_size, H), "model.norm.weight": (H,)}
    if not dims.tie_word_embeddings:
        shapes["lm_head.weight"] = (dims.vocab_size, H)
    for layer in range(dims.num_layers):
        shapes.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})
        for e in range(dims.num_experts):
            shapes.update({f"model.layers.{layer}.mlp.experts.{e}.{k}": v for k, v in per_expert.items()})
    return shapes


def iter_rule_instances(dims: Dims):
    """Every ``(rule, layer, expert)`` of a model, in HF checkpoint order (by layer, then expert)."""
    for rule in RULES[:3]:
        if rule.megatron == "output_layer.weight" and dims.tie_word_embeddings:
            continue
        yield rule, None, None
    for layer in range(dims.num_layers):
        for rule in RULES[3:]:
            if rule.expert:
                for e in range(dims.num_experts):
                    yield rule, layer, e
            else:
                yield rule, layer, None


def megatron_config_kwargs(cfg: dict) -> dict:
    """TransformerConfig fields (for ``presets.qwen3_moe_config``) that reproduce an HF config."""
    dims = dims_from_hf_config(cfg)
    return dict(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size,
        ffn_hidden_size=int(cfg.get("intermediate_size") or 4 * dims.hidden_size),
        num_attention_heads=dims.num_heads, num_query_groups=dims.num_kv_heads, kv_channels=dims.head_dim,
        num_moe_experts=dims.num_experts, moe_router_topk=hf_top_k(cfg),
        moe_ffn_hidden_size=dims.moe_ffn, layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        # norm_topk_prob: top-k then softmax (= renormalised) vs softmax over all, then top-k.
        moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 1e-3)),
    )


def rope_theta(cfg: dict) -> float:
    """RoPE base of an HF config (transformers 5 ``rope_parameters`` or the older ``rope_theta``)."""
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise CheckpointError(f"config.json: rope_type {params['rope_type']!r} is not supported (only default)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


# ---------------------------------------------------------------- layout transforms (full tensors)


def to_megatron(rule: Rule, hf: list, dims: Dims, rows: int | None = None) -> torch.Tensor:
    """Build the full (unsharded) Megatron tensor of ``rule`` from its HF tensors.

    ``rows`` pads a vocabulary tensor with zero rows up to Megatron's padded vocabulary.
    """
    if rule.layout == "copy":
        return hf[0]
    if rule.layout == "vocab":
        t = hf[0]
        if rows is not None and rows > t.shape[0]:
            t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
        return t
    if rule.layout == "gate_up":
        return torch.cat(hf, dim=0)
    if rule.layout == "qkv":
        q, k, v = hf
        ng, D, H = dims.num_kv_heads, dims.head_dim, q.shape[-1]
        q = q.reshape(ng, dims.heads_per_group * D, H)
        return torch.cat([q, k.reshape(ng, D, H), v.reshape(ng, D, H)], dim=1).reshape(-1, H)
    raise ValueError(f"unknown layout {rule.layout!r}")


def to_hf(rule: Rule, full: torch.Tensor, dims: Dims) -> list:
    """Split a full Megatron tensor of ``rule`` into its HF tensors (inverse of ``to_megatron``)."""
    if rule.layout == "copy":
        return [full]
    if rule.layout == "vocab":
        return [full[: dims.vocab_size]]
    if rule.layout == "gate_up":
        return list(full.chunk(2, dim=0))
    if rule.layout == "qkv":
        ng, D, H = dims.num_kv_heads, dims.head_dim, full.shape[-1]
        grouped = full.reshape(ng, (dims.heads_per_group + 2) * D, H)
        q, k, v = grouped.split([dims.heads_per_group * D, D, D], dim=1)
        return [q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]
    raise ValueError(f"unknown layout {rule.layout!r}")


def shard(rule: Rule, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The piece of a full Megatron tensor that tensor-parallel rank ``rank`` of ``size`` holds."""
    if rule.split_dim is None or size == 1:
        return full
    if full.shape[rule.split_dim] % size:
        raise CheckpointError(f"{rule.megatron}: dim {rule.split_dim} of shape {list(full.shape)} "
                              f"does not split over {size} tensor-parallel ranks")
    if rule.layout == "gate_up":
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim=rule.split_dim)[rank]


def unshard(rule: Rule, pieces: list) -> torch.Tensor:
    """Reassemble the full Megatron tensor from every tensor-parallel rank's piece (inverse of ``shard``)."""
    if rule.split_dim is None or len(pieces) == 1:
        return pieces[0]
    if rule.layout == "gate_up":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=rule.split_dim)
