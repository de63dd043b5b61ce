"""What the API server's RBAC refuses this daemon, said where an admin looks.

Kube (kube.py) passes every response of the Kubernetes client through
here.  A 403 records the (verb, resource) its request needed, with the API
server's own message, until a request needing the same succeeds; /readyz
answers 503 naming each one, and the log says it once when refused and
once when granted again.  What the daemon does without it is its own
business and fails closed (sync: a node's share only grows while a watch
cannot list; webhook: a pod it cannot read is refused); this module only
makes the reason plain instead of a retry loop of 403s.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import urllib.parse

from . import metrics

log = logging.getLogger("pyk8sres.coordinator.permissions")

# Refused on purpose: Kube.ensure_crd takes a 403 as "the admin applied the
# CRD" (the chart's RBAC grants no CRD access).
EXPECTED = {("apiextensions.k8s.io", "customresourcedefinitions")}

# The API server's authorization refusal (responsewriters.forbiddenMessage).
# Other 403s are admission's answers to one object (our own webhook
# refusing a pod that does not fit, a quota, Pod Security), not a missing
# grant: they must not make the daemon "not ready".
AUTHORIZATION_REFUSAL = re.compile(r'\bforbidden: User "[^"]*" cannot ')


def refused_by_authorization(status: int, message: str) -> bool:
    return status == 403 and AUTHORIZATION_REFUSAL.search(message) is not None


def request_rule(method: str, url: str) -> tuple[str, str, str, str] | None:
    """(verb, API group, resource[/subresource], namespace or "") of a
    request, by the API server's request rules; None for non-resource paths
    (discovery, /version)."""
    parts = urllib.parse.urlsplit(url)
    path = [p for p in parts.path.split("/") if p]
    if path[:1] == ["api"] and len(path) >= 3:
        group, rest = "", path[2:]
    elif path[:1] == ["apis"] and len(path) >= 4:
        group, rest = path[1], path[3:]
    else:
        return None
    namespace = ""
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    resource, named = rest[0], len(rest) > 1
    if len(rest) > 2:
        resource += "/" + rest[2]
    method = method.upper()
    if method == "GET":
        watch = urllib.parse.parse_qs(parts.query).get("watch", [""])[0] in ("true", "True", "1")
        verb = "get" if named else ("watch" if watch else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if named else "deletecollection"}.get(method, method.lower())
    return verb, group, resource, namespace


def describe(rule: tuple[str, str, str, str]) -> str:
    """'list nodes', 'patch genericnodes/status (API group pyk8sres.io)',
    'get pods in namespace default'."""
    verb, group, resource, namespace = rule
    return (f"{verb} {resource}" + (f" (API group {group})" if group else "")
            + (f" in namespace {namespace}" if namespace else ""))


def status_message(body) -> str:
    """The message of a Status body (bytes or str), else the body itself, short."""
    try:
        text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
        return str(json.loads(text).get("message") or text)[:400]
    except (ValueError, AttributeError):
        return text[:400]


def error_text(e: Exception) -> str:
    """One line for an API error (the client's own str() is its headers and
    raw body); a 403 names the verb and resource RBAC refused."""
    status = getattr(e, "status", None)
    if status is None:
        return f"{type(e).__name__}: {e}"
    msg = status_message(getattr(e, "body", None)) or getattr(e, "reason", "")
    if refused_by_authorization(status, msg):
        return f"forbidden by RBAC: {msg}"
    return f"{status} {getattr(e, 'reason', '')}: {msg}"


class Refusals:
    """(verb, group, resource, namespace) -> the API server's message, for
    each request RBAC refused and nothing has been granted since."""

    def __init__(self):
        self.lock = threading.Lock()
        self.refused: dict[tuple, str] = {}

    def answered(self, method: str, url: str, status: int, body=None) -> None:
        if status != 403 and not self.refused:
            return      # the common case, on every request: nothing to record or clear
        rule = request_rule(method, url)
        if rule is None or rule[1:3] in EXPECTED:
            return
        message = status_message(body) if status == 403 else ""
        if refused_by_authorization(status, message):
            with self.lock:
                new = rule not in self.refused
                self.refused[rule] = message
            if new:
                # Registered at the first refusal: before it, a daemon's
                # readiness is its own checks' (none yet means "starting").
                metrics.HEALTH.check("permissions", self.not_ready)
                log.error("Kubernetes RBAC refuses %s: %s; what needs it fails closed until "
                          "it is granted (the Helm chart's RBAC)", describe(rule), message)
        elif 200 <= status < 300:
            with self.lock:
                granted = self.refused.pop(rule, None) is not None
            if granted:
                log.warning("Kubernetes RBAC now allows %s", describe(rule))

    def not_ready(self) -> str | None:
        """A readiness check: None while nothing is refused."""
        with self.lock:
            rules = sorted(self.refused)
        if not rules:
            return None
        return ("forbidden by RBAC: " + "; ".join(describe(r) for r in rules)
                + " (grant them: the Helm chart's RBAC)")


REFUSALS = Refusals()


def watch_client(api) -> None:
    """Record what RBAC answers every request of this ApiClient, and make
    readiness say it."""
    call = api.call_api

    def call_api(method, url, *args, **kwargs):
        resp = call(method, url, *args, **kwargs)
        status = getattr(resp, "status", 0)
        try:
            REFUSALS.answered(method, url, status, resp.read() if status == 403 else None)
        except Exception:   # bookkeeping must never break a call
            log.debug("cannot record the answer to %s %s", method, url, exc_info=True)
        return resp

    api.call_api = call_api
