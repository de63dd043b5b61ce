"""The plugins also build for the Slurm of the other supported Debian release
(22.05 on Debian 12, 24.11 on Debian 13): the version is detected at build
time from the headers given, never assumed.  Fetches that release's Slurm
source with tools/slurm-source.sh (cached) and runs the project's meson build
against it in a temporary directory.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyk8sres.testbed import releases

REPO = Path(__file__).resolve().parents[2]
OTHER_RELEASE = {"bookworm": "trixie", "trixie": "bookworm"}
# Fetching the source (up to 900 s) and building (up to 900 s), cold.
pytestmark = pytest.mark.timeout(1800)


def looked_up(src: str) -> set:
    """The node_features_p_* names the release's slurmctld looks up (ground
    truth: the syms[] table of its node_features interface)."""
    for rel in ("src/interfaces/node_features.c", "src/common/node_features.c"):
        path = Path(src, rel)
        if path.exists():
            return set(re.findall(r'"(node_features_p_\w+)"', path.read_text()))
    raise AssertionError(f"no node_features interface under {src}")


def codename() -> str:
    text = Path("/etc/os-release").read_text()
    match = re.search(r"^VERSION_CODENAME=(\w+)", text, re.M)
    return match.group(1) if match else ""


def exported(path: Path) -> set:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(codename() not in OTHER_RELEASE, reason="not Debian 12 or 13")
def test_plugins_build_for_the_other_debian_release(tmp_path):
    other = OTHER_RELEASE[codename()]
    src = subprocess.run([str(REPO / "tools" / "slurm-source.sh"), "latest"], check=True,
                         capture_output=True, text=True, timeout=900,
                         env={"PYK8SRES_DEBIAN_CODENAME": other, "PYK8SRES_DEBIAN_SUITES": "",
                              "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
                         ).stdout.strip()
    version = re.search(r"SLURM_VERSION_NUMBER (0x[0-9a-f]+)",
                        Path(src, "slurm", "slurm_version.h").read_text()).group(1)
    major, minor = int(version, 16) >> 16, (int(version, 16) >> 8) & 0xFF

    build = tmp_path / "build"
    meson = [sys.executable, "-m", "mesonbuild.mesonmain"]
    setup = subprocess.run(meson + ["setup", str(build), str(REPO), f"-Dslurm_include={src}",
                                    f"-Dslurm_source={src}", "-Dnode_features=enabled"],
                           capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert f"Building Slurm plugins for Slurm {major}.{minor}." in setup.stdout
    done = subprocess.run(meson + ["compile", "-C", str(build)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    job_submit = exported(build / "job_submit_k8s_resource_completion.so")
    assert {"plugin_name", "plugin_type", "plugin_version", "init", "fini", "job_submit",
            "job_modify"} <= job_submit
    node_features = exported(build / "plugins" / "node_features_k8s_resources.so")
    hooks = {s for s in node_features if s.startswith("node_features_p_")}
    # Exactly what slurmctld looks up: a missing one fails plugin loading, an
    # extra one means a removed hook was not detected.
    assert hooks == looked_up(src)
    assert len(hooks) == {(22, 5): 19, (24, 11): 17}.get((major, minor), len(hooks))


def cached_releases() -> list:
    """Every finished Slurm build under the build cache (tools/slurm-build.sh)."""
    root = Path(releases.build_root())
    return sorted((p.parent.name for p in root.glob("*/.ready")),
                  key=lambda v: tuple(int(x) for x in v.split(".")))


@pytest.mark.parametrize("version", cached_releases() or [None])
def test_plugins_build_for_every_cached_release(tmp_path, version):
    """Each release built here (24.11 from Debian, the others from SchedMD's
    tags): meson detects it from its own headers, node_features exports
    exactly the hooks its slurmctld looks up, and the structure layout is
    accepted (pinned, or the tree slurmctld was compiled from)."""
    if version is None:
        pytest.skip("no Slurm build under the cache (tools/slurm-build.sh)")
    built = Path(releases.build_root(), version)
    src, include = built / "src", built / "prefix" / "include"
    build = tmp_path / "build"
    meson = [sys.executable, "-m", "mesonbuild.mesonmain"]
    setup = subprocess.run(meson + ["setup", str(build), str(REPO), f"-Dslurm_include={include}",
                                    f"-Dslurm_source={src}", "-Dnode_features=enabled",
                                    "-Dcompile_policy=disabled"],
                           capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    major, minor, micro = (int(x) for x in version.split("."))
    assert f"Building Slurm plugins for Slurm {major}.{minor}.{micro}" in setup.stdout
    done = subprocess.run(meson + ["compile", "-C", str(build)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    node_features = exported(build / "plugins" / "node_features_k8s_resources.so")
    assert {s for s in node_features if s.startswith("node_features_p_")} == looked_up(str(src))
    detected = dict(line.split("=", 1) for line in
                    (build / "slurm_build.txt").read_text().split())
    assert detected["SLURM_BUILT_HERE"] == "1"
