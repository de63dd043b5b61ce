"""Shared by the integration tests: a real local Slurm cluster per module.

PYK8SRES_TEST_SLURM picks the Slurm every test runs against: "installed"
(default) or a release built from Debian's source, e.g. 24.11 or 26.05
(tools/run-release-tests.sh builds what is missing and sets it).  Its
commands come first on PATH for the whole test process.
"""
import contextlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pyk8sres.testbed import cluster, releases

SLURM = os.environ.get("PYK8SRES_TEST_SLURM", releases.INSTALLED)
try:
    RELEASE = releases.get(SLURM)
except releases.ReleaseError as e:
    if SLURM != releases.INSTALLED:
        raise  # asked for a release that is not built: fail loudly, never skip
    RELEASE, _why = None, str(e)
else:
    _why = ""
    os.environ["PATH"] = RELEASE.path_env()
# What meson detected in that release (TRES_SLASH, RECONFIGURE_REEXEC, ...).
BUILD = releases.build_info(RELEASE.lib_dir) if RELEASE else {}


def _have_slurmctld() -> bool:
    try:
        return RELEASE is not None and bool(RELEASE.binary("slurmctld", "slurmctld"))
    except releases.ReleaseError:
        return False


# pytestmark for modules that start Slurm daemons.
requires_slurm = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster runs daemons as root"),
    pytest.mark.skipif(not _have_slurmctld(),
                       reason=f"slurmctld not installed (apt-get install slurmctld slurmd) {_why}"),
]


def tres(text: str) -> str:
    """An expected TRES string written as 22.05 prints it (gres:k8scpu:3), in
    the syntax of the release under test (gres/k8scpu:3 from 23.02 on, as
    detected at build time)."""
    if BUILD.get("TRES_SLASH") == "1":
        return re.sub(r"(^|[=,\s])gres:", r"\1gres/", text)
    return text


def local_cluster(tmp_path_factory, name: str, **kwargs):
    """Fixture body: start a cluster (pyk8sres.testbed.cluster.up kwargs), point
    SLURM_CONF at it while the module runs, stop it by PID afterwards."""
    work = str(tmp_path_factory.mktemp(name))
    kwargs.setdefault("slurm", SLURM)
    handle = cluster.up(work, **kwargs)
    try:
        with slurm_conf(handle.conf):
            yield handle
    finally:
        cluster.down(work)


@contextlib.contextmanager
def slurm_conf(path: str):
    """SLURM_CONF (what the Slurm commands and our clients read) is `path`
    inside the block, and as it was afterwards."""
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def port(default: int) -> int:
    """A test module's base port, moved by PYK8SRES_TEST_PORT_OFFSET so that
    two test runs on one machine (e.g. two checkouts) never collide."""
    return default + int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0"))


REPO = Path(__file__).resolve().parents[2]
# Debian's own Python: what a site's slurmctld can read (ours lives under /root).
SYSTEM_PYTHON = "/usr/bin/python3"
# One venv per Slurm release, next to that release's other pyk8sres builds
# (readable by every user; PYK8SRES_RELEASE_PACKAGES moves them all).
VENV = os.path.join(releases.packages_root(), RELEASE.name if RELEASE else "installed",
                    "slurmuser-venv")


def _slurm_args() -> list:
    """meson's -D options for the Slurm under test: the installed one's
    configured source, or a built release's tree and headers."""
    if SLURM == releases.INSTALLED:
        src = subprocess.run([str(REPO / "tools" / "slurm-source.sh")], capture_output=True,
                             text=True, check=True).stdout.strip()
        return [f"-Csetup-args=-Dslurm_source={src}"]
    built = os.path.join(releases.build_root(), RELEASE.name)
    return [f"-Csetup-args=-Dslurm_source={built}/src",
            f"-Csetup-args=-Dslurm_include={built}/prefix/include"]


def readable_build() -> str:
    """pyk8sres built from this checkout into a venv of Debian's Python that
    every user can read (for slurmctld as SlurmUser=slurm), against the Slurm
    under test; returns its _lib directory."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.fail(f"{SYSTEM_PYTHON} missing: tools/install-deps.sh installs python3-venv")
    # -I: the venv's own packages only, whatever PYTHONPATH the tests run with.
    pip = [f"{VENV}/bin/python", "-I", "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    if not os.path.exists(f"{VENV}/.ready"):
        shutil.rmtree(VENV, ignore_errors=True)
        os.makedirs(os.path.dirname(VENV), exist_ok=True)
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", VENV], check=True)
        # Debian 12's pip predates -C (config settings): a current one first.
        subprocess.run(pip + ["-U", "pip"], check=True)
        subprocess.run(pip + ["meson-python>=0.15", "meson>=1.1", "ninja", "cffi>=1.17"],
                       check=True)
        Path(f"{VENV}/.ready").touch()
    subprocess.run(pip + ["--no-build-isolation", "--force-reinstall", "--no-deps",
                          *_slurm_args(), "-Csetup-args=-Dnode_features=enabled", str(REPO)],
                   check=True)
    return subprocess.run([f"{VENV}/bin/python", "-I", "-c",
                           "from pyk8sres import install; print(install.PACKAGE_LIB)"],
                          capture_output=True, text=True, check=True, cwd="/").stdout.strip()
