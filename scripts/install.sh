#!/usr/bin/env bash
# Install sparkdl into a virtual environment (default .venv), taking PyTorch's CPU
# wheel on a machine without an NVIDIA GPU and PyPI's CUDA build on one with a GPU.
#
#   bash scripts/install.sh            # library + main job
#   bash scripts/install.sh test       # ... plus the test tools
#   VENV=/opt/sparkdl TORCH_VERSION=2.13.0 bash scripts/install.sh dev
set -euo pipefail

EXTRAS="${1:-}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

command -v java >/dev/null || { echo "error: Spark needs Java 17 or 21 on PATH (e.g. apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

# the installer (uv where it can be had, else pip) as PIP, and CPU_FROM for PyTorch's CPU index
source "$ROOT/scripts/installer.sh"
choose_installer "$VENV/bin/python"

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
else
    install_torch "$TORCH_VERSION"
fi

if [ -n "$EXTRAS" ]; then
    "${PIP[@]}" -e "$ROOT[$EXTRAS]"
else
    "${PIP[@]}" -e "$ROOT"
fi
# An editable install leaves sparkdl's own sources uncompiled: with PYTHONDONTWRITEBYTECODE
# set, every process (a driver, each executor's Python worker) would compile them again,
# 0.6 s of CPU each (measured: importing torch and sparkdl's driver and worker modules,
# 4.5 -> 3.9 s). A source changed later is compiled afresh in memory, as without these.
"$VENV/bin/python" -m compileall -q -j 0 "$ROOT/sparkdl" "$ROOT/tests" "$ROOT/jobs" \
    || echo "warning: could not compile every source of $ROOT (read-only?); they compile as they import" >&2
echo "installed into $VENV ($("$VENV/bin/python" -c 'import torch, pyspark; print("torch", torch.__version__, "pyspark", pyspark.__version__)'))"
