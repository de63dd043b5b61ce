#!/bin/bash
# Fetch and configure the exact source of the installed Slurm, for plugins
# that need Slurm internals (node_features/k8s_resources uses node_record_t
# and gres_node_feature(), which no public header declares).
#
# Usage: tools/slurm-source.sh [VERSION]
#   VERSION   Debian source version (default: the installed slurmctld's).
# Prints the configured source directory on stdout (everything else goes to
# stderr), so `SRC=$(tools/slurm-source.sh)` works.  Idempotent: a second run
# with the tree already cached prints the path at once.
#
# Cache: ${PYK8SRES_CACHE:-/var/cache/pyk8sres}/slurm-src/<version>/src.
# Release: PYK8SRES_DEBIAN_CODENAME (default: VERSION_CODENAME of /etc/os-release).
# Mirrors: PYK8SRES_DEBIAN_MIRROR (default http://deb.debian.org/debian) and
# PYK8SRES_DEBIAN_SECURITY_MIRROR (default http://deb.debian.org/debian-security).
# Never touches /etc/apt: apt runs on a temporary sources list and temporary
# state/cache dirs that are removed on exit.
set -eu

die() { echo "slurm-source: error: $*" >&2; exit 1; }
say() { echo "slurm-source: $*" >&2; }

# Temporary apt state with deb-src lines for the release (sets $tmp and the
# positional apt options "$@" of the caller through APT_OPTS).
apt_setup() {
	[ -n "${tmp:-}" ] && return 0
	tmp=$(mktemp -d "${TMPDIR:-/tmp}/slurm-source.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT INT TERM
	mkdir -p "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/parts"

	codename=${PYK8SRES_DEBIAN_CODENAME:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
	[ -n "$codename" ] || die "cannot tell the Debian release from /etc/os-release"
	mirror=${PYK8SRES_DEBIAN_MIRROR:-http://deb.debian.org/debian}
	secmirror=${PYK8SRES_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
	cat >"$tmp/sources.list" <<-EOF
	deb-src $mirror $codename main
	deb-src $mirror $codename-updates main
	deb-src $secmirror $codename-security main
	EOF

	# Everything apt keeps goes to $tmp: /etc/apt and /var/lib/apt stay untouched.
	set -- -o "Dir::Etc::SourceList=$tmp/sources.list" \
		-o "Dir::Etc::SourceParts=$tmp/parts" \
		-o "Dir::State::Lists=$tmp/lists" \
		-o "Dir::Cache=$tmp" -o "Dir::Cache::archives=$tmp/archives" \
		-o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" \
		-o "APT::Sandbox::User=root" -o "Debug::NoLocking=1" -q

	say "fetching source indexes for $codename from $mirror"
	apt-get "$@" update >&2 ||
		die "apt-get update on the temporary deb-src list failed (network? mirror?)"
	APT_OPTS=("$@")
}

version=${1:-}
if [ "$version" = latest ]; then
	# The newest slurm-wlm of the release (e.g. to build for Debian 13's Slurm
	# on a Debian 12 machine): resolve it from the source indexes.
	apt_setup
	version=$(apt-cache "${APT_OPTS[@]}" showsrc slurm-wlm 2>/dev/null |
		sed -n 's/^Version: //p' | sort -V | tail -n1)
	[ -n "$version" ] || die "no slurm-wlm in the $codename source indexes"
	say "latest slurm-wlm in $codename: $version"
fi
if [ -z "$version" ]; then
	for pkg in slurmctld slurmd libslurm-dev; do
		version=$(dpkg-query -W -f '${source:Version}' "$pkg" 2>/dev/null) || true
		[ -n "$version" ] && break
	done
fi
[ -n "$version" ] || die "no Slurm package installed (slurmctld, slurmd or libslurm-dev); pass a version"

cache=${PYK8SRES_CACHE:-/var/cache/pyk8sres}/slurm-src/$version
src=$cache/src
if [ -f "$cache/.ready" ] && [ -f "$src/config.h" ]; then
	echo "$src"
	exit 0
fi

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
apt_setup
set -- "${APT_OPTS[@]}"

say "fetching slurm-wlm=$version"
if (cd "$cache/dl" && apt-get "$@" source --download-only "slurm-wlm=$version" >&2) &&
	dsc=$(ls "$cache/dl"/*.dsc 2>/dev/null | head -n1) && [ -n "$dsc" ]; then
	dpkg-source -x "$dsc" "$src" >&2 || die "dpkg-source -x $dsc failed"
else
	# Debian 13's mirror was seen serving only the orig tarball (.dsc and
	# debian tarball 404). The upstream tree is enough for headers + config.h.
	say "full source package unavailable; falling back to the orig tarball"
	# showsrc prints every version it knows: keep the exact one.
	all=$(apt-cache "$@" showsrc slurm-wlm 2>/dev/null) || all=
	rec=$(printf '%s\n' "$all" | awk -v v="$version" \
		'/^Package:/ { keep = 0 } /^Version: / { keep = ($2 == v) } keep')
	if [ -z "$rec" ]; then
		have=$(printf '%s\n' "$all" | sed -n 's/^Version: //p' | sort -u | tr '\n' ' ')
		die "slurm-wlm $version is not in the $codename source indexes (they have: ${have:-nothing}); cannot build plugins that need Slurm internals for this version"
	fi
	dir=$(printf '%s\n' "$rec" | sed -n 's/^Directory: //p' | head -n1)
	line=$(printf '%s\n' "$rec" | sed -n '/^Checksums-Sha256:/,/^[^ ]/p' |
		grep -E ' slurm-wlm_[^ ]*\.orig\.tar\.[a-z0-9]+$' | head -n1)
	[ -n "$dir" ] && [ -n "$line" ] || die "no orig tarball listed for slurm-wlm $version"
	sha=$(echo "$line" | awk '{print $1}')
	file=$(echo "$line" | awk '{print $3}')
	ok=
	for m in "$mirror" "$secmirror"; do
		if /usr/lib/apt/apt-helper "$@" download-file "$m/$dir/$file" \
			"$cache/dl/$file" "SHA256:$sha" >&2; then
			ok=1
			break
		fi
	done
	[ -n "$ok" ] || die "cannot download $file for slurm-wlm $version"
	mkdir -p "$src"
	tar -xf "$cache/dl/$file" -C "$src" --strip-components=1 ||
		die "cannot unpack $file"
fi

# Configure as Debian's build does where it changes structure layouts
# (debian/rules: --enable-multiple-slurmd; the emulator flavour with
# --enable-front-end is a separate package and not what slurmctld runs).
# --without-munge: 24.11's configure stops without libmunge-dev otherwise,
# and munge changes no structure we use.
say "configuring $src (about 20-60 s)"
(cd "$src" && ./configure --quiet --sysconfdir=/etc/slurm --enable-multiple-slurmd \
	--disable-debug --without-rpath --without-munge >"$cache/configure.log" 2>&1) ||
	die "./configure failed, see $cache/configure.log"
[ -f "$src/config.h" ] || die "./configure produced no config.h"
rm -rf "$cache/dl"
touch "$cache/.ready"
say "ready: $src"
echo "$src"
