#!/usr/bin/env bash
# Build the wheel set that runs SGLang 0.5.23's server with the quads plugin on an H200 image with
# python 3.12, torch 2.11 (CUDA 13) and no network (docs/sglang-hopper.md says why each part):
#   sglang 0.5.23 without its Rust server/gRPC/bench/multimodal extensions and multimodal_gen/,
#   sglang-kernel 0.4.5 (links CUDA 13, needs torch 2.11) without FA3, FlashMLA, InfLLM and sm100,
#   the small dependencies the image lacks (requirements/sglang-h200.txt), and this project's wheel
#   (its entry point registers --quantization quads).
# Usage: bash tools/sglang_wheelhouse.sh [OUT]   (default .whl-sglang, git-ignored; carry it to the device)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.whl-sglang}
PY=${PYTHON:-python3}
rm -rf "$OUT" && mkdir -p "$OUT"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
plat=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$tmp" sglang==0.5.23 sglang-kernel==0.4.5 -r requirements/sglang-h200.txt
$PY - "$tmp" "$OUT" <<'PYEOF'
"""Copy the wheels, dropping the parts of sglang / sglang-kernel that the Hopper server path never imports."""
import pathlib, shutil, sys, zipfile

DROP = {
    "sglang-": ("sglang/srt/rust_extensions/_server.", "sglang/srt/rust_extensions/_grpc.",
                "sglang/srt/rust_extensions/_bench.", "sglang/srt/rust_extensions/_multimodal.",
                "sglang/multimodal_gen/", "sglang/test/"),
    "sglang_kernel-": ("sgl_kernel/flash_ops.", "sgl_kernel/flashmla_ops.", "sgl_kernel/infllm_ops.",
                       "sgl_kernel/sm100/"),
}
src, out = map(pathlib.Path, sys.argv[1:])
for whl in sorted(src.glob("*.whl")):
    drop = next((d for prefix, d in DROP.items() if whl.name.startswith(prefix)), None)
    if drop is None:
        shutil.copy(whl, out / whl.name)
        continue
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out / whl.name, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if not item.filename.startswith(drop):
                zout.writestr(item, zin.read(item.filename))
PYEOF
$PY -m pip wheel -q --no-deps -w "$OUT" . >/dev/null
du -sh "$OUT"
