"""Megatron dist_checkpointing save/load of an AQAT model: master weights, optimizer state, recipe, loop state.

The one checkpoint path of the trainer, the GRPO loop and the converters:

* ``save_checkpoint(model, dir, optimizer)`` / ``load_checkpoint(model, dir, optimizer)``: one
  dist_checkpointing (torch_dist) directory.  AQAT leaves the Parameters unquantized, so the
  sharded state dict is Megatron's own (any TP/EP layout can load it); the recipe rides along as
  common (rank-0) state under ``quads_recipe`` as JSON, so a resumed run, the converters and the
  rollout side read the same description.  ``optimizer`` is a Megatron optimizer or a plain
  ``torch.optim`` one, whose per-parameter tensors (Adam's moments) are sharded like the
  parameters they belong to (Megatron's ``optimizer.state.<key>.<param>`` keys).
* ``save_iteration`` / ``load_iteration``: Megatron-LM's training-directory layout,
  ``{save}/iter_NNNNNNN/`` + the ``latest_checkpointed_iteration.txt`` tracker.  An iteration is
  written through ``quads_megatron.output_dir.atomic_output_dir`` (a hidden temporary, renamed once
  every rank finished; a killed run's temporary is removed by the next writer), then the tracker is
  replaced atomically (and never moved backwards), so a crash mid-save keeps the previous
  checkpoint.  Every directory we write gets ``quads_manifest.json`` (per-file SHA-256,
  ``quads_megatron.integrity``) before it becomes visible, and every load verifies it first.
  Extra common state (``common=``) and per-rank state (``rank_state=``, e.g.
  ``get_rng_state()``, one ShardedObject per rank) ride along.
* ``resolve_checkpoint_dir`` / ``load_common_state`` / ``load_recipe`` / ``load_model_state``:
  the reading side, shared with ``quads_megatron.convert.megatron_checkpoint``.

Every user-facing failure (missing or corrupt file, bad tracker, shapes that disagree with the
model) is a ``CheckpointError`` naming the file; Megatron's own exceptions do not surface raw.
"""

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from quads_megatron.output_dir import atomic_output_dir
from quads_megatron.errors import CheckpointError, Interrupted
from quads_megatron.integrity import PRODUCER, read_manifest, require_manifest, verify_manifest, write_manifest
from quads_megatron.megatron.aqat import quads_recipe, unwrap_model
from quads_megatron.megatron.cpu import cuda_to_cpu
from quads_megatron.megatron.dist_writer import no_orphan_writers
from quads_megatron.recipe import QuadsRecipe

TRACKER = "latest_checkpointed_iteration.txt"   # Megatron-LM's tracker file name
METADATA_JSON = "metadata.json"                 # dist_checkpointing's config (sharded_backend, ...)
RECIPE_KEY = "quads_recipe"
HF_CONFIG_KEY = "hf_config"     # config.json as JSON text (written by the converters and the GRPO loop)
META_KEY = "quads_checkpoint"   # layout, optimizer kind/keys, whether per-rank state was saved
RANK_STATE_KEY = "quads_rank_state"
PRODUCER_KEY = "quads_producer"  # integrity.PRODUCER: marks a checkpoint we wrote (its manifest is then required)
_RESERVED = {"model", "optimizer", RECIPE_KEY, META_KEY, RANK_STATE_KEY, PRODUCER_KEY}
# The distributed optimizer's default sharding fails on these versions
# ("flattened_range is not supported"); dp_reshardable works.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _layout() -> dict:
    """World size and Megatron parallel sizes: per-rank state only loads back into the same layout."""
    from megatron.core import parallel_state as ps

    layout = {"world_size": _world_size()}
    if ps.model_parallel_is_initialized():
        layout.update(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                      ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size())
    return layout


# ---------------------------------------------------------------- RNG state (per rank)

def get_rng_state() -> dict:
    """This rank's RNG states: torch CPU, CUDA (when present), Megatron's tracker, python, numpy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["megatron"] = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    except (ImportError, AttributeError):
        pass
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``get_rng_state()`` returned (on the same rank of the same layout)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["megatron"].items()})


# ---------------------------------------------------------------- plain torch.optim optimizers

def _torch_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _torch_state_keys(optimizer) -> list:
    """Per-parameter tensor state names (Adam: exp_avg, exp_avg_sq); ``step`` is kept apart."""
    keys = set()
    for p in _torch_params(optimizer):
        for k, v in optimizer.state.get(p, {}).items():
            if k != "step" and torch.is_tensor(v) and v.shape == p.shape:
                keys.add(k)
    return sorted(keys)


def _torch_optimizer_sharded(optimizer, model_sd, keys, *, loading: bool) -> dict:
    """{param index: {key: ShardedTensor}}: each state tensor sharded like its parameter."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor)

    params = _torch_params(optimizer)
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    missing = [i for i in range(len(params)) if i not in id_map]
    if missing:
        raise CheckpointError(f"optimizer parameters {missing[:5]} are not in the model's sharded_state_dict "
                         "(the optimizer must hold the model's own Parameters)")
    state = {}
    for i, p in enumerate(params):
        own = optimizer.state.get(p, {})
        state[i] = {}
        for k in keys:
            # a parameter that never stepped is saved as zeros: Adam's own lazy initial value
            t = torch.empty_like(p) if loading else own.get(k, torch.zeros_like(p))
            state[i][k] = make_sharded_optimizer_tensor(id_map[i], t.detach(), prefix=f"optimizer.state.{k}")
    return state


def _torch_steps(optimizer) -> list:
    return [optimizer.state.get(p, {}).get("step") for p in _torch_params(optimizer)]


def _load_torch_optimizer(optimizer, loaded_state, keys, steps, common_step) -> None:
    """Load the sharded tensors (+ per-parameter ``step``: this rank's own list when the layout is the
    same, else the common step) into a torch optimizer; parameters that never stepped stay stateless."""
    state = {}
    for i in range(len(_torch_params(optimizer))):
        step = steps[i] if steps is not None else common_step
        if step is None:
            continue
        state[i] = {k: loaded_state[i][k] for k in keys}
        state[i]["step"] = step.clone() if torch.is_tensor(step) else step
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


# ---------------------------------------------------------------- one dist_checkpointing directory

def _write(model, ckpt_dir, optimizer=None, metadata=None, common=None, rank_state=None):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    gpt = unwrap_model(model)
    recipe = quads_recipe(gpt)
    common = dict(common or {})
    if _RESERVED & set(common):
        raise ValueError(f"save_checkpoint: common keys {sorted(_RESERVED & set(common))} are reserved")
    rank_state = dict(rank_state or {})
    meta = {"layout": _layout(), "optimizer": None}
    with cuda_to_cpu():
        state = {"model": gpt.sharded_state_dict(), RECIPE_KEY: recipe.to_json() if recipe is not None else None,
                 PRODUCER_KEY: PRODUCER, **common}
        if isinstance(optimizer, torch.optim.Optimizer):
            keys, steps = _torch_state_keys(optimizer), _torch_steps(optimizer)
            meta["optimizer"] = {"kind": "torch", "keys": keys,
                                 "common_step": next((s for s in steps if s is not None), None)}
            if keys:
                state["optimizer"] = {"state": _torch_optimizer_sharded(optimizer, state["model"], keys,
                                                                        loading=False)}
            rank_state["optimizer_steps"] = steps
        elif optimizer is not None:
            meta["optimizer"] = {"kind": "megatron"}
            state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=metadata or OPTIMIZER_METADATA)
        meta["rank_state"] = bool(rank_state)
        if rank_state:
            state[RANK_STATE_KEY] = ShardedObject(RANK_STATE_KEY, rank_state, (_world_size(),), (_rank(),),
                                                  replica_id=0)
        state[META_KEY] = meta
        with no_orphan_writers():   # no Manager server, no writer outliving a killed or interrupted save
            dist_checkpointing.save(state, str(ckpt_dir))
    _barrier()  # every rank's shards are on disk before they are hashed
    if _rank() == 0:
        write_manifest(ckpt_dir)


def save_checkpoint(model, ckpt_dir, optimizer=None, metadata=None, *, common=None, rank_state=None):
    """Save ``model`` (GPTModel or wrapper), optionally its optimizer (Megatron or torch.optim), and the recipe.

    ``common``: extra picklable objects saved once (rank 0's); ``rank_state``: one object per rank.
    """
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):  # every rank: no rank left in a barrier
        raise CheckpointError(f"save_checkpoint: {ckpt_dir} exists and is not empty")
    _barrier()
    if _rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    _barrier()
    _write(model, ckpt_dir, optimizer, metadata, common, rank_state)
    _barrier()


def read_tracker(save_dir):
    """The tracker's iteration (int), ``"release"``, or None when ``save_dir`` has no tracker."""
    tracker = Path(save_dir) / TRACKER
    if not tracker.is_file():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{tracker}: unreadable ({e})") from None
    if text == "release":
        return text
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number (or 'release'), found {text[:40]!r}")
    return int(text)


def latest_iteration(save_dir):
    """Iteration named by the tracker of a save directory, or None when it holds no checkpoint yet."""
    it = read_tracker(save_dir)
    return it if isinstance(it, int) else None


def iteration_dir(save_dir, iteration) -> Path:
    """``{save_dir}/iter_NNNNNNN`` (Megatron-LM's name; ``release`` for the string "release")."""
    return Path(save_dir) / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def resolve_checkpoint_dir(path) -> Path:
    """The torch_dist directory itself, or the tracker's iteration of a Megatron-LM save directory (trainer,
    GRPO loop and converters); CheckpointError naming the directory, the tracker or ``metadata.json`` when
    one is missing or malformed, or when the checkpoint is not torch_dist (the only backend we read)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory {path}")
    it = read_tracker(path)
    if it is not None:
        tracker = path / TRACKER
        path = iteration_dir(path, it)
        if not path.is_dir():
            raise CheckpointError(f"{tracker} names iteration {it}, but {path} is missing")
    meta = path / METADATA_JSON
    if not meta.is_file():
        raise CheckpointError(f"{path}: not a Megatron dist_checkpointing checkpoint (no {METADATA_JSON}"
                              f"{'' if it is not None else f', no {TRACKER}'})")
    try:
        doc = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("sharded_backend") != "torch_dist":
        found = doc.get("sharded_backend") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"{meta}: expected a dist_checkpointing config with sharded_backend 'torch_dist', "
                              f"found {found!r}")
    return path


def verify_checkpoint(ckpt_dir) -> None:
    """Check the manifest of a checkpoint directory (sizes, SHA-256) before anything reads it; collective.
    A checkpoint without one is accepted only when nothing in it says we wrote it (``quads_evidence``).

    Under torch.distributed each rank hashes its share of the files and every rank raises the
    same CheckpointError, so no rank is left waiting in a collective.
    """
    ckpt_dir = Path(ckpt_dir)
    if not dist.is_initialized() or _world_size() == 1:
        verified = verify_manifest(ckpt_dir)
        check_files(ckpt_dir)
        if not verified:  # someone else's checkpoint, or ours with its manifest deleted
            require_manifest(ckpt_dir, quads_evidence(ckpt_dir, _load_common(ckpt_dir)))
        return
    error = None
    try:
        files = read_manifest(ckpt_dir)
        if files is not None:
            verify_manifest(ckpt_dir, only=sorted(files)[_rank()::_world_size()])
        check_files(ckpt_dir)
        if files is None:
            require_manifest(ckpt_dir, quads_evidence(ckpt_dir, _load_common(ckpt_dir)))
    except CheckpointError as e:
        error = str(e)
    errors = [None] * _world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def quads_evidence(ckpt_dir, common: dict) -> str | None:
    """What in a checkpoint's common state says we wrote it (keys ``quads_*``: producer, recipe, loop
    metadata), or None for someone else's checkpoint."""
    keys = sorted(k for k in common if isinstance(k, str) and k.startswith("quads_"))
    return f"{Path(ckpt_dir) / 'common.pt'} (keys {', '.join(keys)})" if keys else None


def _dcp_metadata(ckpt_dir: Path):
    """torch DCP's ``.metadata`` of a torch_dist checkpoint, unpickled restricted (``safe_load``); CheckpointError
    naming it when missing, corrupt, holding a class no checkpoint holds, or naming a shard outside the directory."""
    from quads_megatron.megatron.safe_load import read_dcp_metadata

    return read_dcp_metadata(ckpt_dir)


def check_files(ckpt_dir) -> None:
    """Before any read: common.pt, ``.metadata`` and every shard file it names exist and are long enough.

    This names the file for checkpoints without a manifest (written by someone else), where
    Megatron / torch DCP would otherwise fail with an unnamed exception deep inside the load.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "common.pt").is_file():
        raise CheckpointError(f"{ckpt_dir / 'common.pt'}: missing (the checkpoint's common state)")
    md = _dcp_metadata(ckpt_dir)
    need = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = ckpt_dir / rel
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {ckpt_dir / '.metadata'})")
        if f.stat().st_size < size:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {ckpt_dir / '.metadata'} needs at least {size} "
                                  "(truncated)")


def check_shapes(request: dict, ckpt_dir) -> None:
    """Every tensor the model (and optimizer) asks for is in the checkpoint with the same global shape."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = _dcp_metadata(Path(ckpt_dir)).state_dict_metadata
    for sh in nested_values(request):
        if not isinstance(sh, ShardedTensor) or getattr(sh, "allow_shape_mismatch", False):
            continue
        if sh.key not in stored:
            raise CheckpointError(f"{ckpt_dir}: holds no tensor {sh.key} (the model expects global shape "
                                  f"{tuple(sh.global_shape)}): a checkpoint of another model config?")
        size = tuple(getattr(stored[sh.key], "size", ()))
        if size != tuple(sh.global_shape):
            raise CheckpointError(f"{ckpt_dir}: {sh.key} has global shape {size} in the checkpoint, the model "
                                  f"expects {tuple(sh.global_shape)}: the model config disagrees with the checkpoint")


def _dist_call(what: str, ckpt_dir, fn, *a):
    """Run a dist_checkpointing read; a missing, truncated or corrupt file becomes a CheckpointError."""
    import pickle

    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException as TorchDCPException

    try:
        return fn(*a)
    except TorchDCPException as e:  # a BaseException; the first rank's own exception says what failed
        cause = next(iter(getattr(e, "failures", {}).values()), (e, None))[0]
        if isinstance(cause, CheckpointError):  # refused by safe_load: already names the file
            raise CheckpointError(str(cause)) from None
        text = str(cause).strip().splitlines()
        raise CheckpointError(f"{ckpt_dir}: {what}: {type(cause).__name__}: {text[0] if text else ''}") from None
    except CheckpointingException as e:
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{ckpt_dir}: {what}: {text[0] if text else type(e).__name__}") from None
    except (OSError, EOFError, pickle.UnpicklingError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt_dir}: {what}: missing, truncated or corrupt file "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    except RuntimeError as e:
        # torch.load / torch DCP on a damaged file: "PytorchStreamReader failed ...", "size mismatch", ...
        text = (str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]
        raise CheckpointError(f"{ckpt_dir}: {what}: {text}") from None


def _dist_load(what: str, ckpt_dir, request: dict) -> dict:
    """``dist_checkpointing.load`` with every pickle of the checkpoint read restricted (``safe_load``)."""
    from megatron.core import dist_checkpointing

    from quads_megatron.megatron.safe_load import safe_load_strategies

    return _dist_call(what, ckpt_dir, lambda: dist_checkpointing.load(request, str(ckpt_dir), **safe_load_strategies()))


def _load_common(ckpt_dir) -> dict:
    from quads_megatron.megatron.safe_load import load_common_state as load_common_restricted

    return load_common_restricted(ckpt_dir)


def load_common_state(ckpt_dir) -> dict:
    """The non-sharded (rank-0) objects of a checkpoint: ``quads_recipe``, ``hf_config``, ``common=`` extras;
    ``common.pt`` is checked against the manifest first, and a checkpoint of ours without one is refused."""
    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    files = read_manifest(ckpt_dir)
    if files is not None:
        verify_manifest(ckpt_dir, only=["common.pt"])
    common = _load_common(ckpt_dir)
    if files is None:
        require_manifest(ckpt_dir, quads_evidence(ckpt_dir, common))
    return common


def load_recipe(ckpt_dir):
    """The QuadsRecipe stored in a checkpoint (None for a checkpoint of a BF16 model)."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"load_recipe: no checkpoint directory {ckpt_dir}")
    return _stored_recipe(load_common_state(ckpt_dir), ckpt_dir)


def _stored_recipe(common: dict, ckpt_dir):
    """The recipe in a checkpoint's common state; CheckpointError when it is not a valid recipe."""
    text = common.get(RECIPE_KEY)
    if text is None:
        return None
    try:
        return QuadsRecipe.from_json(text)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt_dir}/common.pt: '{RECIPE_KEY}' is not a valid recipe ({e})") from None


def _apply_model_state(gpt, loaded: dict, ckpt_dir) -> None:
    missing, _ = gpt.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: tensors missing for the model: {missing[:5]}")


def load_model_state(model, ckpt_dir) -> Path:
    """Load only the weights (no recipe check, no optimizer) from a checkpoint of any TP/EP layout."""
    gpt = unwrap_model(model)
    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    with cuda_to_cpu():
        request = {"model": gpt.sharded_state_dict()}
        check_shapes(request, ckpt_dir)
        loaded = _dist_load("loading the model", ckpt_dir, request)
    _apply_model_state(gpt, loaded["model"], ckpt_dir)
    return ckpt_dir


def _read(model, ckpt_dir, optimizer=None, metadata=None) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from quads_megatron.megatron.aqat import post_optimizer_hook

    gpt = unwrap_model(model)
    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    common = _load_common(ckpt_dir)
    stored, mine = _stored_recipe(common, ckpt_dir), quads_recipe(gpt)
    if stored != mine:
        raise CheckpointError(f"load_checkpoint: {ckpt_dir} was saved with recipe {stored} but the "
                         f"model is converted with {mine}; apply_quads(model, load_recipe(dir)) "
                         "before loading")
    meta = common.get(META_KEY, {"optimizer": {"kind": "megatron"}})  # older checkpoints: Megatron's or none
    opt_meta = meta.get("optimizer") or {}
    is_torch = isinstance(optimizer, torch.optim.Optimizer)
    if optimizer is not None and opt_meta.get("kind") != ("torch" if is_torch else "megatron"):
        raise CheckpointError(f"load_checkpoint: {ckpt_dir} holds {opt_meta.get('kind') or 'no'} optimizer state, "
                         f"not a {'torch.optim' if is_torch else 'Megatron'} optimizer's")
    same_layout = meta.get("layout") == _layout()
    with cuda_to_cpu():
        request = {"model": gpt.sharded_state_dict()}
        if is_torch and opt_meta["keys"]:
            request["optimizer"] = {"state": _torch_optimizer_sharded(optimizer, request["model"], opt_meta["keys"],
                                                                      loading=True)}
        if meta.get("rank_state") and same_layout:
            request[RANK_STATE_KEY] = ShardedObject(RANK_STATE_KEY, None, (_world_size(),), (_rank(),), replica_id=0)
        check_shapes(request, ckpt_dir)
        loaded = _dist_load("loading the model and optimizer", ckpt_dir, request)
        _apply_model_state(gpt, loaded["model"], ckpt_dir)
        rank_state = loaded.get(RANK_STATE_KEY)
        if is_torch:
            steps = rank_state.get("optimizer_steps") if rank_state is not None else None
            with torch.no_grad():
                _load_torch_optimizer(optimizer, (loaded.get("optimizer") or {}).get("state", {}), opt_meta["keys"],
                                      steps, opt_meta["common_step"])
        elif optimizer is not None:
            opt_sd = optimizer.sharded_state_dict(gpt.sharded_state_dict(), is_loading=True,
                                                  metadata=metadata or OPTIMIZER_METADATA)
            loaded_opt = _dist_load("loading the optimizer", ckpt_dir, {"optimizer": opt_sd})
            with torch.no_grad():
                optimizer.load_state_dict(loaded_opt["optimizer"])
    post_optimizer_hook(gpt)
    if rank_state is not None:
        rank_state = {k: v for k, v in rank_state.items() if k != "optimizer_steps"}
    return {"dir": ckpt_dir, "recipe": stored, "common": common, "rank_state": rank_state}


def load_checkpoint(model, ckpt_dir, optimizer=None, metadata=None):
    """Load master weights (and optimizer state) into ``model``; its recipe must equal the stored one.

    ``ckpt_dir``: a checkpoint directory, or a save directory with a tracker. Returns the recipe.
    """
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"load_checkpoint: no checkpoint directory {ckpt_dir}")
    return _read(model, ckpt_dir, optimizer, metadata)["recipe"]


# ---------------------------------------------------------------- Megatron-LM training directories

def _write_tracker(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f"{TRACKER}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / TRACKER)


def _write_failure(e: BaseException, save_dir: Path) -> str | None:
    """What failed when a save's writing failed (a full or read-only disk, a file too large: an OSError, or torch
    DCP's CheckpointException around a writer's OSError / short write), with the free space left; None for
    anything else (a signal, a bug)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        causes = [f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()]
        if any(isinstance(c, (KeyboardInterrupt, Interrupted)) for c in causes):
            return None
        e = next((c for c in causes if isinstance(c, OSError)), causes[0] if causes else e)
    elif not isinstance(e, OSError):
        return None
    if isinstance(e, OSError):
        what = f"{e.strerror or e}" + (f" writing {e.filename}" if e.filename else "")
    else:
        text = str(e).strip().splitlines()
        what = f"{type(e).__name__}: {text[0][:160] if text else ''}"
    try:
        free = f"; {shutil.disk_usage(save_dir).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = ""
    return what + free


def save_iteration(model, save_dir, iteration: int, optimizer=None, *, common=None, rank_state=None,
                   metadata=None, replace: bool = False) -> Path:
    """Save ``{save_dir}/iter_NNNNNNN`` atomically and point the tracker at it; collective (every rank).

    The tracker never moves backwards: saving an iteration below the tracker's raises, unless
    ``replace`` (start over), which also deletes every other ``iter_*`` of ``save_dir`` once the
    new checkpoint and tracker are in place.
    """
    save_dir = Path(save_dir)
    iteration = int(iteration)
    latest = latest_iteration(save_dir) if save_dir.is_dir() else None  # every rank: all raise together
    if latest is not None and latest > iteration and not replace:
        raise CheckpointError(f"{save_dir} holds iteration {latest}; saving iteration {iteration} there would "
                              f"move {TRACKER} backwards")
    final = iteration_dir(save_dir, iteration)
    # rank 0 locks nothing here: the run holds its --save directory (claim_output); a stale iteration of a
    # dead run (written, tracker not yet moved) is ours and replaced
    try:
        with atomic_output_dir(final, force=True, flag="--save", lock=False, manifest=False, collective=True) as tmp:
            _write(model, tmp, optimizer, metadata, common, rank_state)
    except BaseException as e:   # the partial iteration is gone (atomic_output_dir); the tracker was not moved
        cause = _write_failure(e, save_dir)
        if cause is not None:
            kept = f"iteration {latest}" if latest is not None else "no earlier checkpoint"
            raise CheckpointError(f"{save_dir}: saving iteration {iteration} failed ({cause}); the partial "
                                  f"{final.name} was removed, {TRACKER} still names {kept}") from None
        raise
    if _rank() == 0:
        _write_tracker(save_dir, iteration)
        if replace:
            for other in save_dir.glob("iter_*"):
                if other.is_dir() and other != final:
                    shutil.rmtree(other, ignore_errors=True)
    _barrier()
    return final


def load_iteration(model, load_dir, optimizer=None, *, metadata=None):
    """Load the tracker's iteration of a save directory (model, optimizer; recipe checked).

    Returns None when ``load_dir`` holds no checkpoint yet, else ``{"iteration", "dir", "recipe",
    "common", "rank_state"}``; ``rank_state`` is None when the checkpoint was saved with another
    parallel layout (or without one).
    """
    it = latest_iteration(load_dir) if Path(load_dir).is_dir() else None
    if it is None:
        return None
    if not iteration_dir(load_dir, it).is_dir():
        raise CheckpointError(f"{Path(load_dir) / TRACKER} names iteration {it}, but {iteration_dir(load_dir, it)} "
                              "is missing")
    out = _read(model, iteration_dir(load_dir, it), optimizer, metadata)
    out["iteration"] = it
    return out
