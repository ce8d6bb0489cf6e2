# shellcheck shell=bash
# Shared recipe: build a Go program from Debian sid source packages, without installing anything.
#
# Sourced (not run) by hack/controlplane/prepare.sh:
#
#   * a PRIVATE apt configuration (own sources.list pointing at sid on the mirror this machine
#     already uses, own lists/cache/state) -- the system's apt sources are never touched;
#   * packages fetched with `apt-get download` and unpacked with `dpkg-deb -x` into a work root;
#   * sid's default Go toolchain (golang-go's golang-1.NN-go + -src) from that root, building in
#     GOPATH mode (GO111MODULE=off) against the Go sources of the -dev packages under
#     /usr/share/gocode, which are resolved from the program's imports (`go list -deps`) via the
#     Go-Import-Path field of Debian's Sources index.
#
# The caller defines `log MSG...` and `die MSG...` (die must exit non-zero) before calling any
# function here, and runs under `set -Eeuo pipefail` (-E, so that an ERR trap also covers failures
# inside these functions).
#
# Usage:
#   dgo_apt_init "$CACHE_ROOT/apt"     # private apt config + `apt-get update` (sets APTOPTS, DGO_MIRROR)
#   dgo_workspace "$WORK"              # fresh $WORK/{debs,root} (sets DGO_WORK, DEBS, ROOT)
#   dgo_fetch pkg...                   # download newest sid packages and unpack them into $ROOT
#   dgo_toolchain                      # fetch + export the Go toolchain env (sets GO, GOROOT, GOPATH...)
#   dgo_resolve_imports DIR            # fetch the -dev packages providing DIR's missing imports
#   dgo_package_versions               # "pkg NAME=VERSION" per downloaded .deb, sorted
# Env: POLYRL_DEBIAN_MIRROR overrides the mirror (default: the system's Debian mirror).

DGO_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

dgo_check_host() {
    local tool
    for tool in apt-get apt-cache dpkg-deb python3 flock; do
        command -v "$tool" >/dev/null || die "'$tool' is required (this recipe needs a Debian-like machine)"
    done
    [[ -f "$DGO_KEYRING" ]] || die "$DGO_KEYRING is missing (install debian-archive-keyring)"
    [[ -x /usr/lib/apt/apt-helper ]] || die "/usr/lib/apt/apt-helper is missing (apt too old?)"
}

# The Debian mirror this machine is configured with (it is the one the network allows).
dgo_mirror() {
    local mirror="${POLYRL_DEBIAN_MIRROR:-}"
    if [[ -z "$mirror" ]]; then
        mirror=$(
            { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
              grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                  | sed -E 's/\[[^]]*\]//' | awk '{print $2}'; } \
                | grep -v -e security -e '^$' | grep '/debian/\?$' | head -n1 || true
        )
        mirror="${mirror:-http://deb.debian.org/debian}"
    fi
    echo "${mirror%/}"
}

# dgo_apt_init APTDIR: private apt configuration for sid (binary + source indexes) under APTDIR.
dgo_apt_init() {
    local apt="$1"
    dgo_check_host
    DGO_MIRROR=$(dgo_mirror)
    DGO_APT="$apt"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/etc"
    : >"$apt/status"
    cat >"$apt/etc/sources.list" <<EOF
deb [signed-by=$DGO_KEYRING] $DGO_MIRROR sid main
deb-src [signed-by=$DGO_KEYRING] $DGO_MIRROR sid main
EOF
    APTOPTS=(
        -o "Dir::Etc::SourceList=$apt/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State=$apt" -o "Dir::State::Lists=$apt/lists" -o "Dir::State::status=$apt/status"
        -o "Dir::Cache=$apt/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root
        -o Acquire::Languages=none -q
    )
    log "refreshing private apt index of $DGO_MIRROR sid (Packages + Sources)"
    apt-get "${APTOPTS[@]}" update >"$apt/update.log" 2>&1 \
        || { cat "$apt/update.log" >&2; die "apt-get update (private sid config) failed"; }
    # apt-get update exits 0 when a fetch fails (it only warns): check that both indexes came.
    if ! compgen -G "$apt/lists/*_sid_main_binary-*_Packages*" >/dev/null \
        || ! compgen -G "$apt/lists/*_sid_main_source_Sources*" >/dev/null \
        || grep -q '^[WE]: Failed to fetch' "$apt/update.log"; then
        tail -n 20 "$apt/update.log" >&2
        die "apt-get update could not fetch the sid indexes from $DGO_MIRROR"
    fi
}

# dgo_workspace WORK: a fresh work folder with debs/ (downloads) and root/ (unpacked packages).
dgo_workspace() {
    DGO_WORK="$1"
    rm -rf "$DGO_WORK"
    mkdir -p "$DGO_WORK/debs" "$DGO_WORK/root"
    DEBS="$DGO_WORK/debs"
    ROOT="$DGO_WORK/root"
}

# dgo_fetch PKG...: download the named binary packages (newest in sid) and unpack them into $ROOT.
dgo_fetch() {
    (cd "$DEBS" && apt-get "${APTOPTS[@]}" download "$@" >>"$DGO_WORK/download.log" 2>&1) \
        || { tail -n 20 "$DGO_WORK/download.log" >&2; die "apt-get download $* failed"; }
    local p f
    for p in "$@"; do
        for f in "$DEBS/${p}"_*.deb; do
            [[ -f "$f" ]] || die "apt-get download $p produced no .deb"
            dpkg-deb -x "$f" "$ROOT"
        done
    done
}

# dgo_toolchain: sid's default Go toolchain into $ROOT; exports a GOPATH-mode, offline Go env.
dgo_toolchain() {
    local gopkg gover
    gopkg=$({ apt-cache "${APTOPTS[@]}" depends golang-go 2>/dev/null || true; } \
        | awk '/Depends: golang-1\.[0-9]+-go/ {print $2; exit}')
    [[ -n "$gopkg" ]] || die "cannot find sid's default Go toolchain (golang-go's Depends)"
    log "fetching Go toolchain $gopkg + ${gopkg%-go}-src"
    dgo_fetch "$gopkg" "${gopkg%-go}-src"
    gover="${gopkg#golang-}"
    GOROOT="$ROOT/usr/lib/go-${gover%-go}"
    GO="$GOROOT/bin/go"
    [[ -x "$GO" ]] || die "no go binary at $GO"
    export GOROOT GOPATH="$ROOT/usr/share/gocode" GO111MODULE=off CGO_ENABLED=0 GOTOOLCHAIN=local \
        GOPROXY=off GOFLAGS=-buildvcs=false GOCACHE="$DGO_WORK/gocache" GOTELEMETRY=off
}

# Flattened Sources/Packages indexes of the private apt lists (for dgo_map_imports).
_dgo_indexes() {
    [[ -s "$DGO_WORK/Sources" && -s "$DGO_WORK/Packages" ]] && return 0
    local f
    for f in "$DGO_APT"/lists/*_source_Sources*; do /usr/lib/apt/apt-helper cat-file "$f"; done >"$DGO_WORK/Sources"
    for f in "$DGO_APT"/lists/*_binary-*_Packages*; do /usr/lib/apt/apt-helper cat-file "$f"; done >"$DGO_WORK/Packages"
    [[ -s "$DGO_WORK/Sources" && -s "$DGO_WORK/Packages" ]] || die "private apt update produced no Sources/Packages index"
}

# dgo_map_imports IMPORT...: the -dev packages that provide the import paths (stdout, one per
# line); unmapped paths go to stderr as "UNMAPPED ...". Debian's Sources index carries each Go
# package's import path(s) (Go-Import-Path); an import maps to the -dev binaries of the source
# with the longest matching import path.
dgo_map_imports() {
    _dgo_indexes
    # (The script comes on stdin, so the import paths travel as arguments.)
    python3 - "$DGO_WORK/Sources" "$DGO_WORK/Packages" "$@" <<'PY'
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
    # All -dev binaries of the source: one is often an empty transitional name for the real one.
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

# dgo_resolve_imports DIR: fetch (iteratively: each new package reveals its own imports) the -dev
# packages that provide every import of the Go package in DIR that is not yet in $GOPATH.
dgo_resolve_imports() {
    local dir="$1" round missing pkgs p
    local -a new
    declare -gA DGO_FETCHED
    for round in $(seq 1 25); do
        missing=$(cd "$dir" && "$GO" list -e -deps -f '{{if .Error}}{{.ImportPath}}{{end}}' . 2>/dev/null | sort -u || true)
        if [[ -z "$missing" ]]; then return 0; fi
        # shellcheck disable=SC2086 # one import path per word
        pkgs=$(dgo_map_imports $missing 2>"$DGO_WORK/unmapped.txt" | sort -u)
        new=()
        for p in $pkgs; do
            if [[ -z "${DGO_FETCHED[$p]:-}" ]]; then new+=("$p"); DGO_FETCHED[$p]=1; fi
        done
        if [[ ${#new[@]} -eq 0 ]]; then
            cat "$DGO_WORK/unmapped.txt" >&2
            (cd "$dir" && "$GO" list -e -deps -f '{{if .Error}}{{.Error}}{{end}}' . 2>&1 | head -n 20 >&2) || true
            die "imports that no sid package provides: $(tr '\n' ' ' <<<"$missing" | cut -c1-400)"
        fi
        log "round $round: $(wc -w <<<"$missing") missing imports -> fetching ${#new[@]} packages: ${new[*]}"
        dgo_fetch "${new[@]}"
    done
    die "imports still missing after 25 rounds of fetching"
}

# dgo_package_versions: "pkg NAME=VERSION" for every downloaded .deb, sorted.
dgo_package_versions() {
    local f
    # shellcheck disable=SC2016 # dpkg-deb's own ${Field} syntax
    for f in "$DEBS"/*.deb; do dpkg-deb --showformat='pkg ${Package}=${Version}\n' -W "$f"; done | sort
}
