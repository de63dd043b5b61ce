"""Hand back the reservation of a pod create (or binding) that never became
a pod on its node.

A CREATE with spec.nodeName is reserved when the webhook admits it, but the
API server may still refuse it afterwards: ResourceQuota runs after the
validating webhooks, and the store answers AlreadyExists.  Nothing tells the
webhook.  A binding the store refuses (the pod is bound already, or gone)
is the same.  Left alone, the reservation is dropped only by the sync
daemon's `set` once its grace period (reservation_grace) ends, so a
namespace that repeats such a create holds a node's CPUs for as long as it
likes.

So each reserved create and binding is looked at again `after` seconds
later, by namespace/name:
  - a pod of that UID bound to that node exists: it landed; the sync daemon
    owns its share;
  - no pod, one of another UID, or one bound elsewhere: it failed; the
    reservation is released
    with `unbound_only` (pyk8sres.policy.ledger), which never drops an entry
    the sync daemon has already seen bound; a namespace with two such
    creates (not bindings: kube-scheduler's, not the namespace's) within `hold` seconds has its creates on shared nodes refused
    for `hold` seconds (policy: phantom_refusal), so a loop of failing
    creates holds nothing most of the time.  One is forgiven: a pod created
    and deleted before the sync daemon saw it bound looks the same;
  - the API server or the ledger does not answer: tried again every
    `retry` seconds until `give_up` (the ledger's own grace period ends it
    by then anyway).

Race: the API server stores a create right after its last admission plugin
says yes, in one etcd transaction; a create not stored `after` seconds after
the webhook answered means the API server stalled that long in between.  If
it then lands after all, its reservation is gone, and it is counted as any
pod bound without admission: the sync daemon sets its entry as soon as it
sees it (its watch), and if a Slurm job took the room meanwhile, the node
reports Oversubscribed and starts no new job until the pods fit again.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import NamedTuple

from .kube import get_pod
from ..policy import admission
from ..policy.ledger import not_ready, seen_bound

log = logging.getLogger("pyk8sres.coordinator.confirm")


class Created(NamedTuple):
    namespace: str
    name: str
    uid: str
    slurm_node: str
    admitted: float
    node: str = ""            # the Kubernetes node it was admitted on
    create: bool = True       # a create (its failures count against the namespace)


class CreateConfirmer:
    """kube: kube.Kube; ledger: slurm.Ledger.  One worker thread, started
    with the first create tracked; at most `cap` creates are tracked at once
    (beyond that the ledger's grace period is left to drop them)."""

    def __init__(self, kube, ledger, after: float = 2.0, retry: float = 1.0,
                 give_up: float = 30.0, hold: float = 10.0, cap: int = 10_000,
                 clock=time.monotonic):
        self.kube, self.ledger = kube, ledger
        self.after, self.retry, self.give_up, self.hold, self.cap = after, retry, give_up, hold, cap
        self.clock = clock
        self._due: list[tuple[float, int, Created]] = []
        self._seq = 0
        self._blocked: dict[str, float] = {}     # namespace -> refuse its creates until
        self._last: dict[str, float] = {}        # namespace -> its last create that failed
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._old_ledger = False

    # --- called by admission ---------------------------------------------
    def track(self, namespace: str, name: str, uid: str, slurm_node: str, node: str,
              create: bool = True) -> None:
        now = self.clock()
        with self._cv:
            if self._stopped or len(self._due) >= self.cap:
                return
            self._seq += 1
            heapq.heappush(self._due, (now + self.after, self._seq,
                                       Created(namespace, name, uid, slurm_node, now, node,
                                               create)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="webhook-confirm",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def blocked_for(self, namespace: str) -> float:
        """Seconds this namespace's creates on shared nodes are still refused (0: none)."""
        with self._cv:
            until = self._blocked.get(namespace)
            if until is None:
                return 0.0
            left = until - self.clock()
            if left <= 0:
                del self._blocked[namespace]
                return 0.0
            return left

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    def pending(self) -> int:
        with self._cv:
            return len(self._due)

    # --- the worker --------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._due or self._due[0][0] > self.clock()):
                    self._cv.wait(None if not self._due else self._due[0][0] - self.clock())
                if self._stopped:
                    return
                _, _, c = heapq.heappop(self._due)
            try:
                done = self.check(c)
            except Exception:
                log.exception("confirming create %s/%s failed", c.namespace, c.name)
                done = False
            if not done and self.clock() - c.admitted < self.give_up:
                with self._cv:
                    self._seq += 1
                    heapq.heappush(self._due, (self.clock() + self.retry, self._seq, c))

    def _seen_bound(self, c: Created) -> bool:
        """Has the sync daemon already listed this pod bound on its node in
        the ledger?  Then it landed and the sync daemon owns its share:
        nothing to read back.  The usual case, and one local `show` of one
        node instead of a read of the pod from the API server (and etcd)
        for every admitted pod.  Anything else (not listed yet, an older
        ledger, no answer) reads the pod as before."""
        try:
            return seen_bound(self.ledger.show(c.slurm_node), c.slurm_node, c.uid)
        except Exception:     # LedgerError, or a ledger without show: ask the API server
            return False

    def _failed(self, namespace: str) -> None:
        now = self.clock()
        with self._cv:
            last = self._last.get(namespace)
            self._last[namespace] = now
            if last is not None and now - last < self.hold:
                self._blocked[namespace] = now + self.hold
            if len(self._last) > self.cap:       # bounded: forget the oldest
                for ns in sorted(self._last, key=self._last.get)[:len(self._last) // 2]:
                    del self._last[ns]

    def check(self, c: Created) -> bool:
        """One look at a tracked create; True when nothing is left to do."""
        if self._seen_bound(c):
            return True
        try:
            stored = get_pod(self.kube, c.namespace, c.name)
        except Exception as e:
            log.info("create %s/%s: cannot read it back (%s); trying again", c.namespace, c.name, e)
            return False
        if admission.landed(c.uid, c.node, stored):
            return True
        try:
            reply = self.ledger.release_unbound(c.slurm_node, c.uid)
        except Exception as e:     # LedgerError: slurmctld down or failing over
            log.info("create %s/%s: the ledger did not answer (%s); trying again",
                     c.namespace, c.name, e)
            return False
        if reply.get("ok") is True:
            if not reply.get("kept"):
                log.warning("pod %s %s/%s (UID %s) is no pod on node %s %g s after "
                            "admission (refused by ResourceQuota, name taken, bound already, "
                            "or deleted at once): its reservation on Slurm node %s is released",
                            "create" if c.create else "binding", c.namespace, c.name, c.uid,
                            c.node, self.after, c.slurm_node)
                if c.create:
                    self._failed(c.namespace)
            return True
        if reply.get("code") == "badrequest":
            if not self._old_ledger:
                log.warning("the ledger does not know release unbound_only (an older "
                            "slurmctld plugin): refused creates keep their reservation for the "
                            "sync daemon's grace period (%s)", reply.get("error"))
                self._old_ledger = True
            return True
        if not not_ready(reply):
            log.warning("release of create %s/%s on %s: %s", c.namespace, c.name,
                        c.slurm_node, reply)
        return False
