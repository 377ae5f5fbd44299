"""Bad input gets a clear error naming the tensor/file; outputs appear atomically or not at all."""

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from quads_megatron.convert import cli, rollout_export
from quads_megatron.models import qwen3_moe
from quads_megatron.errors import CheckpointError, Interrupted, signals_as_interrupt
from quads_megatron.convert.hf_checkpoint import HFCheckpoint, ShardedSafetensorsWriter
from quads_megatron.output_dir import atomic_output_dir

EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"


def _copy(tiny_hf, tmp_path, name="hf"):
    dst = tmp_path / name
    shutil.copytree(tiny_hf, dst)
    return dst


def _validate(path):
    with HFCheckpoint(path) as ckpt:
        ckpt.validate(qwen3_moe.hf_shapes(qwen3_moe.dims_from_hf_config(ckpt.config)), dtype=torch.bfloat16)


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case, message", [
    ("missing", f"missing, first: ['{EXPERT}']"),
    ("extra", "not expected from config.json, first: ['model.layers.0.mlp.experts.9.down_proj.weight']"),
    ("shape", f"tensor {EXPERT} (model.safetensors) has shape [64, 32]"),
    ("dtype", f"tensor {EXPERT} (model.safetensors) has dtype torch.float32, expected torch.bfloat16"),
])
def test_tensor_mismatches_name_the_tensor(tiny_hf, tmp_path, case, message):
    path = _copy(tiny_hf, tmp_path)
    edits = {
        "missing": lambda t: t.pop(EXPERT),
        "extra": lambda t: t.__setitem__("model.layers.0.mlp.experts.9.down_proj.weight", t[EXPERT].clone()),
        "shape": lambda t: t.__setitem__(EXPERT, t[EXPERT][:, :32].clone()),
        "dtype": lambda t: t.__setitem__(EXPERT, t[EXPERT].float()),
    }
    _rewrite(path, edits[case])
    with pytest.raises(CheckpointError) as err:
        _validate(path)
    assert message in str(err.value)


def test_truncated_safetensors_names_the_file(tiny_hf, tmp_path):
    path = _copy(tiny_hf, tmp_path)
    f = path / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or corrupt safetensors file"):
        HFCheckpoint(path)


def test_config_not_matching_weights(tiny_hf, tmp_path):
    path = _copy(tiny_hf, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["moe_intermediate_size"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"experts.0.down_proj.weight \(model.safetensors\) has shape "
                                              r"\[64, 64\], config.json implies \[64, 32\]"):
        _validate(path)


def test_sharded_index_with_missing_file(tiny_hf, tmp_path):
    src = HFCheckpoint(tiny_hf)
    out = tmp_path / "sharded"
    out.mkdir()
    w = ShardedSafetensorsWriter(out, max_shard_bytes=100_000)
    for name in src.keys():
        w.add(name, src.get(name))
    files = w.close()
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    shutil.copy(tiny_hf / "config.json", out / "config.json")
    with HFCheckpoint(out, being_written=True) as re_read:   # the shards read back bit-exactly (no manifest yet)
        assert all(torch.equal(re_read.get(n), src.get(n)) for n in src.keys())
    (out / files[0]).unlink()
    with pytest.raises(CheckpointError, match=f"safetensors file {files[0]} is missing"):
        HFCheckpoint(out)


def test_existing_output_is_refused_without_force(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    argv = ["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rollout-precision", "w4a16", "--no-progress"]
    assert cli.run(rollout_export.main, argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert cli.run(rollout_export.main, argv + ["--force"]) == 2     # not ours (no manifest): --force refuses it
    assert "'keep'" in capsys.readouterr().err and (out / "keep").read_text() == "x"
    (out / "keep").unlink()                                          # empty: --force replaces it
    assert cli.run(rollout_export.main, argv + ["--force"]) == 0
    (out / "extra").write_text("y")                                  # ours now (manifest): replaced whole
    assert cli.run(rollout_export.main, argv + ["--force"]) == 0
    assert not (out / "extra").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]     # no temporary directories or lock files left


def test_interrupted_export_leaves_nothing(tiny_hf, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = rollout_export.rollout_tensors

    def dies_halfway(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 40:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(rollout_export, "rollout_tensors", dies_halfway)
    argv = ["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rollout-precision", "w4a16", "--no-progress"]
    with pytest.raises(KeyboardInterrupt):
        rollout_export.main(argv)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_cleans_the_temporary_directory(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        with signals_as_interrupt(), atomic_output_dir(out) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x")
            os.kill(os.getpid(), signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []


def test_dry_run_lists_and_writes_nothing(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--dry-run", "--rac-channels", "16"])
    text = capsys.readouterr().out
    assert "model.layers.0.mlp.experts.0.gate_proj.input_comp_index  [16]  int32" in text
    assert "model.layers.0.mlp.experts.0.down_proj.weight  [64, 32]  uint8" in text
    assert not out.exists()
