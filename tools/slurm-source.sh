#!/bin/bash
# Fetch and configure the exact source of a Slurm release from Debian's
# source packages, for plugins that need Slurm internals (node_features/
# k8s_resources uses node_record_t and gres_node_feature(), which no public
# header declares) and for tools/slurm-build.sh.
#
# Usage: tools/slurm-source.sh [VERSION]
#   VERSION   a Debian version (22.05.8-4+deb12u3), an upstream release
#             (24.11.5) or a series (26.05): the newest Debian version that
#             matches; "latest": the newest slurm-wlm in the searched suites.
#             Default: the installed slurmctld's exact version.
# Prints the configured source directory on stdout (everything else goes to
# stderr), so `SRC=$(tools/slurm-source.sh)` works.  Idempotent: with the tree
# already cached it prints the path at once, without network.
#
# Cache: ${PYK8SRES_SLURM_SRC:-${PYK8SRES_CACHE:-/var/cache/pyk8sres}/slurm-src}/<debian version>/src.
# Suites searched: PYK8SRES_DEBIAN_CODENAME (default: VERSION_CODENAME of
# /etc/os-release) with its -updates and -security, then
# PYK8SRES_DEBIAN_SUITES (default "oldstable stable testing unstable"; set it
# empty to search only the release).
# Mirror: the one this machine's apt uses (tools/debian-mirror.sh), or
# PYK8SRES_DEBIAN_MIRROR / PYK8SRES_DEBIAN_SECURITY_MIRROR.
# Exit status 77 when the mirror does not have the release's source.
# Never touches /etc/apt: apt runs on a temporary sources list and temporary
# state/cache dirs that are removed on exit.
set -eu

die() { echo "slurm-source: error: $*" >&2; exit 1; }
# Exit 77: the mirror does not have this release's source (not a bug here;
# callers such as CI may report it as skipped).
unavailable() { echo "slurm-source: error: $*" >&2; exit 77; }
say() { echo "slurm-source: $*" >&2; }
. "$(dirname "${BASH_SOURCE[0]}")/debian-mirror.sh"

# Temporary apt state with deb-src lines for the suites searched (sets $tmp,
# $mirror, $secmirror and the apt options APT_OPTS).
apt_setup() {
	[ -n "${tmp:-}" ] && return 0
	tmp=$(mktemp -d "${TMPDIR:-/tmp}/slurm-source.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT INT TERM
	mkdir -p "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/parts"

	codename=${PYK8SRES_DEBIAN_CODENAME:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
	suites=${PYK8SRES_DEBIAN_SUITES-oldstable stable testing unstable}
	[ -n "$codename$suites" ] || die "cannot tell the Debian release from /etc/os-release"
	debian_mirrors || die "cannot fetch Slurm's source without a Debian mirror"
	mirror=$DEBIAN_MIRROR
	secmirror=$DEBIAN_SECURITY_MIRROR
	{
		if [ -n "$codename" ]; then
			echo "deb-src $mirror $codename main"
			echo "deb-src $mirror $codename-updates main"
			[ -z "$secmirror" ] || echo "deb-src $secmirror $codename-security main"
		fi
		for s in $suites; do
			[ "$s" = "$codename" ] || echo "deb-src $mirror $s main"
		done
	} >"$tmp/sources.list"

	# Everything apt keeps goes to $tmp: /etc/apt and /var/lib/apt stay untouched.
	APT_OPTS=(-o "Dir::Etc::SourceList=$tmp/sources.list"
		-o "Dir::Etc::SourceParts=$tmp/parts"
		-o "Dir::State::Lists=$tmp/lists"
		-o "Dir::Cache=$tmp" -o "Dir::Cache::archives=$tmp/archives"
		-o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
		-o "APT::Sandbox::User=root" -o "Debug::NoLocking=1" -q)

	say "fetching source indexes for ${codename:+$codename }$suites from $mirror"
	apt-get "${APT_OPTS[@]}" update --error-on=any >"$tmp/update.log" 2>&1 || {
		grep -E '^(E|W):' "$tmp/update.log" | tail -n 5 >&2
		die "apt-get update on the temporary deb-src list failed: is $mirror reachable" \
			"(set PYK8SRES_DEBIAN_MIRROR to another mirror)?"
	}
	grep -E '^(W|E):' "$tmp/update.log" >&2 || true
}

# All slurm-wlm versions in the source indexes, one a line.
known_versions() {
	apt-cache "${APT_OPTS[@]}" showsrc slurm-wlm 2>/dev/null | sed -n 's/^Version: //p' | sort -u -V
}

# Newest of the versions on stdin that VERSION names (exact, or a release or
# series prefix followed by . or -).
pick() {
	local v=$1
	awk -v v="$v" '$0 == v || index($0, v ".") == 1 || index($0, v "-") == 1' | sort -V | tail -n1
}

cache_root=${PYK8SRES_SLURM_SRC:-${PYK8SRES_CACHE:-/var/cache/pyk8sres}/slurm-src}
version=${1:-}
if [ -z "$version" ]; then
	for pkg in slurmctld slurmd libslurm-dev; do
		version=$(dpkg-query -W -f '${source:Version}' "$pkg" 2>/dev/null) || true
		[ -n "$version" ] && break
	done
	[ -n "$version" ] || die "no Slurm package installed (slurmctld, slurmd or libslurm-dev); pass a version"
fi

# A release or series already in the cache needs no network.
if [ "$version" != latest ]; then
	cached=$(for d in "$cache_root"/*/; do
		[ -f "$d/.ready" ] && [ -f "$d/src/config.h" ] && basename "$d"
	done 2>/dev/null | pick "$version")
	if [ -n "$cached" ]; then
		echo "$cache_root/$cached/src"
		exit 0
	fi
fi

apt_setup
have=$(known_versions)
if [ "$version" = latest ]; then
	resolved=$(printf '%s\n' "$have" | tail -n1)
else
	resolved=$(printf '%s\n' "$have" | pick "$version")
fi
[ -n "$resolved" ] || unavailable "slurm-wlm $version is not in the source indexes of" \
	"${codename:+$codename }$suites on $mirror (they have: $(echo $have)); cannot build for this version"
[ "$resolved" = "$version" ] || say "slurm-wlm $version: Debian version $resolved"
version=$resolved

cache=$cache_root/$version
src=$cache/src
mkdir -p "$cache" || die "cannot create cache dir $cache (set PYK8SRES_CACHE)"
# One fetch at a time per version (two builds may race on a fresh machine).
exec 9>"$cache/.lock"
flock 9
if [ -f "$cache/.ready" ] && [ -f "$src/config.h" ]; then
	echo "$src"
	exit 0
fi
rm -rf "$src" "$cache/dl"
mkdir -p "$cache/dl"

say "fetching slurm-wlm=$version"
if (cd "$cache/dl" && apt-get "${APT_OPTS[@]}" source --download-only "slurm-wlm=$version" \
	>"$tmp/source.log" 2>&1) &&
	dsc=$(ls "$cache/dl"/*.dsc 2>/dev/null | head -n1) && [ -n "$dsc" ]; then
	dpkg-source -x "$dsc" "$src" >&2 || die "dpkg-source -x $dsc failed"
else
	# Debian 13's mirror was seen serving only the orig tarball (.dsc and
	# debian tarball 404). The upstream tree is enough for headers + config.h
	# and for building Slurm.
	grep -E '^E:' "$tmp/source.log" | head -n 3 >&2
	say "full source package unavailable; falling back to the orig tarball"
	# showsrc prints every version it knows: keep the exact one.
	rec=$(apt-cache "${APT_OPTS[@]}" showsrc slurm-wlm 2>/dev/null | awk -v v="$version" \
		'/^Package:/ { keep = 0 } /^Version: / { keep = ($2 == v) } keep')
	dir=$(printf '%s\n' "$rec" | sed -n 's/^Directory: //p' | head -n1)
	line=$(printf '%s\n' "$rec" | sed -n '/^Checksums-Sha256:/,/^[^ ]/p' |
		grep -E ' slurm-wlm_[^ ]*\.orig\.tar\.[a-z0-9]+$' | head -n1)
	[ -n "$dir" ] && [ -n "$line" ] || die "no orig tarball listed for slurm-wlm $version"
	sha=$(echo "$line" | awk '{print $1}')
	file=$(echo "$line" | awk '{print $3}')
	ok=
	for m in "$mirror" $secmirror; do
		if /usr/lib/apt/apt-helper "${APT_OPTS[@]}" download-file "$m/$dir/$file" \
			"$cache/dl/$file" "SHA256:$sha" >"$tmp/helper.log" 2>&1; then
			ok=1
			break
		fi
	done
	if [ -z "$ok" ]; then
		grep -E '^E:' "$tmp/helper.log" | head -n 1 >&2
		unavailable "cannot download $file: $mirror lists slurm-wlm $version in its source" \
			"index but does not serve the file; set PYK8SRES_DEBIAN_MIRROR to a mirror that has it"
	fi
	mkdir -p "$src"
	tar -xf "$cache/dl/$file" -C "$src" --strip-components=1 ||
		die "cannot unpack $file"
fi

# Configure as Debian's build does where it changes structure layouts
# (debian/rules: --enable-multiple-slurmd; the emulator flavour with
# --enable-front-end is a separate package and not what slurmctld runs).
# --without-munge: 24.11's configure stops without libmunge-dev otherwise,
# and munge changes no structure we use.  (tools/slurm-build.sh configures a
# copy of this tree again, for a real build.)
say "configuring $src (about 20-60 s)"
(cd "$src" && ./configure --quiet --sysconfdir=/etc/slurm --enable-multiple-slurmd \
	--disable-debug --without-rpath --without-munge >"$cache/configure.log" 2>&1) ||
	die "./configure failed, see $cache/configure.log"
[ -f "$src/config.h" ] || die "./configure produced no config.h"
rm -rf "$cache/dl"
touch "$cache/.ready"
say "ready: $src"
echo "$src"
