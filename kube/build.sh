#!/bin/bash
# Build the Kubernetes control plane the test cluster runs, from upstream Go
# modules pinned by go.mod/go.sum in this directory:
#   controlplane/  k8s.io/kubernetes (kube-apiserver, kube-controller-manager,
#                  kube-scheduler, kubectl) with its staging modules, and the
#                  etcd server release that Kubernetes release pins as client
#   kwok/          sigs.k8s.io/kwok (simulated kubelets and nodes)
#   helm/          helm.sh/helm/v4
#   helm-unittest/ github.com/helm-unittest/helm-unittest (the chart's snapshot tests)
#
#   kube/build.sh          # prints NAME=PATH for each binary
#
# Everything lives OUTSIDE the repository, under $PYK8SRES_KUBE_CACHE
# (default /var/cache/pyk8sres/kube):
#   go/mod, go/build   the Go module and build caches
#   <stamp>/bin        the binaries of one set of go.mod/go.sum (never
#                      overwritten: running daemons keep their inode)
# Idempotent (a built stamp prints at once), one build at a time (flock).
# go.sum is checked by the go command (-mod=readonly): a module whose hash
# differs fails the build.  Cold: about 6 minutes on 2 cores.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${PYK8SRES_KUBE_CACHE:-/var/cache/pyk8sres/kube}"

log() { echo "kube/build.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# The Go toolchain: on PATH, else where the official tarball installs it.
command -v go >/dev/null || PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null || die "the Go toolchain (>= 1.26) is missing: https://go.dev/doc/install"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build"
export GOFLAGS="-mod=readonly -modcacherw -trimpath" GOTOOLCHAIN=local CGO_ENABLED=0

stamp=$( (cd "$HERE" && cat build.sh */go.mod */go.sum && go version) | sha256sum | cut -c1-16)
out="$CACHE/$stamp/bin"
names="kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm helm-unittest"
print_paths() {
	local n
	for n in $names; do echo "$n=$out/$n"; done
}
if [[ -e "$out/.complete" ]]; then
	print_paths
	exit 0
fi

# The version the binaries report (kubectl version, /version): the module's.
k8s=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$HERE/controlplane/go.mod")
[[ $k8s =~ ^v1\.([0-9]+)\. ]] || die "cannot read the k8s.io/kubernetes version from controlplane/go.mod"
minor=${BASH_REMATCH[1]}
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s \
-X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
-X k8s.io/component-base/version.gitTreeState=clean \
-X k8s.io/client-go/pkg/version.gitVersion=$k8s"

tmp="$CACHE/$stamp/bin.new"
rm -rf "$tmp"
mkdir -p "$tmp"
start=$(date +%s)
log "building Kubernetes $k8s and etcd (controlplane/go.mod) into $out"
(cd "$HERE/controlplane" && nice go build -ldflags "$ldflags" -o "$tmp/" \
	k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
	go.etcd.io/etcd/server/v3) || die "go build of the control plane failed (see above)"
mv "$tmp/v3" "$tmp/etcd" 2>/dev/null || mv "$tmp/server" "$tmp/etcd"
kwok=$(awk '$1 == "sigs.k8s.io/kwok" { print $2 }' "$HERE/kwok/go.mod")
log "building kwok $kwok (kwok/go.mod)"
(cd "$HERE/kwok" && nice go build -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$kwok" \
	-o "$tmp/" sigs.k8s.io/kwok/cmd/kwok) || die "go build of kwok failed (see above)"
log "building helm (helm/go.mod) and helm-unittest (helm-unittest/go.mod)"
(cd "$HERE/helm" && nice go build -ldflags "-s -w" -o "$tmp/" helm.sh/helm/v4/cmd/helm) ||
	die "go build of helm failed (see above)"
(cd "$HERE/helm-unittest" && nice go build -ldflags "-s -w" -o "$tmp/" \
	github.com/helm-unittest/helm-unittest/cmd/helm-unittest) || die "go build of helm-unittest failed (see above)"
for n in $names; do
	[[ -x "$tmp/$n" ]] || die "the build made no $n"
done
rm -rf "$out"
mv "$tmp" "$out"
echo "$(($(date +%s) - start))" >"$out/.build-seconds"
touch "$out/.complete"
log "built in $(cat "$out/.build-seconds") s"
print_paths
