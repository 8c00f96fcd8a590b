#!/usr/bin/env bash
# Install exactly the dependency floors of pyproject.toml (`dependencies` and the `dev` extra,
# each as pkg==floor) in a temporary virtualenv, install this checkout with --no-deps, and run the
# fast suite. Not part of .ci/run: the floors' torch wheels are large downloads (PyPI's Linux torch
# brings its CUDA libraries, ~3 GB, when PyTorch's CPU wheel index cannot be reached).
#
#   tools/check_floors.sh                        # pytest -m "not slow" -x -q
#   tools/check_floors.sh -m "not slow" -q       # other pytest arguments replace the default ones
#   PYTHON=python3.10 tools/check_floors.sh      # another interpreter (default: python3)
#   FLOORS_VENV=/tmp/floors tools/check_floors.sh  # keep (and reuse) the virtualenv there
#
# docs/DEPENDENCIES.md says which API sets each floor.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ $# -eq 0 ]; then set -- -m "not slow" -x -q; fi

if [ -n "${FLOORS_VENV:-}" ]; then
    venv=$FLOORS_VENV
else
    venv=$(mktemp -d "${TMPDIR:-/tmp}/floors-venv.XXXXXX")
    trap 'rm -rf "$venv"' EXIT  # a temporary virtualenv goes, whatever the outcome
fi
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
py=$venv/bin/python
"$py" -m pip install -q --upgrade pip
"$py" -c 'import tomllib' 2>/dev/null || "$py" -m pip install -q tomli  # Python 3.10

# pkg==floor for each requirement of `dependencies` and of the dev extra (each needs a >= floor)
mapfile -t floors < <("$py" - <<'EOF'
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
    match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", req.strip())
    if match is None:
        sys.exit(f"check_floors: {req!r} is not of the form name>=floor")
    print(f"{match[1]}=={match[2]}")
EOF
)
echo "floors: ${floors[*]}"

torch_pins=()
for pin in "${floors[@]}"; do
    case "${pin%%==*}" in torch|torchvision) torch_pins+=("$pin") ;; esac
done
probe="import urllib.request as u; u.urlopen('$TORCH_CPU_INDEX/torch/', timeout=10)"
if "$py" -c "$probe" 2>/dev/null; then
    echo "torch: CPU wheels from $TORCH_CPU_INDEX"
    "$py" -m pip install -q --index-url "$TORCH_CPU_INDEX" "${torch_pins[@]}"
else
    echo "torch: $TORCH_CPU_INDEX unreachable, wheels from PyPI (with their CUDA libraries)"
fi
"$py" -m pip install -q "${floors[@]}"
"$py" -m pip install -q --no-deps -e .

# each floor must be what got installed (a floor that another one overrides would test nothing)
"$py" - "${floors[@]}" <<'EOF'
import sys
from importlib.metadata import version

from packaging.version import Version

wrong = []
for pin in sys.argv[1:]:
    name, floor = pin.split("==")
    print(f"installed: {name}=={version(name)}")
    if Version(version(name)) != Version(floor):
        wrong.append(f"{name} {version(name)} (floor {floor})")
if wrong:
    sys.exit("check_floors: not the floors: " + ", ".join(wrong))
EOF
start=$(date +%s)
status=0
"$py" -m pytest "$@" || status=$?
echo "check_floors: pytest exit $status after $(( $(date +%s) - start )) s"
exit $status
