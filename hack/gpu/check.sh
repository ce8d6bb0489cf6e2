#!/usr/bin/env bash
# The gpu tier on a GPU machine that has no network and no Ray, DeepSpeed or vLLM (see CONTRIBUTING.md).
#
#   OUT=/some/dir bash hack/gpu/check.sh       # from the repository root, with hack/gpu/wheelhouse
#                                              # made by hack/gpu/wheels.sh
#
# 1. reports the machine: nvidia-smi, Python, torch and its CUDA, transformers, peft;
# 2. installs hack/gpu/requirements.txt from hack/gpu/wheelhouse, offline, into that python3;
# 3. runs `pytest -m gpu` over every test file that has a gpu mark, with the packages from the
#    source tree (PYTHONPATH, nothing built). A file that cannot be collected because it imports a
#    stack the machine lacks (ray, deepspeed, vllm) is listed as not run, never counted as passed;
# 4. summarises: counts, failures, skips with their reasons, measurements the tests record.
#
# Under $OUT (default build/gpu-check): gpu-check.log (all output), gpu-junit.xml, gpu-summary.txt.
# Exit status 0 only when no test failed and at least one passed (hack/gpu/summary.py).
#
# Env: OUT, PYTHON (default python3), GPU_CHECK_BUDGET_S (pytest's whole run, default 300: it is
# interrupted then and still writes its report), GPU_TEST_TIMEOUT_S (one test's hang guard, default 180),
# GPU_CHECK_ALLOW_CPU=1 (a dry run of the script itself on a machine without a GPU: every test skips,
# and the verdict is FAIL since none passed).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-300}
TEST_TIMEOUT_S=${GPU_TEST_TIMEOUT_S:-180}
WHEELS=hack/gpu/wheelhouse
START=$SECONDS

step() { echo; echo "== [$((SECONDS - START))s] $*"; }

machine() {
    step "machine"
    nvidia-smi || echo "!!! nvidia-smi failed"
    "$PY" - <<'EOF'
import importlib
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.device_count(), "x", props.name, f"{props.total_memory / 2**30:.0f} GiB",
          "capability", f"{props.major}.{props.minor}", "bf16", torch.cuda.is_bf16_supported())
for name in ("transformers", "peft", "tokenizers", "safetensors", "numpy", "pytest", "pydantic", "structlog",
             "ray", "deepspeed", "vllm"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # reported, not raised: a missing stack is expected here
        print(name, "-", type(e).__name__, e)
EOF
}

install() {
    step "offline install from $WHEELS"
    if [[ ! -d $WHEELS ]] || ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "!!! no wheels in $WHEELS: run hack/gpu/wheels.sh where PyPI is reachable, and carry $WHEELS"
        return 1
    fi
    local args=(-m pip install --no-index --find-links "$WHEELS" --no-cache-dir --disable-pip-version-check
        --quiet -r hack/gpu/requirements.txt)
    if ! "$PY" "${args[@]}" 2>"$OUT/pip.err"; then
        if grep -q externally-managed "$OUT/pip.err"; then
            "$PY" "${args[@]}" --break-system-packages 2>"$OUT/pip.err" || { cat "$OUT/pip.err"; return 1; }
        else
            cat "$OUT/pip.err"
            return 1
        fi
    fi
    rm -f "$OUT/pip.err"
    "$PY" -c "import pydantic, structlog, pytest, pytest_asyncio, pytest_timeout
print('pydantic', pydantic.VERSION, 'structlog', structlog.__version__, 'pytest', pytest.__version__)"
}

run_tests() {
    step "pytest -m gpu"
    local files
    mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
    if ((${#files[@]} == 0)); then
        echo "!!! no test file under tests/ has a gpu mark"
        return 1
    fi
    printf '  %s\n' "${files[@]}"
    # The packages from the source tree; plugins named, not auto-loaded (the image has others: a
    # plugin of another pytest version must not break the run).
    PYTHONPATH="operator:runtime${PYTHONPATH:+:$PYTHONPATH}" \
        PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
        POLYRL_CACHE="${POLYRL_CACHE:-/tmp/polyrl-cache}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        timeout -s INT -k 30 "$BUDGET_S" "$PY" -m pytest -p pytest_asyncio.plugin -p pytest_timeout \
        -p no:cacheprovider -m gpu --continue-on-collection-errors -o "timeout=$TEST_TIMEOUT_S" \
        -o junit_family=xunit1 --junitxml="$OUT/gpu-junit.xml" -rA -v "${files[@]}"
}

main() {
    echo "gpu tier check: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ)"
    machine
    if [[ ${GPU_CHECK_ALLOW_CPU:-0} != 1 ]] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        echo "!!! torch sees no CUDA GPU: the gpu tier cannot run on this machine"
        echo "gpu tier: FAILED, no CUDA GPU" >"$OUT/gpu-summary.txt"
        return 1
    fi
    if ! install; then
        echo "gpu tier: FAILED, the offline install failed" >"$OUT/gpu-summary.txt"
        return 1
    fi
    rm -f "$OUT/gpu-junit.xml"
    run_tests
    local status=$?
    step "summary (pytest exit status $status)"
    "$PY" hack/gpu/summary.py "$OUT/gpu-junit.xml" "$OUT/gpu-summary.txt" "$status"
    local verdict=$?
    echo "== done in $((SECONDS - START))s; results in $OUT"
    return "$verdict"
}

main 2>&1 | tee "$OUT/gpu-check.log"
exit "${PIPESTATUS[0]}"
