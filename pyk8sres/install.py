"""`pyk8sres install-plugins`: put the built plugins into a Slurm PluginDir.

A wheel cannot write into Slurm's PluginDir, so this is an explicit step.
Every file lands on a new inode (write a temp file, then rename): a daemon
that has the old .so mapped keeps its copy instead of crashing.  The Python
core stays inside the installed package; a symlink next to the plugins
points at it (the plugins find it beside themselves).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

PACKAGE_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib")
PLUGINS = ("job_submit_k8s_resource_completion.so", "node_features_k8s_resources.so")
CORE = "libpyk8sres_core.so"


class InstallError(RuntimeError):
    pass


def built_for(lib_dir: str = PACKAGE_LIB) -> str:
    with open(os.path.join(lib_dir, "slurm_version.txt"), encoding="utf-8") as f:
        return f.read().strip()


def installed_slurm() -> str | None:
    """Version of the Slurm on this machine (`scontrol --version`), or None."""
    try:
        out = subprocess.run(["scontrol", "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.split()
    return parts[1] if len(parts) >= 2 else None


def _version_tuple(text: str) -> tuple:
    """'22.05.8' and '22.5.8' are the same Slurm."""
    return tuple(int(p) if p.isdigit() else p for p in text.split("-")[0].split("."))


def _atomic_copy(src: str, dst: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst), prefix=".pyk8sres-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


def _atomic_symlink(target: str, dst: str) -> None:
    tmp = dst + ".pyk8sres-new"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, dst)


def unreadable_by_others(path: str) -> str | None:
    """The first directory on the way to `path` that other users cannot enter
    (slurmctld usually runs as SlurmUser=slurm, not root), or None."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        directory = os.sep.join(parts[:i])
        if not os.stat(directory).st_mode & 0o001:
            return directory
    return None


def readability_warnings() -> list[str]:
    """Why a non-root slurmctld could not load the core, if it could not."""
    import sysconfig
    warnings = []
    for what, path in (("the Python core", os.path.join(PACKAGE_LIB, CORE)),
                       ("libpython", os.path.join(sysconfig.get_config_var("LIBDIR") or "/",
                                                  sysconfig.get_config_var("LDLIBRARY") or ""))):
        blocked = unreadable_by_others(path) if os.path.exists(path) else None
        if blocked:
            warnings.append(f"{what} ({path}) is inside {blocked}, which other users cannot "
                            "enter: a slurmctld running as SlurmUser=slurm cannot load it; "
                            "install pyk8sres into a Python under /opt or /usr instead")
    return warnings


def install_plugins(plugin_dir: str, *, check_version: bool = True, lib_dir: str = PACKAGE_LIB,
                    slurm_version: str | None = None) -> list[str]:
    """Install every built plugin into `plugin_dir`; returns the paths written.
    lib_dir: where the built plugins are (default: this package's; the test
    cluster passes the build for another Slurm release); slurm_version: the
    Slurm they must match (default: the installed one's)."""
    if not os.path.isdir(lib_dir):
        raise InstallError(f"{lib_dir} missing: pyk8sres was not built (pip install .)")
    if check_version:
        ours, theirs = built_for(lib_dir), slurm_version or installed_slurm()
        if theirs and _version_tuple(theirs) != _version_tuple(ours):
            raise InstallError(f"plugins were built for Slurm {ours} but Slurm {theirs} is "
                               "installed: rebuild (pip install --force-reinstall .)")
    os.makedirs(plugin_dir, exist_ok=True)
    written = []
    for name in PLUGINS:
        src = os.path.join(lib_dir, name)
        if os.path.exists(src):
            _atomic_copy(src, os.path.join(plugin_dir, name))
            written.append(os.path.join(plugin_dir, name))
    if not written:
        raise InstallError(f"no plugins in {lib_dir}")
    _atomic_symlink(os.path.join(lib_dir, CORE), os.path.join(plugin_dir, CORE))
    written.append(os.path.join(plugin_dir, CORE))
    return written
