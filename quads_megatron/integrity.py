"""Per-file SHA-256 manifests for the checkpoints we write, so a flipped byte is a named error, not other weights.

Every checkpoint directory we write (HF, rollout, Megatron dist checkpoint, GRPO iteration) gets
``quads_manifest.json``: ``{"format": "quads-manifest/1", "files": {relative path: {"sha256", "bytes"}}}``.
Readers call ``verify_manifest(dir)``.  A directory without a manifest is accepted when someone else wrote
it; one that says we wrote it (``require_manifest``: a ``PRODUCER`` mark) is refused, since its files
cannot be verified.  Every file a reader opens goes through ``checkpoint_file``: it must resolve (symlinks
followed) inside the directory and, when there is a manifest, be listed in it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from quads_megatron.errors import CheckpointError

MANIFEST = "quads_manifest.json"
FORMAT = "quads-manifest/1"
PRODUCER = "quads-megatron"   # the mark our writers leave in what they write (safetensors metadata, configs)
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
    inside(root, MANIFEST)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest (expected keys 'format' and 'files')")
    return doc["files"]


def _storage_roots(root: Path) -> list:
    """Where the files of checkpoint ``root`` may live (real paths): the directory itself and, for a Hugging Face
    hub cache snapshot (``models--ORG--NAME/snapshots/REV``, whose files are symlinks), its repository's
    ``blobs`` directory."""
    real = os.path.realpath(root)
    roots = [real]
    if Path(real).parent.name == "snapshots" and Path(real).parent.parent.name.startswith("models--"):
        blobs = Path(real).parent.parent / "blobs"
        if blobs.is_dir():
            roots.append(os.path.realpath(blobs))
    return roots


def inside(root, rel, what: str = "file") -> Path:
    """``root/rel`` once it is known to resolve (symlinks followed) inside ``root`` (or, for a hub cache snapshot,
    its repository's blobs); CheckpointError naming it when ``rel`` is not a relative path or it leads out
    (``..``, absolute, a symlink to elsewhere)."""
    root = Path(root)
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        raise CheckpointError(f"{root}: {what} {rel!r} is not a path relative to the checkpoint; refused")
    roots = _storage_roots(root)
    target = os.path.realpath(os.path.join(roots[0], rel))
    if not any(target != r and os.path.commonpath([r, target]) == r for r in roots):
        raise CheckpointError(f"{root / rel}: resolves to {target}, outside the checkpoint directory {root}; "
                              "refused (a checkpoint reads only its own files)")
    return root / rel


def checkpoint_file(root, rel, listed: dict | None, what: str = "file") -> Path:
    """``inside(root, rel)``, and listed in the manifest ``listed`` (``read_manifest``) when there is one:
    the manifest is the list of what a reader may open."""
    path = inside(root, rel, what)
    if listed is not None and rel.replace(os.sep, "/") not in listed:
        raise CheckpointError(f"{path}: not listed in {Path(root) / MANIFEST} (added after the checkpoint was "
                              "written); refused")
    return path


LOADER_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth", "config.json")


def check_loader_reads(root, patterns=LOADER_PATTERNS) -> dict | None:
    """For a loader we do not control (SGLang globs ``*.safetensors`` itself): every file of ``root`` it may
    read must resolve inside ``root`` and, with a manifest, be listed in it; returns the manifest's table."""
    root = Path(root)
    listed = read_manifest(root)
    names = sorted({p.name for pattern in patterns for p in root.glob(pattern)})
    for name in names:
        checkpoint_file(root, name, listed, "file")
    return listed


def require_manifest(root, evidence: str | None) -> None:
    """A directory without a manifest that ``evidence`` says we wrote is a CheckpointError (its files cannot be
    verified: the manifest was deleted); ``evidence`` None (someone else's checkpoint) passes."""
    if evidence is not None and not (Path(root) / MANIFEST).exists():
        raise CheckpointError(f"{Path(root) / MANIFEST}: missing, but {evidence} says QUADS wrote {root}; its files "
                              "cannot be verified -- write the checkpoint again")


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
        p = inside(root, rel, f"{MANIFEST} entry")
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in {MANIFEST})")
        if p.stat().st_size != files[rel]["bytes"]:
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes, the manifest says {files[rel]['bytes']} "
                                  "(truncated or replaced)")
    for rel in names:
        if file_sha256(root / rel) != files[rel]["sha256"]:
            raise CheckpointError(f"{root / rel}: SHA-256 does not match {MANIFEST} (corrupt file)")
    return True
