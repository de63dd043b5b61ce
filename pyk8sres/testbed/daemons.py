"""What every part of the test bed shares: its error, finding a binary of a
Slurm release, starting and stopping the daemons it records under
WORKDIR/run/*.pid, waiting for them, and writing files with explicit modes.

cluster.py (Slurm), accounting.py (MariaDB, slurmdbd) and rest.py
(slurmrestd) all import this module; it imports none of them.
accounting.py and rest.py take the cluster as a SlurmHandle, so they need
not import cluster.py (which imports them).
"""
from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time
from typing import Protocol

from . import releases


class ClusterError(RuntimeError):
    pass


class SlurmHandle(Protocol):
    """What the services beside Slurm (accounting.py, rest.py) need of a
    cluster; cluster.Cluster is one."""
    work: str                   # the work directory, absolute
    conf: str                   # its slurm.conf
    release: releases.Release   # the Slurm whose commands it runs

    @property
    def env(self) -> dict: ...  # SLURM_CONF and PATH for that Slurm's commands


def need(binary: str, package: str, release: releases.Release | None = None) -> str:
    """The path of `binary` of `release` (the installed Slurm by default), or
    a ClusterError naming the package to install."""
    try:
        return (release or releases.Release(releases.INSTALLED)).binary(binary, package)
    except releases.ReleaseError as e:
        raise ClusterError(str(e)) from None


def pid_path(work: str, name: str) -> str:
    return os.path.join(work, "run", f"proc-{name}.pid")


def start_process(work: str, name: str, argv: list[str], env: dict | None = None,
                  cwd: str | None = None, user: tuple[int, int, list[int]] | None = None) -> int:
    """Start a daemon in the background; its PID goes to WORK/run/proc-NAME.pid
    (stop_process and cluster.down() stop it), its output to WORK/log/NAME.out.
    user: (uid, gid, supplementary gids) it runs as, instead of ours."""
    log = os.fdopen(os.open(os.path.join(work, "log", f"{name}.out"),
                            os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "ab")
    os.fchmod(log.fileno(), 0o644)
    # umask: what the daemons create (state, logs, sockets) never becomes
    # writable by others, whatever the caller's umask.
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env, umask=0o022, cwd=cwd,
                            **({"user": user[0], "group": user[1], "extra_groups": user[2]}
                               if user else {}))
    log.close()
    write_file(pid_path(work, name), str(proc.pid))
    return proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie we spawned (same process) still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def running(work: str, name: str) -> bool:
    """Whether the daemon `name` recorded under `work` is alive."""
    try:
        return alive(int(open(pid_path(work, name)).read()))
    except (OSError, ValueError):
        return False


def stop_process(work: str, name: str, timeout: float = 15.0) -> bool:
    """Stop one daemon we started, by its recorded PID. True if it was running."""
    path = pid_path(work, name)
    try:
        pid = int(open(path).read().strip())
    except (OSError, ValueError):
        return False
    was_running = alive(pid)
    if was_running:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(pid) and time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    os.unlink(path)
    return was_running


def wait_until(ready, what: str, timeout: float) -> None:
    """Poll `ready()` until it is true; ClusterError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise ClusterError(f"timed out waiting for {what}")


def log_tail(work: str, name: str, lines: int = 20) -> str:
    try:
        with open(os.path.join(work, "log", name), errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def write_private(path: str, data: bytes, owner: str) -> None:
    """Write `data` to a new 0600 file owned by `owner` (never readable by
    anyone else, not even for a moment): passwords and keys."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    pw = pwd.getpwnam(owner)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def write_file(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
