"""The one module that talks to Slurm (through its client commands).

Why scontrol and not REST or pyslurm: slurmrestd in 22.05 cannot update
node GRES, and no pyslurm release builds against Debian's 22.05/24.11.
Every call has a timeout; failures raise SlurmError with scontrol's words.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import threading
import time

from .. import GRES_CPU, GRES_MEMORY
from . import metrics
from ..policy import backstop
from ..policy.hostlist import expand_hostlist
from ..policy.ledger import encode, merged_show
from ..slurmctld import config as plugin_config

TIMEOUT = 15.0


class SlurmError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    name: str
    cpus: int
    real_memory: int                 # MB
    gres: dict                       # current count per GRES name
    gres_used: dict                  # allocated to jobs per GRES name
    alloc_cpus: int
    alloc_memory: int                # MB
    state: str                       # e.g. IDLE, MIXED, IDLE+DRAIN
    reported_gres: dict              # hardware capacity: {k8scpu: CPUs, k8smemory: RealMemory}
    gres_raw: str = ""               # Gres= as scontrol prints it
    slurmd_start: str = ""           # SlurmdStartTime= (a new value: another slurmd)

    @property
    def drained(self) -> bool:
        return any(flag in self.state for flag in ("DRAIN", "DOWN", "INVALID"))


def run(*args: str, timeout: float = TIMEOUT, check: bool = True) -> str:
    """Run a Slurm client command; returns stdout."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise SlurmError(f"{args[0]} not found: install slurm-client") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{' '.join(args)} timed out after {timeout}s") from exc
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(args)}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_COUNT = re.compile(r"^(\d+)([KMGTP]?)$", re.I)


def _count(text: str) -> int:
    """scontrol prints multiples of 1024 with a suffix: '125K' is 128000."""
    match = _COUNT.match(text)
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()] if match else 0


def parse_gres(text: str | None) -> dict:
    """'k8scpu:3,gpu:tesla:2(IDX:0-1)' -> {'k8scpu': 3, 'gpu': 2}; (null) -> {}."""
    counts: dict = {}
    if not text or text == "(null)":
        return counts
    for entry in re.sub(r"\([^)]*\)", "", text).split(","):
        fields = entry.strip().split(":")
        if not fields[0]:
            continue
        count = fields[-1] if len(fields) > 1 else "1"
        counts[fields[0]] = counts.get(fields[0], 0) + _count(count)
    return counts


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def node_from_record(rec: dict) -> SlurmNode:
    cpus = _int(rec.get("CPUTot"))
    memory = _int(rec.get("RealMemory"))
    return SlurmNode(
        name=rec.get("NodeName", ""),
        cpus=cpus,
        real_memory=memory,
        gres=parse_gres(rec.get("Gres")),
        gres_used=parse_gres(rec.get("GresUsed")),
        alloc_cpus=_int(rec.get("CPUAlloc")),
        alloc_memory=_int(rec.get("AllocMem")),
        state=rec.get("State", ""),
        reported_gres={GRES_CPU: cpus, GRES_MEMORY: memory},
        gres_raw=rec.get("Gres", ""),
        slurmd_start=rec.get("SlurmdStartTime", ""),
    )


# The node fields we use never contain spaces (others, like OS= or Reason=,
# may): one findall per line picks them out, cheaply enough for the sync
# daemon to read every node each resync period.
_NODE_FIELDS = re.compile(
    r"(?:^|\s)(NodeName|CPUTot|RealMemory|Gres|GresUsed|CPUAlloc|AllocMem|State|SlurmdStartTime)=(\S*)")


def node_from_line(line: str) -> SlurmNode:
    """One `scontrol -d show node -o` line -> SlurmNode."""
    return node_from_record(dict(_NODE_FIELDS.findall(line)))


# The last read's nodes by their line.  On an idle cluster nearly every line
# comes back byte for byte, and looking it up costs far less than parsing
# it, which would otherwise be much of an idle sync daemon's CPU.  An
# unchanged node is the same object as before, so comparing views is cheap.
_last_read: dict[str, SlurmNode] = {}


def list_nodes() -> list[SlurmNode]:
    global _last_read
    out = run("scontrol", "-d", "show", "node", "-o")
    last = _last_read
    read = {line: last.get(line) or node_from_line(line)
            for line in out.splitlines() if line.strip()}
    _last_read = read     # only this read's lines: nothing piles up
    return list(read.values())


_JOB_STATE = re.compile(r"(?:^|\s)JobState=(\S+)")
_NODE_GROUP = re.compile(r"(?:^|\s)Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)(?: GRES=(\S*))?")
# A node group's GPUs: gpu:2(IDX:0-1), typed gpu:a100:2(IDX:0-1).
_GPU_IDX = re.compile(r"(?:^|,)gpu(?::[^:(),]+)?:\d+\(IDX:([^)]*)\)")


def completing_allocations() -> tuple[dict[str, tuple[int, int]], dict[str, frozenset]]:
    """Per node, the CPUs and MB, and the GPU indices, of the jobs
    COMPLETING there, as Slurm allocated them (`scontrol -d show job`:
    CPU_IDs, Mem and GRES per node group).  Slurm has freed them already
    while the jobs' processes may still run."""
    jobs, gpus = [], []
    for line in run("scontrol", "-d", "-o", "show", "job").splitlines():
        state = _JOB_STATE.search(line)
        if not state or state.group(1) != "COMPLETING":
            continue
        groups = _NODE_GROUP.findall(line)
        jobs.append((state.group(1), [(expand_hostlist(nodes), backstop.cpu_ids_count(ids),
                                       int(mem)) for nodes, ids, mem, _ in groups]))
        gpus.append((state.group(1), [
            (expand_hostlist(nodes), [i for m in _GPU_IDX.findall(gres)
                                      for i in backstop.gpu_indices(m)])
            for nodes, _, _, gres in groups]))
    return backstop.completing_per_node(jobs), backstop.completing_gpus_per_node(gpus)


def get_node(name: str) -> SlurmNode:
    out = run("scontrol", "-d", "show", "node", "-o", name)
    return node_from_line(out.strip().splitlines()[0])


def jobs_on_nodes(names) -> dict[str, frozenset]:
    """Per node of `names`, the IDs of the jobs Slurm lists there in any
    state but pending (running, completing, suspended...): those whose
    processes may run there.  One squeue for them all; -a: hidden
    partitions' and other groups' too."""
    out: dict[str, set] = {n: set() for n in names}
    if not out:
        return {}
    text = run("squeue", "-h", "-a", "-w", ",".join(sorted(out)), "-o", "%A %t %N")
    for line in text.splitlines():
        f = line.split()
        if len(f) != 3 or f[1] == "PD":
            continue
        for node in expand_hostlist(f[2]):
            if node in out:
                out[node].add(f[0])
    return {n: frozenset(jobs) for n, jobs in out.items()}


def cluster_name() -> str:
    for line in run("scontrol", "show", "config").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip()
    return ""



# --- The ledger: Kubernetes' share of each node, held inside slurmctld ------

class LedgerError(SlurmError):
    """The ledger could not be asked (socket, timeout, a reply that is not
    one): callers fail closed -- no pod admitted, no capacity handed back."""


def ledger_socket_path(slurm_conf: str | None = None) -> str:
    """Where node_features/k8s_resources serves the ledger: LedgerSocket= in
    k8s_resources.conf, else StateSaveLocation/k8s_resources.socket, both
    read from the local configuration files (no slurmctld round trip)."""
    conf = slurm_conf or os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    settings = plugin_config.load(conf)
    if settings.ledger_socket:
        return settings.ledger_socket
    state = "/var/spool/slurmctld"
    with open(conf, encoding="utf-8") as f:
        for raw in f:
            key, sep, value = raw.split("#", 1)[0].strip().partition("=")
            if sep and key.strip().lower() == "statesavelocation":
                state = value.strip()
    return os.path.join(state, "k8s_resources.socket")


# Answers that refuse this process, not its request: the ledger closes the
# connection after them ("busy": the uid holds LedgerConnectionsPerUser=
# connections already, every replica's together; "denied": not allowed).
REFUSES_CALLER = frozenset({"busy", "denied"})


def _refuses_caller(line: bytes) -> bool:
    try:
        return line.endswith(b"\n") and json.loads(line).get("code") in REFUSES_CALLER
    except (ValueError, AttributeError):
        return False


class Ledger:
    """A client of the ledger (pyk8sres.policy.ledger has the protocol).

    One connection, kept open and re-made once when it breaks; one request
    at a time (a lock), so threads (the webhook) may share it.  Both the
    wait for that lock and the request itself are bounded by `timeout`
    each, a reserve, release or set as a whole (connect, send, the reply
    line; a `show`, whose reply grows with the cluster, may take longer as
    long as its reply keeps coming): a ledger that hangs makes each caller
    fail closed (LedgerError) after at most twice `timeout`, and never
    queues every thread behind it."""

    def __init__(self, socket_path: str, timeout: float = 2.0):
        self.socket_path, self.timeout = socket_path, timeout
        self._sock = None
        self._buf = b""
        self._lock = threading.Lock()

    def _connect(self, deadline: float):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise LedgerError(f"cannot reach the ledger at {self.socket_path}: {exc}") from None
        self._sock, self._buf = sock, b""

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buf = None, b""

    def _readline(self, deadline: float, flowing: bool) -> bytes:
        """One reply line, whole, by `deadline` (TimeoutError otherwise);
        `flowing`: the deadline moves on with each part of it that comes."""
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole reply within {self.timeout:g}s")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(1 << 16)
            except TimeoutError:
                raise TimeoutError(f"no whole reply within {self.timeout:g}s") from None
            if not chunk:
                raise OSError("connection closed")
            self._buf += chunk
            if flowing:
                deadline = time.monotonic() + self.timeout
        line, _, self._buf = self._buf.partition(b"\n")
        return line + b"\n"

    def call(self, op: str, **fields) -> dict:
        """One request; the reply dict ({"ok": ...}).  LedgerError if unreachable.
        Counted in the coordinator's metrics (calls, errors, latency by op)."""
        t0 = time.perf_counter()
        try:
            answer = self._call(op, **fields)
        except Exception as e:
            metrics.ledger_call(op, time.perf_counter() - t0, e)
            raise
        refused = answer.get("code") in REFUSES_CALLER
        metrics.ledger_call(op, time.perf_counter() - t0, None,
                            (answer.get("error") or answer["code"]) if refused else None)
        return answer

    def _call(self, op: str, **fields) -> dict:
        line = encode(op, **fields)
        if not self._lock.acquire(timeout=self.timeout):
            raise LedgerError(
                f"ledger at {self.socket_path}: busy: an earlier request on this connection "
                f"has had no answer for {self.timeout:g}s; failing closed")
        try:
            deadline = time.monotonic() + self.timeout
            for attempt in (1, 2):
                try:
                    if self._sock is None:
                        self._connect(deadline)
                    self._sock.settimeout(max(0.001, deadline - time.monotonic()))
                    try:
                        self._sock.sendall(line)
                    except (BrokenPipeError, ConnectionResetError):
                        # A refusal of this process ("busy") comes at accept,
                        # before the request is read, and the ledger closes:
                        # that is the answer.  Anything else left there (a
                        # "notready" sent to every client at shutdown) is no
                        # answer to this request: connect again.
                        if not _refuses_caller(reply := self._readline(deadline, False)):
                            raise
                        break
                    reply = self._readline(deadline, flowing=op == "show")
                    break
                except OSError as exc:
                    self.close()
                    # A broken kept-open connection is retried once; a reply
                    # lost mid-way is safe to ask again (requests are idempotent).
                    if attempt == 2 or isinstance(exc, TimeoutError):
                        raise LedgerError(f"ledger at {self.socket_path}: {exc}") from None
        finally:
            self._lock.release()
        try:
            answer = json.loads(reply)
        except ValueError:
            raise LedgerError(f"ledger at {self.socket_path}: not a reply: {reply[:200]!r}") from None
        if not isinstance(answer, dict) or "ok" not in answer:
            raise LedgerError(f"ledger at {self.socket_path}: not a reply: {reply[:200]!r}")
        if answer.get("code") in REFUSES_CALLER:
            self.close()           # the ledger closed it: the next call connects anew
        return answer

    def reserve(self, node: str, key: str, cpu_m: int, mem_bytes: int, gpus=()) -> dict:
        """Reserve for `key` on `node`, with the node's gpu GRES indices
        `gpus` (all or nothing).  A ledger older than GPUs answers
        badrequest to a reserve with gpus: nothing is reserved."""
        return self.call("reserve", node=node, key=key, cpu_m=cpu_m, mem_bytes=mem_bytes,
                         **({"gpus": sorted(int(i) for i in gpus)} if gpus else {}))

    def release(self, node: str, key: str) -> dict:
        return self.call("release", node=node, key=key)

    def release_unbound(self, node: str, key: str) -> dict:
        """Drop a reservation only if no `set` has listed it (the pod was
        never seen bound).  A ledger older than this option answers
        badrequest and drops nothing (its grace period then does)."""
        return self.call("release", node=node, key=key, unbound_only=True)

    def set(self, node: str, entries: dict, keep_younger_than: float) -> dict:
        """`entries`: key -> (cpu_m, mem_bytes) or (cpu_m, mem_bytes, gpus)."""
        return self.call("set", node=node, keep_younger_than=keep_younger_than,
                         entries={k: _set_entry(v) for k, v in entries.items()})

    def show(self, node: str | None = None, since: str | None = None) -> dict:
        return self.call("show", **({"node": node} if node else {}),
                         **({"since": since} if since else {}))


def _set_entry(value) -> list:
    cpu, mem, *rest = value
    gpus = sorted(int(i) for i in rest[0]) if rest and rest[0] else []
    return [int(cpu), int(mem), *([gpus] if gpus else [])]


def show_gpus(view: dict) -> tuple[int, set, set]:
    """(gpu count, indices Slurm jobs hold, indices the ledger holds) of one
    node's `show` view; (0, set(), set()) for a node without GPUs or a
    ledger older than them."""
    g = view.get("gpus") or {}
    return int(g.get("count", 0)), set(g.get("jobs", ())), set(g.get("share", ()))


class ShowFollower:
    """Every node's `show` view, kept current by asking only for the nodes
    that changed since the last reply (the "since" token), so a poller's
    cost in slurmctld and here is the changes, not the cluster.  Every
    `full_seconds` it asks for every node anyway: whatever went wrong, the
    view is never wrong for longer than that."""

    def __init__(self, ledger: Ledger, full_seconds: float = 30.0):
        self.ledger, self.full_seconds = ledger, full_seconds
        self.nodes: dict | None = None
        self.token: str | None = None
        self.full_at = -1e9

    def refresh(self) -> tuple[dict, set | None]:
        """(a `show` reply holding every node's current view, the names
        whose view changed since the last refresh or None for "maybe all").
        A refusal ("notready", ...) is returned as it came, with None."""
        now = time.monotonic()
        since = self.token if now - self.full_at < self.full_seconds else None
        reply = self.ledger.show(since=since)
        if not reply.get("ok"):
            return reply, None
        self.nodes, changed = merged_show(self.nodes if since else None, reply)
        self.token = reply.get("token")
        if changed is None:
            self.full_at = now
        return {**reply, "nodes": self.nodes}, changed
