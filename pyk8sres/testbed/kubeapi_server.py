"""A real Kubernetes API server (etcd + pyk8sres-apiserver) for tests and demos.

kube/build.sh builds the server from upstream Kubernetes Go sources packaged
by Debian sid and provides etcd and kubectl from sid. This module builds,
starts and stops them. Standard library only.

    paths = build()                       # seconds once built
    with KubeAPIServer(paths).start("/tmp/k", 26443) as kas:
        kas.apply("deploy/crd-genericnode.yaml")
        print(kas.url, kas.kubeconfig)

CLI for manual use (pid files and logs under DIR):
    python -m pyk8sres.testbed.kubeapi_server up --workdir DIR --port P [--etcd-port E]
    python -m pyk8sres.testbed.kubeapi_server down --workdir DIR

The server has no authentication and allows everything: it listens on
127.0.0.1 over plain HTTP only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .. import data

__all__ = ["Paths", "build", "KubeAPIServer", "BuildError", "StartError"]

BUILD_SCRIPT = data.path("kube", "build.sh")
HOST = "127.0.0.1"


class BuildError(RuntimeError):
    """kube/build.sh failed."""


class StartError(RuntimeError):
    """etcd or the API server did not come up."""


@dataclass(frozen=True)
class Paths:
    apiserver: str
    etcd: str
    kubectl: str


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def build(cache: str | os.PathLike | None = None) -> Paths:
    """Run kube/build.sh (idempotent: seconds when already built).

    cache: where sources, toolchain and binaries live (default
    $PYK8SRES_CACHE or /var/cache/pyk8sres/kube). Raises BuildError with the
    script's message on failure.
    """
    env = dict(os.environ)
    if cache is not None:
        env["PYK8SRES_CACHE"] = str(cache)
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-30:])
        raise BuildError(f"kube/build.sh failed (exit {proc.returncode}):\n{tail}")
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    try:
        return Paths(apiserver=found["apiserver"], etcd=found["etcd"], kubectl=found["kubectl"])
    except KeyError as e:
        raise BuildError(f"kube/build.sh printed no {e} path:\n{proc.stdout}") from None


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, n: int = 20, width: int = 300) -> str:
    """Last n lines of a log, each cut to width characters."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return "\n".join(line if len(line) <= width else line[:width] + " ..." for line in lines)


def _pid_alive(pid: int, exe_hint: str) -> bool:
    """True if pid runs and its command line mentions exe_hint (guards against
    a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return exe_hint in cmdline


def _stop_pid(pid: int, exe_hint: str, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL one process of ours."""
    if not _pid_alive(pid, exe_hint):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # Reap it if it is our child; ignore if it is not.
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        if not _pid_alive(pid, exe_hint):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class KubeAPIServer:
    """etcd + pyk8sres-apiserver on 127.0.0.1, data and logs under a workdir.

    Files in workdir: etcd/ (data, kept across restarts), etcd.log,
    apiserver.log, etcd.pid, apiserver.pid, kubeconfig.
    """

    def __init__(self, paths: Paths | None = None, cache: str | os.PathLike | None = None):
        self.paths = paths or build(cache)
        self.workdir: Path | None = None
        self.port: int | None = None
        self.etcd_port: int | None = None
        self.kubeconfig: str | None = None
        self._etcd: subprocess.Popen | None = None
        self._api: subprocess.Popen | None = None

    # -- properties --
    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://{HOST}:{self.etcd_port}"

    # -- lifecycle --
    def start(self, workdir: str | os.PathLike, port: int, etcd_port: int | None = None,
              timeout: float = 60.0, compaction_interval: str = "5m") -> "KubeAPIServer":
        """Start etcd (port etcd_port, peer port etcd_port+1; default port+1)
        and the API server on port; wait for /readyz; write workdir/kubeconfig.

        Starting again on the same workdir keeps the etcd data (a restart).
        """
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = int(port)
        self.etcd_port = int(etcd_port) if etcd_port else self.port + 1
        # A port in use would let our readiness probes reach someone else's
        # etcd or API server (and its data): refuse instead.
        busy = [p for p in (self.etcd_port, self.etcd_port + 1, self.port) if not _port_free(p)]
        if busy:
            raise StartError(f"port(s) {', '.join(map(str, busy))} on {HOST} already in use")
        try:
            self._start_etcd(timeout)
            self._start_apiserver(timeout, compaction_interval)
        except BaseException:
            self.stop()
            raise
        self.kubeconfig = str(self.workdir / "kubeconfig")
        self._write_kubeconfig(Path(self.kubeconfig))
        return self

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        assert self.workdir is not None
        log = open(self.workdir / f"{name}.log", "ab")
        # Own session: a Ctrl-C in the caller's terminal does not hit it; we
        # stop it ourselves by pid.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=self.workdir, start_new_session=True)
        log.close()
        (self.workdir / f"{name}.pid").write_text(f"{proc.pid}\n")
        return proc

    def _wait(self, proc: subprocess.Popen, name: str, url: str, timeout: float) -> None:
        assert self.workdir is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StartError(f"{name} exited with {proc.returncode}:\n{_tail(self.workdir / f'{name}.log')}")
            if _http_ok(url):
                return
            time.sleep(0.1)
        raise StartError(f"{name} not ready at {url} after {timeout}s:\n{_tail(self.workdir / f'{name}.log')}")

    def _start_etcd(self, timeout: float) -> None:
        peer = f"http://{HOST}:{self.etcd_port + 1}"
        self._etcd = self._spawn("etcd", [
            self.paths.etcd, "--name", "default",
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--log-level", "warn",
            # Test data: durability across power loss is not needed, speed is.
            "--unsafe-no-fsync",
        ])
        self._wait(self._etcd, "etcd", self.etcd_url + "/health", timeout)

    def _start_apiserver(self, timeout: float, compaction_interval: str) -> None:
        self._api = self._spawn("apiserver", [
            self.paths.apiserver, "--bind-address", HOST, "--port", str(self.port),
            "--etcd-servers", self.etcd_url, "--etcd-compaction-interval", compaction_interval,
        ])
        self._wait(self._api, "apiserver", self.url + "/readyz", timeout)

    def _write_kubeconfig(self, path: Path) -> None:
        # JSON is valid YAML; kubectl and the Python client read both.
        cfg = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "pyk8sres", "cluster": {"server": self.url}}],
            "users": [{"name": "anonymous", "user": {}}],
            "contexts": [{"name": "pyk8sres", "context": {"cluster": "pyk8sres", "user": "anonymous"}}],
            "current-context": "pyk8sres",
        }
        path.write_text(json.dumps(cfg, indent=1) + "\n")

    def stop(self) -> None:
        """Stop the API server, then etcd (SIGTERM, wait, SIGKILL), by pid."""
        for name, attr, hint in (("apiserver", "_api", "pyk8sres-apiserver"), ("etcd", "_etcd", "etcd")):
            proc = getattr(self, attr)
            if proc is not None:
                _stop_pid(proc.pid, hint)
                proc.poll()
                setattr(self, attr, None)
            elif self.workdir is not None:  # started by another process (CLI)
                pidfile = self.workdir / f"{name}.pid"
                if pidfile.exists():
                    _stop_pid(int(pidfile.read_text().strip() or 0), hint)
            if self.workdir is not None:
                (self.workdir / f"{name}.pid").unlink(missing_ok=True)

    def __enter__(self) -> "KubeAPIServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers --
    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run kubectl against this server; returns the CompletedProcess (text)."""
        proc = subprocess.run([self.paths.kubectl, "--kubeconfig", self.kubeconfig, *args],
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def apply(self, path: str | os.PathLike, timeout: float = 30.0) -> list[str]:
        """kubectl apply -f path; waits until applied CRDs are Established.
        Returns the applied object names (kind/name)."""
        names = self.kubectl("apply", "-f", str(path), "-o", "name").stdout.split()
        crds = [n for n in names if n.startswith("customresourcedefinition")]
        if crds:
            self.kubectl("wait", "--for=condition=Established", f"--timeout={int(timeout)}s", *crds,
                         timeout=timeout + 10)
        return names


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyk8sres.testbed.kubeapi_server",
                                 description="Run a local Kubernetes API server (etcd + pyk8sres-apiserver).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build if needed, start, print the kubeconfig path")
    up.add_argument("--workdir", required=True)
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--etcd-port", type=int)
    up.add_argument("--cache", help="build cache (default $PYK8SRES_CACHE or /var/cache/pyk8sres/kube)")
    up.add_argument("--apply", action="append", default=[], help="manifest to apply after start (repeatable)")
    down = sub.add_parser("down", help="stop what 'up' started in WORKDIR")
    down.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)

    if args.cmd == "up":
        kas = KubeAPIServer(cache=args.cache).start(args.workdir, args.port, args.etcd_port)
        for path in args.apply:
            kas.apply(path)
        # The processes outlive us; `down` finds them through the pid files.
        kas._api = kas._etcd = None
        print(f"server={kas.url}\nkubeconfig={kas.kubeconfig}\nkubectl={kas.paths.kubectl}")
        return 0
    kas = KubeAPIServer(paths=Paths("", "", ""))
    kas.workdir = Path(args.workdir).resolve()
    kas.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
