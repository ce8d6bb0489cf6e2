#!/usr/bin/env bash
# Downloads, where PyPI is reachable, the wheels that hack/gpu/check.sh installs offline on a GPU
# machine: hack/gpu/requirements.txt and everything it needs, for CPython 3.11 and 3.12 on x86-64
# Linux (the GPU image's python3 is 3.12), into hack/gpu/wheelhouse (git-ignored; a run carries it).
#
# Idempotent: the wheelhouse is made anew each time. Fails when a wheel is missing for either Python
# or the wheelhouse outgrows MAX_MIB (it travels with the working tree, 64 MiB in all).
#
# Env: PYTHON (default: .venv/bin/python, else python3), MAX_MIB (default 16).
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DEST="$HERE/wheelhouse"
MAX_MIB=${MAX_MIB:-16}
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x "$REPO/.venv/bin/python" ]] && PYTHON="$REPO/.venv/bin/python"
fi

rm -rf "$DEST"
mkdir -p "$DEST"
for py in 3.11 3.12; do
    echo "== wheels for CPython $py"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --implementation cp --python-version "$py" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -r "$HERE/requirements.txt" -d "$DEST"
done

find "$DEST" -name '*.whl' -printf '%10s  %f\n' | sort -k2
kib=$(du -sk "$DEST" | cut -f1)
echo "== $(find "$DEST" -name '*.whl' | wc -l) wheels, $((kib / 1024)) MiB ($kib KiB) in $DEST"
if (( kib > MAX_MIB * 1024 )); then
    echo "!!! the wheelhouse is over $MAX_MIB MiB: it travels with the working tree (64 MiB in all)" >&2
    exit 1
fi
