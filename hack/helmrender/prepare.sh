#!/usr/bin/env bash
# Builds, once, into a cache, `helmrender`: a Helm chart renderer for the tests (no helm binary
# can be had on the test machines: not on PyPI, npm or in Debian, and GitHub is unreachable).
#
#   helmrender   hack/helmrender/main.go: Go's text/template + sprig v3 + sigs.k8s.io/yaml, wired
#                up the way `helm template` (Helm v3.21) does it. Built with sid's default Go
#                toolchain against the Go sources of Debian sid -dev packages
#                (golang-github-masterminds-sprig-dev, golang-k8s-sigs-yaml-dev, ... and whatever
#                they import), resolved from main.go's imports.
#
# Same approach as hack/controlplane/prepare.sh (shared functions in hack/lib/debian-go.sh):
# nothing is installed system-wide; packages come through a PRIVATE apt configuration under the
# cache folder and are unpacked with `dpkg-deb -x`; the system's apt sources are never touched.
#
# Output: ${POLYRL_CACHE:-~/.cache/polyrl}/helmrender/bin/{helmrender,versions.txt,.recipe}.
# The stamp (.recipe) holds the recipe number and the sha256 of main.go, so editing main.go
# rebuilds on the next run. Idempotent: when the stamp matches it prints what is there and exits 0
# in well under a second. On any failure it exits non-zero with a loud message; the tests that
# need the renderer are then skipped with a loud reason (never silently passed).
#
# Env: POLYRL_CACHE (default ~/.cache/polyrl), POLYRL_DEBIAN_MIRROR (default: the system's),
#      POLYRL_HELMRENDER_REBUILD=1 to force a rebuild, POLYRL_HELMRENDER_KEEP_WORK=1 to keep the
#      unpacked sources after a successful build.
set -Eeuo pipefail  # -E: the ERR trap (loud failure) also fires inside functions

# Bump when the recipe changes in a way that needs a rebuild of the cached binary.
RECIPE=1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MAIN_GO="$HERE/main.go"
CACHE_ROOT="${POLYRL_CACHE:-$HOME/.cache/polyrl}/helmrender"
BIN="$CACHE_ROOT/bin"
STAMP="$BIN/.recipe"
VERSIONS="$BIN/versions.txt"
WORK="$CACHE_ROOT/work"
T0=$(date +%s)

log() { printf '[helmrender %4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
die() {
    {
        echo
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        echo "!!! HELM RENDERER PREPARATION FAILED: $*"
        echo "!!! The tests that render Helm charts will be SKIPPED until this is fixed."
        echo "!!! Work folder (for inspection): $WORK"
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    } >&2
    exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

[[ -f "$MAIN_GO" ]] || die "missing $MAIN_GO"
want_stamp="recipe=$RECIPE main.go=$(sha256sum "$MAIN_GO" | cut -c1-64)"
have_it() {
    [[ -x "$BIN/helmrender" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]
}

if [[ "${POLYRL_HELMRENDER_REBUILD:-0}" != 1 ]] && have_it; then
    echo "[helmrender] cached binary $BIN/helmrender ($want_stamp):"
    grep -v '^pkg ' "$VERSIONS" 2>/dev/null | sed 's/^/[helmrender]   /' || true
    exit 0
fi

# shellcheck source=SCRIPTDIR/../lib/debian-go.sh
source "$HERE/../lib/debian-go.sh"
dgo_check_host

mkdir -p "$CACHE_ROOT" "$BIN"
# Two concurrent `make` runs must not build into the same folders.
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ "${POLYRL_HELMRENDER_REBUILD:-0}" != 1 ]] && have_it; then
    log "another run finished the build meanwhile"
    exit 0
fi

dgo_apt_init "$CACHE_ROOT/apt"
dgo_workspace "$WORK"
dgo_toolchain

# main.go goes inside $GOPATH next to a go.mod: only such code gets GOPATH mode's "minimal module
# compatibility" (Debian installs github.com/Masterminds/semver/v3 as github.com/Masterminds/semver,
# and `import ".../semver/v3"` resolves there only from a module-aware directory).
SRC="$GOPATH/src/polyrl.invalid/helmrender"
mkdir -p "$SRC"
cp "$MAIN_GO" "$SRC/main.go"
printf 'module polyrl.invalid/helmrender\n\ngo 1.22\n' >"$SRC/go.mod"
log "resolving main.go's imports to sid -dev packages"
dgo_resolve_imports "$SRC"

ndebs=$(find "$DEBS" -name '*.deb' | wc -l)
dlsize=$(du -cb "$DEBS"/*.deb | tail -n1 | cut -f1)
log "all sources present: $ndebs packages, $((dlsize / 1000000)) MB downloaded; building"
sprigver=$(dpkg-deb -f "$DEBS"/golang-github-masterminds-sprig-dev_*.deb Version)
yamlver=$(dpkg-deb -f "$DEBS"/golang-k8s-sigs-yaml-dev_*.deb Version)
LDFLAGS="-s -w -X 'main.buildInfo=sprig $sprigver, sigs.k8s.io/yaml $yamlver, $("$GO" version | cut -d' ' -f3)'"
(cd "$SRC" && "$GO" build -trimpath -ldflags="$LDFLAGS" -o "$WORK/helmrender" .) \
    >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; die "go build of helmrender failed"; }
log "built helmrender ($(($(stat -c %s "$WORK/helmrender") / 1000)) kB)"

# ---- smoke check, then publish into the cache ------------------------------------------------
smoke="$WORK/smoke"
mkdir -p "$smoke/templates"
printf 'apiVersion: v2\nname: smoke\nversion: 0.1.0\n' >"$smoke/Chart.yaml"
printf 'greeting: hello\n' >"$smoke/values.yaml"
printf 'kind: ConfigMap\ndata:\n  g: {{ .Values.greeting | upper | quote }}\n' >"$smoke/templates/cm.yaml"
out=$("$WORK/helmrender" --chart "$smoke") || die "the built helmrender does not run"
grep -q 'g: "HELLO"' <<<"$out" || die "the built helmrender renders wrongly: $out"

{
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $DGO_MIRROR sid, $want_stamp"
    "$GO" version
    echo "helmrender: $("$WORK/helmrender" --version)"
    echo "downloaded: $ndebs packages, $dlsize bytes"
    dgo_package_versions
} >"$WORK/versions.txt"

rm -f "$STAMP"
mv -f "$WORK/helmrender" "$BIN/helmrender"
mv -f "$WORK/versions.txt" "$VERSIONS"
echo "$want_stamp" >"$STAMP"

if [[ "${POLYRL_HELMRENDER_KEEP_WORK:-0}" != 1 ]]; then
    rm -rf "$WORK"
fi
log "done; $BIN/helmrender:"
grep -v '^pkg ' "$VERSIONS" | sed 's/^/[helmrender]   /'
echo "[helmrender]   (all package versions: $VERSIONS)"
