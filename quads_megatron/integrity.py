"""Per-file SHA-256 manifests for the checkpoints we write, so a flipped byte is a named error, not other weights.

Every checkpoint directory we write (HF, rollout, Megatron dist checkpoint, GRPO iteration) gets
``quads_manifest.json``: ``{"format": "quads-manifest/1", "files": {relative path: {"sha256", "bytes"}}}``.
Readers call ``verify_manifest(dir)``; a directory without a manifest (written by someone else) is accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from quads_megatron.errors import CheckpointError

MANIFEST = "quads_manifest.json"
FORMAT = "quads-manifest/1"
_CHUNK = 16 << 20


def file_sha256(path) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != MANIFEST:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def write_manifest(root) -> Path:
    """Hash every file under ``root`` (recursively) into ``root/quads_manifest.json``; return its path."""
    root = Path(root)
    files = {rel: {"sha256": file_sha256(root / rel), "bytes": (root / rel).stat().st_size} for rel in _files(root)}
    path = root / MANIFEST
    path.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(root) -> dict | None:
    """The manifest's ``files`` table, or None when ``root`` has none; CheckpointError when it is malformed."""
    path = Path(root) / MANIFEST
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest (expected keys 'format' and 'files')")
    return doc["files"]


def verify_manifest(root, *, only=None) -> bool:
    """Check sizes and SHA-256 of the files the manifest lists (or just ``only``, relative paths).

    Returns False when there is no manifest; raises CheckpointError naming the first missing,
    resized or corrupt file. Sizes are checked for all listed files first (cheap), hashes after.
    """
    root = Path(root)
    files = read_manifest(root)
    if files is None:
        return False
    names = sorted(files) if only is None else sorted(only)
    for rel in names:
        if rel not in files:
            raise CheckpointError(f"{root / rel}: not listed in {root / MANIFEST}")
        p = root / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in {MANIFEST})")
        if p.stat().st_size != files[rel]["bytes"]:
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes, the manifest says {files[rel]['bytes']} "
                                  "(truncated or replaced)")
    for rel in names:
        if file_sha256(root / rel) != files[rel]["sha256"]:
            raise CheckpointError(f"{root / rel}: SHA-256 does not match {MANIFEST} (corrupt file)")
    return True
