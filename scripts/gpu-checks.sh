#!/usr/bin/env bash
# The GPU checks of issue 31 in one run, for a machine with CUDA, torch and CuPy but no network (the
# workplace's device machine): installs the wheels carried in .whl/ (kvtier's own and what the machine
# lacks, made by `scripts/gpu-checks.sh --wheels` on a machine with pip access), then runs each step named
# on the command line with its own time limit, writing STEP.log (and bench JSON) into $OUT (default
# build/gpu-checks). A step that fails or times out does not stop the next.
#
#   scripts/gpu-checks.sh --wheels                  # here: kvtier's wheel + pydantic's for CPython 3.12
#   scripts/gpu-checks.sh env tests replay copy     # there
#
# Steps: env, tests (tests/gpu), replay (demo + the Mooncake trace in .devdata/), phases
# (bench/gpu_copy.py --phases), copy (bench/gpu_copy.py), hit (bench/hit_value.py), pool (bench/host_pool.py).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--wheels" ]; then
    rm -rf .whl && mkdir -p .whl .devdata
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions
    .venv/bin/python -m pip wheel -q --no-deps -w .whl .
    cp ../shared/data/mooncake_synthetic_trace.jsonl .devdata/ 2>/dev/null || true
    ls -la .whl .devdata
    exit 0
fi

OUT=${OUT:-build/gpu-checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1  # (safe path: ./kvtier is not the package)
PY=python3

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-6}" "$OUT/$name.log"
}

for name in "$@"; do
    case $name in
        env)
            step env 30 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
                python3 -V; python3 -m pip list 2>/dev/null | grep -iE "^(torch|cupy|numpy|transformers|pydantic|setuptools) ";
                nproc; free -g | head -2; df -hT . /tmp; uname -r' ;;
        tests)
            step tests 200 $PY -m pytest -q -p no:cacheprovider tests/gpu ;;
        replay)
            step replay_demo 60 $PY -m kvtier.cli replay --json
            step replay_trace 90 $PY -m kvtier.cli replay .devdata/mooncake_synthetic_trace.jsonl --json ;;
        phases)
            step phases 120 $PY bench/gpu_copy.py --phases --fragments 16384,65536 --methods kernel,batch \
                --repeat 5 --pool-bytes $((2 * 1024 ** 3)) ;;
        copy)
            step copy 200 $PY bench/gpu_copy.py --min-seconds 0.1 ;;
        hit)
            mkdir -p build/hit-value  # the checkout's disk, not a tmpfs: the disk tier reads with O_DIRECT
            step hit 200 $PY bench/hit_value.py --disk-path build/hit-value ;;
        pool)
            step pool 150 $PY bench/host_pool.py --gib 64 ;;
        *)
            echo "unknown step $name" ;;
    esac
done
