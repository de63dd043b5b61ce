"""The ledger inside slurmctld: Kubernetes' share of each node, durable.

node_features/k8s_resources serves the request socket on its own thread and
calls in here twice per request (pyk8sres/slurmctld/embed.py):

  prepare()  outside slurmctld's locks: parse, authorize, and write the
             request to the journal (fsync) -- so whatever is granted next
             is already durable when the reply says ok;
  apply()    under slurmctld's job+node write locks: decide with the node's
             facts (capacity, what jobs hold) and hand the node's new share
             to C, which puts it into Slurm's GRES allocation at once.

A request denied after its journal line was written gets an "undo" line
(no fsync: losing it in a crash only keeps a reservation the coordinator's
next `set` drops).  One process owns the journal at a time: the slurmctld in
control, holding an exclusive flock on k8s_resources.ledger.lock
(plugins/ledger_server.c).  It replays the journal when it takes it over
(startup, restart, 24.11's re-exec on reconfigure, a backup controller
taking over with the same StateSaveLocation) and compacts it into one
snapshot line then and now and then; any other process only reads it.

Time: every "t" and "since" is the owning process's time.monotonic(), so a
wall-clock step never ends a reservation's grace period.  A process that
loads the journal (its monotonic clock may have another origin: a reboot, a
backup on another host) replays it in the writer's clock, then rebases every
entry to its own "now" (policy.ledger.rebased: unbound reservations get a
fresh grace period) and, as the owner, writes that down as the snapshot.

Journal: JSON lines, each {"t": seconds, "op": ...} as in policy.ledger plus
{"op": "undo", "node", "key", "entry": [cpu_m, mem_bytes, since, bound,
reserved_at, gpus] | null} (a refused reserve; also a newly registered node's
hold, see registered()), {"op": "undo", "node", "entries": {key: [...]}} (a
refused set; also a node's entries after a request that a registration's
hold overtook) and {"op": "snapshot", "nodes": {node: {key:
[cpu_m, mem_bytes, since, bound, reserved_at, gpus]}}}; reserved_at is null
when no reserve asked for the entry, gpus the sorted gpu indices; journals
from before they were kept have the first four or five only (read as null
and no GPUs).  A request that changes nothing is not
written at all.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, Iterable

from ..policy.ledger import (REGISTERED_KEY, Entry, Facts, Request, RequestError, ShowToken,
                             decide, gpu_units, node_view, parse_request, rebased, registered,
                             share_units)

log = logging.getLogger("pyk8sres")

JOURNAL_NAME = "k8s_resources.ledger"
COMPACT_AFTER = 20_000            # journal lines before a snapshot replaces them

FactsFn = Callable[[str], "Facts | None"]
# (node, CPUs, MB, gpu indices): the node's whole share
ShareFn = Callable[[str, int, int, tuple], None]
# (layout, facts generation) of a `show` token -> (layout, generation now,
# the nodes whose facts changed since, or None when the plugin cannot say).
FactChangesFn = Callable[[int, int], "tuple[int, int, list[str] | None]"]
MAX_CHANGED = 4096                # a `show` since listing more sends every node


class Ledger:
    def __init__(self, directory: str, *, allowed_uids=(0,), clock=time.monotonic):
        self.directory = directory
        self.path = os.path.join(directory, JOURNAL_NAME)
        self.allowed_uids = frozenset(allowed_uids)
        self.clock = clock
        self.nodes: dict[str, dict[str, Entry]] = {}
        self.lines = 0
        self._journal = None
        self._tickets: dict[int, Request] = {}
        self._next_ticket = 1
        # For `show` since a token: a fresh epoch per load (a token from
        # another process or load gets every node), and the nodes whose
        # entries changed, oldest change first.
        self.epoch = os.urandom(4).hex()
        self.entries_gen = 0
        self.entries_changed: dict[str, int] = {}
        # The nodes met since this process took the ledger over (slurmctld's
        # table once it is in control, and every node registered since);
        # None until then: no node is held as new before it is known which
        # are (see registered()).
        self.known: set[str] | None = None
        # registered() runs on slurmctld's registration thread, under its
        # node write lock; the requests' thread touches the journal and reads
        # the entries outside those locks (prepare, a `show`).  Never held
        # while waiting for a slurmctld lock.
        self.mutex = threading.Lock()
        # Nodes a registration changed while a request's ticket was between
        # prepare and apply: its journal line then precedes the hold's.
        self._held_meanwhile: set[str] = set()

    # --- persistence -------------------------------------------------------
    def load(self, *, compact: bool = True) -> None:
        """Replay the journal.  A torn last line (crash mid-write) is ignored;
        any other bad line is an error, and nothing changes: never guess what
        Kubernetes holds.  compact=True only in the process that holds the
        journal's lock (node_features' ledger_server.c): it alone may replace
        the file; a reader (a standby backup, a process waiting for the lock)
        only reads."""
        nodes, lines, written_at = self._read()
        self._close_journal()   # the file may have been replaced since we wrote
        # Replayed in the writer's clock; from here on in ours.
        self.nodes, self.lines = rebased(nodes, self.clock(), written_at), lines
        self.epoch, self.entries_changed = os.urandom(4).hex(), {}
        self.known = None
        if compact:
            self._compact()

    def _read(self) -> tuple[dict, int, float | None]:
        """(the nodes' entries, whole lines, the "t" of the last one)."""
        nodes: dict[str, dict[str, Entry]] = {}
        lines, written_at = 0, None
        try:
            with open(self.path, "rb") as f:
                raw = f.read().split(b"\n")
        except FileNotFoundError:
            raw = []
        last = len(raw) - 1
        for number, line in enumerate(raw):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                nodes = self._replay(nodes, doc)
                written_at = float(doc.get("t", 0))
            except (ValueError, KeyError, TypeError, AttributeError, RequestError) as exc:
                if number == last:  # every whole line ends with a newline
                    log.error("node_features/k8s_resources: ledger %s: ignoring a torn last "
                              "line (crash while writing)", self.path)
                    break
                raise ValueError(f"{self.path}:{number + 1}: bad ledger line: {exc}") from None
            lines += 1
        return nodes, lines, written_at

    def _replay(self, nodes: dict, doc: dict) -> dict:
        op, t = doc["op"], float(doc.get("t", 0))
        if op == "snapshot":
            return {node: {k: _entry(v) for k, v in entries.items()}
                    for node, entries in doc["nodes"].items()}
        if op == "undo":
            if "entries" in doc:        # a node's whole entries (a refused `set`)
                entries = {k: _entry(v) for k, v in doc["entries"].items()}
            else:
                entries = nodes.get(doc["node"], {})
                entries.pop(doc["key"], None)
                if doc.get("entry"):
                    entries[doc["key"]] = _entry(doc["entry"])
            if entries:
                nodes[doc["node"]] = entries
            else:
                nodes.pop(doc["node"], None)
            return nodes
        req = parse_request(json.dumps({k: v for k, v in doc.items() if k != "t"}))
        # Replayed as granted: a grant's undo line follows it if it was not.
        new = self._granted(nodes.get(req.node, {}), req, t)
        if new:
            nodes[req.node] = new
        elif new is not None:
            nodes.pop(req.node, None)
        return nodes

    @staticmethod
    def _granted(entries: dict, req: Request, now: float) -> dict | None:
        roomy = Facts(1 << 62, 1 << 62, 0, 0, gpu_count=1 << 62)
        return decide(entries, req, roomy, now)[0]

    def _store(self, node: str, entries: dict) -> None:
        if entries:
            self.nodes[node] = entries
        else:
            self.nodes.pop(node, None)
        self.entries_gen += 1
        self.entries_changed.pop(node, None)    # re-inserted last: newest change
        self.entries_changed[node] = self.entries_gen

    def _entries_changed_since(self, gen: int) -> list[str] | None:
        changed = []
        for node, at in reversed(self.entries_changed.items()):
            if at <= gen:
                break
            if len(changed) == MAX_CHANGED:
                return None
            changed.append(node)
        return changed

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def _open(self):
        if self._journal is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._journal = os.fdopen(fd, "ab")
        return self._journal

    def _append(self, doc: dict, *, sync: bool) -> None:
        f = self._open()
        f.write(json.dumps(doc, separators=(",", ":")).encode() + b"\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())
        self.lines += 1

    def _compact(self) -> None:
        """Replace the journal by one snapshot line (new file, fsync, rename)."""
        snapshot = {"t": self.clock(), "op": "snapshot",
                    "nodes": {node: {k: _entry_doc(e) for k, e in entries.items()}
                              for node, entries in self.nodes.items()}}
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(snapshot, separators=(",", ":")).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._close_journal()
        self.lines = 1

    # --- the two calls per request ------------------------------------------
    def prepare(self, uid: int, line: bytes) -> tuple[int, dict | None]:
        """(ticket, None) to go on to apply(), or (0, reply) when done.
        The caller is authorised before a byte is parsed (ledger_clients.c
        does it at accept; checked here again)."""
        if uid not in self.allowed_uids:
            return 0, {"ok": False, "code": "denied", "error": (
                f"uid {uid} may not use the ledger (root, SlurmUser and LedgerUsers= in "
                "k8s_resources.conf may)")}
        try:
            req = parse_request(line)
        except RequestError as exc:
            return 0, {"ok": False, "code": exc.code, "error": str(exc)}
        with self.mutex:
            return self._prepare(req)

    def _prepare(self, req: Request) -> tuple[int, None]:
        now = self.clock()
        # Only a request that changes something is journaled (and fsynced):
        # one that changes nothing -- the sync daemon's `set` of a node every
        # second, a repeated reserve -- leaves the replay the same without it.
        journaled = req.op != "show" and \
            self._granted(self.nodes.get(req.node, {}), req, now) is not None
        if journaled:
            if self.lines >= COMPACT_AFTER:
                self._compact()
            self._append({"t": now, **_as_doc(req)}, sync=True)
        ticket = self._next_ticket
        self._next_ticket += 1
        # Decided at the journaled time: replay agrees.
        self._tickets[ticket] = (req, now, journaled)
        return ticket, None

    def read_only(self, ticket: int) -> bool:
        """Does this request only read (`show`)?  Then slurmctld's read
        locks are enough to apply it."""
        return self._tickets[ticket][0].op == "show"

    def apply(self, ticket: int, facts: FactsFn, set_share: ShareFn,
              node_names: Callable[[], Iterable[str]] = tuple,
              stats: Callable[[], dict] = dict,
              fact_changes: FactChangesFn | None = None) -> dict:
        """Under slurmctld's locks: decide, and hand changed shares to C.
        `node_names` lists slurmctld's nodes, `stats` the plugin's counters
        and `fact_changes` which nodes' facts changed (for a `show` of all
        of them)."""
        with self.mutex:     # registered() reads them from another thread
            req, now, journaled = self._tickets.pop(ticket)
        if req.op == "show":
            return self._show(req, facts, node_names, stats, fact_changes)
        entries = self.nodes.get(req.node, {})
        new, reply = decide(entries, req, facts(req.node), now)
        if new is not None:
            self._store(req.node, new)
            set_share(req.node, *share_units(new), gpu_units(new))
        if req.op == "set" and reply["ok"] and self.known is not None:
            with self.mutex:     # the coordinator has counted it: not new
                self.known.add(req.node)
        if req.node in self._held_meanwhile:
            # A registration's hold was journaled after this request's line
            # but decided before it: write down the outcome, so replay agrees.
            with self.mutex:
                self._held_meanwhile.discard(req.node)
                # No fsync under slurmctld's locks: the next grant's makes
                # it durable; lost, replay ends on the hold (held, not freed).
                self._append({"t": now, "op": "undo", "node": req.node, "entries": {
                    k: _entry_doc(e) for k, e in self.nodes.get(req.node, {}).items()}},
                    sync=False)
        elif not reply["ok"] and journaled:
            # Replayed as granted unless undone (no fsync: a lost undo only
            # keeps a reservation the coordinator's next `set` drops).
            if req.op == "reserve":
                old = entries.get(req.key)
                self._append({"t": now, "op": "undo", "node": req.node, "key": req.key,
                              "entry": _entry_doc(old) if old else None}, sync=False)
            else:
                self._append({"t": now, "op": "undo", "node": req.node,
                              "entries": {k: _entry_doc(e) for k, e in entries.items()}},
                             sync=False)
        if reply.get("oversubscribed"):
            log.error("node_features/k8s_resources: node %s: pods hold more than Slurm jobs "
                      "leave (%s); no new job starts there until they leave", req.node,
                      share_units(new if new is not None else entries))
        return reply

    def _show(self, req: Request, facts: FactsFn, node_names, stats,
              fact_changes: FactChangesFn | None) -> dict:
        since = ShowToken.parse(req.since)
        with self.mutex:     # a registration may change them meanwhile
            nodes, entries_gen = dict(self.nodes), self.entries_gen
            entries = self._entries_changed_since(since.entries) \
                if since and since.entries <= entries_gen else None
        if req.node:
            return {"ok": True, "nodes": {req.node: node_view(
                nodes.get(req.node, {}), facts(req.node), with_entries=True)}}
        layout, facts_gen, changed = (fact_changes(since.layout if since else 0,
                                                   since.facts if since else 0)
                                      if fact_changes else (0, 0, None))
        token = ShowToken(self.epoch, layout, facts_gen, entries_gen)
        if since and since.epoch == self.epoch and changed is not None and \
                entries is not None:
            names, full = sorted({*changed, *entries}), False
        else:
            names, full = sorted({*nodes, *node_names()}), True
        return {"ok": True, "full": full, "token": str(token),
                "nodes": {n: node_view(nodes.get(n, {}), facts(n), with_entries=False)
                          for n in names},
                "plugin": stats()}

    # --- nodes slurmctld registers -----------------------------------------
    def meet(self, names: Iterable[str]) -> None:
        """Once this process is in control with the ledger loaded: the nodes
        slurmctld has now (slurm.conf's, and the dynamic ones it recovered)
        are not new, whatever the ledger holds there."""
        try:
            met = set(names)
        except BaseException:
            met = set()       # fail closed: every node registering is new
            raise
        finally:
            with self.mutex:
                self.known = met

    def registered(self, node: str, cpus: int, mb: int, hold: bool) -> tuple | None:
        """Under slurmctld's node write lock, when `node` registers with
        capacity (cpus, mb): its new share (CPUs, MB, gpus) if the ledger
        now holds it otherwise, else None.  With `hold`, a node not met
        before is held whole (policy.ledger.registered), journaled before
        its share is handed to Slurm; before meet() nothing is."""
        known = self.known
        if not hold and known is not None and node in known \
                and REGISTERED_KEY not in self.nodes.get(node, ()):
            return None       # a known node re-registering: not even the mutex
        with self.mutex:
            if self.known is None:
                return None
            known = node in self.known
            self.known.add(node)
            entries = self.nodes.get(node, {})
            if not hold and REGISTERED_KEY not in entries:
                return None
            now = self.clock()
            new = registered(entries, known, (cpus, mb), now)
            if new is None:
                return None
            # An "undo" line puts one entry as it is: older releases replay
            # it.  No compaction and no fsync here, under slurmctld's write
            # locks (a slow StateSaveLocation would stall every RPC): the
            # next grant's fsync makes it durable.  A hold that cannot be
            # written, or is lost in a crash before that, is held all the same
            # (it grants nothing): lost on a restart, it is then not re-made.
            try:
                self._append({"t": now, "op": "undo", "node": node, "key": REGISTERED_KEY,
                              "entry": _entry_doc(new[REGISTERED_KEY])}, sync=False)
            except OSError as exc:
                log.error("node_features/k8s_resources: node %s: cannot journal its hold "
                          "(%s); held until slurmctld restarts", node, exc)
            if any(r.node == node and r.op != "show" for r, _, _ in self._tickets.values()):
                self._held_meanwhile.add(node)
            self._store(node, new)
        if REGISTERED_KEY not in entries:
            log.info("node_features/k8s_resources: node %s registered for the first time: "
                     "held whole in the ledger (%s %d CPUs, %d MB) until the coordinator "
                     "counts the pods there (its first set)", node, REGISTERED_KEY, cpus, mb)
        return (*share_units(new), gpu_units(new))

    def shares(self) -> dict[str, tuple[int, int]]:
        """Every node's share in Slurm units (C re-applies them after a wipe)."""
        return {node: share_units(entries) for node, entries in self.nodes.items()}

    def gpus(self) -> dict[str, tuple]:
        """Every node's gpu indices held, for the nodes that hold any."""
        return {node: gpus for node, entries in self.nodes.items()
                if (gpus := gpu_units(entries))}


# The C side's sizes (plugins/pyk8sres_core.h): a node's facts are
# FACTS_WORDS uint64 words, a set of gpu indices a GPU_WORDS-word bitmask.
GPU_WORDS = 16
FACTS_WORDS = 6 + GPU_WORDS
GPU_PROBLEMS = {
    1: "its gpu GRES has no device bitmap (no File= for it in gres.conf, or the node has "
       "not registered yet): Slurm cannot tell its GPUs apart, so none can be reserved by "
       "index",
    2: f"it has more than {GPU_WORDS * 64} GPUs",
    3: "its GPUs are shared by a shard or MPS GRES as well: a job holding a share of a GPU "
       "does not show in the gpu GRES's own bitmap, so none can be reserved by index",
    4: "its gpu GRES is no_consume: Slurm does not track which GPUs jobs hold",
}


def facts_from_words(words) -> Facts:
    """A node's Facts from the words C filled in."""
    count, problem = int(words[4]), int(words[5])
    jobs = frozenset(w * 64 + b for w in range(GPU_WORDS) for b in range(64)
                     if words[6 + w] >> b & 1) if count else frozenset()
    return Facts(int(words[0]), int(words[1]), int(words[2]), int(words[3]), count, jobs,
                 GPU_PROBLEMS.get(problem, f"gpu problem {problem}") if problem else "")


def gpu_mask(indices) -> list[int]:
    """The GPU_WORDS-word bitmask C reads for these gpu indices."""
    words = [0] * GPU_WORDS
    for i in indices:
        words[i // 64] |= 1 << (i % 64)
    return words


def _entry(v: list) -> Entry:
    """[cpu_m, mem_bytes, since, bound, reserved_at, gpus] as the journal has
    it; older journals wrote the first three, four or five (no reserve time
    known, no GPUs)."""
    return Entry(int(v[0]), int(v[1]), float(v[2]), bool(v[3]) if len(v) > 3 else False,
                 float(v[4]) if len(v) > 4 and v[4] is not None else None,
                 tuple(sorted(int(i) for i in v[5])) if len(v) > 5 else ())


def _entry_doc(e: Entry) -> list:
    """An entry as the journal has it: without GPUs, as before they were
    kept (five fields)."""
    return list(e) if e.gpus else list(e)[:5]


def _as_doc(req: Request) -> dict:
    if req.op == "reserve":
        return {"op": "reserve", "node": req.node, "key": req.key, "cpu_m": req.cpu_m,
                "mem_bytes": req.mem_bytes, **({"gpus": list(req.gpus)} if req.gpus else {})}
    if req.op == "release":
        return {"op": "release", "node": req.node, "key": req.key,
                **({"unbound_only": True} if req.unbound_only else {})}
    return {"op": "set", "node": req.node, "keep_younger_than": req.keep_younger_than,
            "entries": {k: [c, m, *([list(g[0])] if g else [])] for k, c, m, *g in req.entries}}
