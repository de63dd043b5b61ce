"""Hostile callers and controller faults for tests on a local cluster.

Callers of the ledger under other uids (forked children that drop to the
uid, so the kernel's SO_PEERCRED and the socket's mode are what they meet):
    Caller           any function, as that uid
    LedgerFlood      a caller that floods and never reads a reply
    ConnectStorm     a caller that connects again and again
Faults of slurmctld (a cluster from up(), backup_controller=True for the
failover ones):
    fail_over(c, how)          kill -9 the primary, or `scontrol takeover`
    fail_back(c)               the primary returns and takes control back
    kill_and_restart(c)        kill -9 slurmctld and start it again
Each waits until the ledger is served again and returns how long that took.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import time

from ..coordinator.slurm import Ledger, LedgerError, ledger_socket_path

SHOW = b'{"op":"show"}\n'


def _become(uid: int, groups: list[int]) -> None:
    os.setgroups(groups)
    os.setgid(groups[0] if groups else uid)
    os.setuid(uid)


class Caller:
    """target(queue, stop_event, *args) in a forked child running as uid
    (with `groups`); it reports through the queue."""

    def __init__(self, uid: int, groups: list[int], target, *args):
        ctx = multiprocessing.get_context("fork")
        self.queue, self._stop = ctx.Queue(), ctx.Event()

        def run():
            try:
                _become(uid, groups)
                target(self.queue, self._stop, *args)
            except BaseException as exc:
                self.queue.put(("raised", f"{type(exc).__name__}: {exc}"))
        self.proc = ctx.Process(target=run, daemon=True)
        self.proc.start()

    def started(self, timeout: float = 30) -> tuple:
        """The child's first report (("flooding", ...) once it is at it)."""
        event = self.queue.get(timeout=timeout)
        if event[0] == "raised":
            raise RuntimeError(f"hostile caller failed: {event[1]}")
        return event

    def stop(self, timeout: float = 30):
        """Stop it; its last report's payload."""
        self._stop.set()
        kind, payload = self.queue.get(timeout=timeout)[:2]
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
        if kind == "raised":
            raise RuntimeError(f"hostile caller failed: {payload}")
        return payload

    def __enter__(self):
        self.started()
        return self

    def __exit__(self, *exc):
        if self.proc.is_alive():
            self._stop.set()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def _flood_never_reading(queue, stop, path, conns, lines):
    """Keep `conns` connections each writing `lines` show lines, never
    reading a reply; a connection the server drops is made again."""
    payload = SHOW * lines
    open_, dropped, connected, reported = {}, 0, 0, False
    while not stop.is_set():
        while len(open_) < conns:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.setblocking(False)
            open_[s] = 0
            connected += 1
        for s in list(open_):
            try:
                open_[s] = (open_[s] + s.send(payload[open_[s]:open_[s] + 65536])) % len(payload)
            except BlockingIOError:
                pass
            except OSError:              # dropped by the server
                s.close()
                del open_[s]
                dropped += 1
        if not reported:
            queue.put(("flooding", connected))
            reported = True
        time.sleep(0.002)
    queue.put(("done", {"connected": connected, "dropped": dropped}))


class LedgerFlood(Caller):
    """A permitted caller (uid in LedgerUsers, `groups` giving it the
    socket) flooding `show` on `conns` connections, never reading."""

    def __init__(self, path: str, uid: int, groups: list[int], conns: int = 8,
                 lines: int = 20_000):
        super().__init__(uid, groups, _flood_never_reading, path, conns, lines)


def _connect_storm(queue, stop, path, line):
    outcomes: dict = {}
    queue.put(("flooding", 0))
    while not stop.is_set():
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(path)
                try:
                    s.sendall(line)
                except OSError:
                    pass            # refused and closed while still sending
                reply = s.makefile("rb").readline()
                key = json.loads(reply).get("code", "ok") if reply else "closed"
        except OSError as exc:
            key = type(exc).__name__
        outcomes[key] = outcomes.get(key, 0) + 1
    queue.put(("done", outcomes))


class ConnectStorm(Caller):
    """A caller connecting again and again, sending `line` each time; stop()
    returns what came back: {reply code or error name: count}."""

    def __init__(self, path: str, uid: int, groups: list[int], line: bytes = SHOW):
        super().__init__(uid, groups, _connect_storm, path, line)


# --- slurmctld faults --------------------------------------------------------------

def _lock_owner(c) -> int | None:
    try:
        with open(os.path.join(c.work, "state", "k8s_resources.ledger.lock")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_ledger(c, name: str = "slurmctld", timeout: float = 90) -> float:
    """Until the slurmctld we started as `name` owns the ledger's journal and
    answers `show`; the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        pid = c.pid(name)
        try:
            if pid and _lock_owner(c) == pid and \
                    Ledger(ledger_socket_path(c.conf), timeout=2).show().get("ok"):
                return time.monotonic() - t0
        except LedgerError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not serve the ledger within {timeout} s")


def fail_over(c, how: str = "kill -9") -> float:
    """The backup takes over: `how` is "kill -9" (the primary dies; the
    backup notices within SlurmctldTimeout) or "takeover" (`scontrol
    takeover`: the primary hands over)."""
    if how == "kill -9":
        os.kill(c.pid("slurmctld"), signal.SIGKILL)
    elif how == "takeover":
        subprocess.run(["scontrol", "takeover"], env=c.env, check=True, capture_output=True,
                       timeout=60)
    else:
        raise ValueError(f"fail_over: how is 'kill -9' or 'takeover', not {how!r}")
    return wait_ledger(c, "slurmctld-backup")


def fail_back(c) -> float:
    """The primary (re)starts and takes control back from the backup."""
    t0 = time.monotonic()
    if c.pid("slurmctld") is None:
        c.start_slurmctld()
    return wait_ledger(c, "slurmctld") + (time.monotonic() - t0)


def kill_and_restart(c, down_seconds: float = 0.3) -> float:
    """kill -9 slurmctld, start it again after `down_seconds`."""
    t0 = time.monotonic()
    os.kill(c.pid("slurmctld"), signal.SIGKILL)
    time.sleep(down_seconds)
    c.start_slurmctld()
    return wait_ledger(c, "slurmctld") + (time.monotonic() - t0)
