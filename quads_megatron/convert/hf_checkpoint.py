"""Hugging Face checkpoint directories: a validating safetensors reader and a streaming sharded writer."""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quads_megatron.errors import CheckpointError, NonFiniteError
from quads_megatron.integrity import PRODUCER, checkpoint_file, read_manifest, require_manifest, verify_manifest

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

# safetensors dtype strings (get_slice().get_dtype()) -> torch dtypes.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def read_json(path, what: str) -> dict:
    """Load a JSON object from a file, or raise CheckpointError naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


def check_finite(name: str, t: torch.Tensor, where) -> torch.Tensor:
    """``t`` unchanged, or NonFiniteError naming tensor ``name`` (in ``where``) when it holds NaN/Inf."""
    if t.is_floating_point() and t.numel():
        bad = ~torch.isfinite(t.float() if t.element_size() == 1 else t)
        if bool(bad.any()):
            first = int(bad.flatten().nonzero()[0])
            kind = "NaN" if bool(t.flatten()[first].float().isnan()) else "Inf"
            raise NonFiniteError(f"{where}: tensor {name} holds {int(bad.sum())} non-finite value(s) "
                                 f"(first: {kind} at flat index {first}); expected finite weights")
    return t


def write_json(path, data: dict) -> None:
    """Write JSON the way HF does (indent 2, sorted keys, trailing newline)."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


QUADS_RECIPE_FILE = "quads_recipe.json"   # written by quads-convert-megatron-to-hf only
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")
TOKENIZER_CORE = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")  # one makes a tokenizer


def check_tokenizer_dir(path, flag: str = "--tokenizer-dir") -> Path:
    """``path`` as a directory holding a tokenizer (one of ``TOKENIZER_CORE``); ConfigError naming ``flag``."""
    from quads_megatron.errors import ConfigError

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: {'not a directory' if path.exists() else 'no such directory'}")
    if not any((path / f).is_file() or (path / f).is_symlink() for f in TOKENIZER_CORE):
        raise ConfigError(f"{flag} {path}: holds no tokenizer (none of {', '.join(TOKENIZER_CORE)})")
    return path


def side_files(src_dir, names=TOKENIZER_FILES) -> list:
    """The files of ``names`` that ``src_dir`` holds, as paths checked for reading: each must resolve inside
    ``src_dir`` (a symlink to elsewhere is refused) and, when ``src_dir`` has a manifest, be listed in it with
    a matching SHA-256.  Call it before the work starts; ``copy_side_files`` checks again when copying."""
    src, paths = Path(src_dir), []
    listed = read_manifest(src)
    for name in names:
        if (src / name).is_file() or (src / name).is_symlink():
            paths.append(checkpoint_file(src, name, listed, "side file"))
            if listed is not None:
                verify_manifest(src, only=[name])
    return paths


def copy_side_files(src_dir, dst_dir, names=TOKENIZER_FILES) -> list:
    """Copy the files of ``names`` that ``src_dir`` holds into ``dst_dir`` (checked by ``side_files``)."""
    copied = []
    for path in side_files(src_dir, names):
        shutil.copyfile(path, Path(dst_dir) / path.name)
        copied.append(path.name)
    return copied


class HFCheckpoint:
    """Read-only view of ``config.json`` + safetensors (single file or indexed shards) of one directory.

    Opening verifies ``quads_manifest.json`` when there is one (a flipped byte is named) and parses every
    shard header, so a truncated or corrupt file, an index entry whose file or tensor is missing, or a
    tensor stored in two files fails here with the file named.  ``get`` refuses NaN/Inf by name.
    Every file it opens must resolve inside the directory and, with a manifest, be listed in it
    (``integrity.checkpoint_file``); a directory we wrote (``quads_evidence``) without its manifest is refused.
    """

    def __init__(self, path, *, being_written: bool = False):
        """``being_written``: the temporary directory this process is writing (its manifest comes last)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"Hugging Face checkpoint directory not found: {self.path}")
        verified = verify_manifest(self.path)
        self.listed = read_manifest(self.path) if verified else None
        self.config = read_json(self.file("config.json"), "config.json")
        self._handles = {}
        self.weight_map = self._load_weight_map()
        if not verified and not being_written:  # someone else's checkpoint, or ours with its manifest deleted
            require_manifest(self.path, self.quads_evidence())

    def file(self, rel: str, what: str = "file") -> Path:
        """``path/rel``, refused unless it resolves inside the checkpoint and (with a manifest) is listed."""
        return checkpoint_file(self.path, rel, self.listed, what)

    def quads_evidence(self) -> str | None:
        """What says we wrote this directory: our side files, our producer in a quantization config or in
        the safetensors metadata; None for someone else's checkpoint."""
        if (self.path / QUADS_RECIPE_FILE).is_file():
            return str(self.path / QUADS_RECIPE_FILE)

        def ours(block) -> bool:
            return isinstance(block, dict) and isinstance(block.get("producer"), dict) and \
                block["producer"].get("name") == PRODUCER

        if ours(self.config.get("quantization_config")):
            return f"{self.path / 'config.json'} (quantization_config.producer)"
        summary = self.path / "hf_quant_config.json"   # ModelOpt writes one too: only our producer counts
        if summary.is_file() and ours(read_json(self.file(summary.name), summary.name)):
            return f"{summary} (producer)"
        for filename in sorted(set(self.weight_map.values())):
            if (self._open(filename).metadata() or {}).get("producer") == PRODUCER:
                return f"{self.path / filename} (safetensors metadata producer={PRODUCER})"
        return None

    def _open(self, filename: str):
        if filename not in self._handles:
            file = self.file(filename, "safetensors file")
            if not file.is_file():
                raise CheckpointError(f"{self.path}: safetensors file {filename} is missing")
            try:
                self._handles[filename] = safe_open(str(file), framework="pt")
            except SafetensorError as e:
                raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({e})") from None
        return self._handles[filename]

    def _load_weight_map(self) -> dict:
        index = self.path / INDEX_FILE
        if index.is_file() or index.is_symlink():
            listed = read_json(self.file(INDEX_FILE), INDEX_FILE).get("weight_map")
            if not isinstance(listed, dict) or not listed:
                raise CheckpointError(f"{index}: has no 'weight_map'")
            bad = next((f for f in listed.values() if not isinstance(f, str)), None)
            if bad is not None:
                raise CheckpointError(f"{index}: weight_map values must be file names, found {bad!r}")
            for filename in sorted(set(listed.values())):
                present = set(self._open(filename).keys())
                for name in (n for n, f in listed.items() if f == filename):
                    if name not in present:
                        raise CheckpointError(f"{index}: tensor {name} is listed in {filename}, "
                                              "but that file does not contain it")
            return dict(listed)
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
        weight_map = {}
        for filename in files:
            for name in self._open(filename).keys():
                if name in weight_map:
                    raise CheckpointError(f"{self.path}: tensor {name} appears in both "
                                          f"{weight_map[name]} and {filename}")
                weight_map[name] = filename
        return weight_map

    def dims(self, source: str | None = None):
        """``qwen3_moe.Dims`` of config.json, refused (ConfigError naming the field) before anything is built
        when its layer or expert count differs from the tensors the files actually hold: a config asking
        for 10^6 layers fails here with the memory it would take, not after allocating it."""
        import re

        from quads_megatron.errors import ConfigError
        from quads_megatron.models import qwen3_moe

        source = source or str(self.path / "config.json")
        dims = qwen3_moe.dims_from_hf_config(self.config, source)
        layers, experts = set(), set()
        for name in self.weight_map:
            m = re.match(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?", name)
            if m:
                layers.add(int(m.group(1)))
                if m.group(2) is not None:
                    experts.add(int(m.group(2)))
        gib = qwen3_moe.param_count(dims) * 2 / 2**30
        for field, want, have in (("num_hidden_layers", dims.num_layers, len(layers)),
                                  ("num_experts", dims.num_experts, len(experts))):
            if want != have:
                raise ConfigError(f"{source}: {field}={want}, but the checkpoint's tensors hold {have} "
                                  f"({'layers' if field == 'num_hidden_layers' else 'experts per layer'}; a model "
                                  f"of this config would take about {gib:,.1f} GiB in BF16); refused before "
                                  "anything is built")
        return dims

    def keys(self) -> list:
        return sorted(self.weight_map)

    def __contains__(self, name) -> bool:
        return name in self.weight_map

    def _slice(self, name):
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {name} is missing from the checkpoint")
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name) -> tuple:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name) -> torch.dtype:
        st = self._slice(name).get_dtype()
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {st}")
        return _ST_DTYPES[st]

    def get(self, name, *, finite: bool = True) -> torch.Tensor:
        """The whole tensor (loaded from the mmap'd file); NonFiniteError naming it when it holds NaN/Inf
        (``finite=False``: no check, e.g. for bit-level comparisons)."""
        self._slice(name)  # clear error when absent
        t = self._open(self.weight_map[name]).get_tensor(name)
        return check_finite(name, t, self.path / self.weight_map[name]) if finite else t

    def validate(self, expected: dict, *, dtype: torch.dtype | None = None, dtypes: dict | None = None,
                 what: str = "config.json"):
        """Check names and shapes against ``{name: shape}`` from the config, and dtypes: one for every
        tensor (``dtype``) or per name (``dtypes``, names it lacks are not checked).

        Raises CheckpointError naming the first offending tensors: missing, unexpected, wrong shape
        or wrong dtype.
        """
        have = set(self.weight_map)
        missing = sorted(set(expected) - have)
        extra = sorted(have - set(expected))
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} tensor(s) expected from {what} are "
                                  f"missing, first: {missing[:5]}")
        if extra:
            fused = [n for n in extra if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
            if fused:
                raise CheckpointError(f"{self.path}: {fused[0]} is transformers' in-memory fused expert layout; "
                                      "save the model with save_pretrained (per-expert experts.N.*_proj keys)")
            raise CheckpointError(f"{self.path}: {len(extra)} tensor(s) not expected from {what}, "
                                  f"first: {extra[:5]}")
        for name in sorted(expected):
            shape = self.shape(name)
            if shape != tuple(expected[name]):
                raise CheckpointError(f"{self.path}: tensor {name} ({self.weight_map[name]}) has shape "
                                      f"{list(shape)}, {what} implies {list(expected[name])}")
            want = dtype if dtype is not None else (dtypes or {}).get(name)
            if want is not None and self.dtype(name) != want:
                raise CheckpointError(f"{self.path}: tensor {name} ({self.weight_map[name]}) has dtype "
                                      f"{self.dtype(name)}, expected {want}")

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ShardedSafetensorsWriter:
    """Stream (name, tensor) pairs into size-capped safetensors shards plus the HF index.

    One shard is written as ``model.safetensors``; more as ``model-0000i-of-0000N.safetensors``
    with ``model.safetensors.index.json``.  ``dry_run`` records what would be written and writes
    nothing.  Use inside ``atomic_output_dir`` so a failure leaves no partial checkpoint.
    """

    def __init__(self, out_dir, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dry_run: bool = False,
                 metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.dry_run = dry_run
        self.metadata = {"format": "pt", "producer": PRODUCER, **(metadata or {})}
        self.listing = []          # (name, shape, dtype, nbytes) in write order
        self._buffer, self._buffer_bytes = {}, 0
        self._shards = []          # temporary shard names, renamed in close()
        self._names = set()
        self.files = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise CheckpointError(f"tensor {name} written twice")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        self.listing.append((name, tuple(tensor.shape), tensor.dtype, nbytes))
        if self.dry_run:
            return
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view of a larger buffer (a grouped quantize's output): safetensors stores tensors alone
        self._buffer[name] = t
        self._buffer_bytes += nbytes

    def _flush(self) -> None:
        tmp_name = f"shard-{len(self._shards):05d}.tmp"
        try:
            save_file(self._buffer, str(self.out_dir / tmp_name), metadata=self.metadata)
        except SafetensorError as e:   # I/O errors (full disk) arrive as SafetensorError, not OSError
            raise CheckpointError(f"{self.out_dir / tmp_name}: write failed ({e})") from None
        self._shards.append((tmp_name, sorted(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list:
        """Write the last shard and the index; return the file names (would-be names when dry)."""
        if self.dry_run:
            total = sum(item[3] for item in self.listing)
            count = max(1, -(-total // self.max_shard_bytes)) if self.listing else 0
            self.files = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                           for i in range(count)] + [INDEX_FILE]
            return self.files
        if self._buffer or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self._shards):
            final = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.rename(self.out_dir / tmp_name, self.out_dir / final)
            weight_map.update({n: final for n in names})
            self.files.append(final)
        if count > 1:
            total = sum(item[3] for item in self.listing)
            write_json(self.out_dir / INDEX_FILE, {"metadata": {"total_size": total},
                                                   "weight_map": dict(sorted(weight_map.items()))})
            self.files.append(INDEX_FILE)
        return self.files


def format_listing(listing, files) -> str:
    """Human-readable table of a dry run: one line per tensor, then the files."""
    lines = [f"{name}  {list(shape)}  {str(dtype).removeprefix('torch.')}" for name, shape, dtype, _ in listing]
    total = sum(item[3] for item in listing)
    lines.append(f"-- {len(listing)} tensors, {total / 1e6:.2f} MB in {', '.join(files) or 'no files'}")
    return "\n".join(lines)
