#!/usr/bin/env bash
# Pack a virtual environment holding sparkdl (built from this repository as a wheel) and torch,
# for executors whose own Python has neither: spark-submit ships it with --archives and each
# executor unpacks it (docs/guide/install.md).
#
#   bash scripts/pack_env.sh                       # -> dist/sparkdl-env.tar.gz
#   TORCH_BUILD=cuda bash scripts/pack_env.sh      # torch's CUDA build, for GPU executors
#   COMPRESS_LEVEL=1 bash scripts/pack_env.sh      # gzip's fastest (default 4): sooner, a little larger
#
# Keep the .tar.gz (or .zip): Spark unpacks a plain .tar with Hadoop's Java untar, which refuses
# the packed bin/python's link to the interpreter outside the archive.
#
# The executors need the same Python version at the same path as PYTHON here: the packed
# environment's bin/python stays a link to it (venv-pack's way, as PySpark's docs show).
# PySpark itself is left out: Spark puts its own on every executor's path. Set EXTRAS (e.g.
# "mlflow") for optional dependencies, EXCLUDE for more venv-pack exclusion patterns, and
# COMPILE_BYTECODE=0 to pack sources only (smaller and packed sooner; each executor then
# compiles what it imports, torch's thousands of modules, at its first task).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
OUTPUT="${OUTPUT:-$ROOT/dist/sparkdl-env.tar.gz}"
EXTRAS="${EXTRAS:-}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

started=$(date +%s)
step() { echo "[$(( $(date +%s) - started )) s] $*"; }
"$PYTHON" -m venv "$WORK/env"
source "$ROOT/scripts/installer.sh"
choose_installer "$WORK/env/bin/python"
torch_installed() { "$WORK/env/bin/python" -c 'from importlib.metadata import version; print(version("torch"))'; }
step "installing torch"
install_torch "$TORCH_VERSION"
step "building sparkdl's wheel"
# the wheel, built from a copy of the sources (a build writes its build/ folder where it runs)
mkdir -p "$WORK/src"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/sparkdl" "$WORK/src/"
"$WORK/env/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/dist" "$WORK/src" \
    || { echo "error: could not build sparkdl's wheel from $ROOT" >&2; exit 1; }
wheel=("$WORK"/dist/sparkdl_torch-*.whl)
step "installing $(basename "${wheel[0]}") and its dependencies but PySpark"
# the wheel's requirements (with EXTRAS') less PySpark, whose 480 MB Spark has on every executor
"$WORK/env/bin/python" - "${wheel[0]}" "$EXTRAS" > "$WORK/requirements.txt" <<'PY'
import re
import sys
import zipfile
from email.parser import Parser

wheel, extras = sys.argv[1], set(filter(None, sys.argv[2].split(",")))
with zipfile.ZipFile(wheel) as archive:
    metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
    fields = Parser().parsestr(archive.read(metadata).decode())
offered = set(fields.get_all("Provides-Extra") or [])
if extras - offered:
    sys.exit(f"error: EXTRAS names {sorted(extras - offered)}; the wheel offers {sorted(offered)}")
for line in fields.get_all("Requires-Dist") or []:
    requirement, _, marker = (part.strip() for part in line.partition(";"))
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
    if name in {"pyspark", "torch", "sparkdl-torch"}:
        continue
    extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
    if extra is None:
        print(line.strip())  # with its marker (a Python version, a platform): the installer weighs it
    elif extra.group(1) in extras:
        print(requirement)  # an extra's: this project's extras carry no other marker
PY
requirements=()
while IFS= read -r requirement; do requirements+=("$requirement"); done < "$WORK/requirements.txt"
"${PIP[@]}" --no-deps "${wheel[0]}"
"${PIP[@]}" "${requirements[@]}" "torch==$(torch_installed)" venv-pack
pack=("$WORK/env/bin/venv-pack" --prefix "$WORK/env" --output "$OUTPUT" --force --quiet
    --compress-level "${COMPRESS_LEVEL:-4}")
# not on the executors: the installer and the packer, and torch's C++ test programs (about
# 130 MB of the 1.3 GB unpacked, never run by a training task; torch/bin's torch_shm_manager stays)
read -ra more <<< "${EXCLUDE:-}"  # split on spaces, never globbed against this folder
for pattern in 'lib/python*/site-packages/uv/*' 'lib/python*/site-packages/uv-*' 'bin/uv' 'bin/uvx' \
    'lib/python*/site-packages/venv_pack*' 'bin/venv-pack' \
    'lib/python*/site-packages/torch/test/*' 'lib/python*/site-packages/torch/bin/test_*' \
    'lib/python*/site-packages/torch/bin/*Test' ${more[@]+"${more[@]}"}; do
    pack+=(--exclude "$pattern")
done
mkdir -p "$(dirname "$OUTPUT")"
step "packing"
"${pack[@]}"
echo "packed $OUTPUT ($(du -h "$OUTPUT" | cut -f1), $(( $(date +%s) - started )) s): spark-submit --archives $OUTPUT#environment --conf spark.pyspark.python=./environment/bin/python ..."
