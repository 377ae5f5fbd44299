"""Name every parameter of a live Megatron GPTModel by its global (layer, expert) Qwen3-MoE rule."""

import dataclasses
import re

import torch

from quads_megatron.models import qwen3_moe
from quads_megatron.errors import CheckpointError

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_TE_EXPERT_RE = re.compile(r"^(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


@dataclasses.dataclass
class ParamRef:
    """One local parameter with its place in the global model."""

    local_name: str
    param: torch.Tensor
    rule: qwen3_moe.Rule
    layer: int | None
    expert: int | None      # global expert index

    @property
    def global_name(self) -> str:
        return qwen3_moe.megatron_name(self.rule, self.layer, self.expert)


def unwrap(model):
    """The GPTModel inside DDP / Float16Module / other ``.module`` wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def parallel_info() -> dict:
    """This rank's dense-TP, expert-TP and EP ranks and sizes (1-process defaults when uninitialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(tp_rank=0, tp_size=1, etp_rank=0, etp_size=1, ep_rank=0, ep_size=1, pp_size=1)
    return dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
    )


def _num_local_experts(model) -> int:
    config = unwrap(model).config
    info = parallel_info()
    return (config.num_moe_experts or 0) // info["ep_size"]


def global_param_refs(model) -> list:
    """Every parameter of ``model`` as a ParamRef (global layer from ``layer_number``, global expert
    from the EP rank), in a deterministic order shared by all ranks; unknown names raise."""
    gpt = unwrap(model)
    layer_numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
    num_local = _num_local_experts(gpt)
    ep_rank = parallel_info()["ep_rank"]
    refs = []
    for local_name, param in gpt.named_parameters():
        name = local_name
        m = _LAYER_RE.match(name)
        if m:
            rest = m.group(2)
            e = _LOCAL_EXPERT_RE.match(rest) or _TE_EXPERT_RE.match(rest)
            if e:
                glob = ep_rank * num_local + int(e.group(2))
                rest = f"{e.group(1)}{glob}{e.group(3) if e.lastindex == 3 else ''}"
            name = f"decoder.layers.{layer_numbers[m.group(1)]}.{rest}"
        found = qwen3_moe.match_megatron(name)
        if found is None:
            raise CheckpointError(f"Megatron parameter {local_name} (global name {name}) has no "
                                  "Qwen3-MoE Hugging Face counterpart in quads_megatron.models.qwen3_moe")
        rule, layer, expert = found
        refs.append(ParamRef(local_name, param, rule, layer, expert))
    return refs


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron-LM's vocabulary padding: up to a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
