"""When the sync daemon updates a node's GenericNode (pure).

Every admitted pod changes what its node's GenericNode shows (the pods'
share), and so would every job starting or ending: one status write each
would cost the API server more than the pod itself, and wake every client
watching GenericNodes.  So one node's object is updated at most once per
`interval`, always with its newest state:

* the first change after a quiet spell is written at once (leading edge):
  an isolated change shows as soon as it happens;
* changes inside the interval wait for its end and fold into one write
  (trailing edge).  Level-triggered: whoever asks again at or after the
  time `split` returns writes the newest state, so the last change is never
  lost, and `kubectl get genericnode` is at most `interval` behind;
* a node whose object already shows what it should is never written (the
  caller compares the body before writing).

Creating a node's object is not paced (it happens once per node); the
write budget (policy/events.py's bucket, generic_node_qps) still applies
to what `split` lets through.
"""

from __future__ import annotations

from typing import Mapping


def next_write(last: float | None, now: float, interval: float) -> float:
    """When a node whose object was last updated at `last` (None: not in
    the last interval) may be updated again; never before now."""
    return now if last is None else max(now, last + interval)


def split(waiting: Mapping[str, float], written_at: Mapping[str, float], now: float,
          interval: float) -> tuple[list[str], float | None]:
    """waiting: node -> since when its object has differed from what it
    should show; written_at: node -> when it was last updated.  Returns the
    nodes that may be written now, oldest change first (ties by name), and
    when the first of the others may be (None: no other waits)."""
    ready, later = [], None
    for name in waiting:
        at = next_write(written_at.get(name), now, interval)
        if at <= now:
            ready.append(name)
        elif later is None or at < later:
            later = at
    ready.sort(key=lambda n: (waiting[n], n))
    return ready, later


def recent(written_at: Mapping[str, float], now: float, interval: float) -> dict[str, float]:
    """The updates that still hold a node back (within the interval): the
    rest are forgotten, so the table stays as small as one interval's writes."""
    return {n: t for n, t in written_at.items() if now - t < interval}
