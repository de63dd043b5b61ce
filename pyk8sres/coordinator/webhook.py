"""The coordinator's admission webhook: HTTPS, AdmissionReview v1.

A pod is bound to (or created on, or resized on) a node shared with Slurm
only after Slurm's ledger reserved its requests there, keyed by the pod's
UID; otherwise the API server gets a denial naming the node and what Slurm
holds.  The rules are pure (pyk8sres/policy/admission.py); this module does
the I/O: the pod (a Binding carries no spec), the ledger, TLS, and keeping
the ValidatingWebhookConfiguration (the Helm chart's) current.

Fails closed: a ledger that does not answer, a pod we cannot read, anything
unexpected is a denial.  The API server's failurePolicy Fail covers this
process being down.  The HTTPS listener (webhook_server.py) bounds what
anyone who reaches the port can hold, so that the API server always gets in.

TLS out of the box (certs.py): a self-signed CA is made at start under
cert_dir (kept across restarts), it signs our serving certificate, and its
PEM goes into the configuration's caBundle.  The serving certificate is
renewed at 2/3 of its life; the CA too, in two steps (the new CA joins the
bundle first, serving certificates switch to it once the API server had
time to see it).  With cert-manager, point tls_cert_file/tls_key_file at
the mounted Secret (reloaded when it changes) and let its cainjector fill
caBundle.

    python -m pyk8sres.coordinator.webhook --kubeconfig K --ledger-socket S \
        --listen 127.0.0.1:8443 --url https://127.0.0.1:8443/validate --cert-dir D
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import logging
import signal
import ssl
import sys
import threading
import time

from . import certs
from . import metrics
from .config import (ConfigError, SyncConfig, WebhookConfig, check_webhook_config, gpu_identity,
                     load_config, load_webhook_config)
from .confirm import CreateConfirmer
from .events import Recorder
from .gpus import slurm_gpus
from .kube import (ApiException, Informer, Kube, get_pod, get_webhook_config, list_resource_slices,
                   put_webhook_config)
from .permissions import error_text
from .placeholder import Placeholders
from .scope import Scope, WorkersUnknown, slurm_names
from .slurm import Ledger, ShowFollower, ledger_socket_path
from .webhook_server import HEALTH_NAME, Limits, WebhookServer  # noqa: F401 (callers' names)
from ..policy import admission
from ..policy import gpus
from ..policy.events import refusal_reason

log = logging.getLogger("pyk8sres.coordinator.webhook")

# ----------------------------------------------------------------- admission

class Admission:
    """One AdmissionReview in, one out.  kube: kube.Kube; ledger: slurm.Ledger;
    events: an events.Recorder (None: no Events); confirmer: a
    confirm.CreateConfirmer that reads reserved creates back (None: one with
    the defaults)."""

    def __init__(self, kube, ledger, scope: Scope, events=None, confirmer=None):
        self.kube, self.ledger, self.scope, self.events = kube, ledger, scope, events
        self.confirmer = confirmer if confirmer is not None else CreateConfirmer(kube, ledger)
        self.ident = gpu_identity(scope.cfg)
        self.legacy = tuple(scope.cfg.legacy_gpu_resources)
        self.whole_node = scope.cfg.legacy_gpu == "whole-node"

    def decide(self, request: dict) -> admission.Allow | admission.Deny:
        return self._decide(request)[0]

    def _decide(self, request: dict):
        """(decision, the Target or None, the pod or None)."""
        if (request.get("resource") or {}).get("resource") == "resourceclaims":
            return self._decide_claim(request), None, None
        t = admission.classify(request)
        if not isinstance(t, admission.Target):
            return t, None, None
        try:
            snode, unknown = self.scope.slurm_node(t.node), None
        except WorkersUnknown as e:
            snode, unknown = None, str(e)
        pod = None
        if t.pod is None and (snode is not None or unknown):
            try:
                pod = get_pod(self.kube, t.namespace, t.pod_name)
            except Exception as e:
                return admission.Deny(f"pyk8sres: cannot read pod {t.namespace}/{t.pod_name} "
                              f"({error_text(e)}); "
                              "failing closed", "pod_unreadable"), t, None
        d = admission.plan(t, pod, snode, self.scope.exempt, unknown)
        if not isinstance(d, admission.Reserve):
            return d, t, pod
        found = gpus.legacy_requests(t.pod if t.pod is not None else pod or {}, self.legacy)
        whole: tuple = ()
        if found and self.whole_node:
            whole = self._whole_node(t, d, found)
            if isinstance(whole, admission.Deny):
                return whole, t, pod
        elif found and not d.static:
            return gpus.legacy_refusal(t.namespace, t.pod_name, t.node, found), t, pod
        creates = t.op == "create" and not d.static
        if creates and (left := self.confirmer.blocked_for(t.namespace)) > 0:
            return admission.phantom_refusal(t, left), t, pod
        try:
            reply = self.ledger.reserve(d.slurm_node, d.key, d.cpu_m, d.mem_bytes,
                                        **({"gpus": whole} if whole else {}))
        except Exception as e:   # LedgerError (unreachable, malformed reply) or anything else
            return admission.Deny(f"pyk8sres: Slurm's ledger did not answer for node {t.node} ({e}); "
                          "no pod is placed on a shared node until it does",
                          "ledger_unreachable"), t, pod
        decision = admission.verdict(t, d, reply)
        if t.op in ("create", "bind") and not d.static and isinstance(decision, admission.Allow):
            # Quota or the store may still refuse it: read it back shortly.
            self.confirmer.track(t.namespace, t.pod_name, d.key, d.slurm_node, t.node,
                                 create=creates)
        return decision, t, pod

    def _whole_node(self, t: admission.Target, d: admission.Reserve, found: list[str]):
        """legacy_gpu = "whole-node": every GPU index of the node (a static
        pod runs whatever we answer: it gets what can be read), or a Deny."""
        try:
            shown = self.ledger.show(d.slurm_node)
            if not shown.get("ok"):
                raise RuntimeError(f"ledger show: {shown.get('error')}")
        except Exception as e:
            if d.static:
                return ()
            return admission.Deny(f"pyk8sres: Slurm's ledger did not answer for node {t.node} "
                                  f"({e}); no GPU is given on a shared node until it does",
                                  "ledger_unreachable")
        count, _, _ = slurm_gpus((shown.get("nodes") or {}).get(d.slurm_node))
        got = gpus.whole_node_gpus(t.namespace, t.pod_name, t.node, found, count)
        return () if d.static and isinstance(got, admission.Deny) else got

    def _decide_claim(self, request: dict):
        """A claim's allocation on a shared node: its devices' Slurm indices
        reserved in the ledger (claim:<uid>) before the API server stores it."""
        t = gpus.classify_claim(request, self.ident, self.scope.cfg.placeholder_namespace)
        if not isinstance(t, gpus.ClaimTarget):
            return t
        snode = unknown = node_gpus = None
        if t.node:
            try:
                snode = self.scope.slurm_node(t.node)
            except WorkersUnknown as e:
                unknown = str(e)
        if snode is not None:
            try:
                node_gpus = self._node_gpus(t.node, snode)
            except Exception as e:
                return admission.Deny(f"pyk8sres: cannot read the GPUs of node {t.node} "
                                      f"({error_text(e)}); failing closed", "ledger_unreachable")
        d = gpus.claim_plan(t, snode, node_gpus, unknown)
        if not isinstance(d, gpus.GpuReserve):
            return d
        try:
            reply = self.ledger.reserve(d.slurm_node, d.key, 0, 0, gpus=list(d.gpus))
        except Exception as e:
            return admission.Deny(f"pyk8sres: Slurm's ledger did not answer for node {t.node} "
                                  f"({e}); no GPU is given on a shared node until it does",
                                  "ledger_unreachable")
        return gpus.claim_verdict(t, d, reply)

    def _node_gpus(self, k8s_node: str, slurm_node: str):
        """The node's devices mapped onto Slurm's indices, read now: its
        ResourceSlices and Slurm's gpu count (the ledger's show)."""
        slices = list_resource_slices(self.kube, k8s_node, self.ident.driver)
        shown = self.ledger.show(slurm_node)
        if not shown.get("ok"):
            raise RuntimeError(f"ledger show: {shown.get('error')}")
        count, _, problem = slurm_gpus((shown.get("nodes") or {}).get(slurm_node))
        return gpus.node_gpus(slices, k8s_node, slurm_node, count, self.ident, problem)

    def review(self, body: dict) -> dict:
        t0 = time.perf_counter()
        request = body.get("request") or {}
        target = pod = None
        try:
            decision, target, pod = self._decide(request)
        except Exception as e:
            log.exception("admission failed")
            decision = admission.Deny(f"pyk8sres: internal error ({type(e).__name__}: {e}); failing closed")
        if isinstance(decision, admission.Deny):
            log.info("denied %s %s/%s: %s", request.get("operation"), request.get("namespace"),
                     request.get("name"), decision.message)
            if target is not None and not target.dry_run:
                self._refused(target, pod, decision)
        else:
            log.debug("allowed %s %s/%s: %s", request.get("operation"), request.get("namespace"),
                      request.get("name"), decision.reason)
        answer = admission.review_response(request, decision)
        metrics.admission("deny" if isinstance(decision, admission.Deny) else "allow", decision.code,
                          time.perf_counter() - t0)
        return answer

    def _refused(self, t: admission.Target, pod, decision: admission.Deny) -> None:
        """The Event on the pod (queued, posted by the recorder's thread).
        The GenericNode's LedgerUnreachable is the sync daemon's."""
        if self.events is None:
            return
        # A refused create leaves no pod (each attempt had a UID of its own):
        # name the pod only, so attempts add up in one Event.
        p = pod if t.op != "create" else None
        uid = ((p or {}).get("metadata") or {}).get("uid")
        self.events.pod(t.namespace, t.pod_name, uid, refusal_reason(decision.code),
                        decision.message)


# ----------------------------------------------------------------- the daemon

def server_limits(wcfg: WebhookConfig) -> Limits:
    """What the HTTPS listener bounds (webhook_server.py says how)."""
    return Limits(handshake_timeout=wcfg.handshake_timeout,
                  request_timeout=wcfg.request_timeout, idle_timeout=wcfg.idle_timeout,
                  max_pending=wcfg.max_pending_connections,
                  max_anonymous=wcfg.max_anonymous_connections,
                  max_authenticated=wcfg.max_api_server_connections,
                  stall_seconds=wcfg.listener_stall_seconds)


class Webhook:
    """The webhook server plus its refresher (shared nodes, certificates,
    configuration).  start() returns once it serves; stop() ends both."""

    def __init__(self, wcfg: WebhookConfig, scfg: SyncConfig, kube, ledger, events=None):
        check_webhook_config(wcfg, scfg)
        self.wcfg, self.kube, self.ledger = wcfg, kube, ledger
        self.scope = Scope(scfg)
        host, _, port = wcfg.listen.rpartition(":")
        self.addr = (host or "0.0.0.0", int(port))
        self.certs, cert, key = certs.serving(wcfg)
        client_ca = certs.client_ca(wcfg)
        self.confirmer = CreateConfirmer(kube, ledger, after=wcfg.confirm_create_seconds,
                                         hold=wcfg.phantom_hold_seconds)
        self.server = WebhookServer(self.addr, Admission(kube, ledger, self.scope, events,
                                                         self.confirmer),
                                    cert, key, client_ca, wcfg.client_names,
                                    server_limits(wcfg))
        self.stop_event = threading.Event()
        self.missing: str | None = None   # why the configuration cannot be kept current
        self.follower = ShowFollower(ledger)   # Slurm's nodes, asking only for changes
        self.threads: list[threading.Thread] = []
        self.listener: threading.Thread | None = None

    def refresh(self) -> None:
        """One pass: Slurm's nodes, certificates, configuration (the nodes
        Informer keeps the Kubernetes nodes current)."""
        try:
            shown, changed = self.follower.refresh()
            if changed is None or changed:
                self.scope.update(slurm_names=slurm_names(shown))
        except Exception as e:
            log.warning("ledger show failed: %s (shared node list kept)", e)
        if self.certs is not None and self.certs.ensure():
            log.info("webhook certificates renewed")
        self.server.reload_if_changed()
        self.publish()

    def publish(self) -> None:
        """Write caBundle / shared-node condition / clientConfig if they differ.
        The configuration itself is the admin's (the Helm chart's): this
        process may read and update that one object, never create one."""
        bundle = (base64.b64encode(self.certs.bundle()).decode()
                  if self.certs is not None else None)
        client_config = ({"url": self.wcfg.url} if self.wcfg.url else None)
        for _ in range(3):   # 409: someone else wrote it; read again
            try:
                current = get_webhook_config(self.kube, self.wcfg.configuration)
                if current is None:
                    self.missing = (f"ValidatingWebhookConfiguration {self.wcfg.configuration} "
                                    "does not exist (install the Helm chart)")
                    log.warning("%s", self.missing)
                    return
                self.missing = None
                new = admission.updated_webhook_config(current, self.wcfg.webhook_name,
                                               self.scope.unshared(), bundle, client_config)
                if new is None:
                    return
                put_webhook_config(self.kube, new)
                log.info("webhook configuration %s updated", self.wcfg.configuration)
                return
            except ApiException as e:
                if e.status != 409:
                    self.missing = (f"cannot update ValidatingWebhookConfiguration "
                                    f"{self.wcfg.configuration}: {e.status} {e.reason}")
                    log.warning("%s", self.missing)
                    return

    def _refresher(self) -> None:
        """A full refresh every refresh_seconds; in between, the scope is
        published as soon as a node joins, leaves or is relabelled, or
        Slurm's node list changes (the placeholders read it every period)."""
        due = time.monotonic() + self.wcfg.refresh_seconds
        while True:
            self.scope.changed.wait(max(0.0, due - time.monotonic()))
            if self.stop_event.is_set():
                return
            self.scope.changed.clear()
            self._beat()
            try:
                if time.monotonic() >= due:
                    due = time.monotonic() + self.wcfg.refresh_seconds
                    self.refresh()
                else:
                    self.publish()
            except Exception:
                log.exception("webhook refresh failed")

    def _beat(self) -> None:
        metrics.HEALTH.beat("webhook-refresh", max(60.0, 10 * self.wcfg.refresh_seconds))

    def _nodes_known(self) -> str | None:
        if self.missing:
            return self.missing
        if not self.scope.nodes_listed:
            return "Kubernetes nodes not listed yet"
        if self.scope.slurm_names is None:
            return "Slurm's nodes not known yet (no ledger show answered)"
        if not self.scope.workers_known():
            sel = self.scope.workers_sel
            return (f"Slurm's worker pods (namespace {sel.namespace}) not known now "
                    "(not listed yet, or their watch is broken)")
        return None

    def start(self) -> "Webhook":
        self._beat()
        metrics.HEALTH.check("nodes", self._nodes_known)
        metrics.HEALTH.check("ledger", metrics.ledger_check(
            3 * self.wcfg.refresh_seconds + 2 * self.wcfg.ledger_timeout))
        # The listener beats from its own loop; this first beat makes a loop
        # that never turns count as stuck too.
        self.server.beat()
        t = threading.Thread(target=self.server.serve_forever, name="webhook-listener",
                             daemon=True)
        t.start()
        self.threads.append(t)
        self.listener = t
        # Not joined on stop: it only feeds the scope, and may sit in a watch.
        informer = Informer(self.kube, "nodes", self.scope, stop=self.stop_event)
        self.scope.stale_after = informer.stale_after()
        informer.start()
        if self.scope.workers_sel is not None:
            # Slurm's worker pods map the nodes they run on: only their
            # namespace is read (and granted: the chart's Role there).
            Informer(self.kube, "pods", self.scope, stop=self.stop_event,
                     namespace=self.scope.workers_sel.namespace).start()
        # The first configuration names the shared nodes: wait (briefly) for the lists.
        deadline = time.monotonic() + self.wcfg.refresh_seconds
        while not (self.scope.nodes_listed and (self.scope.workers_sel is None
                                                or self.scope.workers_listed)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        self.refresh()
        r = threading.Thread(target=self._refresher, name="webhook-refresh", daemon=True)
        r.start()
        self.threads.append(r)
        return self

    def stop(self) -> None:
        """Stop serving and refreshing; on return nothing of ours writes any
        more (a refresh still running could otherwise re-publish the
        configuration just after its owner deleted it)."""
        self.stop_event.set()
        self.scope.changed.set()
        self.server.close()
        self.confirmer.stop()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(30)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pyk8sres-webhook", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="coordinator config (TOML: sync settings; [webhook] table)")
    p.add_argument("--kubeconfig")
    p.add_argument("--ledger-socket")
    p.add_argument("--listen")
    p.add_argument("--url", help="clientConfig.url to publish (else the manifest's service)")
    p.add_argument("--cert-dir")
    p.add_argument("--client-ca", help="CA of the API server's client certificate (required)")
    p.add_argument("--client-name", action="append",
                   help="name (CN or DNS SAN) the API server's certificate carries "
                        "(repeatable; default kube-apiserver)")
    p.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="plain HTTP /metrics, /healthz, /readyz (default 127.0.0.1:9711; "
                        "'' for none)")
    p.add_argument("--no-events", action="store_false", dest="events", default=None,
                   help="post no Kubernetes Events")
    p.add_argument("--no-placeholders", action="store_false", dest="placeholders",
                   help="do not keep slurm-share-<node> placeholder pods")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    scfg = load_config(args.config)
    # The sync settings may sit in a [sync] table next to [webhook].
    wcfg = load_webhook_config(args.config)
    over = {k: v for k, v in (("ledger_socket", args.ledger_socket), ("listen", args.listen),
                              ("url", args.url), ("cert_dir", args.cert_dir),
                              ("client_ca_file", args.client_ca),
                              ("client_names", tuple(args.client_name or ()))) if v}
    over.update({k: v for k, v in (("metrics_address", args.metrics_address),
                                   ("events", args.events)) if v is not None})
    wcfg = dataclasses.replace(wcfg, **over)
    if not wcfg.ledger_socket:
        wcfg = dataclasses.replace(wcfg, ledger_socket=scfg.ledger_socket or ledger_socket_path())
    kube = Kube(args.kubeconfig or scfg.kubeconfig, scfg.context, timeout=scfg.request_timeout)
    if wcfg.metrics_address:
        try:
            metrics.serve(wcfg.metrics_address)
        except (OSError, ValueError) as e:
            print(f"pyk8sres webhook: metrics address {wcfg.metrics_address}: {e}",
                  file=sys.stderr)
            return 2
    events = None
    if wcfg.events:
        events = Recorder(kube, "pyk8sres-webhook").start()
    try:
        hook = Webhook(wcfg, scfg, kube, Ledger(wcfg.ledger_socket, timeout=wcfg.ledger_timeout),
                       events).start()
    except (ConfigError, OSError, ssl.SSLError) as e:
        print(f"pyk8sres webhook: {e}", file=sys.stderr)
        return 2
    log.info("admission webhook serving on https://%s:%d", *hook.addr)
    placeholders = None
    if args.placeholders:
        # Its own ledger connection: its show() calls never queue admissions.
        placeholders = Placeholders(kube, Ledger(wcfg.ledger_socket, timeout=wcfg.ledger_timeout),
                                    hook.scope, scfg.placeholder_namespace).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # A listener that died cannot come back in this process: exit, so that
    # systemd (Restart=always) or the kubelet starts a fresh one.  A stuck
    # one fails /healthz (the kubelet's liveness probe).
    code = 0
    while not stop.wait(1.0):
        if not hook.listener.is_alive():
            log.critical("the HTTPS listener stopped; exiting")
            code = 1
            break
    if placeholders is not None:
        placeholders.stop()
    hook.stop()
    if events is not None:
        events.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
