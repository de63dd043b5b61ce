"""The coordinator's Prometheus metrics and health endpoints (one plain HTTP
listener per daemon, `--metrics-address`, default on loopback):

    /metrics   prometheus_client's text format (plus process_* metrics)
    /healthz   200 while the daemon's loops are turning (each beats within its limit)
    /readyz    200 only when every readiness check passes: the watches have
               listed (sync) / nodes are known (webhook), and the ledger answered
               its latest call without refusing this process ("busy"); 503
               with the reasons otherwise

The metric objects live here; the daemons update them where things happen
(webhook.py, sync.py, kube.py's Informer, slurm.py's Ledger, events.py).
Labels are fixed words or node names, never pod names.  docs/operations.md
says what to watch and alert on.
"""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, \
    generate_latest

log = logging.getLogger("pyk8sres.coordinator.metrics")

MIB = 1 << 20
# Admission and ledger calls take milliseconds; buckets from 0.5 ms to 5 s.
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

ADMISSION = Counter("pyk8sres_admission_requests", "Admission reviews answered, by result "
                    "(allow|deny) and reason (policy/admission.py: ALLOW_CODES, DENY_CODES)",
                    ["result", "reason"])
ADMISSION_SECONDS = Histogram("pyk8sres_admission_duration_seconds",
                              "Time to answer one admission review (ledger reserve included)",
                              ["result"], buckets=FAST_BUCKETS)
NODE_CAPACITY = Gauge("pyk8sres_node_capacity", "A shared node's capacity as the ledger "
                      "sees it (cpu: CPUs, memory: bytes)", ["node", "resource"])
NODE_ALLOCATED = Gauge("pyk8sres_node_allocated", "What each side holds on a shared node: "
                       "side=slurm its jobs, side=kubernetes the pods' share in the ledger",
                       ["node", "resource", "side"])
NODE_FREE = Gauge("pyk8sres_node_free", "Capacity neither side holds (either may take it)",
                  ["node", "resource"])
NODE_OVERSUBSCRIBED = Gauge("pyk8sres_node_oversubscribed", "1 while pods bound to the node "
                            "hold more than Slurm's jobs leave", ["node"])
NODE_SLURM_UNHELD = Gauge("pyk8sres_node_slurm_unheld", "What Slurm allocated on a shared "
                          "node that no job's k8scpu/k8smemory covers, held from pods: "
                          "kind=unheld jobs hold less than they were allocated, "
                          "kind=completing jobs COMPLETING there (cpu: CPUs, memory: bytes)",
                          ["node", "resource", "kind"])
OVERSUBSCRIPTION_DETECTED = Counter("pyk8sres_oversubscription_detected",
                                    "Times a node was found newly oversubscribed", ["node"])
RECONCILE_SECONDS = Histogram("pyk8sres_reconcile_duration_seconds",
                              "One sync cycle (Kubernetes cache -> ledger)",
                              buckets=FAST_BUCKETS)
RECONCILE_ERRORS = Counter("pyk8sres_reconcile_errors", "Failures in the sync loop, by stage "
                           "(slurm_read, ledger_set, ledger_not_ready, ledger_refused, "
                           "generic_nodes)", ["stage"])
WATCH_RESTARTS = Counter("pyk8sres_watch_restarts", "Watches restarted with a relist, by kind "
                         "and reason (gone: 410, error: anything else)", ["kind", "reason"])
LEDGER_CALLS = Counter("pyk8sres_ledger_calls", "Requests to the ledger in slurmctld", ["op"])
LEDGER_ERRORS = Counter("pyk8sres_ledger_errors", "Ledger requests without an answer "
                        "(unreachable, timeout, malformed reply)", ["op"])
LEDGER_REFUSED = Counter("pyk8sres_ledger_refused", "Ledger requests answered with a refusal "
                         "of this process, not of the request (busy: its uid holds "
                         "LedgerConnectionsPerUser= connections already)", ["op"])
LEDGER_SECONDS = Histogram("pyk8sres_ledger_call_duration_seconds", "One ledger request",
                           ["op"], buckets=FAST_BUCKETS)
EVENTS = Counter("pyk8sres_events", "Kubernetes Events, by action (created, updated, folded: "
                 "counted into the next update, suppressed: over the write budget, "
                 "queue_full: dropped, failed)", ["action"])
GENERIC_NODES_BEHIND = Gauge("pyk8sres_generic_nodes_behind", "GenericNodes waiting (their "
                             "node's minimum interval, the write budget) to show their node's "
                             "newest state")
GENERIC_NODES_LAG = Gauge("pyk8sres_generic_nodes_lag_seconds", "How long the longest waiting "
                          "GenericNode has waited (0: all current)")
READY = Gauge("pyk8sres_ready", "1 when /readyz answers 200")
WEBHOOK_CONNECTIONS = Gauge("pyk8sres_webhook_connections", "Connections to the webhook's "
                            "HTTPS port, by state (pending: TLS handshake under way, "
                            "authenticated: the API server's, anonymous: any other)", ["state"])
WEBHOOK_CUT = Counter("pyk8sres_webhook_connections_cut", "Connections the webhook closed "
                      "before they were served, by reason (evicted_pending, "
                      "expired_pending, evicted_anonymous, expired_anonymous, "
                      "refused_authenticated: over the caps or past the deadlines)", ["reason"])

for _result in ("allow", "deny"):   # export zeros from the start: rate() needs them
    ADMISSION_SECONDS.labels(_result)
for _action in ("created", "updated", "folded", "suppressed", "queue_full", "failed"):
    EVENTS.labels(_action)


def admission(result: str, reason: str, seconds: float) -> None:
    ADMISSION.labels(result, reason).inc()
    ADMISSION_SECONDS.labels(result).observe(seconds)


# ----------------------------------------------------------------- ledger

class _LedgerState:
    """The latest ledger call's outcome in this process (readiness)."""

    def __init__(self):
        self.ok: bool | None = None    # None: never called
        self.at = 0.0
        self.error = ""
        self.refused = ""              # the ledger answered, refusing this process ("busy")


LEDGER = _LedgerState()


def ledger_call(op: str, seconds: float, error: Exception | None, refused: str | None = None) -> None:
    """error: no answer; refused: an answer refusing this process, not its
    request (the ledger's "busy"): both make readiness fail."""
    LEDGER_CALLS.labels(op).inc()
    LEDGER_SECONDS.labels(op).observe(seconds)
    if error is not None:
        LEDGER_ERRORS.labels(op).inc()
    if refused:
        LEDGER_REFUSED.labels(op).inc()
    LEDGER.ok, LEDGER.at, LEDGER.error = error is None, time.monotonic(), str(error or "")
    LEDGER.refused = refused or ""


def ledger_check(max_age: float) -> Callable[[], str | None]:
    """A readiness check: the latest ledger call answered, within max_age seconds."""
    def check():
        if LEDGER.ok is None:
            return "the ledger has not been asked yet"
        if not LEDGER.ok:
            return f"the ledger did not answer: {LEDGER.error}"
        if LEDGER.refused:
            return f"the ledger refused this process: {LEDGER.refused}"
        age = time.monotonic() - LEDGER.at
        if age > max_age:
            return f"no ledger call for {age:.0f}s"
        return None
    return check


# ----------------------------------------------------------------- nodes

class NodeGauges:
    """Per-node gauges from the ledger's show() (CPUs and MB in the reply;
    memory exported in bytes).  Nodes gone from the reply lose their series."""

    def __init__(self):
        self.lock = threading.Lock()
        self.exported: dict[str, dict] = {}   # node -> the view its series show

    def update(self, shown: dict, only: set[str] | None = None) -> None:
        """only: the nodes to export (the shared ones); None: every node the
        ledger knows with k8scpu/k8smemory.  Sets the series of a node only
        when its view changed: setting every series of every node each time
        would cost an idle sync CPU in proportion to the cluster."""
        if not shown.get("ok"):
            return
        seen = set()
        with self.lock:
            for name, v in (shown.get("nodes") or {}).items():
                if v.get("unknown") or (only is not None and name not in only):
                    continue
                seen.add(name)
                if self.exported.get(name) == v:
                    continue
                self.exported[name] = v
                for res, key, scale in (("cpu", "cpu", 1), ("memory", "mem", MIB)):
                    NODE_CAPACITY.labels(name, res).set(v["capacity"][key] * scale)
                    NODE_ALLOCATED.labels(name, res, "slurm").set(v["jobs"][key] * scale)
                    NODE_ALLOCATED.labels(name, res, "kubernetes").set(v["share"][key] * scale)
                    NODE_FREE.labels(name, res).set(v["free"][key] * scale)
                NODE_OVERSUBSCRIBED.labels(name).set(1 if v.get("oversubscribed") else 0)
            for name in set(self.exported) - seen:
                for res in ("cpu", "memory"):
                    for g in (NODE_CAPACITY, NODE_FREE):
                        _remove(g, name, res)
                    for side in ("slurm", "kubernetes"):
                        _remove(NODE_ALLOCATED, name, res, side)
                _remove(NODE_OVERSUBSCRIBED, name)
                del self.exported[name]


def _remove(gauge, *labels) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


NODES = NodeGauges()


# ----------------------------------------------------------------- health

class Health:
    """Liveness: loops beat (beat(name, max_age) each turn).  Readiness:
    liveness plus named checks, each a function returning None (ok) or why not."""

    def __init__(self):
        self.lock = threading.Lock()
        self.beats: dict[str, tuple[float, float]] = {}
        self.checks: dict[str, Callable[[], str | None]] = {}

    def beat(self, name: str, max_age: float) -> None:
        with self.lock:
            self.beats[name] = (time.monotonic(), max_age)

    def forget(self, name: str) -> None:
        """A loop that ended on purpose (its owner stopped) beats no more."""
        with self.lock:
            self.beats.pop(name, None)

    def check(self, name: str, fn: Callable[[], str | None]) -> None:
        with self.lock:
            self.checks[name] = fn

    def alive(self) -> list[str]:
        now = time.monotonic()
        with self.lock:
            beats = dict(self.beats)
        return [f"{name}: no progress for {now - at:.0f}s (limit {limit:.0f}s)"
                for name, (at, limit) in sorted(beats.items()) if now - at > limit]

    def ready(self) -> list[str]:
        with self.lock:
            checks = dict(self.checks)
        problems = self.alive()
        if not checks:
            problems.append("starting")
        for name, fn in sorted(checks.items()):
            try:
                why = fn()
            except Exception as e:  # a check must never break the endpoint
                why = f"check failed: {e}"
            if why:
                problems.append(f"{name}: {why}")
        return problems


HEALTH = Health()
READY.set_function(lambda: 0.0 if HEALTH.ready() else 1.0)


def probe(path: str) -> tuple[int, bytes] | None:
    """(status, body) for /healthz and /readyz; None for other paths."""
    path = path.split("?", 1)[0]
    if path == "/healthz":
        problems = HEALTH.alive()
    elif path == "/readyz":
        problems = HEALTH.ready()
    else:
        return None
    if problems:
        return 503, ("\n".join(problems) + "\n").encode()
    return 200, b"ok\n"


# ----------------------------------------------------------------- HTTP

class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        answer = probe(self.path)
        ctype = "text/plain; charset=utf-8"
        if answer is None:
            if self.path.split("?", 1)[0] == "/metrics":
                answer, ctype = (200, generate_latest(REGISTRY)), CONTENT_TYPE_LATEST
            else:
                answer = (404, b"not found: /metrics, /healthz, /readyz\n")
        code, body = answer
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True


def parse_address(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or ':PORT': every address) -> (host, port).  ValueError if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics address must be HOST:PORT, not {text!r}")
    return host or "0.0.0.0", int(port)


def serve(address: str) -> MetricsServer:
    """Listen on address (raises OSError if taken) and serve in a thread."""
    server = MetricsServer(parse_address(address), _Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    log.info("metrics and health on http://%s:%d/metrics (/healthz, /readyz)",
             *server.server_address[:2])
    return server
