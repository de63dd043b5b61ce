"""Which Slurm a local test cluster runs: the installed one, or a release
built from Debian's source into a cache (tools/slurm-build.sh).

A built release lives in $PYK8SRES_SLURM_BUILD (default
/var/cache/pyk8sres/slurm-build)/<version>/:
    prefix/    Slurm itself (sbin/slurmctld, bin/scontrol, lib/slurm = PluginDir)
    src/       its configured source (meson -Dslurm_source)
and our package built against it (tools/release-plugins.sh) in
$PYK8SRES_RELEASE_PACKAGES (default the same directory)/<version>/pyk8sres.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess

from .. import install

INSTALLED = "installed"
# Debian's multiarch directory first, then other layouts.
SLURM_PLUGIN_DIRS = ("/usr/lib/*/slurm-wlm", "/usr/lib64/slurm", "/usr/lib/slurm")


class ReleaseError(RuntimeError):
    pass


def build_root() -> str:
    return os.environ.get("PYK8SRES_SLURM_BUILD", "/var/cache/pyk8sres/slurm-build")


def packages_root() -> str:
    return os.environ.get("PYK8SRES_RELEASE_PACKAGES", build_root())


@dataclasses.dataclass(frozen=True)
class Release:
    name: str                 # "installed" or the built version, e.g. "24.11.5"
    bin_dirs: tuple = ()      # put first on PATH (empty: the system's Slurm)
    plugin_dir: str = ""      # Slurm's own PluginDir
    lib_dir: str = ""         # our plugins built for this release (pyk8sres/_lib)

    def binary(self, name: str, package: str) -> str:
        for d in self.bin_dirs:
            if os.access(os.path.join(d, name), os.X_OK):
                return os.path.join(d, name)
        if self.bin_dirs:
            raise ReleaseError(f"{name} missing from Slurm {self.name} ({', '.join(self.bin_dirs)})")
        path = shutil.which(name) or next(
            (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)
        if not path:
            raise ReleaseError(f"{name} not found: apt-get install {package}")
        return path

    def path_env(self, path: str | None = None) -> str:
        """PATH with this release's commands first."""
        path = os.environ.get("PATH", "/usr/bin:/bin") if path is None else path
        rest = [p for p in path.split(os.pathsep) if p and p not in self.bin_dirs]
        return os.pathsep.join([*self.bin_dirs, *rest])

    def has_plugin(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.plugin_dir, name + ".so"))


def installed_plugin_dir() -> str:
    for pattern in SLURM_PLUGIN_DIRS:
        for path in glob.glob(pattern):
            if os.path.exists(os.path.join(path, "select_cons_tres.so")):
                return path
    raise ReleaseError("Slurm's plugins (select_cons_tres.so) not found: apt-get install slurmctld")


def _version_key(text: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in text.split("."))


def built_version(want: str) -> str | None:
    """Newest finished build whose version is `want` or starts with `want.`."""
    found = [os.path.basename(os.path.dirname(p))
             for p in glob.glob(os.path.join(build_root(), "*", ".ready"))]
    found = [v for v in found if v == want or v.startswith(want + ".")]
    return max(found, key=_version_key) if found else None


def package_lib(version: str) -> str | None:
    """_lib of our package built for `version`, or None."""
    pattern = os.path.join(packages_root(), version, "pyk8sres", "lib", "python3*",
                           "site-packages", "pyk8sres", "_lib")
    hits = sorted(glob.glob(pattern))
    return hits[-1] if hits else None


def get(name: str | None = None) -> Release:
    """The release `name` names: "installed" (default) or a version such as
    24.11 or 26.05.5 that tools/slurm-build.sh and tools/release-plugins.sh built."""
    if not name or name == INSTALLED:
        return Release(INSTALLED, (), installed_plugin_dir(), install.PACKAGE_LIB)
    version = built_version(name)
    if not version:
        raise ReleaseError(f"Slurm {name} is not built under {build_root()}: run "
                           f"tools/slurm-build.sh {name} && tools/release-plugins.sh {name} "
                           f"(or tools/run-release-tests.sh {name})")
    prefix = os.path.join(build_root(), version, "prefix")
    lib = package_lib(version)
    if not lib:
        raise ReleaseError(f"pyk8sres is not built for Slurm {version} under "
                           f"{packages_root()}/{version}/pyk8sres: run tools/release-plugins.sh {name}")
    return Release(version, (os.path.join(prefix, "sbin"), os.path.join(prefix, "bin")),
                   os.path.join(prefix, "lib", "slurm"), lib)


def build_info(lib_dir: str) -> dict[str, str]:
    """What meson detected for the release the plugins in `lib_dir` were
    built for (_lib/slurm_build.txt: SLURM_VERSION, TRES_SLASH, ...)."""
    info = {}
    try:
        with open(os.path.join(lib_dir, "slurm_build.txt"), encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep:
                    info[key] = value
    except OSError:
        pass
    return info


def tools_dir() -> str | None:
    """tools/ of the pyk8sres checkout this package runs from, if it does
    (the build scripts and the sources release-plugins.sh compiles are
    there, not in an installed package)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tools = os.path.join(here, "tools")
    return tools if os.path.isfile(os.path.join(tools, "release-plugins.sh")) else None


def source_version(tree: str) -> str:
    """The release of an unpacked Slurm tree (its META file)."""
    try:
        with open(os.path.join(tree, "META"), encoding="utf-8") as f:
            meta = dict(re.findall(r"^\s*(Major|Minor|Micro):\s*(\d+)", f.read(), re.M))
    except OSError:
        meta = {}
    if len(meta) != 3:
        raise ReleaseError(f"{tree} is not a Slurm source tree (no META with Major/Minor/Micro): "
                           "unpack a release tarball, or `git archive` a release tag")
    return f"{meta['Major']}.{meta['Minor']}.{meta['Micro']}"


def ensure(name: str | None = None, source: str | None = None, log=None) -> Release:
    """get(name), building first what is missing: Slurm itself
    (tools/slurm-build.sh: Debian's source, or the unpacked tree `source`)
    and this checkout's pyk8sres for it (tools/release-plugins.sh).  The
    build output goes to `log` (a file object; default stderr)."""
    if source:
        version = source_version(source)
        if name and name != INSTALLED and not (version == name or version.startswith(name + ".")):
            raise ReleaseError(f"{source} is Slurm {version}, not {name}")
        name = version
    if not name or name == INSTALLED:
        return get(name)
    try:
        return get(name)
    except ReleaseError as missing:
        tools = tools_dir()
        if tools is None:
            raise ReleaseError(f"{missing} (this pyk8sres is not a checkout: run the build from "
                               "one)") from None
    build = [os.path.join(tools, "slurm-build.sh"), *(["--source", source] if source else []),
             name]
    for argv in (build, [os.path.join(tools, "release-plugins.sh"), name]):
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=log, check=False)
        if proc.returncode == 77:
            raise ReleaseError(f"Slurm {name}: the Debian mirror does not serve its source; build "
                               "it from an unpacked tree: --slurm-source DIR (e.g. a release tag "
                               "of SchedMD's repository, `git archive slurm-26-05-3-1`)")
        if proc.returncode:
            raise ReleaseError(f"{os.path.basename(argv[0])} {name} failed (exit "
                               f"{proc.returncode}, see above)")
    return get(name)
