"""torch.distributed + Megatron parallel_state setup (gloo on CPU, NCCL on GPU), seeding and plain-optimizer grad sync."""

import datetime
import os

import torch
import torch.distributed as dist

from quads_megatron.megatron import cpu


def _init_process_group(backend):
    """Init the default process group from torchrun's env, or as a 1-process group otherwise."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def initialize_distributed(tp: int = 1, ep: int = 1, etp=None, pp: int = 1, seed: int = 1234,
                           backend=None):
    """Init torch.distributed and Megatron's model-parallel groups, patch for CPU, seed RNGs.

    Works under ``torchrun`` (reads RANK/WORLD_SIZE/MASTER_*) and in a single plain process.
    ``etp`` is the expert tensor-parallel size (None: same as ``tp``).  Re-initialising with
    another layout destroys the previous model-parallel groups first.  Seeds the CPU RNG and
    Megatron's tracker identically on every rank; ``model.build_gpt_model`` then gives each
    expert its own seed (CPU initialisation otherwise makes experts equal across EP ranks).
    """
    from megatron.core import parallel_state

    usable = cpu.cuda_usable()
    backend = backend or ("nccl" if usable else "gloo")
    if usable and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    _init_process_group(backend)
    cpu.setup_megatron_cpu()
    world = dist.get_world_size()
    if world % (tp * pp) or world % ((etp or tp) * ep * pp):
        raise ValueError(f"world size {world} is not divisible by tp={tp} x pp={pp} "
                         f"and by etp={etp or tp} x ep={ep} x pp={pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    seed_everything(seed)


def seed_everything(seed: int):
    """Same CPU seed on every rank + Megatron's TP/EP RNG tracker (model_parallel_cuda_manual_seed)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def sync_grads(model):
    """What Megatron's finalize_model_grads does, for a plain torch optimizer on an unwrapped model.

    Sums grads of sequence-parallel-tagged params (norms) over TP, then averages dense grads over
    the data-parallel group and expert grads (``allreduce=False``) over the expert-DP group.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    edp_group = parallel_state.get_expert_data_parallel_group()
    for param in model.parameters():
        if param.grad is None:
            continue
        if getattr(param, "sequence_parallel", False) and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(param.grad, group=tp_group)
        group = dp_group if getattr(param, "allreduce", True) else edp_group
        size = dist.get_world_size(group)
        if size > 1:
            dist.all_reduce(param.grad, group=group)
            param.grad /= size
