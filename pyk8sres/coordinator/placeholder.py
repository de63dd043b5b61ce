"""Placeholder pods: on each shared node, pods whose requests add up to what
Slurm's jobs hold there, so a stock kube-scheduler sees it (rules, and why
growth creates pods instead of resizing one: pyk8sres/policy/placeholder.py).

Level-triggered: every period (0.5 s by default, so a job start or end
shows within a second) read the ledger's show() -- only the nodes changed
since the last pass, every node each relist_seconds -- compare with our
pods, and per node create
(the shortfall), downsize in place (pods/resize) and delete (grace 0), in
that order, so kube-scheduler never counts less than Slurm holds on the way.
Kubernetes nodes come from the webhook's nodes Informer (the shared Scope);
our pods are re-listed every relist_seconds (and after any error), and a pod
we downsized is read again every pass until the kubelet has applied it (or
left it pending: then it is replaced).  If the ledger does not answer,
placeholders stay as they are (never shrink on missing data).  A node whose
create fails keeps its pods until the next pass.
"""

from __future__ import annotations

import logging
import threading
import time

from .kube import create_pod, delete_pod, get_pod, list_namespace_pods, list_nodes, resize_pod
from ..policy import placeholder
from .scope import Scope, slurm_names
from .slurm import ShowFollower

log = logging.getLogger("pyk8sres.coordinator.placeholder")
# Pods someone else made or deleted in our namespace are seen this late at most.
RELIST_SECONDS = 30.0


class Placeholders:
    def __init__(self, kube, ledger, scope: Scope, namespace: str,
                 priority_class: str = placeholder.PRIORITY_CLASS, image: str = placeholder.IMAGE,
                 period: float = 0.5, relist_seconds: float = RELIST_SECONDS,
                 max_pods: int = placeholder.MAX_PODS):
        self.kube, self.ledger, self.scope = kube, ledger, scope
        self.namespace, self.priority_class, self.image = namespace, priority_class, image
        self.period, self.relist_seconds, self.max_pods = period, relist_seconds, max_pods
        self.pods: dict[str, dict] = {}
        self.resizing: set[str] = set()   # downsized, not yet seen applied by the kubelet
        self.listed_at = -1e9
        self.planned_for = None   # (jobs per node, nodes version) the last complete pass followed
        # Each pass asks slurmctld only for the nodes that changed; every
        # relist_seconds for all of them.
        self.follower = ShowFollower(ledger, full_seconds=relist_seconds)
        self.moved: set[str] | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _relist(self) -> None:
        if not self.scope.nodes_watched:   # no Informer feeds the scope (or its watch broke)
            self.scope.update(k8s_nodes=list_nodes(self.kube))
        self.pods = {p["metadata"]["name"]: p for p in list_namespace_pods(self.kube, self.namespace)
                     if placeholder.current(p) is not None}
        self.resizing = {n for n, p in self.pods.items() if placeholder.resize_in_flight(p)}
        self.listed_at = time.monotonic()

    def _reread_resizing(self) -> bool:
        """Read again the pods we downsized; True if one changed."""
        changed = False
        for name in sorted(self.resizing):
            fresh = get_pod(self.kube, self.namespace, name)
            if fresh is None:
                self.pods.pop(name, None)
            else:
                self.pods[name] = fresh
            if fresh is None or not placeholder.resize_in_flight(fresh):
                self.resizing.discard(name)
                changed = True
        return changed

    def sync_once(self) -> dict:
        """One pass; returns what was done {"created", "resized", "deleted"}
        (node names for created, pod names otherwise).  The Kubernetes
        nodes come from the scope (the webhook's nodes Informer, or a list
        here when nothing feeds it)."""
        shown, changed = self.follower.refresh()
        # The nodes changed since the last complete plan (None: maybe all).
        self.moved = None if changed is None or self.moved is None else self.moved | changed
        if self.moved is None or self.moved:  # else Slurm's node set is as it was
            self.scope.update(slurm_names=slurm_names(shown))   # raises when the ledger says no
        relisted = time.monotonic() - self.listed_at >= self.relist_seconds
        if relisted:
            self._relist()
        reread = self._reread_resizing() if self.resizing else False
        done = {"created": [], "resized": [], "deleted": []}
        if self.scope.unshared() is None:   # nodes not listed: never plan from nothing
            return done
        # Planning every node every period holds the GIL the admission threads
        # need: skip it while no job moved, no node changed and no resize
        # came back (our pods change only through our own writes and a relist).
        k8s_nodes, version = self.scope.snapshot()
        if not relisted and not reread and self._as_planned(shown["nodes"], version):
            self.moved = set()      # the plan still holds for every node that moved
            return done
        self.planned_for = None
        names = self.scope.slurm_names or frozenset()
        nodes = {n: shown["nodes"][n] for n in names if n in shown["nodes"]}
        plans = placeholder.plan(self.scope.shared(), k8s_nodes, nodes, self.pods, self.max_pods)
        complete = True
        for k8s, node_plan in sorted(plans.items()):
            if not self._apply(k8s, node_plan, done):
                complete = False
        if complete and self.listed_at > 0:   # nothing failed or asked for a relist
            self.planned_for = ({n: v.get("jobs") for n, v in nodes.items()}, version)
            self.moved = set()
        return done

    def _as_planned(self, shown: dict, version: int) -> bool:
        """Did no job move and no node change since the last complete plan?
        Looks only at the nodes the ledger said changed, when it said."""
        if self.planned_for is None or self.planned_for[1] != version:
            return False
        jobs = self.planned_for[0]
        if self.moved is None:
            return jobs == {n: shown[n].get("jobs") for n in self.scope.slurm_names or ()}
        return all(jobs.get(n) == (shown.get(n) or {}).get("jobs") for n in self.moved)

    def _apply(self, k8s: str, plan: placeholder.NodePlan, done: dict) -> bool:
        """Create, then downsize, then delete; nothing is deleted on a node
        whose create failed (kube-scheduler would count less than Slurm holds)."""
        if plan.create:
            body = placeholder.pod(k8s, self.namespace, *plan.create, plan.alloc,
                         self.priority_class, self.image)
            try:
                made = create_pod(self.kube, self.namespace, body)
            except Exception as e:   # noqa: BLE001 - logged, retried next pass
                log.warning("placeholder for node %s (%d m CPU, %d bytes) not created: %s",
                            k8s, *plan.create, e)
                self.listed_at = -1e9
                return False
            self.pods[made["metadata"]["name"]] = made
            done["created"].append(k8s)
        for name, (cpu_m, mem) in sorted(plan.resize.items()):
            self.pods[name] = resize_pod(self.kube, self.namespace, name, [
                {"name": placeholder.CONTAINER,
                 "resources": placeholder.resources(cpu_m, mem, plan.alloc)}])
            self.resizing.add(name)
            done["resized"].append(name)
        for name in plan.delete:
            delete_pod(self.kube, self.namespace, name)
            self.pods.pop(name, None)
            self.resizing.discard(name)
            done["deleted"].append(name)
        return True

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
