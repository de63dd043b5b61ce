"""Kubernetes Events for what the coordinator decided (core/v1 Event):

  on the pod        why it was refused (InsufficientSharedCapacity, LedgerUnreachable,
                    AdmissionRefused), with the node and the numbers
  on the GenericNode  Oversubscribed, LedgerUnreachable (in namespace "default",
                    as kubelet does for Nodes)

Posting never blocks the caller (the admission response path): emit() only
puts the occurrence on a bounded queue (full: dropped and counted,
pyk8sres_events_total{action="queue_full"}); one worker thread decides with
the pure rules (policy/events.py: create, bump the count, fold into the next
bump, or suppress beyond the global write budget) and makes the API calls
through kube.py.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import queue
import socket
import threading
import time

from . import metrics
from .kube import ApiException, GROUP, VERSION, create_event, patch_event
from ..policy import events

log = logging.getLogger("pyk8sres.coordinator.events")

GENERIC_NODE_NAMESPACE = "default"   # cluster-scoped objects' Events, like kubelet's Node events


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Recorder:
    """emit() from any thread; start() the worker, stop() it."""

    def __init__(self, kube, component: str, limits: events.Limits = events.Limits(),
                 queue_size: int = 256, clock=time.time, uid_of=None):
        """uid_of(GenericNode name) -> its UID or None (kubectl describe matches
        Events by UID); None: GenericNode Events carry no UID."""
        self.kube, self.component, self.limits, self.clock = kube, component, limits, clock
        self.uid_of = uid_of
        self.instance = f"{socket.gethostname()}-{os.getpid()}"
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.table: dict = {}              # key -> policy.events.Seen
        self.bucket = events.Bucket(float(limits.burst), clock())
        self.posted: dict = {}             # key -> (namespace, Event name, latest message)
        self.gn_uids: dict[str, str] = {}
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------ callers

    def pod(self, namespace: str, name: str, uid: str | None, reason: str, message: str,
            type_: str = "Warning") -> None:
        ref = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name}
        if uid:
            ref["uid"] = uid
        self.emit(namespace, ref, reason, message, type_)

    def generic_node(self, name: str, reason: str, message: str, type_: str = "Warning") -> None:
        ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GenericNode", "name": name}
        self.emit(GENERIC_NODE_NAMESPACE, ref, reason, message, type_)

    def emit(self, namespace: str, ref: dict, reason: str, message: str, type_: str) -> None:
        """Queue one occurrence (never blocks)."""
        try:
            self.queue.put_nowait((namespace, ref, reason, message[:1024], type_, self.clock()))
        except queue.Full:
            metrics.EVENTS.labels("queue_full").inc()

    # ------------------------------------------------------------ worker

    def start(self) -> "Recorder":
        self.thread = threading.Thread(target=self._run, name="events", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Post what is queued (and pending counts), then stop."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self) -> None:
        last_prune = self.clock()
        while True:
            try:
                item = self.queue.get(timeout=0.5)
            except queue.Empty:
                item = None
            if item is not None:
                self._handle(*item)
            elif self.stop_event.is_set():
                self._flush(final=True)
                return
            else:
                self._flush()
            now = self.clock()
            if now - last_prune > 60:
                self.table = events.prune(self.table, now, self.limits)
                self.posted = {k: v for k, v in self.posted.items() if k in self.table}
                last_prune = now

    def _key(self, namespace: str, ref: dict, reason: str) -> tuple:
        return (namespace, ref["kind"], ref["name"], ref.get("uid", ""), reason)

    def _handle(self, namespace, ref, reason, message, type_, at) -> None:
        key = self._key(namespace, ref, reason)
        action, seen, self.bucket = events.throttled(key, at, self.table, self.bucket, self.limits)
        if action == events.SUPPRESS:
            metrics.EVENTS.labels("suppressed").inc()
            return
        self.table[key] = seen
        try:
            if action == events.CREATE:
                self._create(key, namespace, ref, reason, message, type_, seen)
            elif action == events.UPDATE:
                self._update(key, seen, message)
            else:
                old = self.posted.get(key)
                if old is not None:
                    self.posted[key] = (old[0], old[1], message)
                metrics.EVENTS.labels("folded").inc()
        except Exception as e:   # the API server down, 403...: never the caller's problem
            metrics.EVENTS.labels("failed").inc()
            log.warning("cannot post Event %s for %s %s: %s", reason, ref["kind"],
                        ref["name"], e)
            self.table.pop(key, None)   # the next occurrence tries a new Event
            self.posted.pop(key, None)

    def _flush(self, final: bool = False) -> None:
        """Write counts folded since the last write, once each key may be written."""
        now = self.clock()
        for key in list(self.table) if final else events.due(self.table, now, self.limits):
            seen = self.table[key]
            if seen.count <= seen.written or key not in self.posted:
                continue
            ok, self.bucket = events.take(self.bucket, now, self.limits)
            if not ok and not final:
                return
            try:
                self._update(key, seen, self.posted[key][2])
            except Exception as e:
                metrics.EVENTS.labels("failed").inc()
                log.warning("cannot update Event %s: %s", self.posted[key][1], e)
            self.table[key] = events.flushed(seen, now)

    def _create(self, key, namespace, ref, reason, message, type_, seen) -> None:
        if ref["kind"] == "GenericNode" and "uid" not in ref and self.uid_of is not None:
            uid = self._generic_node_uid(ref["name"])
            if uid:
                ref = dict(ref, uid=uid)   # kubectl describe matches Events by UID
        name = f"{ref['name']}.{time.time_ns():x}"
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": ref, "reason": reason, "message": message, "type": type_,
            "count": seen.count, "firstTimestamp": _stamp(seen.first),
            "lastTimestamp": _stamp(seen.last),
            "source": {"component": self.component},
            "reportingComponent": f"pyk8sres.io/{self.component}",
            "reportingInstance": self.instance[:128],
        }
        create_event(self.kube, namespace, body)
        self.posted[key] = (namespace, name, message)
        metrics.EVENTS.labels("created").inc()
        log.debug("Event %s/%s: %s %s", namespace, name, reason, message)

    def _update(self, key, seen, message) -> None:
        namespace, name, _ = self.posted[key]
        try:
            patch_event(self.kube, namespace, name, {
                "count": seen.count, "lastTimestamp": _stamp(seen.last), "message": message})
        except ApiException as e:
            if e.status != 404:
                raise
            # Expired (the API server keeps Events an hour) or deleted: start anew.
            self.table[key] = events.flushed(seen, self.clock())
            ns, kind, obj, uid, reason = key
            ref = {"apiVersion": "v1" if kind == "Pod" else f"{GROUP}/{VERSION}",
                   "kind": kind, "name": obj}
            if kind == "Pod":
                ref["namespace"] = ns
            if uid:
                ref["uid"] = uid
            self._create(key, ns, ref, reason, message, "Warning", self.table[key])
            return
        self.posted[key] = (namespace, name, message)
        metrics.EVENTS.labels("updated").inc()

    def _generic_node_uid(self, name: str) -> str | None:
        if name not in self.gn_uids:
            try:
                uid = self.uid_of(name)
            except Exception:
                return None
            if not uid:
                return None
            self.gn_uids[name] = uid
        return self.gn_uids[name]
