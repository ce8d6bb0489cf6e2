#!/usr/bin/env bash
# Prepares the binaries of the "control plane" test tier, once, into a cache:
#
#   etcd                      Debian sid package etcd-server (unpacked, not installed)
#   apiextensions-apiserver   the genuine Kubernetes CRD server, built from Debian sid Go
#                             source packages (golang-k8s-apiextensions-apiserver-dev and the
#                             -dev packages it imports) with sid's default Go toolchain
#   kubectl                   Debian sid package kubectl (same Kubernetes minor as the server)
#
# Nothing is installed system-wide: every package is fetched with `apt-get download` through a
# PRIVATE apt configuration (own sources.list pointing at sid on the mirror this machine already
# uses, own lists/cache/state under the cache folder) and unpacked with `dpkg-deb -x`. The
# system's apt sources are never touched. That recipe lives in hack/lib/debian-go.sh (dgo_*).
# Why sid: it is the only Debian suite that packages
# the Kubernetes 1.36 libraries, and Debian's mirrors are reachable where GitHub/dl.k8s.io are not.
#
# Idempotent: when the binaries and the recipe stamp are in the cache it prints what is there and
# exits 0 in well under a second. On any failure it exits non-zero with a loud message; the
# Makefile then prints a banner and the controlplane tests are skipped (never silently passed).
#
# Env: POLYRL_CACHE (default ~/.cache/polyrl), POLYRL_DEBIAN_MIRROR (default: the system's),
#      POLYRL_CONTROLPLANE_REBUILD=1 to force a rebuild, POLYRL_CONTROLPLANE_KEEP_WORK=1 to keep
#      the unpacked sources after a successful build.
set -Eeuo pipefail

# Bump when the recipe changes in a way that needs a rebuild of the cached binaries.
RECIPE=6
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${POLYRL_CACHE:-$HOME/.cache/polyrl}/controlplane"
BIN="$CACHE_ROOT/bin"
STAMP="$BIN/.recipe"
VERSIONS="$BIN/versions.txt"
WORK="$CACHE_ROOT/work"
T0=$(date +%s)

log() { printf '[controlplane %4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
die() {
    {
        echo
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        echo "!!! CONTROL PLANE PREPARATION FAILED: $*"
        echo "!!! The controlplane / e2e test tiers will be SKIPPED until this is fixed."
        echo "!!! Work folder (for inspection): $WORK"
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    } >&2
    exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

# The first line a command prints, for the version record. Not `cmd | head -n1`: head exits after
# one line, the command gets SIGPIPE, and under pipefail and errtrace the ERR trap fires inside the
# command substitution and prints the failure banner for a preparation that then succeeds.
first_line() {
    local out
    out=$("$@" 2>/dev/null) || true
    printf '%s\n' "${out%%$'\n'*}"
}

have_all() {
    [[ -x "$BIN/etcd" && -x "$BIN/apiextensions-apiserver" && -x "$BIN/kubectl" && -d "$BIN/proto" ]] \
        && [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]]
}

if [[ "${POLYRL_CONTROLPLANE_REBUILD:-0}" != 1 ]] && have_all; then
    echo "[controlplane] cached binaries in $BIN (recipe $RECIPE):"
    sed 's/^/[controlplane]   /' "$VERSIONS" 2>/dev/null || true
    exit 0
fi

# shellcheck source=SCRIPTDIR/../lib/debian-go.sh
source "$HERE/../lib/debian-go.sh"
dgo_check_host

mkdir -p "$CACHE_ROOT" "$BIN"
# Two concurrent `make` runs must not build into the same folders.
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ "${POLYRL_CONTROLPLANE_REBUILD:-0}" != 1 ]] && have_all; then
    log "another run finished the build meanwhile"
    exit 0
fi

dgo_apt_init "$CACHE_ROOT/apt"
dgo_workspace "$WORK"

# ---- etcd and kubectl (prebuilt Debian binaries) --------------------------------------------
log "fetching etcd-server and kubectl"
dgo_fetch etcd-server kubectl
install -m 0755 "$ROOT/usr/bin/etcd" "$WORK/etcd"
install -m 0755 "$ROOT/usr/bin/kubectl" "$WORK/kubectl"

# ---- Go toolchain, apiextensions-apiserver sources and the -dev packages it imports -----------
dgo_toolchain
SRCDIR="$GOPATH/src/k8s.io/apiextensions-apiserver"
log "fetching golang-k8s-apiextensions-apiserver-dev"
dgo_fetch golang-k8s-apiextensions-apiserver-dev
[[ -f "$SRCDIR/main.go" ]] || die "no main.go in $SRCDIR"

# The one source change: the standalone server configures only the OpenAPI v3 *config*, and its
# CRD OpenAPI controllers run only when the v2 config is set too (apiserver.go: "StaticOpenAPISpec
# != nil"), so it publishes no schema of any CRD: no `kubectl explain`, and kubectl's check for
# server-side field validation fails. Set the v2 config exactly like the v3 one (as kube-apiserver
# does); CRD serving and validation code is untouched.
OPTS_GO="$SRCDIR/pkg/cmd/server/options/options.go"
grep -q 'serverConfig.OpenAPIConfig = ' "$OPTS_GO" || {
    grep -q '^\s*serverConfig.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(' "$OPTS_GO" \
        || die "cannot enable CRD OpenAPI publishing: the OpenAPIV3Config line moved in $OPTS_GO (adapt prepare.sh)"
    sed -i -E 's/^(\s*)serverConfig\.OpenAPIV3Config = genericapiserver\.DefaultOpenAPIV3Config\((.*)$/&\n\1serverConfig.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(\2/' "$OPTS_GO"
    log "patched $OPTS_GO: publish CRD OpenAPI (v2 + v3)"
}

# Fetch only what the build imports (~80 packages, mapped through the Go-Import-Path field of
# Debian's Sources index) instead of the >300-package Depends closure (tests, tools).
log "resolving the server's imports to sid -dev packages"
dgo_resolve_imports "$SRCDIR"

# The shim transcodes protobuf request bodies (client-go typed clients, e.g. `kubectl create cm`)
# with Kubernetes' own schema: keep the few generated.proto files it needs.
for d in k8s.io/api/core/v1 k8s.io/apimachinery/pkg/apis/meta/v1 k8s.io/apimachinery/pkg/api/resource \
    k8s.io/apimachinery/pkg/util/intstr k8s.io/apimachinery/pkg/runtime; do
    [[ -f "$GOPATH/src/$d/generated.proto" ]] || die "missing $d/generated.proto in the Debian sources"
    install -D -m 0644 "$GOPATH/src/$d/generated.proto" "$WORK/proto/$d/generated.proto"
done

ndebs=$(find "$DEBS" -name '*.deb' | wc -l)
dlsize=$(du -cb "$DEBS"/*.deb | tail -n1 | cut -f1)
log "all sources present: $ndebs packages, $((dlsize / 1000000)) MB downloaded; building (takes minutes)"
# Stamp the Kubernetes version (Debian's 0.36.4-1 is Kubernetes v1.36.4): without it /version says
# "v0.0.0-master+$Format:%H$", which `kubectl version` (and semver parsers) reject.
debver=$(dpkg-deb -f "$DEBS"/golang-k8s-apiextensions-apiserver-dev_*.deb Version)
kminor=$(sed -E 's/^0\.([0-9]+)\..*/\1/' <<<"$debver")
kver="v1.$(sed -E 's/^0\.([0-9]+\.[0-9]+).*/\1/' <<<"$debver")"
V=k8s.io/component-base/version
LDFLAGS="-s -w -X $V.gitMajor=1 -X $V.gitMinor=$kminor -X $V.gitVersion=$kver -X $V.gitTreeState=clean"
LDFLAGS+=" -X $V.gitCommit=debian-$debver -X $V.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
(cd "$SRCDIR" && "$GO" build -trimpath -ldflags="$LDFLAGS" -o "$WORK/apiextensions-apiserver" .) \
    >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; die "go build of apiextensions-apiserver failed"; }
log "built apiextensions-apiserver $kver ($(($(stat -c %s "$WORK/apiextensions-apiserver") / 1000000)) MB)"

# ---- smoke checks, then publish into the cache ------------------------------------------------
"$WORK/etcd" --version >/dev/null || die "the fetched etcd does not run"
"$WORK/kubectl" version --client >/dev/null || die "the fetched kubectl does not run"
"$WORK/apiextensions-apiserver" --help >/dev/null 2>&1 || die "the built apiextensions-apiserver does not run"

{
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $DGO_MIRROR sid, recipe $RECIPE"
    "$GO" version
    echo "etcd: $(first_line "$WORK/etcd" --version)"
    echo "kubectl: $(first_line "$WORK/kubectl" version --client)"
    echo "downloaded: $ndebs packages, $dlsize bytes"
    dgo_package_versions
} >"$WORK/versions.txt"

rm -f "$STAMP"
for b in etcd kubectl apiextensions-apiserver; do mv -f "$WORK/$b" "$BIN/$b"; done
rm -rf "$BIN/proto" && mv "$WORK/proto" "$BIN/proto"
mv -f "$WORK/versions.txt" "$VERSIONS"
echo "$RECIPE" >"$STAMP"

if [[ "${POLYRL_CONTROLPLANE_KEEP_WORK:-0}" != 1 ]]; then
    rm -rf "$WORK"
fi
log "done; binaries in $BIN:"
grep -v '^pkg ' "$VERSIONS" | sed 's/^/[controlplane]   /'
grep -E '^pkg (etcd-server|kubectl|golang-1\.[0-9]+-go|golang-k8s-(apiextensions-apiserver|apiserver|apimachinery|client-go)-dev)=' \
    "$VERSIONS" | sed 's/^pkg /[controlplane]   /'
echo "[controlplane]   (all package versions: $VERSIONS)"
