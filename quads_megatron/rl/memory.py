"""The memory a GRPO run needs, estimated from its flags before anything is built.

A run whose estimate exceeds the memory of the device it runs on is a ConfigError naming the flag that
dominates (``--seq-length`` for the rollout KV cache, the model's size flags for the weights), with the
estimate and what is available, instead of an allocation that grows until the process is killed.  The
estimate is a lower bound: the trainer's weights, gradients and Adam moments, the local engine's weights,
its static KV cache (one per batch size: the rollout batch and the pass@1 set) and the GQA-expanded keys
and values of one layer's attention; activations of the trainer's own steps are not counted.
"""

from __future__ import annotations

import math
import os

EVAL_BATCH = 64        # the tasks' held-out set (tasks.*Task eval_size): the engine's second decoder
_GIB = 2**30


def available_memory() -> tuple[int, str]:
    """``(bytes, where)``: this rank's GPU's total memory when CUDA works, else the host's MemAvailable."""
    import torch

    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        props = torch.cuda.get_device_properties(index)
        return props.total_memory, f"GPU {index} ({props.name})"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"


def estimate(args, dims, *, on_gpu: bool) -> dict:
    """``{part: bytes}`` of one rank of the run ``args`` (parsed flags) for a model of ``dims``."""
    from quads_megatron.models import qwen3_moe

    params = qwen3_moe.param_count(dims)
    tp = args.tensor_model_parallel_size
    world = max(1, int(os.environ.get("WORLD_SIZE", 1)))
    dp = max(1, world // tp)
    parts = {"trainer weights, gradients and Adam moments": params * (8 if args.bf16 else 16) // world}
    if args.rollout_engine == "local":
        elem = 2 if on_gpu else 4     # the engine's dtype: BF16 on a GPU, FP32 on the CPU
        batches = [math.ceil(args.rollout_batch_size * args.n_samples_per_prompt / dp), math.ceil(EVAL_BATCH / dp)]
        kv_per_token = dims.num_layers * 2 * dims.num_kv_heads * dims.head_dim * elem + 8   # + the padding mask
        parts["local engine weights"] = params * elem
        parts["rollout KV cache"] = sum(batches) * kv_per_token * args.seq_length
        parts["attention keys/values expanded to all heads"] = \
            max(batches) * dims.num_heads * (2 * dims.head_dim * elem + 4) * args.seq_length
    return parts


def check_memory(args, dims) -> None:
    """ConfigError when the estimate of ``args`` exceeds this machine's memory, naming the dominant flag."""
    import torch

    parts = estimate(args, dims, on_gpu=torch.cuda.is_available())
    need = sum(parts.values())
    have, where = available_memory()
    if need <= have:
        return
    weights = parts["trainer weights, gradients and Adam moments"] + parts.get("local engine weights", 0)
    per_token = (need - weights) / args.seq_length
    if weights >= need - weights:
        sizes = "".join(f" --{f.replace('_', '-')} {getattr(args, f)}" for f in ("num_layers", "hidden_size",
                                                                                  "num_experts")
                        if getattr(args, f, None) is not None)
        source = f"--hf-checkpoint {args.hf_checkpoint}" if args.hf_checkpoint else f"--preset {args.preset}"
        flag = f"{source}{sizes} ({dims.num_layers} layers, {dims.num_experts} experts)"
        advice = "choose a smaller model or spread it over more ranks"
    else:
        flag = f"--seq-length {args.seq_length}"
        advice = (f"each position costs {per_token / 1024:,.0f} KiB here: lower --seq-length, --rollout-batch-size "
                  "or --n-samples-per-prompt")
    shown = ", ".join(f"{k} {v / _GIB:,.1f} GiB" for k, v in parts.items() if v >= need / 100)
    from quads_megatron.errors import ConfigError

    raise ConfigError(f"{flag}: this run needs at least {need / _GIB:,.1f} GiB ({shown}), more than the "
                      f"{have / _GIB:,.1f} GiB of {where}; {advice}")
