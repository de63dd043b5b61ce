"""The admission webhook's HTTPS listener, built so that nobody who can
reach its port can stop admission.

Every connection is in one of three classes, each with a cap and a clock:

* pending: accepted, TLS handshake not finished.  One thread (the
  listener, `webhook-listener`) accepts every connection at once and runs
  every handshake non-blocking in one selector, each within
  handshake_timeout.  At most max_pending are pending; one more closes the
  oldest.  An idle TCP connection or a ClientHello dribbled byte by byte
  costs one descriptor for a bounded time and never a thread, and a new
  handshake -- the API server's after its restart, or a second API
  server's -- always gets its turn: it is the newest.
* authenticated: the handshake is done and the client certificate names
  the API server (refuse_caller; the TLS layer checked its CA).  A thread
  of its own, kept alive between reviews (the API server reuses its
  connections) until it idles idle_timeout.  At most max_authenticated;
  only holders of the API server's certificate can fill them.
* anonymous: any other finished handshake (no certificate: a probe, or
  anyone).  One request, which must arrive whole within request_timeout
  (headers dribbled byte by byte are cut at the deadline), then closed.
  At most max_anonymous; one more cuts the oldest.

Descriptors: the soft RLIMIT_NOFILE is raised to the hard one at start and
the caps are fitted under it (RESERVED_FDS kept for the rest of the
process), so accept() never fails for want of a descriptor while every
class is full.  Health: the listener beats "webhook-listener" every turn
(at least once a second); a dead or stuck listener makes /healthz fail.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import resource
import selectors
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler

from . import metrics

log = logging.getLogger("pyk8sres.coordinator.webhook")

MAX_REVIEW_BYTES = 8 << 20    # an AdmissionReview of the largest pod the API server takes (3 MB) twice
RESERVED_FDS = 128            # the ledger, the API server client, certificates, logs, metrics
HEALTH_NAME = "webhook-listener"


@dataclasses.dataclass(frozen=True)
class Limits:
    handshake_timeout: float = 5.0    # accept to finished TLS handshake
    request_timeout: float = 5.0      # an anonymous connection's one request, whole
    idle_timeout: float = 120.0       # the API server's kept-alive connection between reviews
    max_pending: int = 1024
    max_anonymous: int = 32
    max_authenticated: int = 256
    backlog: int = 1024
    stall_seconds: float = 30.0       # /healthz fails once the listener has not turned this long


def fit(limits: Limits, nofile: int) -> Limits:
    """The caps, shrunk (pending first, then the others to their half) so
    that every class full still leaves RESERVED_FDS of `nofile` free."""
    budget = max(nofile - RESERVED_FDS, 16)
    auth = min(limits.max_authenticated, max(budget // 4, 4))
    anon = min(limits.max_anonymous, max(budget // 8, 2))
    pending = min(limits.max_pending, max(budget - auth - anon, 4))
    return dataclasses.replace(limits, max_pending=pending, max_anonymous=anon,
                               max_authenticated=auth)


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, e)
    return soft


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: the API server reuses connections
    server: "WebhookServer"
    anonymous = False
    caller_checked = False
    caller_refused: tuple[int, str] | None = None

    def handle(self) -> None:
        if self.anonymous:          # one request, no keep-alive
            self.handle_one_request()
        else:
            super().handle()

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if self.anonymous:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _refused(self) -> tuple[int, str] | None:
        """refuse_caller of this connection's certificate, asked once: it
        cannot change within a TLS connection, and the API server sends
        every review on the few it keeps alive."""
        if not self.caller_checked:
            self.caller_refused = self.server.refuse_caller(self.connection.getpeercert())
            self.caller_checked = True
        return self.caller_refused

    def do_POST(self) -> None:
        refused = self._refused()
        if refused:
            code, why = refused
            log.warning("refused a review from %s: %s", self.client_address[0], why)
            metrics.admission("deny", "unauthenticated", 0.0)
            self.close_connection = True
            self._send(code, json.dumps({"error": why}).encode())
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_REVIEW_BYTES:
                raise ValueError(f"{n} bytes")
            body = json.loads(self.rfile.read(n))
        except (ValueError, OSError):
            self._send(400, b'{"error":"want an AdmissionReview"}')
            return
        self._send(200, json.dumps(self.server.admission.review(body)).encode())

    def do_GET(self) -> None:
        code, body = metrics.probe(self.path) or (404, b"not found\n")
        self._send(code, body, "text/plain; charset=utf-8")

    def log_message(self, fmt, *args) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)


class _Anonymous(_Handler):
    anonymous = True


@dataclasses.dataclass(eq=False)
class _Conn:
    tls: ssl.SSLSocket
    addr: tuple
    deadline: float
    closed: bool = False


class WebhookServer:
    """HTTPS, authenticated by client certificate: a certificate from
    another CA fails the handshake; a review without one, or from a name
    not in client_names, is refused (401/403) before it is read.  Probes
    (GET /healthz, /readyz) need no certificate.  The module's docstring
    says how connections are bounded."""

    def __init__(self, addr, admission, cert_file: str, key_file: str,
                 client_ca_file: str, client_names, limits: Limits | None = None):
        self.admission = admission
        self.cert_file, self.key_file = cert_file, key_file
        self.client_names = frozenset(client_names)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ctx.verify_mode = ssl.CERT_OPTIONAL
        self.ctx.load_verify_locations(cafile=client_ca_file)
        self.reload()
        self.limits = fit(limits or Limits(), raise_nofile())
        self.sock = socket.create_server(addr, backlog=self.limits.backlog)
        self.sock.setblocking(False)
        self.server_address = self.sock.getsockname()
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.pending: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self.anonymous: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self.authenticated: set[_Conn] = set()
        self.lock = threading.Lock()      # anonymous, authenticated (handler threads)
        self.closing = False
        self.stopped = threading.Event()
        self.accept_paused_until = 0.0
        self.counts = collections.Counter()   # evicted_pending, evicted_anonymous, ...

    # ------------------------------------------------------------- callers

    def reload(self) -> None:
        """Serve the certificate files' current content to new connections."""
        self.ctx.load_cert_chain(self.cert_file, self.key_file)
        self.loaded = (os.stat(self.cert_file).st_mtime_ns, os.stat(self.key_file).st_mtime_ns)

    def reload_if_changed(self) -> None:
        try:
            now = (os.stat(self.cert_file).st_mtime_ns, os.stat(self.key_file).st_mtime_ns)
        except OSError:
            return
        if now != self.loaded:
            self.reload()
            log.info("serving certificate reloaded")

    def refuse_caller(self, cert: dict | None) -> tuple[int, str] | None:
        """(HTTP status, why) for a caller that may not ask for reviews, else
        None.  The TLS layer already checked the certificate against the CA."""
        if not cert:
            return 401, "no client certificate: only the API server may call this webhook"
        names = {v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"}
        names |= {v for k, v in cert.get("subjectAltName", ()) if k == "DNS"}
        if names & self.client_names:
            return None
        return 403, (f"client certificate of {', '.join(sorted(names)) or 'no name'} is not "
                     f"the API server's ({', '.join(sorted(self.client_names))})")

    # ------------------------------------------------------------- the listener

    def beat(self) -> None:
        metrics.HEALTH.beat(HEALTH_NAME, self.limits.stall_seconds)

    def serve_forever(self) -> None:
        """The listener loop (its own thread); returns after close()."""
        try:
            self.sel.register(self.sock, selectors.EVENT_READ, None)
            self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            while not self.closing:
                self.beat()
                now = time.monotonic()
                for key, events in self.sel.select(self._wait(now)):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        self._handshake(key.data)
                self._expire(time.monotonic())
                self._export()
        finally:
            for c in list(self.pending.values()):
                self._close_pending(c)
            self.stopped.set()

    def _wait(self, now: float) -> float:
        """Until the oldest deadline (pending or anonymous), at most 1 s
        (and a third of stall_seconds: an idle listener still beats)."""
        wait = min(1.0, self.limits.stall_seconds / 3)
        if self.accept_paused_until:
            wait = min(wait, self.accept_paused_until - now)
        for c in self.pending.values():     # oldest first: its deadline is the earliest
            wait = min(wait, c.deadline - now)
            break
        with self.lock:
            for c in self.anonymous:
                wait = min(wait, c.deadline - now)
                break
        return max(wait, 0.0)

    def _cut_count(self, reason: str) -> None:
        self.counts[reason] += 1
        metrics.WEBHOOK_CUT.labels(reason).inc()

    def _export(self) -> None:
        metrics.WEBHOOK_CONNECTIONS.labels("pending").set(len(self.pending))
        metrics.WEBHOOK_CONNECTIONS.labels("authenticated").set(len(self.authenticated))
        metrics.WEBHOOK_CONNECTIONS.labels("anonymous").set(len(self.anonymous))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(512):
                pass
        except (BlockingIOError, OSError):
            pass

    def _accept(self) -> None:
        for _ in range(256):          # a burst, then the handshakes get a turn
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:      # EMFILE/ENFILE/ENOBUFS: never spin on the backlog
                log.warning("webhook accept failed: %s; pausing 0.1 s", e)
                self.sel.unregister(self.sock)
                self.accept_paused_until = time.monotonic() + 0.1
                return
            try:
                conn.setblocking(False)
                # Headers and body go out in separate writes: without NODELAY,
                # Nagle plus the client's delayed ACK add ~40 ms to each answer.
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tls = self.ctx.wrap_socket(conn, server_side=True,
                                           do_handshake_on_connect=False)
            except (OSError, ValueError):
                conn.close()
                continue
            while len(self.pending) >= self.limits.max_pending:
                _, oldest = self.pending.popitem(last=False)
                self._cut_count("evicted_pending")
                self._close_pending(oldest, popped=True)
            c = _Conn(tls, addr, time.monotonic() + self.limits.handshake_timeout)
            self.pending[tls.fileno()] = c
            self.sel.register(tls, selectors.EVENT_READ, c)

    def _close_pending(self, c: _Conn, popped: bool = False) -> None:
        if not popped:
            self.pending.pop(c.tls.fileno(), None)
        try:
            self.sel.unregister(c.tls)
        except (KeyError, ValueError):
            pass
        c.tls.close()

    def _handshake(self, c: _Conn) -> None:
        try:
            c.tls.do_handshake()
        except ssl.SSLWantReadError:
            self.sel.modify(c.tls, selectors.EVENT_READ, c)
            return
        except ssl.SSLWantWriteError:
            self.sel.modify(c.tls, selectors.EVENT_WRITE, c)
            return
        except (ssl.SSLError, OSError) as e:
            log.debug("TLS handshake from %s failed: %s", c.addr, e)
            self._close_pending(c)
            return
        self.pending.pop(c.tls.fileno(), None)
        self.sel.unregister(c.tls)
        try:
            authenticated = self.refuse_caller(c.tls.getpeercert()) is None
        except (ValueError, OSError):
            c.tls.close()
            return
        self._hand_over(c, authenticated)

    def _hand_over(self, c: _Conn, authenticated: bool) -> None:
        """A thread for the finished handshake, within its class's cap."""
        limits = self.limits
        with self.lock:
            if authenticated:
                if len(self.authenticated) >= limits.max_authenticated:
                    self._cut_count("refused_authenticated")
                    log.warning("webhook: %d connections with the API server's certificate "
                                "open already (the limit); closing one more from %s",
                                limits.max_authenticated, c.addr[0])
                    c.tls.close()
                    return
                self.authenticated.add(c)
            else:
                while len(self.anonymous) >= limits.max_anonymous:
                    oldest, _ = self.anonymous.popitem(last=False)
                    self._cut_count("evicted_anonymous")
                    self._cut(oldest)
                c.deadline = time.monotonic() + limits.request_timeout
                self.anonymous[c] = None
        try:
            c.tls.setblocking(True)
            c.tls.settimeout(limits.idle_timeout if authenticated else limits.request_timeout)
            threading.Thread(target=self._serve, args=(c, authenticated),
                             name="webhook-conn", daemon=True).start()
        except (OSError, RuntimeError) as e:     # no thread to be had: this one goes
            log.warning("webhook: cannot serve a connection from %s: %s", c.addr[0], e)
            self._done(c)

    @staticmethod
    def _cut(c: _Conn) -> None:
        """lock held.  Unblock the connection's thread (it closes the socket)."""
        if not c.closed:
            try:
                c.tls.shutdown(socket.SHUT_RDWR)
            except (OSError, ValueError):
                pass

    def _serve(self, c: _Conn, authenticated: bool) -> None:
        try:
            (_Handler if authenticated else _Anonymous)(c.tls, c.addr, self)
        except Exception as e:   # a connection's failure is never the listener's
            log.debug("webhook connection from %s ended: %s", c.addr[0], e)
        finally:
            self._done(c)

    def _done(self, c: _Conn) -> None:
        with self.lock:
            self.authenticated.discard(c)
            self.anonymous.pop(c, None)
            c.closed = True
            try:
                c.tls.close()
            except OSError:
                pass

    def _expire(self, now: float) -> None:
        while self.pending:
            c = next(iter(self.pending.values()))
            if c.deadline > now:
                break
            self._cut_count("expired_pending")
            self._close_pending(c)
        with self.lock:
            while self.anonymous:
                c = next(iter(self.anonymous))
                if c.deadline > now:
                    break
                del self.anonymous[c]
                self._cut_count("expired_anonymous")
                self._cut(c)
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.sel.register(self.sock, selectors.EVENT_READ, None)

    # ------------------------------------------------------------- stop

    def close(self) -> None:
        """Stop serving and drop every connection, kept-alive ones included
        (the API server reuses them: a stopped server would still answer)."""
        if not self.closing:
            self.closing = True
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            if self.sel.get_map():          # the loop runs: let it finish
                self.stopped.wait(10)
            self.sock.close()
            metrics.HEALTH.forget(HEALTH_NAME)
            if self.stopped.is_set() or not self.sel.get_map():
                self.sel.close()
                self._wake_r.close()
                self._wake_w.close()
        with self.lock:
            for c in list(self.authenticated) + list(self.anonymous):
                self._cut(c)
