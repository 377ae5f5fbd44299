"""Read torch_dist checkpoints without running what their pickles hold: every unpickling is restricted.

A torch_dist directory carries three kinds of pickles: ``.metadata`` (torch DCP's index, a plain
``pickle.dump``), ``common.pt`` (``torch.save``) and the byte items of ``*.distcp`` shards (Megatron's
ShardedObjects and ``_extra_state``, ``torch.save`` bytes).  torch DCP reads the first with
``pickle.load`` and the last with ``torch.load(weights_only=False)``: a crafted checkpoint would run
code on load.  Here:

* ``read_dcp_metadata`` unpickles ``.metadata`` with ``RestrictedUnpickler``, which admits only the DCP
  metadata dataclasses, ``torch.Size``, dtypes and layouts, and checks that every shard file it names
  lies inside the checkpoint directory;
* ``load_torch_file`` / ``check_torch_bytes`` use torch's own allowlist (``torch.load(weights_only=True)``,
  ``torch.serialization.get_unsafe_globals_in_checkpoint``);
* ``SAFE_LOAD_STRATEGIES`` are the Megatron load strategies that read through both
  (``dist_checkpointing.load(..., sharded_strategy=..., common_strategy=...)``).

A refused class is a ``CheckpointError`` naming the file and the class, raised before the class is called.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from pathlib import Path

import torch

from quads_megatron.errors import CheckpointError
from quads_megatron.integrity import inside

DCP_METADATA = ".metadata"
COMMON_PT = "common.pt"

# What torch DCP (torch 2.14) and Megatron's torch_dist writer put into .metadata: the metadata
# dataclasses, the save plans kept in it (all_local_plans), their enums, and torch.Size / dtype / layout.
_DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = frozenset({
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                        "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                       "BytesIOWriteData")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
})


def _refused(path, what: str, kind: str) -> CheckpointError:
    return CheckpointError(f"{path}: refused to unpickle {what} (not a {kind} a torch_dist checkpoint holds; "
                           "nothing of the file was run): an untrusted or tampered checkpoint")


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``METADATA_GLOBALS`` and torch dtypes (the Python docs'
    "restricting globals" recipe): any other class or function is refused before it can be called."""

    def __init__(self, file, path):
        super().__init__(file)
        self._path = path

    def find_class(self, module, name):
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refused(self._path, f"{module}.{name}", "class")

    def persistent_load(self, pid):
        raise _refused(self._path, f"persistent id {str(pid)[:60]!r}", "reference")


def read_dcp_metadata(ckpt_dir):
    """torch DCP's ``Metadata`` of ``ckpt_dir/.metadata``, unpickled with ``RestrictedUnpickler``; every shard
    file it names must lie inside ``ckpt_dir``.  CheckpointError naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = Path(ckpt_dir) / DCP_METADATA
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint's tensor index)")
    try:
        with open(path, "rb") as f:
            md = RestrictedUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a damaged pickle raises any of many types
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: truncated or corrupt ({type(e).__name__}: {text[0] if text else ''})") \
            from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or \
            not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{path}: not torch.distributed.checkpoint metadata ({type(md).__name__})")
    for rel in sorted({getattr(info, "relative_path", None) for info in md.storage_data.values()}, key=str):
        inside(path.parent, rel, f"shard file named in {DCP_METADATA}")
    check_tensors_stored(md, path)
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


def check_tensors_stored(md, path) -> None:
    """Every tensor ``.metadata`` declares is covered by its chunks, and every chunk has a shard entry of at
    least its bytes: with the shard files' lengths checked (``check_files``), the shapes a reader trusts are
    backed by data on disk, so a declared 10^6-layer tensor cannot make anyone allocate it."""
    import math

    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    for fqn, tm in md.state_dict_metadata.items():
        if not isinstance(tm, TensorStorageMetadata):
            continue
        size = tuple(tm.size)
        if any(not isinstance(n, int) or n < 0 for n in size):
            raise CheckpointError(f"{path}: tensor {fqn} has an invalid shape {list(size)}")
        itemsize = tm.properties.dtype.itemsize
        covered = 0
        for chunk in tm.chunks:
            numel = math.prod(chunk.sizes)
            covered += numel
            info = md.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if info is None or int(info.length) < numel * itemsize:
                have = "no shard entry" if info is None else f"a shard entry of {int(info.length)} bytes"
                raise CheckpointError(f"{path}: tensor {fqn} {list(size)}: its chunk at {list(chunk.offsets)} needs "
                                      f"{numel * itemsize} bytes, {DCP_METADATA} gives {have}")
        if covered != math.prod(size):
            raise CheckpointError(f"{path}: tensor {fqn} declares shape {list(size)} ({math.prod(size)} elements), "
                                  f"but its chunks hold {covered}: not backed by the shards")


def _unsafe_globals(source) -> list:
    """GLOBALs of a ``torch.save`` zip that torch's weights_only allowlist does not admit (read, not run)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except (ValueError, RuntimeError, pickle.UnpicklingError, EOFError, OSError, KeyError):
        return []  # not a zip checkpoint, or damaged: torch.load(weights_only=True) below names it


def load_torch_file(path, what: str = "state"):
    """``torch.load(path, weights_only=True)`` on CPU; a class outside torch's allowlist (plus the ones
    Megatron registers) is a CheckpointError naming the file and the class."""
    path = Path(path)
    unsafe = _unsafe_globals(str(path))
    if unsafe:
        raise _refused(path, ", ".join(unsafe[:3]), "class")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint's {what})") from None
    except pickle.UnpicklingError as e:
        culprit = _weights_only_culprit(e)
        if culprit is not None:
            raise _refused(path, culprit, "class") from None
        raise CheckpointError(f"{path}: truncated or corrupt ({_first_line(e)})") from None
    except (RuntimeError, EOFError, OSError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _weights_only_culprit(e: BaseException) -> str | None:
    """The GLOBAL torch's weights_only unpickler refused, from its message; None for any other failure."""
    import re

    m = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"unrecognized function ([\w.<> ]+)", str(e))
    return m.group(1) if m else None


def check_torch_bytes(data: bytes, where: str) -> None:
    """Refuse ``torch.save`` bytes (a DCP byte item) holding a class outside torch's weights_only allowlist."""
    unsafe = _unsafe_globals(io.BytesIO(data))
    if unsafe:
        raise _refused(where, ", ".join(unsafe[:3]), "class")
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        culprit = _weights_only_culprit(e)
        if culprit is not None:
            raise _refused(where, culprit, "class") from None
        raise CheckpointError(f"{where}: truncated or corrupt ({_first_line(e)})") from None
    except (RuntimeError, EOFError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{where}: truncated or corrupt ({_first_line(e)})") from None


class _BytesChecked:
    """A DCP load planner whose byte items are checked (``check_torch_bytes``) before the planner unpickles
    the very same bytes; everything else goes to the wrapped planner."""

    def __init__(self, planner, path: Path, storage_data: dict):
        self._planner, self._path, self._storage = planner, path, storage_data

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        data = value.read()
        info = self._storage.get(read_item.storage_index)
        shard = self._path / info.relative_path if info is not None else self._path
        check_torch_bytes(data, f"{shard} (item {read_item.dest_index.fqn})")
        self._planner.load_bytes(read_item, io.BytesIO(data))


def _reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader)

    class RestrictedFileSystemReader(CachedMetadataFileSystemReader):
        """torch DCP's filesystem reader, with ``.metadata`` read by ``read_dcp_metadata`` and byte items
        checked by ``check_torch_bytes`` before DCP unpickles them."""

        def __init__(self, path):
            super().__init__(path)
            self._root = Path(path)

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:
                raise CheckpointError(f"{self._root}: per-rank DCP metadata files are not read")
            if self._cached_metadata is None:
                self._cached_metadata = read_dcp_metadata(self._root)
            self._cached_metadata.storage_meta.load_id = self.load_id
            return self._cached_metadata

        def read_data(self, plan, planner):
            return super().read_data(plan, _BytesChecked(planner, self._root, self.storage_data))

    return RestrictedFileSystemReader


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _restricted_reader():
    """Megatron's torch_dist strategy builds its reader through ``_get_filesystem_reader``: have it build
    ``RestrictedFileSystemReader`` for the duration of one read."""
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    reader = _reader_class()
    with _PATCH_LOCK:
        original = mtorch._get_filesystem_reader
        mtorch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: reader(checkpoint_dir)
        try:
            yield
        finally:
            mtorch._get_filesystem_reader = original


def safe_load_strategies() -> dict:
    """``sharded_strategy`` / ``common_strategy`` keyword arguments for ``dist_checkpointing.load`` that read
    every pickle of the checkpoint restricted (see the module docstring)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class RestrictedTorchDistLoad(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            with _restricted_reader():
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            return super().load_tensors_metadata(checkpoint_dir, metadata or read_dcp_metadata(checkpoint_dir))

        def load_sharded_metadata(self, checkpoint_dir):
            with _restricted_reader():
                return super().load_sharded_metadata(checkpoint_dir)

    class RestrictedCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return load_torch_file(Path(checkpoint_dir) / COMMON_PT, "common state")

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointError(f"{checkpoint_dir}: per-object .pt files are not read (torch_dist keeps "
                                  "ShardedObjects in its shards)")

    return {"sharded_strategy": RestrictedTorchDistLoad(), "common_strategy": RestrictedCommonLoad()}


def load_common_state(ckpt_dir) -> dict:
    """``common.pt`` of a checkpoint, read restricted; CheckpointError unless it is a dict."""
    path = Path(ckpt_dir) / COMMON_PT
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint's common state)")
    common = load_torch_file(path, "common state")
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}: expected a dict of common state, found {type(common).__name__}")
    return common
