"""The one module that talks to Kubernetes (official ``kubernetes`` client).

Everything comes back as plain JSON dicts (we ask the client for the raw
response and parse it ourselves): the policy in usage.py works on dicts, and
the client's model objects would cost many times the memory of a large
cluster's pods.

Every call has a client-side timeout.  Watches follow the usual informer
rules: list (paged) then watch from the list's resourceVersion, follow
bookmarks, relist on 410 Gone, back off on errors.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import select
import threading
import time
from typing import Iterator
from urllib.parse import quote

import yaml  # a dependency of the kubernetes client
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .. import data
from . import metrics, permissions

log = logging.getLogger("pyk8sres.coordinator.kube")

GROUP = "pyk8sres.io"
VERSION = "v1alpha1"
PLURAL = "genericnodes"
MANAGED_BY = {"app.kubernetes.io/managed-by": "pyk8sres-sync"}
MERGE_PATCH = "application/merge-patch+json"
# The paths Kube.request is given, in the client's own notation (names in
# braces, filled and quoted by request); tests/unit/test_rbac.py reads them
# to know what the chart's RBAC must grant.
POD_PATH = "/api/v1/namespaces/{namespace}/pods/{name}"
GENERIC_NODE_PATH = "/apis/{group}/{version}/{plural}/{name}"
GENERIC_NODE_STATUS_PATH = "/apis/{group}/{version}/{plural}/{name}/status"

# The one definition of GenericNode: the Helm chart's crds/.
CRD_MANIFEST = ("deploy", "helm", "pyk8sres", "crds", "genericnode.yaml")

# Seconds a watch waits, once it has read all that has arrived, before it
# reads again.  Every node reports its status every few minutes (kwok and
# kubelets alike), so a large cluster's nodes watch never rests: waking up
# for each event costs several times what reading them in batches does, and
# the nodes watches would be most of an idle coordinator's CPU
# (bench/bench_watch_read.py measures both; docs/development.md has the
# figures).  A node change may wait half a second; pod events are
# read at once (their latency is what admission and sync are measured by).
READ_PAUSE = {"nodes": 0.5}


# DRA (resource.k8s.io/v1, GA in Kubernetes 1.34): claims and the slices
# their devices are in.
DRA_KINDS = ("resourceclaims", "resourceslices")


def generic_node_crd() -> dict:
    """The GenericNode CRD, read from the manifest the package ships (the same
    file Helm installs), so code and the chart can never disagree."""
    return yaml.safe_load(data.path(*CRD_MANIFEST).read_text(encoding="utf-8"))


class Gone(Exception):
    """410: our resourceVersion is too old; relist."""


def _json(resp) -> dict:
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()


def done(resp) -> None:
    """Back to the pool with its body read: release_conn() alone returns the
    connection with the body unread, and the next request on it reads that
    body as its status line (BadStatusLine; urllib3 retries only idempotent
    methods, so a POST fails)."""
    resp.drain_conn()
    resp.release_conn()


def _nothing_waiting(resp) -> bool:
    """The watch's connection has no byte waiting, in TLS or the kernel.
    Unknown (no socket to ask) counts as something waiting: never pause."""
    sock = getattr(getattr(resp, "connection", None), "sock", None)
    if sock is None:
        return False
    pending = getattr(sock, "pending", None)   # decrypted, not yet read
    if pending is not None and pending():
        return False
    try:
        poller = select.poll()        # select.select fails on fds above 1023
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):     # closed meanwhile: let the read say so
        return False


class Kube:
    """Thin wrapper over the API; timeouts on every call."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None,
                 timeout: float = 10.0):
        self.timeout = timeout
        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig, context=context)
        else:
            try:
                cfg = client.Configuration()
                config.load_incluster_config(client_configuration=cfg)
                api = client.ApiClient(cfg)
            except config.ConfigException:
                api = config.new_client_from_config(context=context)
        permissions.watch_client(api)   # what RBAC refuses goes to the log and /readyz
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.ext = client.ApiextensionsV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.resource = client.ResourceV1Api(api)
        # Set to False once the server rejects the "spec.nodeName!=" selector;
        # from then on we filter unbound pods client-side.
        self.pod_field_selector_ok = True

    def request(self, method: str, path: str, body=None, content_type: str | None = None,
                timeout=None, **names: str):
        """One request the short way: path one of the *_PATH above, its
        names given as keywords (group, version and plural are GenericNode's
        unless given); the response, unread (as the client's
        _preload_content=False gives it), ApiException for anything not 2xx.
        For the calls made once per admitted pod: the generated methods
        validate their arguments (pydantic) and walk the body to serialise
        it on every call, which costs more CPU than the request itself;
        this keeps the same connection pool, authentication and RBAC
        bookkeeping (permissions.watch_client) without them."""
        path = path.format(**{"group": GROUP, "version": VERSION, "plural": PLURAL,
                              **{k: quote(v, safe="") for k, v in names.items()}})
        api = self.api
        headers = {"Accept": "application/json", **api.default_headers}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        api.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
        url = api.configuration.host + path
        resp = api.call_api(method, url, headers, body, None,
                            self.timeout if timeout is None else timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response

    # ------------------------------------------------------------ pods/nodes

    def _lister(self, kind: str, namespace: str | None = None):
        if kind == "pods" and namespace:
            return functools.partial(self.core.list_namespaced_pod, namespace)
        if kind == "pods":
            return self.core.list_pod_for_all_namespaces
        if kind == "nodes":
            return self.core.list_node
        if kind == "resourceclaims":
            return self.resource.list_resource_claim_for_all_namespaces
        if kind == "resourceslices":
            return self.resource.list_resource_slice
        raise ValueError(kind)

    def _selector(self, kind: str) -> str | None:
        if kind == "pods" and self.pod_field_selector_ok:
            return "spec.nodeName!="
        return None

    def _call(self, kind: str, namespace: str | None = None, **kw):
        """One list/watch request (namespace: that namespace's objects only);
        falls back once if the field selector is refused."""
        fn = self._lister(kind, namespace)
        try:
            return fn(field_selector=self._selector(kind), _preload_content=False, **kw)
        except ApiException as e:
            if e.status == 400 and self._selector(kind):
                log.warning("server refused field selector for %s (%s); filtering "
                            "client-side", kind, e.reason)
                self.pod_field_selector_ok = False
                return fn(_preload_content=False, **kw)
            raise

    def list(self, kind: str, page: int = 500, reduce=None,
             namespace: str | None = None) -> tuple[list, str]:
        """All objects (paged, one consistent snapshot) and the list's resourceVersion.

        reduce(obj), if given, is applied to each object as its page arrives
        and only its result is kept: full pod objects cost many times
        their reductions, and a large cluster holds many.
        """
        items: list = []
        token = None
        while True:
            kw = {"limit": page, "_request_timeout": self.timeout}
            if token:
                kw["_continue"] = token
            try:
                body = _json(self._call(kind, namespace, **kw))
            except ApiException as e:
                if e.status == 410:  # continue token expired: start over
                    items, token = [], None
                    continue
                raise
            objs = body.pop("items", None) or []
            items.extend(map(reduce, objs) if reduce else objs)
            del objs
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, meta.get("resourceVersion", "")

    def watch(self, kind: str, resource_version: str, timeout_seconds: int = 60,
              namespace: str | None = None) -> Iterator[tuple[str, dict]]:
        """Open a watch from resource_version; return an iterator of (type, object).

        The request is made here (so the caller knows the watch is open when
        this returns); the iterator runs until the server ends the watch.
        BOOKMARK events are yielded too (their object carries only the new
        resourceVersion).  Raises Gone on 410; silence longer than the server
        timeout plus a margin raises a read timeout (a stale connection).
        """
        try:
            resp = self._call(kind, namespace, watch=True, resource_version=resource_version,
                              allow_watch_bookmarks=True, timeout_seconds=timeout_seconds,
                              _request_timeout=(self.timeout, timeout_seconds + self.timeout))
        except ApiException as e:
            if e.status == 410:
                raise Gone(str(e.reason)) from e
            raise
        return self._events(resp, READ_PAUSE.get(kind, 0.0))

    @staticmethod
    def _events(resp, pause: float = 0.0) -> Iterator[tuple[str, dict]]:
        try:
            buf = b""
            for chunk in resp.stream(amt=None, decode_content=False):
                lines = (buf + chunk).split(b"\n")
                buf = lines.pop()          # an incomplete last line waits for more
                for line in lines:
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    if ev.get("type") == "ERROR":
                        obj = ev.get("object") or {}
                        if obj.get("code") == 410:
                            raise Gone(obj.get("message", "410 Gone"))
                        raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                    yield ev["type"], ev["object"]
                if pause and _nothing_waiting(resp):
                    time.sleep(pause)   # let events gather: one wake-up for many
        finally:
            resp.close()
            resp.release_conn()

    # ------------------------------------------------------------ GenericNode

    def ensure_crd(self) -> None:
        """Create the GenericNode CRD if it is not there.

        The chart's RBAC grants no access to CRDs (Helm installs the chart's
        crds/ as the admin): a 403 here means "assume it is there".
        """
        crd = generic_node_crd()
        try:
            done(self.ext.read_custom_resource_definition(
                crd["metadata"]["name"], _preload_content=False,
                _request_timeout=self.timeout))
            return
        except ApiException as e:
            if e.status == 403:
                return
            if e.status != 404:
                raise
        try:
            done(self.ext.create_custom_resource_definition(
                crd, _preload_content=False, _request_timeout=self.timeout))
        except ApiException as e:
            if e.status != 409:
                raise
        # The new resource takes a moment to be served.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.list_generic_nodes()
                return
            except ApiException as e:
                if e.status != 404:
                    raise
            time.sleep(0.2)

    def list_generic_nodes(self) -> dict[str, dict]:
        body = _json(self.custom.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, _preload_content=False, _request_timeout=self.timeout))
        return {o["metadata"]["name"]: o for o in body.get("items") or []}

    def create_generic_node(self, name: str, spec: dict, status: dict) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GenericNode",
                "metadata": {"name": name, "labels": dict(MANAGED_BY)}, "spec": spec}
        done(self.custom.create_cluster_custom_object(
            GROUP, VERSION, PLURAL, body, _preload_content=False,
            _request_timeout=self.timeout))
        try:
            self.clear_generic_node_field_owners(name)
        except ApiException as e:   # the next relist clears them
            log.warning("GenericNode %s: managedFields kept: %s", name, e.reason)
        # status is a subresource: create ignores it, set it separately.
        if status:
            self.patch_generic_node(name, status=status)

    def clear_generic_node_field_owners(self, name: str) -> None:
        """Empty the object's metadata.managedFields (the "[{}]" reset).
        The API server then tracks no field owner on later patches and
        updates (it resumes only once someone applies server-side), so the
        status write each admitted pod sets off no longer decodes,
        recomputes and stores them: a smaller object through every step of
        the write (bench_admission.py measures both).  Only the sync daemon
        writes these objects, never by apply, and nothing reads who owns
        which field.  A request of its own, on the object (the status
        subresource keeps them; reset with other changes, the resetter
        would own those)."""
        done(self.request("PATCH", GENERIC_NODE_PATH, {"metadata": {"managedFields": [{}]}},
                          MERGE_PATCH, name=name))

    def patch_generic_node(self, name: str, spec: dict | None = None,
                           status: dict | None = None) -> None:
        """Merge-patch spec and/or status.  The status patch follows every
        admitted pod: the short request path, and the reply (the whole
        object) is drained, not parsed: nobody reads it."""
        if spec is not None:
            done(self.request("PATCH", GENERIC_NODE_PATH, {"spec": spec}, MERGE_PATCH, name=name))
        if status is not None:
            # A merge patch merges maps but replaces lists, which is what we want
            # for allocatedResources.  null removes keys we no longer set.
            done(self.request("PATCH", GENERIC_NODE_STATUS_PATH, {"status": status}, MERGE_PATCH,
                              name=name))

    def delete_generic_node(self, name: str) -> None:
        try:
            done(self.custom.delete_cluster_custom_object(
                GROUP, VERSION, PLURAL, name, _preload_content=False,
                _request_timeout=self.timeout))
        except ApiException as e:
            if e.status != 404:
                raise


class Informer(threading.Thread):
    """List+watch one kind forever, feeding a handler.

    handler.replace(kind, items)  after every (re)list: the full truth
      (or, if the handler has slim(kind, obj): replace_slim(kind, [slim(obj)...]))
    handler.event(kind, type, obj) for ADDED/MODIFIED/DELETED
    handler.health(kind, ok)      False on any error and on 410 (until the
                                  relist is in), True once the watch is open again
    handler.contact(kind)         (optional) the server spoke: an event, a
                                  bookmark or a watch (re)opened

    Level-triggered: a watch the server ends normally (every watch_timeout
    seconds) resumes from the last resourceVersion; after 410 or any error
    we relist.  A connection that goes silent without closing is caught by
    the read timeout (watch_timeout + request timeout); until then the
    handler can tell from contact() that the server has been quiet longer
    than a live watch ever is (stale_after).
    """

    def __init__(self, kube: Kube, kind: str, handler, watch_timeout: int = 15,
                 backoff_max: float = 30.0, stop: threading.Event | None = None,
                 namespace: str | None = None):
        super().__init__(name=f"informer-{kind}", daemon=True)
        self.kube, self.kind, self.handler = kube, kind, handler
        # One namespace's objects only (else every namespace's).
        self.scoped = {"namespace": namespace} if namespace else {}
        self.watch_timeout = watch_timeout
        self.backoff_max = backoff_max
        self.stop_event = stop or threading.Event()
        self.rv: str | None = None
        self.relists = 0

    def _contact(self) -> None:
        contact = getattr(self.handler, "contact", None)
        if contact is not None:
            contact(self.kind)

    def stale_after(self) -> float:
        """Seconds without contact after which a watch is silent for no good
        reason: each is reopened at most every watch_timeout seconds."""
        return self.watch_timeout + self.kube.timeout

    def run(self) -> None:
        backoff = 0.5
        while not self.stop_event.is_set():
            try:
                if self.rv is None:
                    # The handler may reduce objects as pages arrive (memory).
                    slim = getattr(self.handler, "slim", None)
                    if slim is not None:
                        items, self.rv = self.kube.list(
                            self.kind, reduce=lambda o: slim(self.kind, o), **self.scoped)
                        self.handler.replace_slim(self.kind, items)
                    else:
                        items, self.rv = self.kube.list(self.kind, **self.scoped)
                        self.handler.replace(self.kind, items)
                    del items
                    self.relists += 1
                # Server-side timeout jittered so pod and node watches do not
                # reconnect in lockstep.
                t = max(1, int(self.watch_timeout * random.uniform(0.8, 1.0)))
                events = self.kube.watch(self.kind, self.rv, t, **self.scoped)
                self._contact()
                self.handler.health(self.kind, True)  # open, from a known rv: in sync
                backoff = 0.5
                for typ, obj in events:
                    self._contact()
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if typ != "BOOKMARK":
                        self.handler.event(self.kind, typ, obj)
                    if rv:
                        self.rv = rv
                    if self.stop_event.is_set():
                        return
                # Watch ended normally (server timeout); loop re-watches from rv.
            except Gone as e:
                log.info("%s: resourceVersion %s expired (%s); relisting", self.kind, self.rv, e)
                metrics.WATCH_RESTARTS.labels(self.kind, "gone").inc()
                # Events between rv and now are lost: not in sync until relisted.
                self.handler.health(self.kind, False)
                self.rv = None
            except Exception as e:  # network, 5xx, timeouts: never fatal
                metrics.WATCH_RESTARTS.labels(self.kind, "error").inc()
                self.handler.health(self.kind, False)
                # Relist rather than resume: a resumed watch looks healthy the
                # moment it opens, before the server can say 410 -- and a cycle
                # in that gap would trust a cache that missed events.
                self.rv = None
                log.warning("%s: %s; relisting in %.1fs", self.kind,
                            permissions.error_text(e), backoff)
                if self.stop_event.wait(backoff):
                    return
                backoff = min(self.backoff_max, backoff * 2)


# ------------------------------------------------------------ admission and pods
# (the webhook, the placeholder pods and the test scheduler use these)

STRATEGIC_PATCH = "application/strategic-merge-patch+json"


def _missing(e: ApiException) -> bool:
    return e.status == 404


def _read(call) -> dict | None:
    """The object call() reads, None where the server says there is none."""
    try:
        return _json(call())
    except ApiException as e:
        if _missing(e):
            return None
        raise


def get_pod(kube: Kube, namespace: str, name: str) -> dict | None:
    return _read(lambda: kube.request("GET", POD_PATH, namespace=namespace, name=name))


def list_pods(kube: Kube, namespace: str | None = None, field_selector: str | None = None) -> list:
    if namespace:
        return list_namespace_pods(kube, namespace, field_selector)
    return _json(kube.core.list_pod_for_all_namespaces(
        field_selector=field_selector, _preload_content=False,
        _request_timeout=kube.timeout)).get("items") or []


def list_namespace_pods(kube: Kube, namespace: str, field_selector: str | None = None) -> list:
    """One namespace only (all a Role in that namespace allows: the chart's RBAC)."""
    return _json(kube.core.list_namespaced_pod(
        namespace, field_selector=field_selector, _preload_content=False,
        _request_timeout=kube.timeout)).get("items") or []


def create_pod(kube: Kube, namespace: str, body: dict) -> dict:
    return _json(kube.core.create_namespaced_pod(
        namespace, body, _preload_content=False, _request_timeout=kube.timeout))


def delete_pod(kube: Kube, namespace: str, name: str) -> None:
    try:
        done(kube.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0,
                                              _preload_content=False,
                                              _request_timeout=kube.timeout))
    except ApiException as e:
        if not _missing(e):
            raise


def resize_pod(kube: Kube, namespace: str, name: str, containers: list[dict]) -> dict:
    """PATCH pods/resize: containers = [{"name", "resources"}, ...]."""
    return _json(kube.core.patch_namespaced_pod_resize(
        name, namespace, {"spec": {"containers": containers}}, _content_type=STRATEGIC_PATCH,
        _preload_content=False, _request_timeout=kube.timeout))


def bind_pod(kube: Kube, namespace: str, name: str, node: str, uid: str | None = None) -> None:
    """POST pods/binding, as kube-scheduler's DefaultBinder does."""
    body = {"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    # The server answers with a Status, not a Binding: read it raw.
    done(kube.core.create_namespaced_pod_binding(
        name, namespace, body, _preload_content=False, _request_timeout=kube.timeout))


def list_nodes(kube: Kube) -> list:
    return _json(kube.core.list_node(_preload_content=False,
                                     _request_timeout=kube.timeout)).get("items") or []


def get_webhook_config(kube: Kube, name: str) -> dict | None:
    return _read(lambda: kube.admission.read_validating_webhook_configuration(
        name, _preload_content=False, _request_timeout=kube.timeout))


def put_webhook_config(kube: Kube, body: dict) -> dict:
    """Replace it (body carries the resourceVersion it was read at: a
    concurrent change is a 409, and the caller retries)."""
    return _json(kube.admission.replace_validating_webhook_configuration(
        body["metadata"]["name"], body, _preload_content=False, _request_timeout=kube.timeout))


# ------------------------------------------------------------ events (coordinator/events.py)

def create_event(kube: Kube, namespace: str, body: dict) -> dict:
    return _json(kube.core.create_namespaced_event(
        namespace, body, _preload_content=False, _request_timeout=kube.timeout))


def patch_event(kube: Kube, namespace: str, name: str, patch: dict) -> dict:
    """Merge-patch an Event (count, lastTimestamp, message)."""
    return _json(kube.core.patch_namespaced_event(
        name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False,
        _request_timeout=kube.timeout))


def list_events(kube: Kube, namespace: str, field_selector: str | None = None) -> list:
    return _json(kube.core.list_namespaced_event(
        namespace, field_selector=field_selector, _preload_content=False,
        _request_timeout=kube.timeout)).get("items") or []


def get_generic_node(kube: Kube, name: str) -> dict | None:
    return _read(lambda: kube.custom.get_cluster_custom_object(
        GROUP, VERSION, PLURAL, name, _preload_content=False, _request_timeout=kube.timeout))


# ------------------------------------------------------------ DRA (GPUs)

def list_resource_slices(kube: Kube, node: str, driver: str) -> list:
    """The ResourceSlices of `driver` published for one node."""
    return _json(kube.resource.list_resource_slice(
        field_selector=f"spec.nodeName={node},spec.driver={driver}",
        _preload_content=False, _request_timeout=kube.timeout)).get("items") or []


def get_claim(kube: Kube, namespace: str, name: str) -> dict | None:
    return _read(lambda: kube.resource.read_namespaced_resource_claim(
        name, namespace, _preload_content=False, _request_timeout=kube.timeout))


def create_claim(kube: Kube, namespace: str, body: dict) -> dict:
    return _json(kube.resource.create_namespaced_resource_claim(
        namespace, body, _preload_content=False, _request_timeout=kube.timeout))


def put_claim_status(kube: Kube, claim: dict) -> dict:
    """Replace a claim's status (claim carries the resourceVersion it was read at)."""
    meta = claim["metadata"]
    return _json(kube.resource.replace_namespaced_resource_claim_status(
        meta["name"], meta["namespace"], claim, _preload_content=False,
        _request_timeout=kube.timeout))


def delete_claim(kube: Kube, namespace: str, name: str) -> None:
    try:
        done(kube.resource.delete_namespaced_resource_claim(
            name, namespace, _preload_content=False, _request_timeout=kube.timeout))
    except ApiException as e:
        if not _missing(e):
            raise
