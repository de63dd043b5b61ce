"""GPUs in the sync daemon (docs/gpus.md; the rules are policy/gpus.py):
the ResourceClaims and ResourceSlices it watches, the ledger entries of
the claims allocated on shared nodes, and the holder claims that show
kube-scheduler the devices Slurm's jobs hold.

Fail closed: while the claims or slices are not trusted (no list yet, a
watch broken) the claims' entries on a node only grow, and the holders are
neither created nor deleted on missing data.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, Mapping

from . import kube as kube_calls
from .permissions import error_text
from ..policy import gpus

log = logging.getLogger("pyk8sres.coordinator.gpus")


def slim_claim(obj: dict) -> dict:
    """What the rules read of a claim: its names, labels and allocation."""
    meta = obj.get("metadata") or {}
    alloc = (obj.get("status") or {}).get("allocation")
    return {"metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "labels",
                                                  "resourceVersion")},
            "status": {"allocation": alloc} if alloc else {}}


def slurm_gpus(view: dict | None) -> tuple[int | None, list[int], str | None]:
    """(gpu count or None, indices Slurm's jobs hold, the problem Slurm's
    side reports or None) from a node's `show` view; a node without GPUs
    in Slurm (or a ledger older than GPUs) has no count."""
    g = (view or {}).get("gpus")
    if not isinstance(g, dict) or not isinstance(g.get("count"), int):
        return None, [], None
    return (g["count"], [i for i in g.get("jobs") or [] if isinstance(i, int)],
            g.get("problem") or None)


class GpuState:
    """Informer handler for resourceclaims and resourceslices; `changed`
    (the sync cache's event) wakes the loop on any change."""

    KINDS = kube_calls.DRA_KINDS

    def __init__(self, ident: gpus.Identity, holder_namespace: str,
                 changed: threading.Event | None = None):
        self.ident, self.holder_namespace = ident, holder_namespace
        self.changed = changed or threading.Event()
        self.lock = threading.Lock()
        self.objs: dict[str, dict[str, dict]] = {k: {} for k in self.KINDS}
        self.ok = {k: False for k in self.KINDS}
        self.dirty = False
        self.warned: set[str] = set()
        self.on_fence = None    # on_fence(k8s node, why): an Event (None: the log only)

    def _key(self, obj: dict) -> str:
        meta = obj.get("metadata") or {}
        return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"

    def _keep(self, kind: str, obj: dict) -> dict | None:
        if kind == "resourceclaims":
            return slim_claim(obj)
        spec = obj.get("spec") or {}
        return obj if spec.get("driver") == self.ident.driver else None

    def replace(self, kind: str, items: list) -> None:
        kept = {self._key(o): k for o in items if (k := self._keep(kind, o)) is not None}
        with self.lock:
            self.objs[kind], self.ok[kind], self.dirty = kept, True, True
        self.changed.set()

    def event(self, kind: str, typ: str, obj: dict) -> None:
        key, kept = self._key(obj), self._keep(kind, obj)
        with self.lock:
            if typ == "DELETED" or kept is None:
                if self.objs[kind].pop(key, None) is None:
                    return
            else:
                self.objs[kind][key] = kept
            self.dirty = True
        self.changed.set()

    def health(self, kind: str, ok: bool) -> None:
        with self.lock:
            self.ok[kind] = ok
        if not ok:
            self.changed.set()

    def take_changed(self) -> bool:
        with self.lock:
            d, self.dirty = self.dirty, False
        return d

    def trusted(self) -> bool:
        with self.lock:
            return all(self.ok.values())

    def snapshot(self) -> tuple[list[dict], list[dict]]:
        with self.lock:
            return (list(self.objs["resourceclaims"].values()),
                    list(self.objs["resourceslices"].values()))

    def claims(self) -> list[dict]:
        """The claims alone (the poller's check, every fast period)."""
        with self.lock:
            return list(self.objs["resourceclaims"].values())

    def node_gpus(self, shared: dict[str, str], shown: dict, slices: list[dict],
                  full: bool = False) -> dict[str, gpus.NodeGpus]:
        """Kubernetes node -> its mapped devices (shared: Slurm node ->
        Kubernetes node; shown: the ledger's view of each Slurm node);
        a node newly fenced or unfenced is logged once."""
        out = {}
        for snode, knode in shared.items():
            count, _, problem = slurm_gpus(shown.get(snode))
            out[knode] = g = gpus.node_gpus(slices, knode, snode, count, self.ident, problem)
            if g.fence and g.fence not in self.warned:
                log.warning("GPUs of node %s fenced (every allocation there refused, every "
                            "device held for Slurm): %s", knode, g.fence)
                if self.on_fence is not None:
                    self.on_fence(knode, g.fence)
        fences = {g.fence for g in out.values() if g.fence}
        # Every shared node seen (the holders' pass): forget fences lifted.
        self.warned = fences if full else self.warned | fences
        return out

    def entries(self, k8s_to_slurm: dict[str, str],
                shown: dict) -> dict[str, dict]:
        """Slurm node -> the claims' ledger entries there."""
        claims, slices = self.snapshot()
        nodes = self.node_gpus({s: k for k, s in k8s_to_slurm.items()}, shown, slices)
        out, warnings = gpus.claim_entries(claims, nodes, k8s_to_slurm, self.ident,
                                           self.holder_namespace)
        for w in warnings:
            log.warning("%s", w)
        return out


class Holders:
    """Keeps one holder claim per device Slurm's jobs hold on a shared node
    (and per device of a fenced node) in holder_namespace; deletes the
    others.  Writes only what differs from what the claims watch shows."""

    def __init__(self, kube, state: GpuState):
        self.kube, self.state = kube, state

    def existing(self) -> dict[str, dict]:
        claims, _ = self.state.snapshot()
        return {c["metadata"]["name"]: c for c in claims
                if gpus.is_holder(c, self.state.holder_namespace)}

    def sync(self, k8s_to_slurm: dict[str, str], shown: dict,
             completing: Mapping[str, Iterable[int]] | None = None,
             pods: dict | None = None) -> bool:
        """One pass; False if a write failed (retried next cycle).
        completing: Slurm node -> GPU indices of jobs completing there
        (freed by Slurm, maybe still in use: held for them too); pods:
        Slurm node -> the indices pods counted whole-node hold there (no
        claim shows kube-scheduler those: their holders do)."""
        if not self.state.trusted():
            return True
        shared = {s: k for k, s in k8s_to_slurm.items()}
        _, slices = self.state.snapshot()
        nodes = self.state.node_gpus(shared, shown, slices, full=True)
        jobs = {s: sorted({*slurm_gpus(shown.get(s))[1], *(completing or {}).get(s, ()),
                           *(pods or {}).get(s, ())})
                for s in shared}
        wanted = gpus.wanted_holders(jobs, shared, nodes)
        create, delete = gpus.holder_changes(wanted, self.existing(), self.state.ident)
        ns = self.state.holder_namespace
        ok = self._release(ns, delete)
        for name in create:
            if name in delete and not ok:
                continue
            knode, pool, device = wanted[name]
            claim, status = gpus.holder_claim(ns, knode, pool, device, self.state.ident)
            try:
                made = kube_calls.create_claim(self.kube, ns, claim)
                kube_calls.put_claim_status(self.kube, {**made, "status": status})
                log.info("holder claim %s/%s: Slurm holds %s on %s", ns, name, device, knode)
            except kube_calls.ApiException as e:
                if e.status == 409:   # made by an earlier pass: its status is written below
                    ok = self._fill(ns, name, status) and ok
                    continue
                log.warning("cannot hold %s of %s for Slurm: %s", device, knode, error_text(e))
                ok = False
            except Exception as e:
                log.warning("cannot hold %s of %s for Slurm: %s", device, knode, error_text(e))
                ok = False
        return ok

    def _release(self, ns: str, names: list[str]) -> bool:
        """Deallocate them all, then delete them: kube-scheduler retries the
        pods waiting for a device when a claim is deallocated, not when one
        is deleted, and a pod waiting for several devices gets them with
        the last deallocation, not after the deletes before it.  False if
        a write failed (retried next pass)."""
        ok, deallocated = True, []
        for name in names:
            try:
                c = kube_calls.get_claim(self.kube, ns, name)
                if c is None:
                    continue
                if (c.get("status") or {}).get("allocation"):
                    kube_calls.put_claim_status(self.kube, {**c, "status": {}})
                deallocated.append(name)
            except Exception as e:
                log.warning("cannot release holder claim %s/%s: %s", ns, name, error_text(e))
                ok = False
        for name in deallocated:
            try:
                kube_calls.delete_claim(self.kube, ns, name)
                log.info("holder claim %s/%s released", ns, name)
            except Exception as e:
                log.warning("cannot delete holder claim %s/%s: %s", ns, name, error_text(e))
                ok = False
        return ok

    def _fill(self, ns: str, name: str, status: dict) -> bool:
        """A holder made but not allocated (the status write failed): write it."""
        c = self.existing().get(name)
        if c is not None and (c.get("status") or {}).get("allocation"):
            return True
        try:
            made = kube_calls.get_claim(self.kube, ns, name)
            if made is None or (made.get("status") or {}).get("allocation"):
                return True
            kube_calls.put_claim_status(self.kube, {**made, "status": status})
            return True
        except Exception as e:
            log.warning("cannot allocate holder claim %s/%s: %s", ns, name, error_text(e))
            return False
