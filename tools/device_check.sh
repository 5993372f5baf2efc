#!/usr/bin/env bash
# The CUDA checks, for a lent GPU machine that reaches no package index (README "On a GPU").
#
# Here (x86-64, Python 3.12 there):  bash tools/device_check.sh --wheels   # kvproof + the dependencies the
#                                                                          # machine's image lacks, into .whl/
# There (carry .whl):                bash tools/device_check.sh            # logs and reports under $OUT
#
# There it runs, each step bounded: every `cuda` case of tests/gpu_runtime (the real CUDA-graph capture and
# replay among them) and of tests/conformance, `kvproof conform` against the runtime on cuda:0 (its JSON report
# compares with a CPU run's: derandomized, the same examples and steps), and `kvproof bench --quick` for
# swa_allocator. The exit status is the first failing step's.
set -u
if [ "${1:-}" = "--wheels" ]; then
    rm -rf .whl && mkdir -p .whl || exit 2
    py=${PYTHON:-.venv/bin/python}
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl . || exit 2
    for p in pydantic pydantic_core annotated-types typing-inspection typing_extensions hypothesis z3-solver; do
        v=$("$py" -m pip show "$p" | sed -n 's/^Version: //p')
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$p==$v" || exit 2
    done
    du -sh .whl
    exit 0
fi
OUT=${OUT:-/tmp/kvproof-device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 KVPROOF_PROFILE=ci
rc=0
step() {  # step NAME SECONDS COMMAND...: run it under a timeout, its output to $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS r
    shift 2
    echo "== $name: $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    r=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc $r in $((SECONDS - start)) s"
    [ "$rc" -ne 0 ] || rc=$r
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, hypothesis, pydantic; print("torch", torch.__version__, torch.cuda.get_device_name(0),
"| hypothesis", hypothesis.__version__, "| pydantic", pydantic.__version__)'
step pytest-cuda 180 python3 -m pytest -q -n 8 --dist loadgroup -k cuda tests/gpu_runtime tests/conformance \
    --junit-xml "$OUT/pytest-cuda.xml"
step conform 200 kvproof conform --json-report "$OUT/conform.json"
step bench 90 kvproof bench --quick --component swa_allocator
exit $rc
