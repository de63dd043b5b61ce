"""Placeholder pods: keep one ``slurm-share-<node>`` pod per shared node sized
to what Slurm's jobs hold there, so a stock kube-scheduler sees it (rules in
pyk8sres/policy/placeholder.py).

Level-triggered: every period (0.5 s by default, so a job start or end
shows within a second; a pass reads every node from slurmctld, so not more
often) read the ledger's show(), compare with our pods, create / resize in
place (pods/resize) / delete what differs.  Kubernetes nodes come from the
webhook's nodes Informer (the shared Scope); our pods are re-listed every
relist_seconds (and after any error).  If the ledger does not answer,
placeholders stay as they are (never shrink on missing data).
"""

from __future__ import annotations

import logging
import threading
import time

from . import kube as K
from ..policy import placeholder as P
from .scope import Scope, slurm_names

log = logging.getLogger("pyk8sres.coordinator.placeholder")


class Placeholders:
    def __init__(self, kube, ledger, scope: Scope, namespace: str,
                 priority_class: str = P.PRIORITY_CLASS, image: str = P.IMAGE,
                 period: float = 0.5, relist_seconds: float = 30.0):
        self.kube, self.ledger, self.scope = kube, ledger, scope
        self.namespace, self.priority_class, self.image = namespace, priority_class, image
        self.period, self.relist_seconds = period, relist_seconds
        self.pods: dict[str, dict] = {}
        self.listed_at = -1e9
        self.planned_for = None   # (jobs per node, nodes version) the last complete pass followed
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _relist(self) -> None:
        if not self.scope.nodes_watched:   # no Informer feeds the scope (or its watch broke)
            self.scope.update(k8s_nodes=K.list_nodes(self.kube))
        self.pods = {p["metadata"]["name"]: p for p in K.list_namespace_pods(self.kube, self.namespace)
                     if P.current(p) is not None}
        self.listed_at = time.monotonic()

    def sync_once(self) -> dict:
        """One pass; returns what was done {"created", "resized", "deleted"}.
        The Kubernetes nodes come from the scope (the webhook's nodes
        Informer, or a list here when nothing feeds it); our own pods are
        re-listed every relist_seconds and after any error."""
        shown = self.ledger.show()
        names = slurm_names(shown)            # raises when the ledger says no
        self.scope.update(slurm_names=names)
        relisted = time.monotonic() - self.listed_at >= self.relist_seconds
        if relisted:
            self._relist()
        done = {"created": [], "resized": [], "deleted": []}
        if self.scope.unshared() is None:   # nodes not listed: never plan from nothing
            return done
        # Planning 1000 nodes every period holds the GIL the admission threads
        # need: skip it while no job moved and no node changed (our pods
        # change only through our own writes and a relist).
        k8s_nodes, version = self.scope.snapshot()
        followed = ({n: shown["nodes"][n].get("jobs") for n in names}, version)
        if not relisted and followed == self.planned_for:
            return done
        self.planned_for = None
        nodes = {n: shown["nodes"][n] for n in names}
        create, resize, delete = P.plan(self.scope.shared(), k8s_nodes, nodes, self.pods)
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
            self.planned_for = followed
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
