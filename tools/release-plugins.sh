#!/bin/bash
# Build this checkout's pyk8sres (Python package, core, both plugins) against
# a Slurm release built by tools/slurm-build.sh, into a per-release prefix
# that `pyk8sres cluster up --slurm VERSION` installs the plugins from.
#
# Usage: tools/release-plugins.sh VERSION      e.g. 24.11
# Prints the prefix: ${PYK8SRES_RELEASE_PACKAGES:-<slurm-build>}/<version>/pyk8sres
# (<slurm-build> is ${PYK8SRES_SLURM_BUILD:-/var/cache/pyk8sres/slurm-build}).
# Idempotent: rebuilds only when this checkout's sources or the Slurm build
# changed (a stamp of both); one build per release at a time (flock).
set -eu

die() { echo "release-plugins: error: $*" >&2; exit 1; }
say() { echo "release-plugins: $*" >&2; }

[ $# -eq 1 ] || die "usage: $0 VERSION (e.g. 24.11)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
slurm_prefix=$("$repo/tools/slurm-build.sh" "$1") || die "Slurm $1 is not built (see above)"
dir=$(dirname "$slurm_prefix")
version=$(basename "$dir")
out=${PYK8SRES_RELEASE_PACKAGES:-$(dirname "$dir")}/$version/pyk8sres
mkdir -p "$(dirname "$out")" || die "cannot create $(dirname "$out")"

# What the build depends on: our sources (tracked files as they are now) and
# the Slurm build itself.
stamp=$( (cd "$repo" && { git ls-files -co --exclude-standard 2>/dev/null || find . -type f -not -path './.git/*'; } |
	grep -E '^(\./)?(pyk8sres/|plugins/|meson\.build|meson\.options|pyproject\.toml|kube/|deploy/)' |
	sort | xargs -d '\n' sha256sum; cat "$dir/build-seconds") | sha256sum | cut -d' ' -f1)
exec 9>"$out.lock"
flock 9
if [ "$(cat "$out/.stamp" 2>/dev/null)" = "$stamp" ]; then
	echo "$out"
	exit 0
fi
say "building pyk8sres for Slurm $version into $out"
start=$(date +%s)
rm -rf "$out.new"
log=$(dirname "$out")/pyk8sres-build.log
(cd "$repo" && nice python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
	--no-build-isolation --no-deps --ignore-installed --prefix "$out.new" \
	-Csetup-args=-Dslurm_include="$slurm_prefix/include" \
	-Csetup-args=-Dslurm_source="$dir/src" \
	-Csetup-args=-Dnode_features=enabled . >"$log" 2>&1) || {
	tail -n 30 "$log" >&2
	die "pip install failed, see $log"
}
lib=$(ls -d "$out.new"/lib/python3*/site-packages/pyk8sres/_lib 2>/dev/null | head -n1)
# 26.05.3 and 26.5.3 are the same release (meson prints numbers).
norm() { echo "$1" | awk -F. '{ printf "%d.%d.%d", $1, $2, $3 }'; }
[ -n "$lib" ] && [ "$(norm "$(cat "$lib/slurm_version.txt")")" = "$(norm "$version")" ] ||
	die "the build in $out.new is not for Slurm $version"
# A running slurmctld may have the old core mapped: move, never overwrite.
[ ! -e "$out" ] || mv "$out" "$out.old.$$"
mv "$out.new" "$out"
rm -rf "$out.old.$$" &
echo "$stamp" >"$out/.stamp"
say "built in $(($(date +%s) - start)) s"
echo "$out"
