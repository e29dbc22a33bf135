#!/usr/bin/env bash
# Create (or update) the venv $1 for kvtier's SGLang tests (tests/sglang_server): SGLang 0.5.23 from its prebuilt
# wheels, kvtier from this checkout (editable, with the test extra), and the test-only CPU stand-ins of
# tests/sglang_server/cpu_standins, an SGLang plugin that lets its HiCache run without a GPU. SGLang pins torch
# 2.14.1 (the CUDA build; it runs on CPU), hence a venv of its own (PYTHON picks the interpreter that creates it:
# 3.10 to 3.12). The version is pinned because the stand-ins replace SGLang internals. Measured here: 3.6 min and
# 11 GB from scratch (3.6 GB of it NVIDIA libraries); ~1 s when everything is already in place: each step is
# skipped while what it installed is there and newer than its sources. The first SGLang server compiles SGLang's HiCache key hash
# (a C++ extension: g++, ninja and OpenSSL's headers, Debian's build-essential ninja-build libssl-dev) into
# ~/.cache/torch_extensions; this script builds it once, so no test pays the ~12 s.
set -euo pipefail
venv="${1:?usage: scripts/install-sglang.sh VENV_DIR}"
here="$(cd "$(dirname "$0")/.." && pwd)"
standins="$here/tests/sglang_server/cpu_standins"
py="$venv/bin/python"
pip=("$py" -m pip install -q)
built=0

# The compiler and headers that hash extension needs, where a fresh Debian machine lacks them (as root only).
missing=()
for package in g++ libssl-dev; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})) && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" || { apt-get update -q &&
    apt-get install -y -q --no-install-recommends "${missing[@]}"; }
fi
[ -x "$py" ] || "${PYTHON:-python3}" -m venv "$venv"
# Versions are read from the installed metadata: importing sglang alone takes ~5 s.
if ! "$py" -c 'from importlib.metadata import version; assert version("sglang") == "0.5.23"' 2>/dev/null; then
  "${pip[@]}" "sglang==0.5.23"
  built=1
fi
# kvtier: again when pyproject.toml changed (its dependencies may have).
if [ ! "$venv/.kvtier-installed" -nt "$here/pyproject.toml" ] ||
   ! "$py" -c "import kvtier, sys; sys.exit(not kvtier.__file__.startswith('$here/'))" 2>/dev/null; then
  "${pip[@]}" -e "$here[test]"
  touch "$venv/.kvtier-installed"
  built=1
fi
# The stand-ins: again when a source file of theirs is newer than the last install (pip builds them in the source
# tree; the build/ and egg-info it leaves there are removed).
marker="$venv/.kvtier-sglang-cpu-standins"
if [ ! -e "$marker" ] || [ -n "$(find "$standins" -maxdepth 1 -type f \( -name '*.py' -o -name pyproject.toml \) \
                                    -newer "$marker" -print -quit)" ]; then
  "${pip[@]}" --no-deps --no-build-isolation --force-reinstall "$standins"
  rm -rf "$standins/build" "$standins"/*.egg-info
  touch "$marker"
  built=1
fi
if [ "$built" = 1 ]; then
  SGLANG_USE_CPU_ENGINE=1 "$py" -W ignore -c \
    "from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([1, 2, 3, 4], page_size=4)"
fi
"$py" -c 'from importlib.metadata import entry_points, version
import common_ops, kvtier_sglang_cpu
assert "kvtier_cpu_standins" in entry_points(group="sglang.srt.plugins").names
print("sglang", version("sglang"), "with the CPU stand-ins ready")'
