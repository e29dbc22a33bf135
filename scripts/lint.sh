#!/usr/bin/env bash
# `make lint`: ruff (lint and format), mypy over every kvtier module, and the import contract (their settings: pyproject.toml),
# run from the lint venv given as $1 (made by the Makefile: vLLM's CPU install, so connectors/vllm is
# type-checked too, and the tools of requirements/lint.txt). Every check runs; the exit status is 1 when any failed.
#
# kvtier's folders map into the package through setuptools' package-dir (core/ is kvtier.core), which the
# default editable install serves through an import hook that static tools cannot follow. So the lint venv
# holds a strict editable install instead: a tree of links named like the package (build/__editable__.*),
# redone on every run so that modules added or removed since are seen. mypy reads kvtier from that tree
# and names files by their paths in it; those are turned back into the repository's own paths here.
set -euo pipefail
venv="$(cd "${1:?usage: scripts/lint.sh LINT_VENV}" && pwd)"
cd "$(dirname "$0")/.."
here="$(pwd)"
# (quietly: setuptools warns about editable installs at length; shown when the install fails)
if ! log="$("$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . \
        --config-settings editable_mode=strict 2>&1)"; then
    echo "$log" >&2
    exit 1
fi
# The link tree's root, as the lint venv finds it (-I: not the kvtier/ folder of the current directory).
tree="$("$venv/bin/python" -I -c \
  'import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec("kvtier").origin)))')"
failed=()

echo "== $("$venv/bin/ruff" --version)"
"$venv/bin/ruff" check --output-format concise . || failed+=(ruff)
"$venv/bin/ruff" format --check . || failed+=("ruff format (run: $venv/bin/ruff format .)")

echo "== $("$venv/bin/mypy" --version)"
MYPYPATH="$tree" "$venv/bin/mypy" | "$venv/bin/python" -c '
import os, sys
for line in sys.stdin:
    path, sep, rest = line.partition(":")
    if sep and os.path.islink(path):
        line = os.path.relpath(os.path.realpath(path)) + sep + rest
    sys.stdout.write(line)' || failed+=(mypy)

# import-linter reads kvtier from the link tree too, so it runs outside the checkout: it puts the current
# directory on its path, where the kvtier/ folder alone (without core/, tiers/, ...) would shadow the package.
echo "== import-linter $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("import-linter"))')"
(cd / && "$venv/bin/lint-imports" --no-logo --no-cache --config "$here/pyproject.toml") || failed+=(import-linter)

if ((${#failed[@]})); then
    echo "make lint: ${failed[*]} failed" >&2
    exit 1
fi
echo "make lint: clean"
