"""The checkpoint manifest: a flipped, truncated or missing file is a named CheckpointError."""

import hashlib
import json

import pytest

from quads_megatron.errors import CheckpointError
from quads_megatron.integrity import MANIFEST, verify_manifest, write_manifest


def _tree(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "sub" / "b.json").write_text('{"x": 1}')
    return tmp_path


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    root = _tree(tmp_path)
    write_manifest(root)
    files = json.loads((root / MANIFEST).read_text())["files"]
    assert sorted(files) == ["a.bin", "sub/b.json"]
    assert files["sub/b.json"]["sha256"] == hashlib.sha256(b'{"x": 1}').hexdigest()  # independent hash
    assert verify_manifest(root) is True


def test_no_manifest_is_accepted(tmp_path):
    assert verify_manifest(_tree(tmp_path)) is False


@pytest.mark.parametrize("fault, match", [
    ("flip", "SHA-256 does not match"), ("truncate", "truncated"), ("delete", "missing")])
def test_fault_is_named(tmp_path, fault, match):
    root = _tree(tmp_path)
    write_manifest(root)
    p = root / "a.bin"
    data = bytearray(p.read_bytes())
    if fault == "flip":
        data[1000] ^= 0xFF
        p.write_bytes(bytes(data))
    elif fault == "truncate":
        p.write_bytes(bytes(data[:-1]))
    else:
        p.unlink()
    with pytest.raises(CheckpointError, match=match) as e:
        verify_manifest(root)
    assert "a.bin" in str(e.value)


def test_malformed_manifest_is_named(tmp_path):
    root = _tree(tmp_path)
    (root / MANIFEST).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=MANIFEST):
        verify_manifest(root)
