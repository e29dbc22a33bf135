#!/usr/bin/env bash
# `make wheel-check`: build kvtier's wheel, check that it holds every module of the source folders and the
# package data, install it into a fresh venv ($1, without torch: the demo runs on numpy alone) and run
# `kvtier demo` from a scratch directory outside the checkout, so nothing of the repository is on the path.
set -euo pipefail
venv="${1:?usage: scripts/wheel-check.sh VENV_DIR}"
cd "$(dirname "$0")/.."
dist=build/dist
rm -rf "$venv"
python3 -m venv "$venv"
venv="$(cd "$venv" && pwd)"
# setuptools copies the packages through build/lib, where a module deleted since the last build would linger
rm -rf "$dist" build/lib build/bdist.*
"$venv/bin/python" -m pip wheel -q --no-deps -w "$dist" .
wheel="$(ls "$dist"/kvtier-*.whl)"
echo "built $wheel"

# Every module of every folder the package maps (kvtier/ itself with testing/, and kvtier/<folder>/ for core/,
# tiers/, ...), found in the wheel under its package path; the package data beside them.
"$venv/bin/python" - "$wheel" <<'PY'
import pathlib, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
folders = {name.split("/")[1] for name in names if name.startswith("kvtier/") and name.count("/") >= 2}
expected = {f"kvtier/{p}" for p in ("default.yaml", "replay.yaml")}
expected |= {p.as_posix() for p in pathlib.Path("kvtier").rglob("*.py") if "__pycache__" not in p.parts}
for folder in folders:
    expected |= {f"kvtier/{p.as_posix()}" for p in pathlib.Path(folder).rglob("*.py") if "__pycache__" not in p.parts}
missing = sorted(expected - names)
if missing:
    sys.exit("the wheel lacks " + ", ".join(missing) + " (pyproject.toml: [tool.setuptools] packages, package-data)")
print(f"the wheel holds all {len(expected)} files of kvtier/ and {', '.join(sorted(folders))}")
PY

# kvtier alone first: the package imports without the command's extra; then the extra, for the command
"$venv/bin/python" -m pip install -q "$wheel"
(cd / && "$venv/bin/python" -c 'import kvtier.api, kvtier.builder, sys; assert "rich" not in sys.modules')
"$venv/bin/python" -m pip install -q "$wheel[cli]"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
"$venv/bin/python" -c 'import kvtier, sys; assert "site-packages" in kvtier.__file__, kvtier.__file__; print("kvtier from", kvtier.__file__)'
"$venv/bin/kvtier" demo
