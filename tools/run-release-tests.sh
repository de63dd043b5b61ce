#!/bin/bash
# Run integration tests against a Slurm release that is not the installed
# one, building whatever is missing first: Slurm itself from Debian's source
# (tools/slurm-build.sh, cached), and this checkout's pyk8sres against it
# (tools/release-plugins.sh, per-release prefix).  The tests import that
# per-release package, so nothing is installed into the system Python.
#
# Usage: tools/run-release-tests.sh VERSION [PYTEST ARGS...]
#   VERSION      e.g. 24.11 or 26.05
#   PYTEST ARGS  default: the modules CI runs for every release:
#                integration/test_job_submit.py integration/test_node_features.py
#                integration/test_sync.py
# Needs root (the test cluster runs daemons as root), pytest and the
# kubernetes client (tools/install-deps.sh installs them), and for test_sync
# the test Kubernetes API server (kube/build.sh, cached).
# Exit code: pytest's; 77 when the release is neither built nor in the Debian
# mirror (nothing was tested: report it as skipped, not passed).  Prints the
# time of each phase.
set -eu

die() { echo "run-release-tests: error: $*" >&2; exit 1; }
say() { echo "run-release-tests: $*" >&2; }

[ $# -ge 1 ] || die "usage: $0 VERSION [PYTEST ARGS...]"
version=$1
shift
[ "$version" != installed ] || die "the installed Slurm runs with tools/run-tests.sh"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -gt 0 ] || set -- integration/test_job_submit.py integration/test_node_features.py \
	integration/test_sync.py

t0=$(date +%s)
"$repo/tools/slurm-build.sh" "$version" >/dev/null || {
	rc=$?
	[ $rc -ne 77 ] || {
		say "SKIPPED: no source for Slurm $version here: the Debian mirror does not serve it and no build of it is cached under ${PYK8SRES_SLURM_BUILD:-/var/cache/pyk8sres/slurm-build} (build one from an unpacked tree: tools/slurm-build.sh --source DIR $version)"
		exit 77
	}
	die "cannot build Slurm $version"
}
t1=$(date +%s)
pkg=$("$repo/tools/release-plugins.sh" "$version") || die "cannot build pyk8sres for Slurm $version"
t2=$(date +%s)
site=$(ls -d "$pkg"/lib/python3*/site-packages | head -n1)
say "Slurm $version: build $((t1 - t0)) s, pyk8sres $((t2 - t1)) s; testing with $site"

cd "$repo/tests"
rc=0
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYK8SRES_TEST_SLURM=$version \
	python3 -m pytest -q -p no:cacheprovider "$@" || rc=$?
t3=$(date +%s)
say "Slurm $version: tests $((t3 - t2)) s, total $((t3 - t0)) s (exit $rc)"
exit $rc
