"""tools/debian-mirror.sh: the Debian mirror comes from the machine's own apt
configuration (deb822 .sources or one-line sources.list), or the override;
no mirror host is built in."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "debian-mirror.sh"

DEB822 = """Types: deb
# http://snapshot.example/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
"""
DISABLED_THEN_REAL = """Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Enabled: no

Types: deb deb-src
URIs: https://real.example/debian/
Suites: bookworm
"""
ONE_LINE = """# deb http://commented.example/debian bookworm main
deb [arch=amd64 signed-by=/x.gpg] http://list.example/debian bookworm main contrib
deb http://list-sec.example/debian-security bookworm-security main
"""
OTHER_REPO_FIRST = """deb http://vendor.example/apt stable main
deb http://proxy.example:3142/debian trixie main
"""

CASES = [
    # (files under etc/apt, codename, env, expected mirror, expected security)
    ({"sources.list.d/debian.sources": DEB822}, "bookworm", {},
     "http://mirror.example/debian", "http://security.example/debian-security"),
    ({"sources.list.d/debian.sources": DISABLED_THEN_REAL}, "bookworm", {},
     "https://real.example/debian", ""),
    ({"sources.list": ONE_LINE}, "bookworm", {},
     "http://list.example/debian", "http://list-sec.example/debian-security"),
    ({"sources.list.d/x.list": OTHER_REPO_FIRST}, "trixie", {},
     "http://proxy.example:3142/debian", ""),
    ({"sources.list.d/debian.sources": DEB822}, "bookworm",
     {"PYK8SRES_DEBIAN_MIRROR": "http://override.example/debian"},
     "http://override.example/debian", "http://security.example/debian-security"),
    ({"sources.list.d/debian.sources": DEB822}, "bookworm",
     {"PYK8SRES_DEBIAN_MIRROR": "http://o.example/d", "PYK8SRES_DEBIAN_SECURITY_MIRROR": ""},
     "http://o.example/d", ""),
]


def run(tmp_path, files, codename, env):
    etc = tmp_path / "apt"
    for name, text in files.items():
        (etc / name).parent.mkdir(parents=True, exist_ok=True)
        (etc / name).write_text(text)
    etc.mkdir(exist_ok=True)
    full = {"PATH": os.environ["PATH"], "PYK8SRES_APT_ETC": str(etc),
            "PYK8SRES_DEBIAN_CODENAME": codename, **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full)


@pytest.mark.parametrize("files,codename,env,mirror,security", CASES)
def test_mirror_from_apt_configuration(tmp_path, files, codename, env, mirror, security):
    proc = run(tmp_path, files, codename, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"mirror={mirror}", f"security={security}"]


def test_no_apt_configuration_is_a_clear_error(tmp_path):
    proc = run(tmp_path, {}, "bookworm", {})
    assert proc.returncode == 1
    assert "no Debian mirror found" in proc.stderr and "PYK8SRES_DEBIAN_MIRROR" in proc.stderr


def test_no_mirror_host_in_the_code():
    host = "deb" + ".debian.org"  # spelled apart so this file does not match itself
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = [f for f in files if (REPO / f).is_file() and
            host in (REPO / f).read_text(errors="replace")]
    assert hits == []
