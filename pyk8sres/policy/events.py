"""Pure rules for the Kubernetes Events the coordinator posts: which reason a
refusal gets, and, for each occurrence, whether to create a new Event, bump
the count of the one already posted (PATCH count/lastTimestamp/message, as
kubelet's event correlator does) or fold it into the next bump.

Keyed by (involved object, reason): a storm of refusals of one pod for one
reason is one Event whose count grows, written at most once per
`update_interval`; occurrences in between are counted and written by the
next write (the poster calls due() when idle, so the last ones are not lost).
A key not seen for `window` starts a new Event (kubelet's aggregation
window; the API server drops Events after an hour anyway).  Under churn
(many different pods refused) every write also takes a token from one
bucket (`rate` per second, `burst`): beyond it a new Event is suppressed
and a bump is folded, so the API server never sees a storm.

No I/O, standard library only (coordinator/events.py does the posting).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Mapping

CREATE, UPDATE, DROP, SUPPRESS = "create", "update", "drop", "suppress"

# Deny codes (policy/admission.py) -> Event reason on the pod.
REFUSAL_REASONS = {
    "nofit": "InsufficientSharedCapacity",
    "ledger_unreachable": "LedgerUnreachable",
    "ledger_not_ready": "LedgerUnreachable",
}
DEFAULT_REFUSAL_REASON = "AdmissionRefused"
OVERSUBSCRIBED = "Oversubscribed"
# A Slurm node shares more than its Kubernetes node's allocatable (the difference is held).
OVER_ALLOCATABLE = "SlurmCapacityOverAllocatable"
LEDGER_UNREACHABLE = "LedgerUnreachable"
GPUS_FENCED = "GPUsFenced"


def refusal_reason(code: str) -> str:
    return REFUSAL_REASONS.get(code, DEFAULT_REFUSAL_REASON)


@dataclasses.dataclass(frozen=True)
class Limits:
    update_interval: float = 5.0   # at most one write per key this often (seconds)
    window: float = 600.0          # a key unseen this long starts a new Event
    max_keys: int = 4096           # the table forgets the oldest keys beyond this
    rate: float = 5.0              # API writes per second over all keys, sustained
    burst: int = 50                # ... and at once


@dataclasses.dataclass(frozen=True)
class Seen:
    """What was posted for one key."""
    count: int       # occurrences so far
    written: int     # the count the API server has
    first: float     # first occurrence (epoch seconds)
    last: float      # latest occurrence
    sent: float      # latest write


def decide(key: Hashable, now: float, table: Mapping[Hashable, Seen],
           limits: Limits = Limits()) -> tuple[str, Seen]:
    """(CREATE | UPDATE | DROP, the key's new entry) for one occurrence at `now`."""
    old = table.get(key)
    if old is None or now - old.last >= limits.window:
        return CREATE, Seen(count=1, written=1, first=now, last=now, sent=now)
    new = dataclasses.replace(old, count=old.count + 1, last=max(old.last, now))
    if now - old.sent >= limits.update_interval:
        return UPDATE, dataclasses.replace(new, written=new.count, sent=now)
    return DROP, new


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Write tokens left at time `at`."""
    tokens: float
    at: float


def _tokens(bucket: Bucket, now: float, limits: Limits) -> float:
    """The bucket's tokens at `now` (refilled at rate, never above burst)."""
    return min(float(limits.burst), bucket.tokens + max(0.0, now - bucket.at) * limits.rate)


def take(bucket: Bucket, now: float, limits: Limits = Limits()) -> tuple[bool, Bucket]:
    """(whether one write may go now, the bucket after)."""
    tokens = _tokens(bucket, now, limits)
    if tokens >= 1.0:
        return True, Bucket(tokens - 1.0, now)
    return False, Bucket(tokens, now)


def until_token(bucket: Bucket, now: float, limits: Limits = Limits()) -> float:
    """Seconds until take() would give a token (0: now; inf: it never refills)."""
    tokens = _tokens(bucket, now, limits)
    if tokens >= 1.0:
        return 0.0
    return (1.0 - tokens) / limits.rate if limits.rate > 0 else float("inf")


def throttled(key: Hashable, now: float, table: Mapping[Hashable, Seen], bucket: Bucket,
              limits: Limits = Limits()) -> tuple[str, Seen | None, Bucket]:
    """decide(), then the global budget: (action, the key's new entry or None
    (SUPPRESS: nothing posted, nothing remembered), the bucket after)."""
    action, seen = decide(key, now, table, limits)
    if action == DROP:
        return DROP, seen, bucket
    ok, bucket = take(bucket, now, limits)
    if ok:
        return action, seen, bucket
    if action == CREATE:
        return SUPPRESS, None, bucket
    old = table[key]
    return DROP, dataclasses.replace(old, count=old.count + 1, last=max(old.last, now)), bucket


def due(table: Mapping[Hashable, Seen], now: float, limits: Limits = Limits()) -> list:
    """Keys with occurrences the API server does not have yet whose next
    write is allowed now (oldest write first)."""
    keys = [k for k, s in table.items()
            if s.count > s.written and now - s.sent >= limits.update_interval]
    return sorted(keys, key=lambda k: table[k].sent)


def flushed(seen: Seen, now: float) -> Seen:
    """The entry once its pending occurrences were written at `now`."""
    return dataclasses.replace(seen, written=seen.count, sent=now)


def prune(table: Mapping[Hashable, Seen], now: float, limits: Limits = Limits()) -> dict:
    """The table without keys past their window (their Event is final) and
    with at most max_keys entries (the most recent kept).  Keys with unwritten
    occurrences are kept while in their window."""
    live = {k: s for k, s in table.items() if now - s.last < limits.window}
    if len(live) > limits.max_keys:
        newest = sorted(live, key=lambda k: live[k].last, reverse=True)[:limits.max_keys]
        live = {k: live[k] for k in newest}
    return live
