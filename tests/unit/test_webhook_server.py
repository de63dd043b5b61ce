"""The webhook's HTTPS listener (pyk8sres/coordinator/webhook_server.py) over
real TLS on loopback: its caps and clocks, keep-alive for the API server's
certificate, and /healthz covering the listener itself."""

import http.client
import json
import socket
import ssl
import threading
import time

import pytest

from pyk8sres.coordinator import metrics
from pyk8sres.coordinator import webhook_server
from pyk8sres.coordinator.certs import Certs
from pyk8sres.testbed import pki

API_SERVER = "kube-apiserver-webhook-client"


class Echo:
    def __init__(self):
        self.calls = 0

    def review(self, body):
        self.calls += 1
        return {"response": {"uid": body["request"]["uid"], "allowed": True}}


@pytest.fixture
def tls(tmp_path):
    """(serving Certs, client CA file, the API server's cert/key, a stranger's)."""
    certs = Certs(str(tmp_path / "serving"), ["localhost"], ["127.0.0.1"], 1, 10, 60)
    certs.ensure()
    ca = pki.Authority(str(tmp_path / "pki"), "client-ca", "client CA")
    api = ca.issue("apiserver", API_SERVER)
    other = ca.issue("someone", "someone")
    return certs, ca.cert_file, api, other


def start(tls, **limits):
    certs, client_ca, _, _ = tls
    srv = webhook_server.WebhookServer(("127.0.0.1", 0), Echo(), certs.cert_file, certs.key_file,
                                       client_ca, [API_SERVER], webhook_server.Limits(**limits))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv, t


def client_ctx(tls, cert=None):
    certs = tls[0]
    ctx = ssl.create_default_context(cadata=certs.bundle().decode())
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx


def review(conn):
    body = json.dumps({"request": {"uid": "u1"}})
    conn.request("POST", "/validate", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_fit_keeps_every_class_under_the_descriptor_limit():
    big = webhook_server.fit(webhook_server.Limits(), 1 << 20)
    assert (big.max_pending, big.max_anonymous, big.max_authenticated) == (1024, 32, 256)
    for nofile in (64, 256, 1024, 4096):
        f = webhook_server.fit(webhook_server.Limits(), nofile)
        total = f.max_pending + f.max_anonymous + f.max_authenticated
        reserved = webhook_server.RESERVED_FDS
        assert total + reserved <= max(nofile, reserved + 24), (nofile, f)
        assert f.max_authenticated >= 4 and f.max_pending >= 4


def test_api_server_keeps_alive_strangers_get_one_request(tls):
    srv, _ = start(tls)
    try:
        port = srv.server_address[1]
        api = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls, tls[2]))
        for _ in range(3):                         # one connection, three reviews
            assert review(api) == (200, {"response": {"uid": "u1", "allowed": True}})
        assert srv.admission.calls == 3 and len(srv.authenticated) == 1
        api.close()
        # No certificate: refused, and the connection is closed after one request.
        anon = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls))
        status, body = review(anon)
        assert status == 401 and "no client certificate" in body["error"]
        other = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls, tls[3]))
        status, body = review(other)
        assert status == 403 and "someone" in body["error"]
        assert srv.admission.calls == 3
        anon2 = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls))
        anon2.request("GET", "/healthz")
        r = anon2.getresponse()
        assert r.getheader("Connection") == "close"
        r.read()
        for c in (anon, other, anon2):
            c.close()
    finally:
        srv.close()


def test_idle_and_dribbling_callers_are_cut_and_never_crowd_out_the_api_server(tls):
    """Caps of 8 handshakes and 2 anonymous requests, short clocks: 50 idle
    TCP connections, 5 dribbled ClientHellos and 4 dribbled HTTP headers are
    cut (oldest first, or at their deadline), while the API server's new
    connection is served at once."""
    evicted = metrics.REGISTRY.get_sample_value("pyk8sres_webhook_connections_cut_total",
                                                {"reason": "evicted_pending"}) or 0
    srv, _ = start(tls, max_pending=8, max_anonymous=2, handshake_timeout=1.0,
                   request_timeout=1.0)
    port = srv.server_address[1]
    held = []
    try:
        for _ in range(50):
            held.append(socket.create_connection(("127.0.0.1", port)))
        hello = []
        for _ in range(5):                        # a TLS record header, then nothing
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"\x16")
            hello.append(s)
        dribblers = []
        for _ in range(4):                        # TLS done, headers byte by byte
            s = client_ctx(tls).wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                            server_hostname="127.0.0.1")
            s.sendall(b"G")
            dribblers.append(s)
        held += hello + dribblers
        assert wait_until(lambda: srv.counts["evicted_pending"] >= 50 - 8
                          and srv.counts["evicted_anonymous"] >= 2)
        assert len(srv.pending) <= 8 and len(srv.anonymous) <= 2
        assert metrics.REGISTRY.get_sample_value("pyk8sres_webhook_connections_cut_total",
                                                 {"reason": "evicted_pending"}) >= evicted + 42
        t0 = time.monotonic()
        api = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls, tls[2]),
                                          timeout=5)
        assert review(api)[0] == 200
        assert time.monotonic() - t0 < 0.5
        for s in dribblers[-2:]:                 # the two left are cut at their deadline
            s.sendall(b"E")
        assert wait_until(lambda: not srv.anonymous and not srv.pending, 3)
        assert srv.counts["expired_anonymous"] >= 1
        for s in dribblers:
            s.settimeout(2)
            assert s.recv(1) == b""              # closed by the server
        assert review(api)[0] == 200             # the API server's stays alive
        assert len(srv.authenticated) == 1
    finally:
        for s in held:
            s.close()
        srv.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_healthz_covers_the_listener(tls, monkeypatch):
    """A live process whose listener is stuck or dead reports unhealthy."""
    metrics.HEALTH.beats.clear()
    srv, t = start(tls, stall_seconds=0.3)
    try:
        assert wait_until(lambda: webhook_server.HEALTH_NAME in metrics.HEALTH.beats)
        time.sleep(0.5)
        assert metrics.probe("/healthz") == (200, b"ok\n")      # idle, still turning
        # Stuck: the loop blocks (as on a wedged lock) and turns no more.
        stuck = threading.Event()
        real = srv.sel.select
        monkeypatch.setattr(srv.sel, "select", lambda timeout=None: (stuck.wait(), real(0))[1])
        srv._wake_w.send(b"x")
        assert wait_until(lambda: metrics.probe("/healthz")[0] == 503, 3)
        assert webhook_server.HEALTH_NAME in metrics.probe("/healthz")[1].decode()
        monkeypatch.setattr(srv.sel, "select", real)
        stuck.set()
        assert wait_until(lambda: metrics.probe("/healthz")[0] == 200, 3)
        # Dead: the loop thread ends on an error of its own.
        monkeypatch.setattr(srv.sel, "select", lambda timeout=None: 1 / 0)
        srv._wake_w.send(b"x")
        t.join(3)
        assert not t.is_alive()
        assert wait_until(lambda: metrics.probe("/healthz")[0] == 503, 3)
    finally:
        monkeypatch.undo()
        srv.close()
        metrics.HEALTH.beats.clear()


def test_close_drops_kept_alive_connections(tls):
    srv, t = start(tls)
    api = http.client.HTTPSConnection("127.0.0.1", srv.server_address[1],
                                      context=client_ctx(tls, tls[2]), timeout=5)
    assert review(api)[0] == 200
    srv.close()
    t.join(5)
    assert not t.is_alive()
    # stopped on purpose: not a stall
    assert webhook_server.HEALTH_NAME not in metrics.HEALTH.beats
    with pytest.raises((OSError, http.client.HTTPException)):
        review(api)
    api.close()
    srv.close()                                   # twice is harmless


def test_the_callers_certificate_is_checked_once_per_connection(tls):
    """Reviews on one kept-alive connection: refuse_caller once for the
    handshake, once for the connection's first request, never again."""
    srv, _ = start(tls)
    asked = []
    refuse = srv.refuse_caller
    srv.refuse_caller = lambda cert: asked.append(cert) or refuse(cert)
    try:
        port = srv.server_address[1]
        api = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls, tls[2]))
        for _ in range(4):
            assert review(api)[0] == 200
        assert srv.admission.calls == 4 and len(asked) == 2
        api.close()
        other = http.client.HTTPSConnection("127.0.0.1", port, context=client_ctx(tls, tls[3]))
        assert review(other)[0] == 403        # another connection: checked again, refused
        assert srv.admission.calls == 4
        other.close()
    finally:
        srv.close()
