"""Megatron-Core ``dist_checkpointing`` (torch_dist) save/load of Qwen3-MoE models built from an HF config.

A checkpoint saved here is ``{"model": model.sharded_state_dict(), "hf_config": <config.json>}``:
the sharded tensors under Megatron's global keys (readable by any TP/EP layout, and by
Megatron-LM's own loader) plus the HF config in the common state, so Megatron -> HF needs no
side files, and ``quads_manifest.json`` (per-file SHA-256).  Megatron-LM training directories
(``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/``, e.g. a GRPO ``--save`` directory) are
resolved to their latest iteration.  ``MegatronCheckpoint`` checks every file of a checkpoint (manifest,
``metadata.json``, ``.metadata``, shard sizes, ``common.pt``) and a config against the stored shapes
before any model is built; the weights are then read through ``quads_megatron.megatron.checkpoint``
(one path for trainer and converters), whose errors this module turns into ``CheckpointError``.
"""

import json
import pickle
from pathlib import Path

import torch

from quads_megatron.models import qwen3_moe
from quads_megatron.convert.megatron_params import padded_vocab_size
from quads_megatron.output_dir import atomic_output_dir
from quads_megatron.errors import CheckpointError, Interrupted
from quads_megatron.integrity import PRODUCER, require_manifest, verify_manifest
from quads_megatron.megatron.checkpoint import HF_CONFIG_KEY, PRODUCER_KEY, quads_evidence, resolve_checkpoint_dir
from quads_megatron.megatron.dist_writer import no_orphan_writers
from quads_megatron.megatron.safe_load import COMMON_PT, DCP_METADATA, load_common_state, read_dcp_metadata

# HF config fields the weights were trained with: --hf-config / --preset must agree with the stored ones.
ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_experts", "moe_intermediate_size", "num_experts_per_tok", "tie_word_embeddings",
               "norm_topk_prob")


def _one_line(e: BaseException) -> str:
    """An exception as ``Type: first line`` (library messages can span many lines)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _reraise_interrupt(e: BaseException) -> None:
    """torch.distributed.checkpoint wraps every BaseException of a rank (our ``Interrupted`` too) into
    ``CheckpointException``: re-raise the signal so it ends the run as a signal, not as a bad checkpoint."""
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (Interrupted, KeyboardInterrupt)):
            raise inner
    cause = e.__cause__ or e.__context__
    if isinstance(cause, (Interrupted, KeyboardInterrupt)):
        raise cause


def build_model_from_hf_config(hf_config: dict, *, tp: int = 1, ep: int = 1, etp=None, spec: str = "local",
                               params_dtype: torch.dtype = torch.bfloat16, make_vocab_size_divisible_by: int = 128,
                               **model_kwargs):
    """A Megatron GPTModel with the architecture of ``hf_config`` for the current parallel layout.

    Needs ``quads_megatron.megatron.initialize_distributed(tp=..., ep=..., etp=...)`` first.
    Experts keep Megatron's initialisation (the weights are loaded right after); ``model_kwargs``
    go to ``build_gpt_model`` (e.g. ``parallel_output=False``).
    """
    from quads_megatron.megatron.model import build_gpt_model
    from quads_megatron.megatron.presets import qwen3_moe_config

    dims = qwen3_moe.dims_from_hf_config(hf_config)
    config = qwen3_moe_config(
        "tiny", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if etp is not None else tp, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, **qwen3_moe.megatron_config_kwargs(hf_config))
    vocab = padded_vocab_size(dims.vocab_size, tp, make_vocab_size_divisible_by)
    return build_gpt_model(
        config, vocab, int(hf_config.get("max_position_embeddings", 4096)), spec=spec,
        rotary_base=qwen3_moe.rope_theta(hf_config), expert_seed=None,
        share_embeddings_and_output_weights=dims.tie_word_embeddings, **model_kwargs)


def save_megatron_checkpoint(model, out_dir, hf_config: dict, *, force: bool = False, inputs=(),
                             flag: str = "--save-dir") -> Path:
    """Save ``model`` (every rank calls this) to ``out_dir`` through ``atomic_output_dir`` (collective):
    all ranks write one temporary sibling directory, rank 0 adds ``quads_manifest.json`` and renames it
    once everyone finished.  A signal removes the temporary directory and ends the run; an OSError (full or
    read-only filesystem) is a CheckpointError naming ``out_dir``."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir, force=force, inputs=inputs, flag=flag, collective=True) as tmp:
        state = {"model": model.sharded_state_dict(), HF_CONFIG_KEY: json.dumps(hf_config, sort_keys=True),
                 PRODUCER_KEY: PRODUCER}
        try:
            with no_orphan_writers():
                dist_checkpointing.save(state, str(tmp))
        except CheckpointException as e:
            _reraise_interrupt(e)
            raise CheckpointError(f"output {out_dir}: writing the checkpoint failed ({_one_line(e)})") from None
    return out_dir


class MegatronCheckpoint:
    """Read-only view of a torch_dist checkpoint, every file checked before a model is built.

    Opening verifies ``quads_manifest.json`` (when there is one: a flipped byte in a ``.distcp``
    shard is named), reads ``.metadata`` (global tensor shapes, shard files), checks every shard
    file exists and is long enough for what ``.metadata`` puts in it, and reads ``common.pt``; a
    checkpoint of ours (``quads_*`` common keys) whose manifest is missing is refused.
    """

    def __init__(self, path):
        self.load_dir = Path(path)
        self.path = resolve_checkpoint_dir(path)
        verified = verify_manifest(self.path)
        self.shapes, self.files = self._read_dcp_metadata()
        self._check_shards()
        self.common = self._read_common()
        if not verified:  # someone else's checkpoint, or ours with its manifest deleted
            require_manifest(self.path, quads_evidence(self.path, self.common))

    def _read_dcp_metadata(self) -> tuple:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = read_dcp_metadata(self.path)  # restricted unpickling; shard paths inside the directory
        shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        files = {}
        for info in (md.storage_data or {}).values():
            end = int(info.offset) + int(info.length)
            files[info.relative_path] = max(files.get(info.relative_path, 0), end)
        return shapes, files

    def _check_shards(self) -> None:
        for rel, need in sorted(self.files.items()):
            f = self.path / rel
            if not f.is_file():
                raise CheckpointError(f"{f}: missing shard (listed in {self.path / DCP_METADATA})")
            if f.stat().st_size < need:
                raise CheckpointError(f"{f}: truncated shard ({f.stat().st_size} bytes, {DCP_METADATA} needs {need})")

    def _read_common(self) -> dict:
        return load_common_state(self.path)  # torch.load(weights_only=True): no class outside torch's allowlist

    def stored_hf_config(self) -> dict | None:
        """The HF config the weights were written with (common state, else the save directory's hf/), or None."""
        text = self.common.get(HF_CONFIG_KEY)
        if text is not None:
            try:
                cfg = json.loads(text)
            except (TypeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path / COMMON_PT}: stored {HF_CONFIG_KEY} is not JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise CheckpointError(f"{self.path / COMMON_PT}: stored {HF_CONFIG_KEY} is not a JSON object")
            return cfg
        side = hf_side_dir(self.load_dir)
        if side is None:
            return None
        from transformers import AutoConfig

        try:  # save_pretrained leaves out default values: let transformers fill them in
            return AutoConfig.from_pretrained(str(side)).to_dict()
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"{side / 'config.json'}: {_one_line(e)}") from None

    def check_config(self, hf_config: dict, source: str, *, tp: int = 1, divisible_by: int = 128) -> None:
        """Refuse a config whose shapes disagree with ``.metadata`` or whose architecture fields differ from
        the stored config, before any model is built (a 30B preset on a tiny checkpoint fails here)."""
        dims = qwen3_moe.dims_from_hf_config(hf_config, source)
        for key, want in expected_stored_shapes(dims).items():
            have = self.shapes.get(key)
            if key == "output_layer.weight" and dims.tie_word_embeddings and have is not None:
                raise CheckpointError(f"{self.path}: holds {key} {list(have)}, but {source} has "
                                      "tie_word_embeddings=true")
            if have is None:
                if key in ("embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight"):
                    raise CheckpointError(f"{self.path / DCP_METADATA}: no tensor {key}; not a Qwen3-MoE checkpoint")
                continue
            if len(want) != len(have) or any(w is not None and w != h for w, h in zip(want, have)):
                shown = ["V" if w is None else w for w in want]
                raise CheckpointError(f"{self.path}: tensor {key} has shape {list(have)}, {source} implies {shown}")
        rows = self.shapes["embedding.word_embeddings.weight"][0]
        if dims.vocab_size > rows:
            raise CheckpointError(f"{source}: vocab_size={dims.vocab_size}, but the checkpoint's embedding "
                                  f"({self.path}) has only {rows} rows")
        padded = padded_vocab_size(dims.vocab_size, tp, divisible_by)
        if padded != rows:
            raise CheckpointError(f"{source}: vocab_size={dims.vocab_size} pads to {padded} rows (TP={tp}, "
                                  f"--make-vocab-size-divisible-by {divisible_by}); the checkpoint's embedding "
                                  f"({self.path}) has {rows}")
        stored = self.stored_hf_config()
        if stored is None or stored == hf_config:
            return
        for field in ARCH_FIELDS:
            if field in stored and field in hf_config and stored[field] != hf_config[field]:
                raise CheckpointError(f"{source}: {field}={hf_config[field]!r}, but the checkpoint {self.path} was "
                                      f"written with {field}={stored[field]!r}")


def expected_stored_shapes(dims) -> dict:
    """Global shapes (None: not fixed by the config) of the stacked torch_dist tensors a config implies."""
    L, H, E, F, D = dims.num_layers, dims.hidden_size, dims.num_experts, dims.moe_ffn, dims.head_dim
    qkv = (dims.num_heads + 2 * dims.num_kv_heads) * D
    return {
        "embedding.word_embeddings.weight": (None, H),
        "output_layer.weight": (None, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.layers.self_attention.linear_qkv.weight": (L, qkv, H),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, dims.num_heads * D),
        "decoder.layers.self_attention.q_layernorm.weight": (L, D),
        "decoder.layers.self_attention.k_layernorm.weight": (L, D),
        "decoder.layers.mlp.router.weight": (L, E, H),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, E, 2 * F, H),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, E, H, F),
    }


def hf_side_dir(load_dir) -> Path | None:
    """The HF side of a trainer save directory (``{save}/hf``: config.json + tokenizer, written by the GRPO
    loop), for ``load_dir`` = the save directory or one of its ``iter_*``; None when there is none."""
    load_dir = Path(load_dir)
    save_dir = load_dir.parent if load_dir.name.startswith("iter_") or load_dir.name == "release" else load_dir
    return save_dir / "hf" if (save_dir / "hf" / "config.json").is_file() else None


def read_hf_config(ckpt_dir) -> dict:
    """The HF config.json stored in a checkpoint (``save_megatron_checkpoint``, the GRPO loop), else the one
    in the save directory's ``hf/``."""
    cfg = MegatronCheckpoint(ckpt_dir).stored_hf_config()
    if cfg is None:
        raise CheckpointError(f"{ckpt_dir}: has no stored '{HF_CONFIG_KEY}' (not written by quads-convert-hf-"
                              "to-megatron) and no hf/config.json beside it; pass --hf-config with the model's "
                              "config.json, or --preset")
    return cfg


def hf_config_from_preset(preset: str) -> dict:
    """HF config.json of a trainer preset (``quads_megatron.megatron.presets``), for its checkpoints."""
    from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_config, qwen3_moe_model_args

    args = qwen3_moe_model_args(preset)
    return hf_qwen3_moe_config_dict(qwen3_moe_config(preset), args["vocab_size"], args["max_seq_len"],
                                    rotary_base=args["rotary_base"])


def load_megatron_checkpoint(model, ckpt_dir) -> None:
    """Load a torch_dist checkpoint written by any TP/EP layout into ``model`` (every rank calls this).

    Missing tensors, shape mismatches and unreadable shards come out as CheckpointError naming the
    directory; a signal during the load stays a signal.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from quads_megatron.megatron import checkpoint as mckpt

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    try:
        mckpt.load_model_state(model, ckpt_dir)
    except CheckpointException as e:
        _reraise_interrupt(e)
        raise CheckpointError(f"{ckpt_dir}: cannot load into the model ({_one_line(e)})") from None
    except CheckpointingException as e:
        raise CheckpointError(f"{ckpt_dir}: cannot load into the model: {_one_line(e)}") from None
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{ckpt_dir}: truncated or corrupt shard data ({_one_line(e)})") from None
    except ValueError as e:  # tensors missing for the model
        raise CheckpointError(str(e)) from None
