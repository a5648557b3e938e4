#!/usr/bin/env bash
# Create the virtualenv and install dynemb with its test extras.
# torch goes in first, pinned to the local CPU wheel, so no dependency pulls in the CUDA wheels.
set -euo pipefail
venv=${1:-.venv}
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
"$py" -m pip install -q -e ".[test,bench]"
