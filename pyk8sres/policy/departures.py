"""How long a pod that left the API server still holds its share.

A pod's API object can vanish before its containers stop: a forced delete
(`--grace-period=0 --force`) removes it at once and the kubelet kills the
containers afterwards, at its own pace, up to the pod's
terminationGracePeriodSeconds; pod garbage collection force-deletes the
pods of a deleted Node; a partitioned kubelet learns of nothing until it is
back.  Until then those CPUs and that memory are still in use, so the share
stays held:

  the last object seen says its containers are gone   -> released at once
  (every container terminated; a phase alone proves nothing: pod GC marks
  the pods of a deleted Node Failed with their containers still "running")
  its node carries the out-of-service taint           -> released at once
  (the admin's word that the node is shut down: upstream's non-graceful
  node shutdown)
  its node is NotReady or Unknown                      -> held until the node
                                                          is Ready again, then
                                                          as below (deleting
                                                          the Node object does
                                                          not end the wait)
  otherwise (node Ready, or its Node object deleted)   -> held for what is left
                                                          of its grace period,
                                                          plus a margin

What is left of the grace period: if the pod was seen Terminating before it
vanished, the kubelet was told then and kills it by deletionTimestamp; if
not (a forced delete), the kubelet hears of it only now and may take the
whole terminationGracePeriodSeconds.  The margin covers the kubelet's own
delay in noticing and killing.  Pure: no I/O, times passed in.
"""
from __future__ import annotations

import datetime as dt
from typing import Mapping, NamedTuple

DEFAULT_GRACE = 30.0   # the API server's default terminationGracePeriodSeconds
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"

# A node's state as far as held shares care.
READY, UNREACHABLE, FENCED, ABSENT = "ready", "unreachable", "fenced", "absent"


def _seconds(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return float(value)


def grace_of(pod: Mapping) -> float:
    """How long its kubelet may take to kill the pod once told: its
    terminationGracePeriodSeconds (the API server's default if unset), or a
    longer grace period its deletion asked for (`delete --grace-period=N`)."""
    spec = _seconds((pod.get("spec") or {}).get("terminationGracePeriodSeconds"))
    asked = _seconds((pod.get("metadata") or {}).get("deletionGracePeriodSeconds"))
    return max(DEFAULT_GRACE if spec is None else spec, asked or 0.0)


def kill_by(pod: Mapping) -> float | None:
    """When the kubelet must have killed the pod, as seconds since the epoch
    (its deletionTimestamp), or None: not Terminating, or deleted with grace
    period 0.  A forced delete sets deletionTimestamp to now and removes the
    object in the same breath; the kubelet hears of it only afterwards and
    may take the pod's whole terminationGracePeriodSeconds."""
    meta = pod.get("metadata") or {}
    stamp, period = meta.get("deletionTimestamp"), meta.get("deletionGracePeriodSeconds")
    if not isinstance(stamp, str) or isinstance(period, bool) or \
            not isinstance(period, int) or period <= 0:
        return None
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def containers_gone(pod: Mapping) -> bool:
    """Does this object show that nothing of the pod runs any more: a
    status for every container, each terminated?  (A kubelet reports a
    terminal phase only with its containers terminated; pod GC sets phase
    Failed on pods it is about to delete and leaves their states as they were.)"""
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    names = {c.get("name") for c in (spec.get("containers") or [])}
    names |= {c.get("name") for c in (spec.get("initContainers") or [])
              if c.get("restartPolicy") == "Always"}
    seen = {c.get("name"): c for c in (status.get("containerStatuses") or [])
            + (status.get("initContainerStatuses") or []) if isinstance(c, Mapping)}
    if not names or not names <= set(seen):
        return False
    return all("terminated" in ((seen[n].get("state") or {})) and
               not (seen[n].get("state") or {}).get("running") for n in names)


def node_state(node: Mapping | None) -> str:
    """READY, UNREACHABLE, FENCED or ABSENT for a Node object (or None)."""
    if node is None:
        return ABSENT
    spec = node.get("spec") or {}
    if any(t.get("key") == OUT_OF_SERVICE_TAINT for t in spec.get("taints") or []):
        return FENCED
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return READY if c.get("status") == "True" else UNREACHABLE
    # No Ready condition yet: its kubelet has never reported, so nothing of
    # any pod runs there.
    return READY


class Held(NamedTuple):
    """A departed pod's share: what it held, where, and until when (seconds
    on the caller's clock; None: until its node is Ready again)."""
    cpu_m: int
    mem_bytes: int
    k8s_node: str
    grace: float
    until: float | None
    whole_gpus: bool = False   # it held every GPU of its node (usage.PodUsage.whole_gpus)


def first_hold(cpu_m: int, mem_bytes: int, k8s_node: str, grace: float,
               was_terminating_until: float | None, state: str, *, now: float,
               wall: float, margin: float, whole_gpus: bool = False) -> Held | None:
    """The hold of a pod that just vanished without its containers seen
    gone, or None when nothing needs holding (its node is fenced).
    was_terminating_until: the deletionTimestamp seen BEFORE it vanished
    (None for a pod never seen Terminating, e.g. a forced delete);
    whole_gpus: its node's GPUs are held with its share."""
    if state == FENCED:
        return None
    if state == UNREACHABLE:
        return Held(cpu_m, mem_bytes, k8s_node, grace, None, whole_gpus)
    left = grace if was_terminating_until is None else max(0.0, was_terminating_until - wall)
    return Held(cpu_m, mem_bytes, k8s_node, grace, now + left + margin, whole_gpus)


def next_hold(h: Held, state: str, *, now: float, margin: float) -> Held | None:
    """The hold as its node stands now: None once released (fenced, or its
    time is up on a node that is not unreachable); waiting while the node
    is unreachable, and on after its Node object is deleted (that says
    nothing of the machine); a full grace period and margin from the
    moment a waited-for node is Ready (its kubelet kills the pod only then)."""
    if state == FENCED:
        return None
    if state == UNREACHABLE or (state == ABSENT and h.until is None):
        return h if h.until is None else h._replace(until=None)
    if h.until is None:
        return h._replace(until=now + h.grace + margin)
    return None if now >= h.until else h
