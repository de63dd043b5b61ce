"""The coordinator's ledger client (pyk8sres.coordinator.slurm.Ledger)
against a real unix socket server that hangs, dribbles or answers: one
stuck request never wedges the threads that share the client (the
webhook's admissions); each fails closed within twice the timeout."""

import json
import os
import socketserver
import threading
import time

import pytest

from pyk8sres.coordinator.slurm import Ledger, LedgerError
from pyk8sres.coordinator.webhook import Admission

from test_admission import pod, req
from test_not_ready import _scope

TIMEOUT = 0.3
SLACK = 0.5          # thread start-up and a loaded 2-core machine


class StubLedger(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Answers each request line by `mode`: "answer" at once, "stuck" only
    once `release` is set, "dribble" one byte every `dribble` seconds."""
    daemon_threads = True

    def __init__(self, path, mode="answer"):
        self.mode, self.release, self.dribble = mode, threading.Event(), 0.1
        self.requests = 0
        super().__init__(path, Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def reply_for(self, line: bytes) -> bytes:
        op = json.loads(line)["op"]
        if op == "show":
            return json.dumps({"ok": True, "nodes": {f"n{i}": {} for i in range(40)}}).encode()
        return b'{"ok": true}'


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        srv = self.server
        for line in self.rfile:
            srv.requests += 1
            reply = srv.reply_for(line) + b"\n"
            try:
                if srv.mode == "stuck":
                    srv.release.wait(10)
                if srv.mode == "dribble":
                    for i in range(len(reply)):
                        self.wfile.write(reply[i:i + 1])
                        self.wfile.flush()
                        time.sleep(srv.dribble)
                else:
                    self.wfile.write(reply)
            except OSError:
                return


@pytest.fixture
def stub(tmp_path):
    servers = []

    def start(mode):
        path = os.path.join(tmp_path, f"ledger{len(servers)}.sock")
        servers.append(StubLedger(path, mode))
        return servers[-1]
    yield start
    for s in servers:
        s.release.set()
        s.shutdown()
        s.server_close()


def _concurrently(n, fn):
    """Run fn() in n threads at once: [(seconds, result or exception)]."""
    out = [None] * n
    go = threading.Barrier(n)

    def run(i):
        go.wait()
        t0 = time.monotonic()
        try:
            r = fn()
        except Exception as e:          # noqa: BLE001 - the test looks at it
            r = e
        out[i] = (time.monotonic() - t0, r)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o is not None for o in out), "a caller is still waiting"
    return out


def test_a_stuck_ledger_fails_every_sharing_thread_closed_in_bounded_time(stub):
    srv = stub("stuck")
    ledger = Ledger(srv.server_address, timeout=TIMEOUT)
    results = _concurrently(8, lambda: ledger.reserve("n1", "k", 1000, 0))
    assert all(isinstance(r, LedgerError) for _, r in results), results
    assert max(t for t, _ in results) < 2 * TIMEOUT + SLACK, results
    messages = " ".join(str(r) for _, r in results)
    assert "busy" in messages and "failing closed" in messages
    assert "no whole reply" in messages or "timed out" in messages
    # The ledger answers again: the next call is served (a new connection).
    srv.mode = "answer"
    srv.release.set()
    assert ledger.reserve("n1", "k", 1000, 0) == {"ok": True}


def test_a_reply_dribbled_past_the_timeout_fails_the_reserve(stub):
    srv = stub("dribble")
    ledger = Ledger(srv.server_address, timeout=TIMEOUT)
    t0 = time.monotonic()
    with pytest.raises(LedgerError, match="no whole reply"):
        ledger.reserve("n1", "k", 1000, 0)
    assert time.monotonic() - t0 < TIMEOUT + SLACK


def test_a_show_reply_that_keeps_coming_is_read_whole(stub):
    """A show of a large cluster may take longer than the timeout to arrive
    in full: it is read as long as it keeps coming."""
    srv = stub("dribble")
    srv.reply_for = lambda line: b'{"ok": true, "nodes": {"n1": {}, "n2": {}}}'
    srv.dribble = 0.02                                # ~44 bytes: ~0.9 s in all
    ledger = Ledger(srv.server_address, timeout=TIMEOUT)
    assert ledger.show() == {"ok": True, "nodes": {"n1": {}, "n2": {}}}


def test_answers_are_matched_to_their_requests(stub):
    srv = stub("answer")
    ledger = Ledger(srv.server_address, timeout=TIMEOUT)
    results = _concurrently(6, lambda: ledger.show())
    assert all(len(r["nodes"]) == 40 for _, r in results)
    assert ledger.reserve("n1", "k", 1, 1) == {"ok": True}


def test_admission_fails_closed_when_the_ledger_hangs(stub):
    """The webhook's Admission over the real client: every review on a
    shared node is refused, saying the ledger did not answer, within twice
    the ledger timeout (well inside the API server's own timeout)."""
    srv = stub("stuck")
    admission = Admission(kube=None, ledger=Ledger(srv.server_address, timeout=TIMEOUT),
                          scope=_scope())
    review = {"request": req("CREATE", "pods", "", pod(node="n1"))}
    results = _concurrently(6, lambda: admission.review(review)["response"])
    assert max(t for t, _ in results) < 2 * TIMEOUT + SLACK, results
    for _, answer in results:
        assert answer["allowed"] is False
        assert "Slurm's ledger did not answer for node n1" in answer["status"]["message"]
