#!/bin/bash
# Build a Slurm release that is not installed, from Debian's source package,
# into a cache prefix, so the test cluster can run it
# (`pyk8sres cluster up --slurm 24.11`).
#
# Usage: tools/slurm-build.sh VERSION     e.g. 24.11, 26.05, 24.11.5
#        tools/slurm-build.sh --source DIR VERSION
#   --source DIR: build that unpacked Slurm tree (e.g. an upstream release
#   tarball) instead of Debian's source package; VERSION must match it.
# Prints the install prefix on stdout (progress goes to stderr):
#   ${PYK8SRES_SLURM_BUILD:-/var/cache/pyk8sres/slurm-build}/<upstream version>/prefix
# with sbin/slurmctld, sbin/slurmd, bin/scontrol, bin/sbatch, include/slurm,
# lib/slurm (PluginDir), and next to it src/ (the configured tree the
# plugins are built against: meson -Dslurm_source=.../src).
#
# Configured like Debian's build where it matters for the tests:
# --enable-multiple-slurmd, munge (libmunge-dev), slurmrestd with JWT where
# the release builds it (libjwt-dev, libjson-c-dev, libhttp-parser-dev,
# libyaml-dev), slurmdbd's accounting_storage/mysql (libmariadb-dev).  Missing build packages are installed with apt-get (set
# PYK8SRES_NO_APT=1 to only report them).
# Exit status 77 when the mirror does not have the release's source.
# Idempotent and cached: a finished build prints its prefix at once; one
# build per version at a time (flock).  About 4 min on 2 cores (24.11.5: 221 s).
set -eu

die() { echo "slurm-build: error: $*" >&2; exit 1; }
say() { echo "slurm-build: $*" >&2; }

tree=
if [ "${1:-}" = --source ]; then
	[ $# -eq 3 ] || die "usage: $0 --source DIR VERSION"
	tree=$(cd "$2" && pwd) || die "no such directory: $2"
	shift 2
	[ -f "$tree/META" ] && [ -f "$tree/configure" ] && [ -d "$tree/src/slurmctld" ] ||
		die "$tree is not a Slurm source tree (META, configure and src/slurmctld missing): unpack a release tarball, or \`git archive\` a release tag such as slurm-26-05-3-1 of SchedMD's repository"
fi
[ $# -eq 1 ] || die "usage: $0 [--source DIR] VERSION (e.g. 24.11 or 26.05)"
want=$1
root=${PYK8SRES_SLURM_BUILD:-/var/cache/pyk8sres/slurm-build}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Newest finished build whose version is WANT or starts with WANT. or WANT-.
finished() {
	local d
	for d in "$root"/*/; do
		[ -f "$d/.ready" ] && basename "$d"
	done 2>/dev/null | awk -v v="$1" '$0 == v || index($0, v ".") == 1' | sort -V | tail -n1
}
done_v=$(finished "$want")
if [ -n "$done_v" ]; then
	echo "$root/$done_v/prefix"
	exit 0
fi

if [ -n "$tree" ]; then
	orig=$tree
	# An unconfigured tree has no slurm_version.h yet: META says the version.
	meta() { sed -n "s/^ *$1:[[:space:]]*\([0-9]*\).*/\1/p" "$orig/META" | head -n1; }
	version=$(meta Major).$(meta Minor).$(meta Micro)
	[ "$version" != .. ] || die "cannot read the version from $orig/META"
	case "$version" in "$want" | "$want".*) ;; *) die "$orig is Slurm $version, not $want" ;; esac
else
	# The Debian source of that release (cached by slurm-source.sh).
	orig=$("$here/slurm-source.sh" "$want") || {
		rc=$?
		echo "slurm-build: error: no source for Slurm $want (see above)" >&2
		exit $rc # 77: the mirror does not have it
	}
	num=$(sed -n 's/^#define SLURM_VERSION_NUMBER \(0x[0-9a-fA-F]*\).*/\1/p' "$orig/slurm/slurm_version.h")
	[ -n "$num" ] || die "cannot read SLURM_VERSION_NUMBER from $orig/slurm/slurm_version.h"
	version=$(printf '%d.%02d.%d' $((num >> 16)) $(((num >> 8) & 255)) $((num & 255)))
fi
installed=$(dpkg-query -W -f '${Version}' slurmctld 2>/dev/null || true)
case "$installed" in "$version"-*)
	say "note: $version is the installed release: 'cluster up --slurm installed' needs no build" ;;
esac

dir=$root/$version
mkdir -p "$dir" || die "cannot create $dir (set PYK8SRES_SLURM_BUILD)"
exec 9>"$dir/.lock"
flock 9
if [ -f "$dir/.ready" ]; then
	echo "$dir/prefix"
	exit 0
fi

# Build dependencies (Debian package names).
need=(gcc make libmunge-dev libjwt-dev libjson-c-dev libhttp-parser-dev libyaml-dev libmariadb-dev)
missing=()
for p in "${need[@]}"; do
	dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	[ -z "${PYK8SRES_NO_APT:-}" ] || die "missing build packages: ${missing[*]} (apt-get install them)"
	say "installing build packages: ${missing[*]}"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 ||
		die "apt-get install ${missing[*]} failed"
fi

src=$dir/src
prefix=$dir/prefix
rm -rf "$src" "$prefix"
say "copying $orig to $src"
cp -a "$orig" "$src"
log=$dir/build.log
start=$(date +%s)
say "configuring Slurm $version for $prefix (log: $log)"
(cd "$src" && nice ./configure --prefix="$prefix" --sysconfdir="$prefix/etc" \
	--enable-multiple-slurmd --disable-debug --without-rpath \
	--with-munge --with-jwt --with-json --with-http-parser --with-yaml \
	--without-hdf5 --without-lua >"$log" 2>&1) ||
	die "./configure failed, see $log"
grep -E '^configure: WARNING' "$log" >&2 || true
say "compiling (make -j${PYK8SRES_BUILD_JOBS:-2}, niced)"
(cd "$src" && nice make -j"${PYK8SRES_BUILD_JOBS:-2}" >>"$log" 2>&1) || die "make failed, see $log"
(cd "$src" && nice make install >>"$log" 2>&1) || die "make install failed, see $log"
for f in sbin/slurmctld sbin/slurmd bin/scontrol bin/sbatch include/slurm/slurm.h; do
	[ -e "$prefix/$f" ] || die "$prefix/$f missing after make install, see $log"
done
secs=$(($(date +%s) - start))
echo "$secs" >"$dir/build-seconds"
echo "${orig%/src}" >"$dir/source"
touch "$dir/.ready"
say "Slurm $version built in ${secs} s: $prefix"
echo "$prefix"
