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
    line = _refused_by_converter(src, tmp_path, capsys, "not inside")
    assert str(src / ".metadata") in line and rel in line


def test_converter_refuses_a_shard_that_is_a_symlink_out_of_the_checkpoint(mg, tmp_path, capsys):
    src = shutil.copytree(mg, tmp_path / "src")
    (src / MANIFEST).unlink()
    shard = next(src.glob("*.distcp"))
    shutil.move(shard, tmp_path / "outside.distcp")
    shard.symlink_to(tmp_path / "outside.distcp")
    _refused_by_converter(src, tmp_path, capsys, re.escape(shard.name) + ".*not inside")


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
