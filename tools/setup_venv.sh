#!/usr/bin/env bash
# Create (or reuse) .venv with everything the project, its example and its tests need.
# torch 2.14.1 + torchvision 0.29.1 are SGLang 0.5.23's pins; SGLang and ModelOpt are
# installed with --no-deps because their declared dependencies are CUDA-only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -r requirements/test.txt -c requirements/constraints.txt
.venv/bin/python -m pip install -q --no-deps -c requirements/constraints.txt -r requirements/no-deps.txt
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
