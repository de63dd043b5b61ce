"""Kubernetes quantities and what a pod requests, exactly.

Pure (no I/O): parsing and formatting cpu/memory quantities ("1735m",
"1.5Gi") as exact Fractions, and a pod's effective cpu/memory requests as
kube-scheduler counts them (containers, init containers and sidecars,
overhead, pod-level resources, in-place resizes).  Pods are plain dicts in
the Kubernetes JSON shape.  What each node should then hold is usage.py's.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Mapping

MI = 1024 * 1024
NANO = 10**9


class QuantityError(ValueError):
    """A Kubernetes quantity we cannot read (or must not trust)."""


# --------------------------------------------------------------------------
# Quantities
# --------------------------------------------------------------------------

_SUFFIX = {
    "": Fraction(1),
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9),
    "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30),
    "Ti": Fraction(2**40), "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}
# Kubernetes grammar: <sign><digits>[.<digits>]<suffix>, suffix one of the
# above or a decimal exponent e<int>/E<int>.
_QUANTITY_RE = re.compile(
    r"^(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<exp>[eE][+-]?\d+)|(?P<suf>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$")


def parse_quantity(value) -> Fraction:
    """Exact value of a Kubernetes quantity ("1735m", "1.5Gi", "1e3")."""
    if isinstance(value, bool):
        raise QuantityError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        return Fraction(value)
    if not isinstance(value, str):
        # float / None / dict: the API server only ever sends strings or ints.
        raise QuantityError(f"not a quantity: {value!r}")
    return _parse_text(value)


@functools.lru_cache(maxsize=4096)
def _parse_text(value: str) -> Fraction:
    # Cached: a cluster's pods use a handful of distinct strings; Fraction is immutable.
    m = _QUANTITY_RE.match(value.strip())
    if not m:
        raise QuantityError(f"malformed quantity {value!r}")
    num = Fraction(m.group("num"))  # Fraction parses decimal strings exactly
    if m.group("exp"):
        exp = int(m.group("exp")[1:])
        if abs(exp) > 30:  # absurd, and would make huge integers
            raise QuantityError(f"quantity exponent out of range: {value!r}")
        return num * Fraction(10) ** exp
    return num * _SUFFIX[m.group("suf") or ""]


def request_quantity(value) -> Fraction:
    """A quantity used as a resource request: must be >= 0."""
    q = parse_quantity(value)
    if q < 0:
        raise QuantityError(f"negative request {value!r}")
    return q


def format_cpu(cores: Fraction) -> str:
    """Kubernetes style: whole cores "3", else millicores "2735m" (rounded up)."""
    if cores == int(cores):
        return str(int(cores))
    return f"{math.ceil(cores * 1000)}m"


def format_memory(nbytes: Fraction) -> str:
    """Like the reference: "4000Mi"; "0" for nothing; Ki or bytes if not whole Mi."""
    b = math.ceil(nbytes)
    if b == 0:
        return "0"
    if b % MI == 0:
        return f"{b // MI}Mi"
    if b % 1024 == 0:
        return f"{b // 1024}Ki"
    return str(b)


# --------------------------------------------------------------------------
# Pod requests
# --------------------------------------------------------------------------

def _requests_of(resources: Mapping | None) -> dict[str, Fraction]:
    """cpu/memory requests of one container (or pod-level) resources block.

    A limit without a request means request = limit (the API server defaults
    it that way; we do the same in case it did not).
    """
    resources = resources or {}
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    out = {}
    for name in ("cpu", "memory"):
        if name in requests:
            out[name] = request_quantity(requests[name])
        elif name in limits:
            out[name] = request_quantity(limits[name])
    return out


def _add(a: dict, b: Mapping) -> None:
    for k, v in b.items():
        a[k] = a.get(k, 0) + v


def _max(a: dict, b: Mapping) -> None:
    for k, v in b.items():
        a[k] = max(a.get(k, 0), v)


def _quantities(values: Mapping | None) -> dict[str, Fraction]:
    """cpu/memory of a ResourceList (allocatedResources, status requests)."""
    return {k: request_quantity(v) for k, v in (values or {}).items() if k in ("cpu", "memory")}


def resize_infeasible(pod: Mapping) -> bool:
    """The kubelet said it will never apply the pending resize (condition
    PodResizePending, reason Infeasible; the first such condition decides)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodResizePending":
            return c.get("reason") == "Infeasible"
    return False


def _effective(spec: dict[str, Fraction], status: Mapping | None,
               infeasible: bool) -> dict[str, Fraction]:
    """One container's requests as kube-scheduler counts them (1.35,
    component-helpers determineEffectiveRequests): once its kubelet has
    reported it (status resources set), the larger of spec, what it runs
    with (status resources) and what it was allocated; while a resize is
    Infeasible the spec is left out (it will never run)."""
    if not status or status.get("resources") is None:
        return spec
    parts = [_quantities(status["resources"].get("requests")),
             _quantities(status.get("allocatedResources"))]
    if not infeasible:
        parts.insert(0, spec)
    out: dict[str, Fraction] = {}
    for p in parts:
        _max(out, p)
    return out


def pod_requests(pod: Mapping, spec_counts: bool = False) -> dict[str, Fraction]:
    """Effective cpu/memory requests of a pod, as kube-scheduler 1.35 counts
    them (component-helpers/resource PodRequests with UseStatusResources).

    max(sum of app containers + sidecars, each init container's need) plus pod
    overhead.  A sidecar (init container with restartPolicy Always) keeps running,
    so it adds to every init container started after it and to the app sum
    (Kubernetes' AggregateContainerRequests).  An app container or sidecar the
    kubelet has reported counts max(spec, status resources, allocatedResources):
    a downsized pod holds its old size until the kubelet applied the resize, a
    grown one its new size at once, except that an Infeasible resize's spec is
    left out.  Pod-level requests (spec.resources), when set, replace the
    container sum for that resource (their in-place resize is alpha in 1.35
    and off: the spec counts).  spec_counts: the spec counts even while a
    resize is Infeasible (admission of a new resize: the kubelet judges the
    new spec afresh and may apply it).  Raises QuantityError on malformed data.
    """
    spec = pod.get("spec") or {}
    st = pod.get("status") or {}
    statuses = {c.get("name"): c for c in (st.get("containerStatuses") or [])
                + (st.get("initContainerStatuses") or []) if isinstance(c, Mapping)}
    infeasible = resize_infeasible(pod) and not spec_counts
    total: dict[str, Fraction] = {}
    for c in spec.get("containers") or []:
        _add(total, _effective(_requests_of(c.get("resources")), statuses.get(c.get("name")),
                               infeasible))

    sidecars: dict[str, Fraction] = {}
    init_need: dict[str, Fraction] = {}
    for c in spec.get("initContainers") or []:
        req = _requests_of(c.get("resources"))
        if c.get("restartPolicy") == "Always":
            req = _effective(req, statuses.get(c.get("name")), infeasible)
            _add(total, req)
            _add(sidecars, req)
            need = dict(sidecars)
        else:
            need = dict(req)
            _add(need, sidecars)
        _max(init_need, need)
    _max(total, init_need)

    pod_level = _requests_of(spec.get("resources"))
    total.update(pod_level)

    for name, q in (spec.get("overhead") or {}).items():
        if name in ("cpu", "memory"):
            total[name] = total.get(name, 0) + request_quantity(q)
    return {"cpu": Fraction(total.get("cpu", 0)),
            "memory": Fraction(total.get("memory", 0))}


def held_requests(pod: Mapping) -> dict[str, Fraction]:
    """What the ledger holds for a pod: per container the larger of what its
    spec asks and what its kubelet may run (status resources,
    allocatedResources), whatever the pending resize's state.  kube-scheduler
    drops the spec of an Infeasible resize; the ledger does not, because an
    Infeasible verdict is the kubelet's of the moment (it judges the spec
    again when the node or the pod changes, and the condition stays on the
    pod, stale, after the next resize until the kubelet reports again), so
    a spec the kubelet may still apply is never left unheld.  Deferred and
    in-progress resizes count the same way.  Raises QuantityError."""
    return pod_requests(pod, spec_counts=True)
