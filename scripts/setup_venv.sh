#!/usr/bin/env bash
# Create the project venv and install everything the demo and the tests need.
# torch==2.13.0 first when no torch is present: a bare `torch` requirement would pull a
# multi-GB CUDA build, while 2.13.0 resolves to the CPU wheel available on our machines.
set -euo pipefail
venv=${1:-.venv}
py=${2:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
fi
"$venv/bin/python" -m pip install -q -e ".[test]"
