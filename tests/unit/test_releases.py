"""pyk8sres.testbed.releases: which Slurm a test cluster runs."""
import os

import pytest

from pyk8sres.testbed import releases


def make_build(root, version, package=True, ready=True):
    d = root / version
    (d / "prefix" / "sbin").mkdir(parents=True)
    (d / "prefix" / "bin").mkdir(parents=True)
    (d / "prefix" / "lib" / "slurm").mkdir(parents=True)
    if ready:
        (d / ".ready").touch()
    if package:
        lib = d / "pyk8sres" / "lib" / "python3.11" / "site-packages" / "pyk8sres" / "_lib"
        lib.mkdir(parents=True)
        (lib / "slurm_build.txt").write_text(f"SLURM_VERSION={version}\nTRES_SLASH=1\n")


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("PYK8SRES_SLURM_BUILD", str(tmp_path))
    monkeypatch.delenv("PYK8SRES_RELEASE_PACKAGES", raising=False)
    return tmp_path


@pytest.mark.parametrize("builds,want,found", [
    (["24.11.5"], "24.11", "24.11.5"),
    (["24.11.5", "24.11.10"], "24.11", "24.11.10"),   # numeric, not text order
    (["24.11.5"], "24.11.5", "24.11.5"),
    (["24.11.5"], "24.1", None),                       # a series is matched whole
    (["26.05.5"], "24.11", None),
    ([], "26.05", None),
])
def test_built_version(root, builds, want, found):
    for v in builds:
        make_build(root, v)
    assert releases.built_version(want) == found


def test_unfinished_build_is_not_used(root):
    make_build(root, "24.11.5", ready=False)
    with pytest.raises(releases.ReleaseError, match="tools/slurm-build.sh 24.11"):
        releases.get("24.11")


def test_release_without_our_package_says_what_to_run(root):
    make_build(root, "24.11.5", package=False)
    with pytest.raises(releases.ReleaseError, match="tools/release-plugins.sh 24.11"):
        releases.get("24.11")


def test_built_release_paths_and_detected_build(root):
    make_build(root, "24.11.5")
    rel = releases.get("24.11")
    prefix = root / "24.11.5" / "prefix"
    assert rel.name == "24.11.5"
    assert rel.bin_dirs == (str(prefix / "sbin"), str(prefix / "bin"))
    assert rel.plugin_dir == str(prefix / "lib" / "slurm")
    assert releases.build_info(rel.lib_dir) == {"SLURM_VERSION": "24.11.5", "TRES_SLASH": "1"}
    assert rel.path_env(f"/usr/bin:{prefix / 'bin'}:/bin").split(os.pathsep) == [
        str(prefix / "sbin"), str(prefix / "bin"), "/usr/bin", "/bin"]
    (prefix / "sbin" / "slurmctld").write_text("#!/bin/sh\n")
    (prefix / "sbin" / "slurmctld").chmod(0o755)
    assert rel.binary("slurmctld", "slurmctld") == str(prefix / "sbin" / "slurmctld")
    with pytest.raises(releases.ReleaseError, match="slurmd missing from Slurm 24.11.5"):
        rel.binary("slurmd", "slurmd")  # never falls back to the installed one


def test_installed_release_uses_path():
    rel = releases.Release(releases.INSTALLED)
    assert rel.path_env("/a:/b") == "/a:/b"
    with pytest.raises(releases.ReleaseError, match="apt-get install pkg-x"):
        rel.binary("no-such-binary-pyk8sres", "pkg-x")


def test_ensure_uses_a_finished_build_without_building(root, monkeypatch):
    make_build(root, "26.05.3")
    monkeypatch.setattr(releases.subprocess, "run", lambda *a, **k: pytest.fail("built again"))
    assert releases.ensure("26.05").name == "26.05.3"


def test_ensure_builds_what_is_missing_then_uses_it(root, monkeypatch, tmp_path):
    monkeypatch.setattr(releases, "tools_dir", lambda: "/checkout/tools")
    tree = tmp_path / "src-26.05.3"
    tree.mkdir()
    (tree / "META").write_text("  Major:\t26\n  Minor:\t05\n  Micro:\t3\n")
    ran = []

    def run(argv, **kwargs):
        ran.append([os.path.basename(argv[0]), *argv[1:]])
        if argv[0].endswith("release-plugins.sh"):
            make_build(root, "26.05.3")
        return releases.subprocess.CompletedProcess(argv, 0)
    monkeypatch.setattr(releases.subprocess, "run", run)
    assert releases.ensure(None, str(tree)).name == "26.05.3"
    assert ran == [["slurm-build.sh", "--source", str(tree), "26.05.3"],
                   ["release-plugins.sh", "26.05.3"]]


@pytest.mark.parametrize("meta,name,message", [
    (None, None, "not a Slurm source tree"),
    ("  Major:\t25\n  Minor:\t11\n  Micro:\t7\n", "26.05", "is Slurm 25.11.7, not 26.05"),
])
def test_ensure_refuses_a_tree_that_is_not_the_release(root, tmp_path, meta, name, message):
    tree = tmp_path / "tree"
    tree.mkdir()
    if meta:
        (tree / "META").write_text(meta)
    with pytest.raises(releases.ReleaseError, match=message):
        releases.ensure(name, str(tree))


def test_ensure_says_how_when_debian_has_no_source(root, monkeypatch):
    monkeypatch.setattr(releases, "tools_dir", lambda: "/checkout/tools")
    monkeypatch.setattr(releases.subprocess, "run",
                        lambda argv, **k: releases.subprocess.CompletedProcess(argv, 77))
    with pytest.raises(releases.ReleaseError, match="--slurm-source DIR"):
        releases.ensure("26.05")


def test_ensure_outside_a_checkout_says_where_to_build(root, monkeypatch):
    monkeypatch.setattr(releases, "tools_dir", lambda: None)
    monkeypatch.setattr(releases.subprocess, "run", lambda *a, **k: pytest.fail("nothing to run"))
    with pytest.raises(releases.ReleaseError, match="not a checkout"):
        releases.ensure("26.05")
