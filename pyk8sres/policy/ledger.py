"""The ledger's rules: the request protocol, what fits, and a share in Slurm units.

The ledger holds, per node, what Kubernetes holds there, inside slurmctld's
own GRES allocation (k8scpu/k8smemory "allocated" = Slurm jobs + this share).
Both sides use this module: node_features/k8s_resources serves the requests
(pyk8sres/slurmctld/ledger.py), the coordinator and the CLI send them
(pyk8sres/coordinator/slurm.py).  Pure: standard library only, no I/O.

Protocol: one JSON object per line over a unix stream socket, one reply line
per request line.

    {"op": "reserve", "node": "n1", "key": "<pod uid>", "cpu_m": 2735, "mem_bytes": 3582984192}
    {"op": "reserve", "node": "n1", "key": "claim:<uid>", "cpu_m": 0, "mem_bytes": 0,
     "gpus": [0, 1]}
    {"op": "release", "node": "n1", "key": "<pod uid>"}
    {"op": "release", "node": "n1", "key": "<pod uid>", "unbound_only": true}
    {"op": "set", "node": "n1", "entries": {"<uid>": [cpu_m, mem_bytes], ...,
     "claim:<uid>": [cpu_m, mem_bytes, [gpu index, ...]]}, "keep_younger_than": 30}
    {"op": "show"}  or  {"op": "show", "node": "n1"}  or  {"op": "show", "since": TOKEN}

A `set` makes the node's entries what the sync daemon sees bound, but for
keep_younger_than seconds after a key's last `reserve` it neither shrinks
that key's entry nor (never seen bound) drops it: its view may predate the
reserve (see decide).

GPUs: "gpus" names indices of the node's `gpu` GRES (Slurm's IDX) an entry
holds.  A reserve is refused nofit (nothing changed, its CPU and memory
part neither) if any index is held by a Slurm job or by another entry on
the node, is not below the node's gpu count, or the node's gpu GRES has no
device files (File=) to tell indices apart.  Inside slurmctld the indices
are allocated in the node's gpu GRES itself, so a job pends (Resources)
behind them device by device.  A `set` keeps a recently reserved entry's
indices as it keeps its size.

A release with "unbound_only" drops the entry only while it is a reservation
no `set` has listed yet (the pod was never seen bound); the reply then says
"kept": true for an entry it left.  The webhook uses it to hand back a
create's reservation once the create is known to have failed, without
racing the sync daemon: a pod it has seen bound keeps its share.

Each node's view in a `show` reply has its "share" (CPUs, MB), "reserved"
(how many entries are reservations not yet seen bound by a `set`),
"registered": true for a node held whole since it newly registered
(REGISTERED_KEY, until the coordinator's first `set` there) and,
for a node slurmctld knows, "capacity", "jobs", "free" and "oversubscribed";
for a node with a gpu GRES (or entries holding GPUs) "gpus": {"count": N,
"jobs": [indices Slurm jobs hold], "share": [indices entries hold]}; a
`show` of one node adds its "entries" and which of them are "unbound"
(reservations no `set` has listed).

A `show` of every node carries a "token".  Sent back as "since", the next
reply lists only the nodes whose view changed after it ("full": false); the
caller merges it into what it has.  A reply with "full": true lists every
node and replaces it: the token was from another process or journal load,
the node table changed, or too much changed to list.

Replies: {"ok": true, ...} or {"ok": false, "code": CODE, "error": "why"}
with CODE one of CODES:

    nofit         the node has no room for this reservation (nothing changed)
    badrequest    the line is not a valid request (nothing changed)
    unknown_node  slurmctld has no such node with k8scpu/k8smemory (nothing changed)
    denied        this uid may not use the ledger; the connection is closed
    busy          this uid has too many connections open; this one is closed
    notready      slurmctld is starting, or a backup is taking over, and has not
                  recovered its node and job state yet: nothing was read or
                  changed.  It says nothing about any node -- above all not
                  "unknown" or "no share": retry in a moment, and until then
                  fail closed (admit no pod, release nothing).  The server
                  answers it to every request, `show` included, then serves
                  normally once ready; a server that shuts down or hands over
                  answers it once and closes the connection.
    internal      a bug inside slurmctld's plugin (see slurmctld's log)

A connection that cannot be made (no socket, refused) means no slurmctld owns
the ledger right now (down, or failing over): the same as notready.
"""
from __future__ import annotations

import json
import re
from typing import Mapping, NamedTuple

MIB = 1 << 20
MAX_REQUEST_BYTES = 1 << 20       # one line; a node with 1000 pods is ~80 KB
MAX_CPU_M = 1 << 40               # 1e9 CPUs: anything above is a caller bug
MAX_MEM_BYTES = 1 << 60
MAX_ENTRIES = 100_000
MAX_KEEP_SECONDS = 86_400
MAX_GPUS = 1024                   # gpu indices 0..MAX_GPUS-1 (inside slurmctld: a bitmask)
# Slurm node names may hold "_" (NodeName=gpu_01); Kubernetes names cannot,
# but a node_map or the mapping label can point at such a Slurm node.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@/+-]{0,252}\Z", re.ASCII)
CODES = ("nofit", "badrequest", "unknown_node", "denied", "busy", "notready", "internal")
OPS = ("reserve", "release", "set", "show")


class RequestError(ValueError):
    """A request that cannot be served; `code` is one of CODES."""

    def __init__(self, message: str, code: str = "badrequest"):
        super().__init__(message)
        self.code = code


class Entry(NamedTuple):
    """What one key (a pod) holds on a node, since when (seconds on the
    ledger process's monotonic clock: a wall-clock step neither ends nor
    stretches a grace period), whether a `set` has listed it (the pod
    was seen bound): only a reservation never seen bound gets a grace period
    in `set`, and when a `reserve` last asked for it (None: never, or a
    journal written before this was kept): for that long a `set` may not
    make it smaller (see decide)."""
    cpu_m: int
    mem_bytes: int
    since: float
    bound: bool = False
    reserved_at: float | None = None
    gpus: tuple = ()                  # sorted gpu indices (Slurm's IDX)


class Request(NamedTuple):
    op: str
    node: str | None = None
    key: str | None = None
    cpu_m: int = 0
    mem_bytes: int = 0
    # set: ((key, cpu_m, mem_bytes), ...), with a 4th element, the sorted
    # gpu indices, for an entry that holds GPUs
    entries: tuple = ()
    keep_younger_than: float = 0.0
    since: str | None = None          # show: a token from an earlier show
    unbound_only: bool = False        # release: only a reservation never seen bound
    gpus: tuple = ()                  # reserve: sorted gpu indices


class Facts(NamedTuple):
    """What slurmctld says of a node, read under its locks.  gpu_count is
    the node's `gpu` GRES count (0: none), gpu_jobs the indices Slurm jobs
    hold, gpu_problem why no index can be reserved there ("" if they can)."""
    capacity_cpu: int
    capacity_mem: int
    jobs_cpu: int
    jobs_mem: int
    gpu_count: int = 0
    gpu_jobs: frozenset = frozenset()
    gpu_problem: str = ""


def _name(value, what: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise RequestError(f"{what} must be a name of 1-253 ASCII letters, digits or _._:@/+-, "
                           f"not {value!r}"[:300])
    return value


def _amount(value, what: str, limit: int) -> int:
    # bool is an int subclass: true/false as an amount is a caller bug.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise RequestError(f"{what} must be an integer from 0 to {limit}, not {value!r}"[:300])
    return value


def _gpus(value, what: str) -> tuple:
    if not isinstance(value, list) or len(value) > MAX_GPUS or \
            any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_GPUS
                for i in value) or len(set(value)) != len(value):
        raise RequestError(f"{what} must be a list of distinct gpu indices from 0 to "
                           f"{MAX_GPUS - 1}, not {value!r}"[:300])
    return tuple(sorted(value))


def parse_request(line: bytes | str) -> Request:
    """The checked request, or RequestError saying what is wrong."""
    if len(line) > MAX_REQUEST_BYTES:
        raise RequestError(f"request larger than {MAX_REQUEST_BYTES} bytes")
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"not a JSON object: {exc}"[:300]) from None
    if not isinstance(doc, dict):
        raise RequestError("a request is a JSON object")
    op = doc.get("op")
    if op not in OPS:
        raise RequestError(f"op must be one of {', '.join(OPS)}, not {op!r}"[:300])
    allowed = {"reserve": {"node", "key", "cpu_m", "mem_bytes", "gpus"},
               "release": {"node", "key", "unbound_only"},
               "set": {"node", "entries", "keep_younger_than"}, "show": {"node", "since"}}[op]
    unknown = sorted(set(doc) - allowed - {"op"})
    if unknown:
        raise RequestError(f"{op}: unknown field(s) {', '.join(map(str, unknown))}"[:300])
    if op == "show":
        node, since = doc.get("node"), doc.get("since")
        if node is not None and since is not None:
            raise RequestError("show: since is for a show of every node, not of one")
        return Request(op, node=None if node is None else _name(node, "node"),
                       since=None if since is None else _name(since, "since"))
    missing = sorted(f for f in allowed if f not in doc
                     and f not in ("keep_younger_than", "unbound_only", "gpus"))
    if missing:
        raise RequestError(f"{op}: missing field(s) {', '.join(missing)}")
    node = _name(doc["node"], "node")
    if op == "release":
        unbound_only = doc.get("unbound_only", False)
        if not isinstance(unbound_only, bool):
            raise RequestError(f"release: unbound_only must be true or false, not "
                               f"{unbound_only!r}"[:300])
        return Request(op, node=node, key=_name(doc["key"], "key"), unbound_only=unbound_only)
    if op == "reserve":
        return Request(op, node=node, key=_name(doc["key"], "key"),
                       cpu_m=_amount(doc["cpu_m"], "cpu_m", MAX_CPU_M),
                       mem_bytes=_amount(doc["mem_bytes"], "mem_bytes", MAX_MEM_BYTES),
                       gpus=_gpus(doc.get("gpus", []), "gpus"))
    entries = doc["entries"]
    if not isinstance(entries, dict) or len(entries) > MAX_ENTRIES:
        raise RequestError(f"set: entries must be an object of at most {MAX_ENTRIES} "
                           "key -> [cpu_m, mem_bytes] or [cpu_m, mem_bytes, [gpu, ...]]")
    checked = []
    for key, value in entries.items():
        if not isinstance(value, list) or len(value) not in (2, 3):
            raise RequestError(f"set: entry {key!r} must be [cpu_m, mem_bytes] or "
                               f"[cpu_m, mem_bytes, [gpu, ...]]"[:300])
        gpus = _gpus(value[2], f"set: entry {key!r}'s gpus") if len(value) == 3 else ()
        checked.append((_name(key, "key"), _amount(value[0], "cpu_m", MAX_CPU_M),
                        _amount(value[1], "mem_bytes", MAX_MEM_BYTES), *([gpus] if gpus else [])))
    keep = doc.get("keep_younger_than", 0)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or \
            not 0 <= keep <= MAX_KEEP_SECONDS:
        raise RequestError(f"set: keep_younger_than must be 0 to {MAX_KEEP_SECONDS} seconds")
    return Request(op, node=node, entries=tuple(sorted(checked)), keep_younger_than=float(keep))


class ShowToken(NamedTuple):
    """Where a `show` of every node stood: the ledger's journal load
    (`epoch`), the plugin's node table and facts generation (`layout`,
    `facts`), and the ledger's entries generation (`entries`)."""
    epoch: str
    layout: int
    facts: int
    entries: int

    def __str__(self) -> str:
        return f"{self.epoch}.{self.layout}.{self.facts}.{self.entries}"

    @classmethod
    def parse(cls, text: str | None) -> "ShowToken | None":
        """The token, or None for one this cannot read (the caller then
        gets every node)."""
        try:
            epoch, *numbers = (text or "").split(".")
            return cls(epoch, *map(int, numbers))
        except (TypeError, ValueError):
            return None


def merged_show(known: Mapping[str, dict] | None, reply: Mapping) -> tuple[dict, set[str] | None]:
    """(every node's view, the names that changed or None for "all") after
    a `show` reply: a full reply replaces what was known, a partial one is
    merged into it.  The client side of the "since" token."""
    nodes = reply.get("nodes") or {}
    if known is None or reply.get("full", True):
        return dict(nodes), None
    return {**known, **nodes}, set(nodes)


def not_ready(reply) -> bool:
    """Is this reply the server's "notready" (slurmctld still recovering, a
    backup taking over)?  It says nothing about any node: the caller keeps
    what it knew, admits nothing new and releases nothing, and retries."""
    return isinstance(reply, Mapping) and reply.get("ok") is False and \
        reply.get("code") == "notready"


NOT_READY_TEXT = ("Slurm's ledger is not ready (slurmctld is starting, or a backup "
                  "controller is taking over)")


def encode(op: str, **fields) -> bytes:
    """A request line (the client side of parse_request)."""
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode() + b"\n"


def share_units(entries: Mapping[str, tuple]) -> tuple[int, int]:
    """Whole CPUs and MB (MiB, as Slurm counts) that `entries` (Entry, or
    (cpu_m, mem_bytes) as a `set` sends them) hold together: requests add
    up exactly, then round up once (two 500m pods = 1 CPU)."""
    cpu_m = sum(e[0] for e in entries.values())
    mem = sum(e[1] for e in entries.values())
    return -(-cpu_m // 1000), -(-mem // MIB)


def gpu_units(entries: Mapping[str, Entry]) -> tuple[int, ...]:
    """The gpu indices `entries` hold together, sorted."""
    return tuple(sorted({i for e in entries.values() for i in e.gpus}))


def gpu_conflicts(gpus, others: Mapping[str, Entry], facts: Facts) -> str:
    """Why `gpus` cannot be held next to Slurm's jobs and `others` ("" if
    they can)."""
    if not gpus:
        return ""
    if facts.gpu_problem:
        return facts.gpu_problem
    if not facts.gpu_count:
        return "it has no gpu GRES"
    too_high = [i for i in gpus if i >= facts.gpu_count]
    if too_high:
        return f"it has {facts.gpu_count} GPUs (indices 0-{facts.gpu_count - 1}), not {too_high}"
    jobs = sorted(set(gpus) & facts.gpu_jobs)
    if jobs:
        return f"Slurm jobs hold GPU index(es) {jobs}"
    held = {i: k for k, e in others.items() for i in e.gpus}
    taken = sorted(i for i in gpus if i in held)
    if taken:
        return f"GPU index(es) {taken} are held by {held[taken[0]]}"
    return ""


def applied(share: tuple[int, int], facts: Facts) -> tuple[int, int]:
    """What Slurm can really carry of `share` next to its jobs: allocated
    (jobs + share) is never above the total, or Slurm's unsigned free count
    would wrap around (DESIGN.md §7)."""
    return (max(0, min(share[0], facts.capacity_cpu - facts.jobs_cpu)),
            max(0, min(share[1], facts.capacity_mem - facts.jobs_mem)))


def _fits(share: tuple[int, int], facts: Facts) -> bool:
    return (facts.jobs_cpu + share[0] <= facts.capacity_cpu and
            facts.jobs_mem + share[1] <= facts.capacity_mem)


def decide(entries: Mapping[str, Entry], req: Request, facts: Facts | None,
           now: float) -> tuple[dict[str, Entry] | None, dict]:
    """(the node's new entries or None if unchanged, the reply) for a
    reserve/release/set on one node.  `facts` is None for a node slurmctld
    does not know (or that has not registered its k8s GRES yet)."""
    if facts is None:
        if req.op == "release" and req.key not in entries:
            return None, {"ok": True}
        if req.op in ("reserve", "set"):
            return None, {"ok": False, "code": "unknown_node",
                          "error": f"node {req.node} is not a Slurm node with k8scpu/k8smemory "
                                   "(unknown, or not registered yet)"}
    if req.op == "release":
        if req.key not in entries:
            return None, {"ok": True}
        if req.unbound_only and entries[req.key].bound:
            return None, {"ok": True, "kept": True}
        new = {k: e for k, e in entries.items() if k != req.key}
        return new, {"ok": True}
    if req.op == "set":
        return _set(entries, req, facts, now)
    # reserve: idempotent per key, and it only ever grows a reservation (a
    # resize asks for more): whoever sends it can never hand capacity back.
    # Shrinking and releasing are the repair's (`set`, from the pods the API
    # server really has).  Even one that asks for no more renews
    # reserved_at: a `set` computed from an older view of the pod must not
    # shrink it below what was just admitted.
    # A reservation's GPUs grow the same way (union), all or nothing with
    # its CPU and memory.
    old = entries.get(req.key)
    if old is not None and req.cpu_m <= old.cpu_m and req.mem_bytes <= old.mem_bytes and \
            set(req.gpus) <= set(old.gpus):
        if old.reserved_at == now:
            return None, {"ok": True}
        return {**entries, req.key: old._replace(reserved_at=now)}, {"ok": True}
    new = dict(entries)
    new[req.key] = Entry(max(req.cpu_m, old.cpu_m if old else 0),
                         max(req.mem_bytes, old.mem_bytes if old else 0),
                         old.since if old else now, old.bound if old else False, now,
                         tuple(sorted({*req.gpus, *(old.gpus if old else ())})))
    others_entries = {k: e for k, e in entries.items() if k != req.key}
    gpu_refusal = gpu_conflicts(sorted(set(req.gpus) - set(old.gpus if old else ())),
                                others_entries, facts)
    share = share_units(new)
    if _fits(share, facts) and not gpu_refusal:
        return new, {"ok": True}
    if gpu_refusal:
        return None, {"ok": False, "code": "nofit", "error": (
            f"node {req.node} cannot give GPU(s) {list(req.gpus)} to {req.key}: "
            f"{gpu_refusal}")}
    others = share_units(others_entries)
    return None, {"ok": False, "code": "nofit", "error": (
        f"node {req.node} has no room: this needs {req.cpu_m}m CPU and "
        f"{-(-req.mem_bytes // MIB)} MB; Slurm jobs hold {facts.jobs_cpu} of "
        f"{facts.capacity_cpu} CPUs and {facts.jobs_mem} of {facts.capacity_mem} MB, "
        f"pods already hold {others[0]} CPUs and {others[1]} MB")}


# The entry that holds a node slurmctld newly registered (a dynamic node, a
# node created at runtime) whole until the coordinator's first `set` there:
# it may come up beside pods nobody has counted yet.  A name no pod UID can
# take; bound, so the first `set` (which never lists it) replaces it.
REGISTERED_KEY = "slurm:registered"


def registered(entries: Mapping[str, Entry], known: bool, capacity: tuple[int, int],
               now: float) -> dict[str, Entry] | None:
    """The node's new entries (None: unchanged) when it registers with
    `capacity` (CPUs, MB).  A node the ledger has not met (`known` False:
    not in slurmctld's table when this process took the ledger over, not
    registered since) is held whole by REGISTERED_KEY; one still held is
    re-sized to its new capacity.  Whatever else it holds stays, and the
    hold is what those entries leave of the capacity."""
    held = entries.get(REGISTERED_KEY)
    if held is None and known:
        return None
    others = share_units({k: e for k, e in entries.items() if k != REGISTERED_KEY})
    cpu_m = max(0, int(capacity[0]) - others[0]) * 1000
    mem = max(0, int(capacity[1]) - others[1]) * MIB
    if held is not None:
        if (held.cpu_m, held.mem_bytes) == (cpu_m, mem):
            return None
        return {**entries, REGISTERED_KEY: held._replace(cpu_m=cpu_m, mem_bytes=mem)}
    return {**entries, REGISTERED_KEY: Entry(cpu_m, mem, now, True)}


def _reserved_lately(e: Entry, now: float, keep: float) -> bool:
    return e.reserved_at is not None and now - e.reserved_at < keep


def _set(entries: Mapping[str, Entry], req: Request, facts: Facts,
         now: float) -> tuple[dict[str, Entry] | None, dict]:
    """A `set`: the node's entries become what the sync daemon sees bound,
    with two holds, both for keep_younger_than seconds:
    * a reservation never seen bound is kept that long after its last
      reserve (a pod admitted a moment ago may not be seen bound yet);
    * a listed entry is never made smaller than it was at its last reserve
      that long ago: the sync daemon may have computed this `set` from a
      view of the pod older than that reserve (a resize admitted meanwhile).
    One seen bound before and not listed now is gone: its pod object is.
    GPU indices follow the same rules as the size (a recent reserve's are
    kept, united with those listed)."""
    keep = req.keep_younger_than
    wanted = {}
    for key, cpu, mem, *rest in req.entries:
        gpus = rest[0] if rest else ()
        old = entries.get(key)
        if old is None:
            wanted[key] = Entry(cpu, mem, now, True, gpus=gpus)
        elif _reserved_lately(old, now, keep):
            wanted[key] = old._replace(cpu_m=max(cpu, old.cpu_m),
                                       mem_bytes=max(mem, old.mem_bytes), bound=True,
                                       gpus=tuple(sorted({*gpus, *old.gpus})))
        else:
            wanted[key] = old._replace(cpu_m=cpu, mem_bytes=mem, bound=True, gpus=gpus)
    kept = {k: e for k, e in entries.items()
            if k not in wanted and not e.bound and
            now - max(e.since, e.reserved_at or e.since) < keep}
    new = {**kept, **wanted}
    share = share_units(new)
    reply = {"ok": True, "dropped": sorted(set(entries) - set(new)),
             "share": {"cpu": share[0], "mem": share[1]}}
    if not _fits(share, facts) or _gpus_overbooked(new, facts):
        reply["oversubscribed"] = True
    return (None if new == dict(entries) else new), reply


def _gpus_overbooked(entries: Mapping[str, Entry], facts: Facts) -> bool:
    """Do `entries` hold a GPU index twice, or one a job holds or the node
    has not?  (Inside slurmctld only the indices free of jobs are carried.)"""
    held = [i for e in entries.values() for i in e.gpus]
    return bool(held) and (len(set(held)) != len(held) or
                           bool(gpu_conflicts(sorted(set(held)), {}, facts)))


def repair_needed(view: Mapping | None, entries: Mapping[str, tuple]) -> bool:
    """Must a `set` of `entries` (key -> (cpu_m, mem_bytes[, gpus])), unchanged since
    the last one, be sent again to the node whose `show` view is `view`?
    Only if the ledger may hold something else there: reservations not
    seen bound (the `set` expires the stale ones), or another share than
    these entries' (a `release` by hand, a journal lost).  Yes whenever the
    view cannot say: no view, an unknown node, a server without "reserved"."""
    if not view or view.get("unknown") or view.get("reserved", 1):
        return True
    cpu, mem = share_units(entries)
    gpus = sorted({i for e in entries.values() if len(e) > 2 for i in e[2]})
    return view.get("share") != {"cpu": cpu, "mem": mem} or \
        (view.get("gpus") or {}).get("share", []) != gpus


def rebased(nodes: Mapping[str, Mapping[str, Entry]], now: float,
            written_at: float | None = None) -> dict[str, dict[str, Entry]]:
    """The entries as a new process takes them over from the journal: its
    monotonic clock has another origin (a reboot, a backup on another host),
    so every entry counts from `now`.  A reservation not seen bound gets a
    fresh grace period (kept a little longer, never dropped early); what a
    bound pod holds has no grace period to lose.  A reserve's age is kept as
    it was at `written_at` (the writer's clock at its last journal line):
    the time the ledger had no owner is not counted, so its hold on the
    entry's size lasts longer, never shorter.  Without `written_at` every
    reserve counts as made `now`."""
    def moved(e: Entry) -> Entry:
        reserved_at = e.reserved_at
        if reserved_at is not None:
            age = max(0.0, written_at - reserved_at) if written_at is not None else 0.0
            reserved_at = now - age if age < MAX_KEEP_SECONDS else None
        return e._replace(since=now, reserved_at=reserved_at)
    return {node: {k: moved(e) for k, e in entries.items()}
            for node, entries in nodes.items()}


def node_view(entries: Mapping[str, Entry], facts: Facts | None, *,
              with_entries: bool) -> dict:
    """One node of a `show` reply."""
    share = share_units(entries)
    view = {"share": {"cpu": share[0], "mem": share[1]},
            "reserved": sum(not e.bound for e in entries.values())}
    if REGISTERED_KEY in entries:      # held whole until the coordinator's first set
        view["registered"] = True
    gpus = gpu_units(entries)
    if facts is not None:
        carried = applied(share, facts)
        view.update(
            capacity={"cpu": facts.capacity_cpu, "mem": facts.capacity_mem},
            jobs={"cpu": facts.jobs_cpu, "mem": facts.jobs_mem},
            free={"cpu": facts.capacity_cpu - facts.jobs_cpu - carried[0],
                  "mem": facts.capacity_mem - facts.jobs_mem - carried[1]},
            oversubscribed=carried != share or _gpus_overbooked(entries, facts))
        if facts.gpu_count or gpus:
            view["gpus"] = {"count": facts.gpu_count, "jobs": sorted(facts.gpu_jobs),
                            "share": list(gpus)}
            if facts.gpu_problem:
                view["gpus"]["problem"] = facts.gpu_problem
    else:
        view["unknown"] = True
        if gpus:
            view["gpus"] = {"count": 0, "jobs": [], "share": list(gpus)}
    if with_entries:
        view["entries"] = {k: [e.cpu_m, e.mem_bytes, *([list(e.gpus)] if e.gpus else [])]
                           for k, e in sorted(entries.items())}
        view["unbound"] = sorted(k for k, e in entries.items() if not e.bound)
    return view


def seen_bound(reply: Mapping, node: str, key: str) -> bool:
    """Does this `show` of one node say that a `set` has listed entry `key`
    there (its pod seen bound by the sync daemon)?  False whenever the
    reply cannot say: not ok, no such entry, or a server that does not
    list "unbound"."""
    view = (reply.get("nodes") or {}).get(node) if reply.get("ok") is True else None
    if not isinstance(view, Mapping) or not isinstance(view.get("unbound"), list):
        return False
    return key in (view.get("entries") or {}) and key not in view["unbound"]

