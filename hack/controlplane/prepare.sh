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
# system's apt sources are never touched. Why sid: it is the only Debian suite that packages
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
CACHE_ROOT="${POLYRL_CACHE:-$HOME/.cache/polyrl}/controlplane"
BIN="$CACHE_ROOT/bin"
STAMP="$BIN/.recipe"
VERSIONS="$BIN/versions.txt"
WORK="$CACHE_ROOT/work"
APT="$CACHE_ROOT/apt"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
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

have_all() {
    [[ -x "$BIN/etcd" && -x "$BIN/apiextensions-apiserver" && -x "$BIN/kubectl" && -d "$BIN/proto" ]] \
        && [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]]
}

if [[ "${POLYRL_CONTROLPLANE_REBUILD:-0}" != 1 ]] && have_all; then
    echo "[controlplane] cached binaries in $BIN (recipe $RECIPE):"
    sed 's/^/[controlplane]   /' "$VERSIONS" 2>/dev/null || true
    exit 0
fi

for tool in apt-get dpkg-deb python3 flock; do
    command -v "$tool" >/dev/null || die "'$tool' is required (this recipe needs a Debian-like machine)"
done
[[ -f "$KEYRING" ]] || die "$KEYRING is missing (install debian-archive-keyring)"

mkdir -p "$CACHE_ROOT" "$BIN"
# Two concurrent `make` runs must not build into the same folders.
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ "${POLYRL_CONTROLPLANE_REBUILD:-0}" != 1 ]] && have_all; then
    log "another run finished the build meanwhile"
    exit 0
fi

# ---- private apt configuration --------------------------------------------------------------
# Reuse the mirror host this machine is configured with (it is the one the network allows).
mirror="${POLYRL_DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror=$(
        { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
          grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
              | sed -E 's/\[[^]]*\]//' | awk '{print $2}'; } \
            | grep -v -e security -e '^$' | grep '/debian/\?$' | head -n1 || true
    )
    mirror="${mirror:-http://deb.debian.org/debian}"
fi
mirror="${mirror%/}"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/etc"
: >"$APT/status"
cat >"$APT/etc/sources.list" <<EOF
deb [signed-by=$KEYRING] $mirror sid main
deb-src [signed-by=$KEYRING] $mirror sid main
EOF
APTOPTS=(
    -o "Dir::Etc::SourceList=$APT/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State=$APT" -o "Dir::State::Lists=$APT/lists" -o "Dir::State::status=$APT/status"
    -o "Dir::Cache=$APT/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root
    -o Acquire::Languages=none -q
)
log "refreshing private apt index of $mirror sid (Packages + Sources)"
apt-get "${APTOPTS[@]}" update >"$APT/update.log" 2>&1 || { cat "$APT/update.log" >&2; die "apt-get update (private sid config) failed"; }

rm -rf "$WORK"
mkdir -p "$WORK/debs" "$WORK/root"
DEBS="$WORK/debs"
ROOT="$WORK/root"

# Downloads the named binary packages (candidate = newest in sid) and unpacks them into $ROOT.
fetch() {
    (cd "$DEBS" && apt-get "${APTOPTS[@]}" download "$@" >>"$WORK/download.log" 2>&1) \
        || { tail -n 20 "$WORK/download.log" >&2; die "apt-get download $* failed"; }
    local p f
    for p in "$@"; do
        for f in "$DEBS/${p}"_*.deb; do dpkg-deb -x "$f" "$ROOT"; done
    done
}

# ---- etcd and kubectl (prebuilt Debian binaries) --------------------------------------------
log "fetching etcd-server and kubectl"
fetch etcd-server kubectl
install -m 0755 "$ROOT/usr/bin/etcd" "$WORK/etcd"
install -m 0755 "$ROOT/usr/bin/kubectl" "$WORK/kubectl"

# ---- Go toolchain -----------------------------------------------------------------------------
gopkg=$(apt-cache "${APTOPTS[@]}" depends golang-go | awk '/Depends: golang-1\.[0-9]+-go/ {print $2; exit}')
[[ -n "$gopkg" ]] || die "cannot find sid's default Go toolchain (golang-go's Depends)"
log "fetching Go toolchain $gopkg + ${gopkg%-go}-src"
fetch "$gopkg" "${gopkg%-go}-src"
gover="${gopkg#golang-}"; GOROOT="$ROOT/usr/lib/go-${gover%-go}"
GO="$GOROOT/bin/go"
[[ -x "$GO" ]] || die "no go binary at $GO"

# ---- apiextensions-apiserver sources and the -dev packages it imports --------------------------
export GOROOT GOPATH="$ROOT/usr/share/gocode" GO111MODULE=off CGO_ENABLED=0 GOTOOLCHAIN=local \
    GOPROXY=off GOFLAGS=-buildvcs=false GOCACHE="$WORK/gocache" GOTELEMETRY=off
SRCDIR="$GOPATH/src/k8s.io/apiextensions-apiserver"
log "fetching golang-k8s-apiextensions-apiserver-dev"
fetch golang-k8s-apiextensions-apiserver-dev
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

# Debian's Sources index carries each Go package's import path(s) (Go-Import-Path); a missing
# import is mapped to the -dev package of the source with the longest matching import path.
# This fetches only what the build imports (~80 packages) instead of the >300-package Depends
# closure (tests, tools). Iterate because each new package reveals its own imports.
SOURCES_TXT="$WORK/Sources"
for f in "$APT"/lists/*_source_Sources*; do /usr/lib/apt/apt-helper cat-file "$f"; done >"$SOURCES_TXT"
PACKAGES_TXT="$WORK/Packages"
for f in "$APT"/lists/*_binary-*_Packages*; do /usr/lib/apt/apt-helper cat-file "$f"; done >"$PACKAGES_TXT"
[[ -s "$SOURCES_TXT" && -s "$PACKAGES_TXT" ]] || die "private apt update produced no Sources/Packages index"

map_imports() { # args: missing import paths; stdout: package names
    # (The script comes on stdin, so the import paths travel as arguments.)
    python3 - "$SOURCES_TXT" "$PACKAGES_TXT" "$@" <<'PY'
import sys


def stanzas(path: str) -> list[dict[str, str]]:
    out = []
    for block in open(path, encoding="utf-8", errors="replace").read().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if line[:1] not in ("", " ", "\t") and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        out.append(fields)
    return out


available = {f["Package"] for f in stanzas(sys.argv[2]) if "Package" in f}
by_path: dict[str, list[str]] = {}  # import path -> the source's -dev binaries in the archive
for fields in stanzas(sys.argv[1]):
    paths = [p.strip() for p in fields.get("Go-Import-Path", "").split(",") if p.strip()]
    # All -dev binaries of the source: one is often an empty transitional name (e.g.
    # golang-gogoprotobuf-dev) for the real one; they are small, so take every one.
    devs = [b.strip() for b in fields.get("Binary", "").split(",")]
    devs = [b for b in devs if b.endswith("-dev") and b in available]
    for path in paths:
        if devs and path not in by_path:
            by_path[path] = devs
missing = []
for imp in sys.argv[3:]:
    parts = imp.split("/")
    for n in range(len(parts), 0, -1):
        hit = by_path.get("/".join(parts[:n]))
        if hit:
            print("\n".join(hit))
            break
    else:
        missing.append(imp)
if missing:
    print("UNMAPPED " + " ".join(missing), file=sys.stderr)
PY
}

declare -A fetched=()
for round in $(seq 1 25); do
    missing=$(cd "$SRCDIR" && "$GO" list -e -deps -f '{{if .Error}}{{.ImportPath}}{{end}}' . 2>/dev/null | sort -u || true)
    if [[ -z "$missing" ]]; then break; fi
    # shellcheck disable=SC2086 # one import path per word
    pkgs=$(map_imports $missing 2>"$WORK/unmapped.txt" | sort -u)
    new=()
    for p in $pkgs; do
        if [[ -z "${fetched[$p]:-}" ]]; then new+=("$p"); fetched[$p]=1; fi
    done
    if [[ ${#new[@]} -eq 0 ]]; then
        cat "$WORK/unmapped.txt" >&2
        (cd "$SRCDIR" && "$GO" list -e -deps -f '{{if .Error}}{{.Error}}{{end}}' . 2>&1 | head -n 20 >&2) || true
        die "imports that no sid package provides: $(tr '\n' ' ' <<<"$missing" | cut -c1-400)"
    fi
    log "round $round: $(wc -w <<<"$missing") missing imports -> fetching ${#new[@]} packages"
    fetch "${new[@]}"
done

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
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $mirror sid, recipe $RECIPE"
    echo "$("$GO" version)"
    echo "etcd: $("$WORK/etcd" --version | head -n1)"
    echo "kubectl: $("$WORK/kubectl" version --client 2>/dev/null | head -n1)"
    echo "downloaded: $ndebs packages, $dlsize bytes"
    for f in "$DEBS"/*.deb; do dpkg-deb --showformat='pkg ${Package}=${Version}\n' -W "$f"; done | sort
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
