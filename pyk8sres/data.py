"""Files pyk8sres ships besides code: deploy/ (the Helm chart, systemd units) and kube/ (the test
API server's sources).  A source checkout has them at the top; an installed
package carries copies under pyk8sres/_data (meson.build installs them)."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
ROOT = _PACKAGE.parent if (_PACKAGE.parent / "kube" / "build.sh").exists() else _PACKAGE / "_data"


def path(*parts: str) -> Path:
    return ROOT.joinpath(*parts)
