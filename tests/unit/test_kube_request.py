"""Kube.request, the short request path of the calls made once per
admitted pod (a GenericNode's status, a created pod read back): what
reaches the server, errors as ApiException, RBAC refusals recorded, as the
generated client methods do.  A local plain-HTTP server plays the API
server."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes.client.exceptions import ApiException

from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import permissions


class Server:
    def __init__(self):
        self.seen, self.answers = [], {}
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.seen.append((self.command, self.path, dict(self.headers), body))
                status, obj = outer.answers.get(self.path.split("?")[0], (200, {"kind": "X"}))
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            do_GET = do_PATCH = do_POST = _any

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def api(tmp_path):
    srv = Server()
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": srv.url}}],
        "users": [{"name": "u", "user": {"token": "sekrit"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    yield srv, kube_calls.Kube(str(cfg))
    srv.httpd.shutdown()


def test_status_patch_is_a_merge_patch_with_the_token(api):
    srv, kube = api
    srv.answers["/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status"] = (200, {"status": {"x": 1}})
    kube.patch_generic_node("n1", status={"x": 1, "y": None})
    method, path, headers, body = srv.seen[-1]
    assert (method, path) == ("PATCH", "/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status")
    assert headers["Content-Type"] == kube_calls.MERGE_PATCH
    assert {k.lower(): v for k, v in headers.items()}["authorization"] == "Bearer sekrit"
    assert json.loads(body) == {"status": {"x": 1, "y": None}}


def test_spec_and_status(api):
    srv, kube = api
    kube.patch_generic_node("n1", spec={"alias": "s1"}, status={"x": 1})
    assert [(m, p, json.loads(b)) for m, p, _, b in srv.seen] == [
        ("PATCH", "/apis/pyk8sres.io/v1alpha1/genericnodes/n1", {"spec": {"alias": "s1"}}),
        ("PATCH", "/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status", {"status": {"x": 1}})]


def test_create_clears_field_owners_then_sets_the_status(api):
    """The field owners are cleared in a request of their own, on the
    object (not its status), before the status is written."""
    srv, kube = api
    kube.create_generic_node("n1", {"alias": "s1"}, {"x": 1})
    assert [(m, p, json.loads(b)) for m, p, _, b in srv.seen[1:]] == [
        ("PATCH", "/apis/pyk8sres.io/v1alpha1/genericnodes/n1",
         {"metadata": {"managedFields": [{}]}}),
        ("PATCH", "/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status", {"status": {"x": 1}})]
    assert srv.seen[0][:2] == ("POST", "/apis/pyk8sres.io/v1alpha1/genericnodes")
    assert srv.seen[1][2]["Content-Type"] == kube_calls.MERGE_PATCH


def test_get_pod(api):
    srv, kube = api
    srv.answers["/api/v1/namespaces/q/pods/p"] = (200, {"metadata": {"uid": "u"}})
    assert kube_calls.get_pod(kube, "q", "p") == {"metadata": {"uid": "u"}}
    assert srv.seen[-1][:2] == ("GET", "/api/v1/namespaces/q/pods/p")
    srv.answers["/api/v1/namespaces/q/pods/gone"] = (404, {"kind": "Status", "code": 404})
    assert kube_calls.get_pod(kube, "q", "gone") is None


def test_errors_are_api_exceptions_and_refusals_are_recorded(api, monkeypatch):
    srv, kube = api
    monkeypatch.setattr(permissions, "REFUSALS", permissions.Refusals())
    srv.answers["/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status"] = (
        403, {"kind": "Status", "code": 403, "reason": "Forbidden",
              "message": 'genericnodes.pyk8sres.io "n1" is forbidden: User "x" cannot patch '
                         'resource "genericnodes/status" in API group "pyk8sres.io" at the '
                         'cluster scope'})
    with pytest.raises(ApiException) as e:
        kube.patch_generic_node("n1", status={"x": 1})
    assert e.value.status == 403
    assert "genericnodes" in (permissions.REFUSALS.not_ready() or "")
    srv.answers["/api/v1/namespaces/q/pods/p"] = (500, {"kind": "Status", "code": 500})
    with pytest.raises(ApiException) as e:
        kube_calls.get_pod(kube, "q", "p")
    assert e.value.status == 500
    # Every connection went back to the pool: one more request still works.
    srv.answers["/api/v1/namespaces/q/pods/p"] = (200, {"metadata": {}})
    assert kube_calls.get_pod(kube, "q", "p") == {"metadata": {}}
