"""The ledger's socket against hostile callers, on a real slurmctld (root only).

Who may talk to the ledger is root, SlurmUser and LedgerUsers=; the socket
is 0660 to LedgerGroup= and checked with SO_PEERCRED at accept.  Callers:
  STRANGER  (nobody)   neither listed nor in the group: cannot connect;
  GROUP     in LedgerGroup but not in LedgerUsers: connects, is refused
            before a byte of its request is read;
  FLOODER   in LedgerUsers and LedgerGroup: may call, floods and never reads.
Meanwhile root's `show` and `reserve` are timed: p99 <= 50 ms each.  The
module runs twice: slurmctld as root, and as SlurmUser=slurm (as sites run
it; LedgerGroup is then slurm's group, which slurmctld belongs to).
"""
import json
import os
import pwd
import re
import shutil
import socket
import tempfile
import time

import pytest

from pyk8sres import install
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.testbed import cluster
from pyk8sres.testbed.faults import ConnectStorm, LedgerFlood, Caller
from local_slurm import RELEASE, SLURM, port, readable_build, requires_slurm

pytestmark = requires_slurm + [
    pytest.mark.skipif(RELEASE is not None and
                       not os.path.exists(os.path.join(RELEASE.lib_dir, install.PLUGINS[1])),
                       reason="node_features_k8s_resources.so not built (-Dslurm_source)")]

BASE_PORT = port(17600)
FLOODER, GROUP, STRANGER = 65533, 65532, 65534
ROOT_GROUP = 65531          # LedgerGroup when slurmctld runs as root
FLOOD_LINES = 20_000
CONN_PER_UID = 8            # LedgerConnectionsPerUser= below (the default is larger)
GOAL_MS = 50.0
SHOW = b'{"op":"show"}\n'


@pytest.fixture(scope="module", params=["root", "slurm"])
def c(request):
    slurm_user = request.param
    group = pwd.getpwnam("slurm").pw_gid if slurm_user == "slurm" else ROOT_GROUP
    lib = readable_build() if slurm_user == "slurm" else None
    work = tempfile.mkdtemp(prefix="pyk8sres-hostile-")
    os.chmod(work, 0o755)       # callers of other uids must reach the socket
    # As a site gives the coordinator's uid the ledger and nothing else: the
    # socket in a directory of its own, StateSaveLocation private.
    ledger_dir = os.path.join(work, "ledger")
    os.mkdir(ledger_dir, 0o755)
    pw = pwd.getpwnam(slurm_user)
    os.chown(ledger_dir, pw.pw_uid, pw.pw_gid)
    try:
        handle = cluster.up(work, nodes=2, cpus=8, memory=8000, base_port=BASE_PORT,
                            slurm=SLURM, slurm_user=slurm_user, plugin_lib=lib,
                            k8s_conf=f"LedgerUsers={FLOODER}\nLedgerGroup={group}\n"
                                     f"LedgerSocket={ledger_dir}/k8s_resources.socket\n"
                                     f"LedgerConnectionsPerUser={CONN_PER_UID}\n")
        os.chmod(os.path.join(work, "state"), 0o700)
    except BaseException:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)
        raise
    handle.group = group
    handle.socket = ledger_socket_path(handle.conf)
    assert handle.socket.startswith(ledger_dir)
    try:
        yield handle
    finally:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)


# --- root's view ----------------------------------------------------------------------

def _p99(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * 0.99))]


def measure(path: str, rounds: int = 300) -> dict:
    """root's `show` (every node) and `reserve` latencies (ms) over `rounds`,
    through one kept-open connection, as the coordinator calls."""
    ledger = Ledger(path, timeout=5)
    lat = {"show": [], "reserve": []}
    try:
        for i in range(rounds):
            t0 = time.perf_counter()
            shown = ledger.show()
            lat["show"].append((time.perf_counter() - t0) * 1000)
            assert shown["ok"] and set(shown["nodes"]) == {"n1", "n2"}, shown
            t0 = time.perf_counter()
            reserved = ledger.reserve("n1", f"probe-{i}", 100, 1 << 20)
            lat["reserve"].append((time.perf_counter() - t0) * 1000)
            assert reserved == {"ok": True}, reserved
            assert ledger.release("n1", f"probe-{i}")["ok"]
    finally:
        ledger.close()
    return {op: _p99(v) for op, v in lat.items()}


def slurmctld_alive(c) -> None:
    assert c.ping().get("primary") == "UP"
    assert Ledger(c.socket).show("n1")["ok"]


def log_lines(c, pattern: str) -> list[str]:
    with open(os.path.join(c.work, "log", "slurmctld.log"), errors="replace") as f:
        return [line for line in f if re.search(pattern, line)]


# --- the tests ---------------------------------------------------------------------------

def test_socket_admits_only_root_slurmuser_and_ledger_group(c):
    st = os.stat(c.socket)
    slurm_user = open(c.conf).read().split("SlurmUser=")[1].split()[0]
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == \
        (pwd.getpwnam(slurm_user).pw_uid, c.group, 0o660), (st, slurm_user)


def test_the_coordinators_uid_gets_the_ledger_and_nothing_else(c):
    """LedgerUsers + LedgerGroup: the socket, not StateSaveLocation (the
    journal, job scripts, Slurm's keys) nor the munge key."""
    def probe(queue, stop, path, state, key):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(SHOW)
            shown = json.loads(s.makefile("rb").readline())
        denied = []
        for what, fn in (("state", lambda: os.listdir(state)),
                         ("journal", lambda: open(os.path.join(state, "k8s_resources.ledger"))),
                         ("munge key", lambda: open(key, "rb"))):
            try:
                fn()
            except PermissionError:
                denied.append(what)
        queue.put(("done", (shown.get("ok"), sorted(shown.get("nodes", {})), denied)))
    child = Caller(FLOODER, [c.group], probe, c.socket, os.path.join(c.work, "state"),
                   os.path.join(c.work, "munge", "munge.key"))
    ok, nodes, denied = child.queue.get(timeout=30)[1]
    child.proc.join(10)
    assert (ok, nodes) == (True, ["n1", "n2"])
    assert sorted(denied) == ["journal", "munge key", "state"], denied


def test_stranger_cannot_connect_and_its_storm_slows_nobody(c):
    storm = ConnectStorm(c.socket, STRANGER, [STRANGER], SHOW)
    storm.started()
    time.sleep(0.5)
    p99 = measure(c.socket)
    outcomes = storm.stop()
    print(f"stranger's connect storm {outcomes}: root p99 {p99}")
    assert set(outcomes) == {"PermissionError"} and outcomes["PermissionError"] > 100, outcomes
    assert max(p99.values()) <= GOAL_MS, p99
    slurmctld_alive(c)


def test_group_member_not_listed_is_refused_before_a_byte_is_parsed(c):
    # 2 MiB that is not even a request: the answer is still "denied" (its
    # uid is checked at accept), never "badrequest".
    garbage = b"x" * (2 << 20)
    storm = ConnectStorm(c.socket, GROUP, [c.group], garbage)
    storm.started()
    time.sleep(0.5)
    p99 = measure(c.socket)
    outcomes = storm.stop()
    print(f"group member's storm {outcomes}: root p99 {p99}")
    assert outcomes.get("denied", 0) > 100, outcomes
    assert not {"badrequest", "ok"} & set(outcomes), outcomes
    assert max(p99.values()) <= GOAL_MS, p99
    # Each refusal says what and why, but a storm cannot flood the log: at
    # most one line per 10 s per kind, counting what it held back.
    logged = log_lines(c, rf"ledger: _accept_all: refused uid {GROUP} ")
    assert logged and len(logged) <= 10, logged
    assert all("not root, SlurmUser or in LedgerUsers" in line for line in logged)
    slurmctld_alive(c)


def test_permitted_flood_that_never_reads_delays_nobody(c):
    baseline = measure(c.socket, rounds=100)
    flood = LedgerFlood(c.socket, FLOODER, [c.group], conns=CONN_PER_UID, lines=FLOOD_LINES)
    flood.started()
    time.sleep(0.5)
    p99 = measure(c.socket)
    time.sleep(1.5)             # let the last connections be dropped too
    stats = flood.stop()
    print(f"flood of {FLOOD_LINES} show lines per connection, never read ({stats}): "
          f"root p99 {p99} ms (idle {baseline} ms)")
    assert max(p99.values()) <= GOAL_MS, (p99, baseline)
    # The server really served the flood, and dropped each stalled connection.
    assert stats["dropped"] >= CONN_PER_UID, stats
    served = [int(m.group(1)) for line in log_lines(c, rf"dropped a client of uid {FLOODER}")
              for m in [re.search(r"\((\d+) requests served", line)] if m]
    assert served and max(served) >= 10, served
    slurmctld_alive(c)


def test_connections_per_uid_are_capped_and_root_still_gets_in(c):
    def hold(queue, stop, path):
        socks = []
        for _ in range(CONN_PER_UID):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(path)
            s.sendall(SHOW)
            socks.append((s, s.makefile("rb")))
        answers = [json.loads(f.readline())["ok"] for s, f in socks]
        extra = socket.socket(socket.AF_UNIX)
        extra.settimeout(5)
        extra.connect(path)
        refused = json.loads(extra.makefile("rb").readline())
        closed = extra.recv(1) == b""
        queue.put(("held", answers, refused, closed))
        # One of ours goes: a new one is welcome again.
        socks[0][1].close()     # (a makefile keeps the socket open)
        socks[0][0].close()
        time.sleep(0.3)
        again = socket.socket(socket.AF_UNIX)
        again.settimeout(5)
        again.connect(path)
        again.sendall(SHOW)
        queue.put(("again", json.loads(again.makefile("rb").readline())))
        stop.wait(30)
        queue.put(("done", None))
    child = Caller(FLOODER, [c.group], hold, c.socket)
    _, answers, refused, closed = child.queue.get(timeout=30)
    assert answers == [True] * CONN_PER_UID
    assert refused["code"] == "busy" and f"{CONN_PER_UID} connections" in refused["error"]
    assert "LedgerConnectionsPerUser=" in refused["error"]
    assert closed
    assert Ledger(c.socket).show("n1")["ok"]          # another uid is not affected
    again = child.queue.get(timeout=30)
    assert again[1]["ok"], again
    child.stop()
    slurmctld_alive(c)


def test_malformed_and_huge_lines_get_an_error_and_never_hurt_slurmctld(c):
    pid = c.pid("slurmctld")

    def exchange(sock, data):
        sock.sendall(data)
        return json.loads(sock.makefile("rb").readline())
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(c.socket)
        for bad in (b"{\n", b"\xff\xfe\n", b"[1,2]\n", b'{"op":"show"}\x00\n',
                    b"[" * 100_000 + b"\n",
                    b'{"op":"reserve","node":"n1","key":"k","cpu_m":-1,"mem_bytes":1}\n',
                    b'{"op":"set","node":"n1","entries":{"k":[1]}}\n',
                    b'{"op":"reserve","node":"' + b"n" * 300 +
                    b'","key":"k","cpu_m":1,"mem_bytes":1}\n',
                    b" " * ((1 << 20) - 2) + b"\n"):
            reply = exchange(s, bad)
            assert reply["ok"] is False and reply["code"] == "badrequest", (bad[:40], reply)
        assert exchange(s, SHOW)["ok"]                  # the connection still serves
    # A line longer than 1 MiB: refused, and the connection is closed.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(c.socket)
        s.setblocking(True)
        try:
            s.sendall(b"y" * (3 << 20))
        except OSError:
            pass                                        # closed on us mid-send
        f = s.makefile("rb")
        reply = json.loads(f.readline())
        assert reply["code"] == "badrequest" and "longer than 1 MiB" in reply["error"], reply
        try:
            rest = f.read()
        except ConnectionResetError:    # closed with our unread bytes
            rest = b""
        assert rest == b""
    # Half a line, then gone; a connection that says nothing.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(c.socket)
        s.sendall(b'{"op":"sh')
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(c.socket)
    assert measure(c.socket, rounds=20)
    idle.close()
    assert c.pid("slurmctld") == pid
    slurmctld_alive(c)
