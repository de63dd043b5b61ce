#!/bin/bash
# The Debian mirror this machine's apt already uses, so that admins' mirrors
# and proxies keep working.  Sourced by tools/slurm-source.sh and
# kube/build.sh; run directly it prints the two URLs.
#
# Sets DEBIAN_MIRROR (the archive) and DEBIAN_SECURITY_MIRROR (may be empty).
# Overrides: PYK8SRES_DEBIAN_MIRROR, PYK8SRES_DEBIAN_SECURITY_MIRROR (set
# empty: none).  PYK8SRES_APT_ETC (default /etc/apt) and
# PYK8SRES_DEBIAN_CODENAME (default from /etc/os-release) are for tests.
# Read: /etc/apt/sources.list.d/*.sources (deb822 "URIs:" of a stanza whose
# "Suites:" names the machine's release) and /etc/apt/sources.list and
# /etc/apt/sources.list.d/*.list ("deb[-src] [opts] URL suite ...").
# The archive is the entry for the release itself (or -updates/-backports),
# the security mirror the entry for <release>-security.

# Print "suite uri" for every enabled entry of the apt configuration.
_apt_entries() {
	local f etc=${PYK8SRES_APT_ETC:-/etc/apt}
	for f in "$etc"/sources.list.d/*.sources; do
		[ -r "$f" ] || continue
		# deb822: stanzas separated by blank lines; comments start with #.
		awk '
			function flush() {
				if (uris != "" && suites != "" && enabled != "no")
					for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print s[j], u[i]
				uris = suites = ""; enabled = ""; nu = ns = 0
			}
			/^[ \t]*#/ { next }
			/^[ \t]*$/ { flush(); next }
			tolower($1) == "uris:" { uris = $0; nu = split(substr($0, index($0, ":") + 1), u, " ") }
			tolower($1) == "suites:" { suites = $0; ns = split(substr($0, index($0, ":") + 1), s, " ") }
			tolower($1) == "enabled:" { enabled = tolower($2) }
			END { flush() }
		' "$f"
	done
	for f in "$etc"/sources.list "$etc"/sources.list.d/*.list; do
		[ -r "$f" ] || continue
		# deb [arch=amd64 signed-by=...] URL suite components...
		sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" |
			awk '($1 == "deb" || $1 == "deb-src") && NF >= 3 { print $3, $2 }'
	done
}

# debian_mirrors: set DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR, or return 1
# with a message on stderr.
debian_mirrors() {
	local codename entries
	DEBIAN_MIRROR=${PYK8SRES_DEBIAN_MIRROR:-}
	DEBIAN_SECURITY_MIRROR=${PYK8SRES_DEBIAN_SECURITY_MIRROR:-}
	[ -n "$DEBIAN_MIRROR" ] && [ -n "${PYK8SRES_DEBIAN_SECURITY_MIRROR+set}" ] && return 0
	codename=${PYK8SRES_DEBIAN_CODENAME:-$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")}
	entries=$(_apt_entries)
	if [ -z "$DEBIAN_MIRROR" ]; then
		DEBIAN_MIRROR=$(printf '%s\n' "$entries" | awk -v c="$codename" \
			'c != "" && ($1 == c || $1 == c "-updates" || $1 == c "-backports") { print $2; exit }')
		if [ -z "$DEBIAN_MIRROR" ]; then
			# No entry for the release (e.g. a machine on "stable" or "sid"):
			# take the first entry that is not a security archive.
			DEBIAN_MIRROR=$(printf '%s\n' "$entries" | awk '$1 !~ /-security$/ && $2 ~ /^(https?|file):/ { print $2; exit }')
		fi
	fi
	if [ -z "${PYK8SRES_DEBIAN_SECURITY_MIRROR+set}" ]; then
		DEBIAN_SECURITY_MIRROR=$(printf '%s\n' "$entries" | awk '$1 ~ /-security$/ { print $2; exit }')
	fi
	DEBIAN_MIRROR=${DEBIAN_MIRROR%/}
	DEBIAN_SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR%/}
	if [ -z "$DEBIAN_MIRROR" ]; then
		echo "no Debian mirror found in ${PYK8SRES_APT_ETC:-/etc/apt}/sources.list.d/*.sources or sources.list" \
			"(no deb entry for '${codename:-?}'); set PYK8SRES_DEBIAN_MIRROR=URL" \
			"(e.g. the archive URL your apt uses)" >&2
		return 1
	fi
	return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
	set -eu
	debian_mirrors || exit 1
	echo "mirror=$DEBIAN_MIRROR"
	echo "security=$DEBIAN_SECURITY_MIRROR"
fi
