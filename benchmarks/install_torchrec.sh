#!/usr/bin/env bash
# Optional: install TorchRec (CPU) into the project's virtualenv so that benchmarks/train_step.py can compare
# against it. Never part of the package's requirements.
#
# Pins: fbgemm-gpu-cpu 1.9.0 does not load on torch 2.13, 1.8.0 does; torchrec 1.8.0 is installed without its
# declared dependencies (they would replace torch), plus the few small ones it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip install "fbgemm-gpu-cpu==1.8.0"
"$PY" -m pip install --no-deps "torchrec==1.8.0"
"$PY" -m pip install tensordict torchmetrics pyre-extensions tqdm
"$PY" -c "import torchrec, fbgemm_gpu; print('torchrec', torchrec.__version__, 'ok')"
