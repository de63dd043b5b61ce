"""Placeholder pods: keep one ``slurm-share-<node>`` pod per shared node sized
to what Slurm's jobs hold there, so a stock kube-scheduler sees it (rules in
pyk8sres/policy/placeholder.py).

Level-triggered: every period (0.2 s by default, so a job start or end shows
within a second) read the ledger's show(), compare with our pods, create /
resize in place (pods/resize) / delete what differs.  Kubernetes nodes and our
pods are re-listed every relist_seconds (and after any error).  If the ledger
does not answer, placeholders stay as they are (never shrink on missing data).
"""

from __future__ import annotations

import logging
import threading
import time

from . import kube as K
from ..policy import placeholder as P
from .webhook import Scope, slurm_names

log = logging.getLogger("pyk8sres.coordinator.placeholder")


class Placeholders:
    def __init__(self, kube, ledger, scope: Scope, namespace: str,
                 priority_class: str = P.PRIORITY_CLASS, image: str = P.IMAGE,
                 period: float = 0.2, relist_seconds: float = 5.0):
        self.kube, self.ledger, self.scope = kube, ledger, scope
        self.namespace, self.priority_class, self.image = namespace, priority_class, image
        self.period, self.relist_seconds = period, relist_seconds
        self.nodes: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.listed_at = -1e9
        self.planned_for = None   # the jobs per node the last complete pass followed
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _relist(self) -> None:
        nodes = K.list_nodes(self.kube)
        self.scope.update(k8s_nodes=nodes)
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.pods = {p["metadata"]["name"]: p for p in K.list_namespace_pods(self.kube, self.namespace)
                     if P.current(p) is not None}
        self.listed_at = time.monotonic()

    def sync_once(self) -> dict:
        """One pass; returns what was done {"created", "resized", "deleted"}."""
        shown = self.ledger.show()
        names = slurm_names(shown)            # raises when the ledger says no
        self.scope.update(slurm_names=names)
        relisted = time.monotonic() - self.listed_at >= self.relist_seconds
        if relisted:
            self._relist()
        done = {"created": [], "resized": [], "deleted": []}
        # Planning 1000 nodes every period holds the GIL the admission threads
        # need: skip it while no job moved (our pods and Kubernetes' nodes
        # change only through our own writes and a relist).
        jobs = {n: shown["nodes"][n].get("jobs") for n in names}
        if not relisted and jobs == self.planned_for:
            return done
        self.planned_for = None
        nodes = {n: shown["nodes"][n] for n in names}
        create, resize, delete = P.plan(self.scope.shared(), self.nodes, nodes, self.pods)
        for k8s, (cpu_m, mem, alloc) in create.items():
            body = P.pod(k8s, self.namespace, cpu_m, mem, alloc, self.priority_class, self.image)
            try:
                self.pods[body["metadata"]["name"]] = K.create_pod(self.kube, self.namespace, body)
            except K.ApiException as e:
                if e.status != 409:
                    raise
                self.listed_at = -1e9        # someone made it: read it next pass
            done["created"].append(k8s)
        for k8s, (cpu_m, mem, alloc) in resize.items():
            name = P.name_for(k8s)
            self.pods[name] = K.resize_pod(self.kube, self.namespace, name, [
                {"name": P.CONTAINER, "resources": P.resources(cpu_m, mem, alloc)}])
            done["resized"].append(k8s)
        for name in delete:
            K.delete_pod(self.kube, self.namespace, name)
            self.pods.pop(name, None)
            done["deleted"].append(name)
        if self.listed_at > 0:             # no 409 asked for a relist
            self.planned_for = jobs
        return done

    def start(self) -> "Placeholders":
        def loop():
            while not self.stop_event.is_set():
                try:
                    self.sync_once()
                except Exception as e:
                    log.warning("placeholder pass failed: %s", e)
                    self.listed_at = -1e9
                self.stop_event.wait(self.period)
        self.thread = threading.Thread(target=loop, name="placeholders", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread:
            self.thread.join(10)
