"""Untrusted torch_dist checkpoints (issue 26): loading one runs none of the code its pickles hold, and reads
nothing outside its directory.

Each case plants a payload whose unpickling would create a marker file (``os.system`` / ``builtins.exec``
via ``__reduce__``) in one of the checkpoint's pickles -- ``.metadata``, ``common.pt``, a byte item of a
``.distcp`` shard -- and rewrites the manifest as an attacker would.  The converter and the loader must
end with one line naming the file and the refused class (exit 2 for the CLI), the marker absent and no
output written.  A control case shows each payload does run under plain ``pickle``.
"""

import builtins
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from quads_megatron.convert import cli, hf_to_megatron, megatron_to_hf
from quads_megatron.errors import CheckpointError
from quads_megatron.integrity import MANIFEST, write_manifest
from quads_megatron.megatron import build_gpt_model, initialize_distributed, qwen3_moe_config
from quads_megatron.megatron import checkpoint as mckpt
from tests.convert.convert_fixtures import save_tiny_hf

ITER = "iter_0000001"


class _Payload:
    """Unpickling it runs ``fn(arg)``: ``os.system("touch marker")`` or ``exec("open(marker, 'w')")``."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def _payloads(marker: Path) -> dict:
    return {"os.system": (_Payload(os.system, f"touch {marker}"), r"(posix|os)\.system"),
            "builtins.exec": (_Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()"), r"builtins\.exec")}


PAYLOADS = ["os.system", "builtins.exec"]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_control_each_payload_runs_under_plain_pickle(payload, tmp_path):
    marker = tmp_path / "ran"
    obj, _ = _payloads(marker)[payload]
    pickle.loads(pickle.dumps(obj))
    assert marker.exists()


# ---------------------------------------------------------------- planting payloads

def _dcp_metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # our own, untampered file


def _write_metadata(ckpt: Path, md) -> None:
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)


def plant_in_metadata(ckpt: Path, obj) -> str:
    md = _dcp_metadata(ckpt)
    md.planner_data = obj
    _write_metadata(ckpt, md)
    return str(ckpt / ".metadata")


def plant_in_common(ckpt: Path, obj) -> str:
    common = torch.load(ckpt / "common.pt", weights_only=True)
    common["note"] = obj
    torch.save(common, ckpt / "common.pt")
    return str(ckpt / "common.pt")


def plant_in_byte_item(ckpt: Path, obj) -> str:
    """Append ``torch.save([obj])`` to a shard and point the first byte item (a ShardedObject) at it."""
    buf = io.BytesIO()
    torch.save([obj], buf)
    md = _dcp_metadata(ckpt)
    index, info = next((k, v) for k, v in md.storage_data.items() if k.offset is None)  # byte items have no offset
    shard = ckpt / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(buf.getvalue())
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    _write_metadata(ckpt, md)
    return str(shard)


PLANTS = {"metadata": plant_in_metadata, "common.pt": plant_in_common, "byte-item": plant_in_byte_item}


def point_shard_at(ckpt: Path, rel: str) -> None:
    md = _dcp_metadata(ckpt)
    next(iter(md.storage_data.values())).relative_path = rel
    _write_metadata(ckpt, md)


# ---------------------------------------------------------------- the converter (quads-convert-megatron-to-hf)

@pytest.fixture(scope="module")
def mg(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    hf = save_tiny_hf(root / "hf")
    out = root / "mg"
    assert cli.run(hf_to_megatron.main, ["--load-dir", str(hf), "--save-dir", str(out), "--no-progress"]) == 0
    return out


def _refused_by_converter(src: Path, tmp_path, capsys, match: str) -> str:
    out = tmp_path / "out"
    capsys.readouterr()
    rc = cli.run(megatron_to_hf.main, ["--load-dir", str(src), "--save-dir", str(out), "--no-progress"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert re.search(match, lines[0]), lines[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    return lines[0]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("where", list(PLANTS))
def test_converter_refuses_a_pickled_payload_before_running_it(where, payload, mg, tmp_path, capsys):
    src = shutil.copytree(mg, tmp_path / "src")
    marker = tmp_path / "ran"
    obj, cls = _payloads(marker)[payload]
    file = PLANTS[where](src, obj)
    write_manifest(src)  # the attacker rewrites the manifest: integrity alone cannot catch this
    line = _refused_by_converter(src, tmp_path, capsys, cls)
    assert file in line and "refused to unpickle" in line
    assert not marker.exists()


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/hostname", "sub/../../outside.distcp"])
def test_converter_refuses_a_shard_outside_the_checkpoint(rel, mg, tmp_path, capsys):
    src = shutil.copytree(mg, tmp_path / "src")
    shutil.copy(next(src.glob("*.distcp")), tmp_path / "outside.distcp")
    point_shard_at(src, rel)
    write_manifest(src)
    line = _refused_by_converter(src, tmp_path, capsys, "outside the checkpoint|not a path relative")
    assert rel in line


def test_converter_refuses_a_shard_that_is_a_symlink_out_of_the_checkpoint(mg, tmp_path, capsys):
    src = shutil.copytree(mg, tmp_path / "src")
    (src / MANIFEST).unlink()
    shard = next(src.glob("*.distcp"))
    shutil.move(shard, tmp_path / "outside.distcp")
    shard.symlink_to(tmp_path / "outside.distcp")
    _refused_by_converter(src, tmp_path, capsys, re.escape(str(shard)) + ".*outside the checkpoint")


def test_untampered_checkpoint_still_converts(mg, tmp_path):
    assert cli.run(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(tmp_path / "out"),
                                         "--no-progress"]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


# ---------------------------------------------------------------- the trainer's loader (GRPO --load, load_iteration)

def _model():
    return build_gpt_model(qwen3_moe_config("tiny"), 256, 16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save directory: iteration 1 of the tiny model with AdamW state and per-rank RNG state."""
    initialize_distributed()
    model = _model()
    root = tmp_path_factory.mktemp("untrusted_iter") / "save"
    mckpt.save_iteration(model, root, 1, torch.optim.AdamW(model.parameters()), common={"note": "test"},
                         rank_state={"rng": mckpt.get_rng_state()})
    return root


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("where", list(PLANTS))
def test_loader_refuses_a_pickled_payload_before_running_it(where, payload, saved, tmp_path):
    root = shutil.copytree(saved, tmp_path / "save")
    marker = tmp_path / "ran"
    obj, cls = _payloads(marker)[payload]
    file = PLANTS[where](root / ITER, obj)
    write_manifest(root / ITER)
    model = _model()
    with pytest.raises(CheckpointError, match=cls) as e:
        mckpt.load_iteration(model, root, torch.optim.AdamW(model.parameters()))
    assert file in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not marker.exists()


def test_loader_restores_untampered_rank_state(saved):
    model = _model()
    state = mckpt.load_iteration(model, saved, torch.optim.AdamW(model.parameters()))
    assert state["iteration"] == 1 and state["common"]["note"] == "test"
    assert torch.is_tensor(state["rank_state"]["rng"]["torch"])


def test_weights_only_override_env_does_not_reopen_common_pt(saved, tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns torch.load's default off; the loader passes weights_only itself."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    root = shutil.copytree(saved, tmp_path / "save")
    marker = tmp_path / "ran"
    plant_in_common(root / ITER, _payloads(marker)["os.system"][0])
    write_manifest(root / ITER)
    with pytest.raises(CheckpointError, match="common.pt"):
        mckpt.load_common_state(root)
    assert not marker.exists()


# ---------------------------------------------------------------- HF checkpoints: nothing outside the directory is read

from quads_megatron.convert import rollout_export  # noqa: E402
from quads_megatron.convert.hf_checkpoint import INDEX_FILE, SINGLE_FILE  # noqa: E402
from test_converters import assert_refused  # noqa: E402 (this directory is on sys.path under pytest)


@pytest.fixture(scope="module")
def hf(mg):
    return mg.parent / "hf"  # save_tiny_hf's output (someone else's checkpoint: no manifest)


@pytest.fixture(scope="module")
def hf_ours(mg):
    """quads-convert-megatron-to-hf of ``mg`` (with quads_manifest.json)."""
    out = mg.parent / "hf_ours"
    assert cli.run(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(out), "--no-progress"]) == 0
    return out


def _index(d: Path, target: str) -> None:
    """An HF index mapping every tensor of ``d``'s model.safetensors to file ``target``."""
    from safetensors import safe_open

    with safe_open(str(d / SINGLE_FILE), framework="pt") as f:
        names = list(f.keys())
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {n: target for n in names}}))


def _refused(main, argv, capsys, match: str, out: Path) -> str:
    """The converter suite's check: exit 2, one line matching ``match``, no ``out`` (nor a temporary of it)."""
    return assert_refused(main, argv, capsys, match, out=out)


def _to_megatron(src, out):
    return hf_to_megatron.main, ["--load-dir", str(src), "--save-dir", str(out), "--no-progress"]


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(where, hf, tmp_path, capsys):
    src = shutil.copytree(hf, tmp_path / "src")
    outside = tmp_path / "outside.safetensors"
    _index(src, "../outside.safetensors" if where == "parent" else str(outside))
    shutil.move(src / SINGLE_FILE, outside)
    line = _refused(*_to_megatron(src, tmp_path / "out"), capsys, "outside the checkpoint|not a path relative",
                    tmp_path / "out")
    assert "outside.safetensors" in line


def test_extra_unlisted_index_next_to_a_manifest_is_refused(hf_ours, tmp_path, capsys):
    src = shutil.copytree(hf_ours, tmp_path / "src")
    shutil.copy(src / SINGLE_FILE, src / "model-extra.safetensors")
    _index(src, "model-extra.safetensors")
    line = _refused(*_to_megatron(src, tmp_path / "out"), capsys, "not listed in .*quads_manifest.json",
                    tmp_path / "out")
    assert INDEX_FILE in line


def test_extra_unlisted_safetensors_next_to_a_manifest_is_refused(hf_ours, tmp_path, capsys):
    src = shutil.copytree(hf_ours, tmp_path / "src")
    shutil.copy(src / SINGLE_FILE, src / "zz-extra.safetensors")
    line = _refused(*_to_megatron(src, tmp_path / "out"), capsys, "not listed in .*quads_manifest.json",
                    tmp_path / "out")
    assert "zz-extra.safetensors" in line


def test_safetensors_symlink_out_of_a_foreign_checkpoint_is_refused(hf, tmp_path, capsys):
    src = shutil.copytree(hf, tmp_path / "src")
    shutil.move(src / SINGLE_FILE, tmp_path / "elsewhere.safetensors")
    (src / SINGLE_FILE).symlink_to(tmp_path / "elsewhere.safetensors")
    _refused(*_to_megatron(src, tmp_path / "out"), capsys, re.escape(str(src / SINGLE_FILE)) + ".*outside",
             tmp_path / "out")


def _secret(tmp_path) -> Path:
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output\n")
    return secret


def test_exporter_refuses_a_tokenizer_symlink_out_of_the_checkpoint(hf, tmp_path, capsys):
    src = shutil.copytree(hf, tmp_path / "src")
    (src / "tokenizer.json").symlink_to(_secret(tmp_path))
    out = tmp_path / "out"
    line = _refused(rollout_export.main, ["--load-dir", str(src), "--save-dir", str(out), "--no-progress",
                                          "--calib-size", "2", "--calib-seq-len", "8"], capsys,
                    re.escape(str(src / "tokenizer.json")) + ".*outside", out)
    assert "secret.txt" in line


def test_converter_refuses_a_tokenizer_symlink_out_of_the_tokenizer_dir(mg, tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "tokenizer.json").symlink_to(_secret(tmp_path))
    out = tmp_path / "out"
    _refused(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(out), "--no-progress",
                                   "--tokenizer-dir", str(tok)], capsys,
             re.escape(str(tok / "tokenizer.json")) + ".*outside", out)


@pytest.mark.parametrize("case", ["missing", "empty", "a-file"])
def test_tokenizer_dir_that_holds_no_tokenizer_is_named(case, mg, tmp_path, capsys):
    tok = tmp_path / "tok"
    if case == "empty":
        tok.mkdir()
    elif case == "a-file":
        tok.write_text("x")
    out = tmp_path / "out"
    _refused(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(out), "--no-progress",
                                   "--tokenizer-dir", str(tok)], capsys, rf"--tokenizer-dir {re.escape(str(tok))}:",
             out)


def test_tokenizer_files_inside_the_directory_are_copied(mg, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    out = tmp_path / "out"
    assert cli.run(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(out), "--no-progress",
                                         "--tokenizer-dir", str(tok)]) == 0
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'


# ---------------------------------------------------------------- ours, with the manifest deleted: an error, not a pass

def test_our_hf_checkpoint_without_its_manifest_is_refused(hf_ours, tmp_path, capsys):
    src = shutil.copytree(hf_ours, tmp_path / "src")
    (src / MANIFEST).unlink()
    line = _refused(*_to_megatron(src, tmp_path / "out"), capsys, "quads_manifest.json: missing, but .* says QUADS",
                    tmp_path / "out")
    assert str(src) in line


def test_our_megatron_checkpoint_without_its_manifest_is_refused(mg, tmp_path, capsys):
    src = shutil.copytree(mg, tmp_path / "src")
    (src / MANIFEST).unlink()
    _refused(megatron_to_hf.main, ["--load-dir", str(src), "--save-dir", str(tmp_path / "out"), "--no-progress"],
             capsys, r"quads_manifest.json: missing, but .*common.pt \(keys .*quads_producer", tmp_path / "out")


def test_our_iteration_without_its_manifest_is_refused_by_the_loader(saved, tmp_path):
    root = shutil.copytree(saved, tmp_path / "save")
    (root / ITER / MANIFEST).unlink()
    shard = next((root / ITER).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the flip the deleted manifest would have named
    shard.write_bytes(bytes(data))
    model = _model()
    with pytest.raises(CheckpointError, match="quads_manifest.json: missing, but"):
        mckpt.load_iteration(model, root, torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError, match="quads_manifest.json: missing, but"):
        mckpt.load_common_state(root)


def test_a_foreign_hf_checkpoint_without_a_manifest_still_converts(hf, tmp_path):
    assert not (hf / MANIFEST).exists()
    assert cli.run(hf_to_megatron.main, ["--load-dir", str(hf), "--save-dir", str(tmp_path / "out"),
                                         "--no-progress"]) == 0


def test_a_manifest_entry_outside_the_directory_is_refused(tmp_path):
    from quads_megatron.integrity import verify_manifest

    root = tmp_path / "ck"
    root.mkdir()
    (root / "a.bin").write_bytes(b"abc")
    write_manifest(root)
    doc = json.loads((root / MANIFEST).read_text())
    doc["files"]["../secret.txt"] = {"sha256": "0" * 64, "bytes": 3}
    (root / MANIFEST).write_text(json.dumps(doc))
    _secret(tmp_path)
    with pytest.raises(CheckpointError, match=r"secret\.txt: resolves to .*outside the checkpoint"):
        verify_manifest(root)


# ---------------------------------------------------------------- sizes: checked against the tensors present, first

def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("field, value, what", [("num_hidden_layers", 10**6, "layers"),
                                                ("num_experts", 10**9, "experts per layer")])
@pytest.mark.parametrize("tool", ["hf-to-megatron", "export-rollout"])
def test_config_asking_for_a_huge_model_is_refused_against_the_tensors(tool, field, value, what, hf, tmp_path,
                                                                       capsys):
    src = shutil.copytree(hf, tmp_path / "src")
    _edit_config(src, **{field: value})
    out = tmp_path / "out"
    main = hf_to_megatron.main if tool == "hf-to-megatron" else rollout_export.main
    have = 2 if field == "num_hidden_layers" else 4   # the tiny model's tensors (convert_fixtures)
    line = _refused(main, ["--load-dir", str(src), "--save-dir", str(out), "--no-progress"], capsys,
                    rf"config\.json: {field}={value}, but the checkpoint's tensors hold {have} \({what}; .* GiB",
                    out)
    assert str(src / "config.json") in line


@pytest.mark.parametrize("field, value, shapes", [
    ("num_hidden_layers", 10**6, r"has shape \[2, 128, 64\], --hf-config .* implies \[1000000, 128, 64\]"),
    ("num_experts", 10**9, r"has shape \[2, 4, 64\], --hf-config .* implies \[2, 1000000000, 64\]")])
def test_megatron_conversion_with_a_huge_hf_config_is_refused_before_building(field, value, shapes, mg, tmp_path,
                                                                               capsys):
    cfg = json.loads((mg.parent / "hf" / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    _refused(megatron_to_hf.main, ["--load-dir", str(mg), "--save-dir", str(out), "--no-progress", "--hf-config",
                                   str(tmp_path / "config.json")], capsys, shapes, out)


def test_dcp_metadata_declaring_a_tensor_its_shards_do_not_hold_is_refused(mg, tmp_path, capsys):
    src = shutil.copytree(mg, tmp_path / "src")
    md = _dcp_metadata(src)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    md.state_dict_metadata[key].size = torch.Size([10**6, *list(md.state_dict_metadata[key].size)[1:]])
    _write_metadata(src, md)
    write_manifest(src)
    line = _refused(megatron_to_hf.main, ["--load-dir", str(src), "--save-dir", str(tmp_path / "out"),
                                          "--no-progress"], capsys, "not backed by the shards", tmp_path / "out")
    assert key in line and "1000000" in line


@pytest.mark.parametrize("field, value, match", [
    ("rms_norm_eps", "1e-6", r"rms_norm_eps must be a finite number, found '1e-6' \(str\)"),
    ("norm_topk_prob", "yes", r"norm_topk_prob must be true or false, found 'yes'"),
    ("max_position_embeddings", 64.5, r"max_position_embeddings must be an integer, found 64\.5"),
    ("rope_theta", [1], r"rope_theta must be a finite number, found \[1\]"),
    ("intermediate_size", "128", r"intermediate_size must be an integer, found '128'"),
])
def test_config_field_of_the_wrong_type_is_a_named_config_error(field, value, match, hf, tmp_path, capsys):
    from quads_megatron.errors import ConfigError
    from quads_megatron.models import qwen3_moe

    src = shutil.copytree(hf, tmp_path / "src")
    _edit_config(src, **{field: value})
    with pytest.raises(ConfigError, match=match):
        qwen3_moe.dims_from_hf_config(json.loads((src / "config.json").read_text()))
    _refused(*_to_megatron(src, tmp_path / "out"), capsys, match, tmp_path / "out")


# ---------------------------------------------------------------- a Hugging Face hub cache snapshot is not "outside"

def _hub_snapshot(hf: Path, root: Path) -> Path:
    """``hf`` laid out as huggingface_hub caches it: files in ``blobs/<sha256>``, the snapshot of symlinks to them."""
    import hashlib

    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in sorted(hf.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snap


def test_a_hub_cache_snapshot_converts(hf, tmp_path):
    snap = _hub_snapshot(hf, tmp_path / "hub")
    assert cli.run(hf_to_megatron.main, ["--load-dir", str(snap), "--save-dir", str(tmp_path / "out"),
                                         "--no-progress"]) == 0


def test_a_hub_cache_snapshot_still_reads_nothing_outside_its_repository(hf, tmp_path, capsys):
    snap = _hub_snapshot(hf, tmp_path / "hub")
    (snap / "tokenizer.json").symlink_to(_secret(tmp_path))
    out = tmp_path / "out"
    _refused(rollout_export.main, ["--load-dir", str(snap), "--save-dir", str(out), "--no-progress"], capsys,
             re.escape(str(snap / "tokenizer.json")) + ".*outside", out)
