#!/bin/bash
# Build pyk8sres-apiserver (kube/apiserver) from upstream Kubernetes Go
# sources packaged by Debian sid, and provide etcd and kubectl from sid too.
#
#   kube/build.sh            # prints the paths of the three binaries
#
# Everything lives in a cache OUTSIDE the repository:
#   $PYK8SRES_CACHE (default /var/cache/pyk8sres/kube)
#     apt/     temporary apt state for sid (never touches /etc/apt)
#     debs/    downloaded .deb files
#     root/    the .debs unpacked with dpkg -x (Go toolchain, Go sources, etcd, kubectl)
#     gopath/  our sources + generated OpenAPI models (GOPATH mode build)
#     bin/     pyk8sres-apiserver, etcd, kubectl
# Idempotent: when the binary exists and the sources are unchanged (stamp)
# it returns in well under a second. Needs: apt-get, dpkg, sha256sum, flock.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${PYK8SRES_CACHE:-/var/cache/pyk8sres/kube}"
# The Debian mirror this machine's apt uses (or PYK8SRES_DEBIAN_MIRROR).
. "$HERE/../tools/debian-mirror.sh"
KEYRING="${PYK8SRES_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"
# Root packages; their Go -dev dependency closure is added automatically.
ROOT_PKGS="golang-k8s-apiserver-dev golang-k8s-apiextensions-apiserver-dev golang-1.27-go"
TOOL_PKGS="etcd-server kubectl kube-openapi"

log() { echo "kube/build.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

mkdir -p "$CACHE/bin"
exec 9>"$CACHE/.lock"
flock 9 # one build at a time (parallel test sessions share the cache)

# Stamp: our Go sources + this script. Unchanged + binaries present = done.
STAMP="$(cat "$HERE"/apiserver/*.go "$HERE/build.sh" | sha256sum | cut -d' ' -f1)"
print_paths() {
    echo "apiserver=$CACHE/bin/pyk8sres-apiserver"
    echo "etcd=$CACHE/bin/etcd"
    echo "kubectl=$CACHE/bin/kubectl"
}
if [[ -x "$CACHE/bin/pyk8sres-apiserver" && -x "$CACHE/bin/etcd" && -x "$CACHE/bin/kubectl" &&
      "$(cat "$CACHE/bin/.stamp" 2>/dev/null)" == "$STAMP" ]]; then
    print_paths
    exit 0
fi

ROOT="$CACHE/root"
# ---- 1. download and unpack the sid packages (once) ----
if [[ ! -e "$ROOT/.complete" ]]; then
    debian_mirrors || die "cannot download the Kubernetes sources without a Debian mirror"
    MIRROR=$DEBIAN_MIRROR
    command -v apt-get >/dev/null || die "apt-get not found: this build needs a Debian-like system"
    [[ -r "$KEYRING" ]] || die "$KEYRING missing: apt-get install debian-archive-keyring"
    APT="$CACHE/apt"
    rm -rf "$APT" "$CACHE/debs" "$ROOT"
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$CACHE/debs" "$ROOT"
    echo "deb [signed-by=$KEYRING] $MIRROR sid main" >"$APT/sid.list"
    : >"$APT/status" # empty dpkg status: nothing counts as installed
    APTOPTS=(-o "Dir::Etc::SourceList=$APT/sid.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "Dir::State::status=$APT/status"
        -o APT::Sandbox::User=root)
    log "fetching the Debian sid package index from $MIRROR"
    apt-get "${APTOPTS[@]}" -q update --error-on=any >"$APT/update.log" 2>&1 ||
        die "apt-get update for sid failed (see $APT/update.log): is $MIRROR reachable?"
    # The Go -dev closure (their Depends are other golang-* packages; C
    # libraries and tools they pull in are not needed to compile).
    apt-cache "${APTOPTS[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances $ROOT_PKGS >"$APT/depends.txt" 2>"$APT/depends.err" ||
        die "resolving dependencies failed (see $APT/depends.err): does sid still ship $ROOT_PKGS?"
    grep -E '^golang' "$APT/depends.txt" | sort -u >"$APT/packages.txt"
    echo $TOOL_PKGS | tr ' ' '\n' >>"$APT/packages.txt"
    log "downloading $(wc -l <"$APT/packages.txt") packages from sid (~350 MB)"
    (cd "$CACHE/debs" && apt-get "${APTOPTS[@]}" -q download $(cat "$APT/packages.txt")) >"$APT/download.log" 2>&1 ||
        die "apt-get download failed (see $APT/download.log)"
    log "unpacking"
    find "$CACHE/debs" -name '*.deb' -print0 | xargs -0 -n 8 -P 4 sh -c 'for f; do dpkg -x "$f" "$0" || exit 255; done' "$ROOT" ||
        die "dpkg -x failed"
    touch "$ROOT/.complete"
fi

GOROOT="$(ls -d "$ROOT"/usr/lib/go-1.* 2>/dev/null | sort -V | tail -1)"
[[ -x "$GOROOT/bin/go" ]] || die "no Go toolchain under $ROOT/usr/lib (remove $ROOT to download again)"
export GOROOT PATH="$GOROOT/bin:$PATH"
export GOPATH="$CACHE/gopath:$ROOT/usr/share/gocode"
export GO111MODULE=off GOPROXY=off GOTOOLCHAIN=local GOFLAGS= CGO_ENABLED=0
export GOCACHE="$CACHE/gocache"
SRC="$CACHE/gopath/src/pyk8sres"

# ---- 2. OpenAPI models of the built-in types (once) ----
# Debian does not package k8s.io/kubernetes' generated models; openapi-gen
# (from sid's kube-openapi) makes them from k8s.io/api. Needed for
# server-side apply and kubectl's OpenAPI use.
if ! grep -qs admissionregistration "$SRC/openapi/zz_openapi.go"; then
    log "generating OpenAPI models"
    mkdir -p "$SRC/openapi"
    : >"$CACHE/gopath/boilerplate.txt"
    "$ROOT/usr/bin/openapi-gen" --go-header-file "$CACHE/gopath/boilerplate.txt" \
        --output-dir "$SRC/openapi" --output-pkg pyk8sres/openapi --output-file zz_openapi.go.tmp \
        -r /dev/null \
        k8s.io/api/core/v1 k8s.io/api/rbac/v1 k8s.io/api/admissionregistration/v1 k8s.io/apimachinery/pkg/apis/meta/v1 \
        k8s.io/apimachinery/pkg/runtime k8s.io/apimachinery/pkg/version \
        k8s.io/apimachinery/pkg/api/resource k8s.io/apimachinery/pkg/util/intstr ||
        die "openapi-gen failed"
    mv "$SRC/openapi/zz_openapi.go.tmp" "$SRC/openapi/zz_openapi.go"
fi

# ---- 3. build ----
rm -rf "$SRC/apiserver"
mkdir -p "$SRC/apiserver"
cp "$HERE"/apiserver/*.go "$SRC/apiserver/"
log "building pyk8sres-apiserver (first build ~5-7 min on 2 cores, then ~20 s)"
start=$(date +%s)
(cd "$SRC/apiserver" && go build -trimpath -o "$CACHE/bin/pyk8sres-apiserver.new" .) || die "go build failed"
mv "$CACHE/bin/pyk8sres-apiserver.new" "$CACHE/bin/pyk8sres-apiserver"
log "built in $(($(date +%s) - start)) s"

# ---- 4. etcd and kubectl from sid ----
for tool in etcd kubectl; do
    [[ -x "$ROOT/usr/bin/$tool" ]] || die "$tool missing from $ROOT/usr/bin"
    ln -sfn "../root/usr/bin/$tool" "$CACHE/bin/$tool" # relative: the cache can be moved
done
echo "$STAMP" >"$CACHE/bin/.stamp"
print_paths
