"""The coordinator's health rules and node gauges (pyk8sres.coordinator.metrics)."""

import json
import socket
import time
import threading

import pytest

from pyk8sres.coordinator import metrics
from pyk8sres.coordinator.events import Recorder
from pyk8sres.coordinator.slurm import Ledger, LedgerError


def sample(name, **labels):
    return metrics.REGISTRY.get_sample_value(name, labels)


def test_readiness_needs_every_check_and_liveness_needs_beats():
    h = metrics.Health()
    assert h.ready() == ["starting"] and h.alive() == []
    state = {"why": "pods not listed/watched"}
    h.check("watches", lambda: state["why"])
    h.check("broken", lambda: 1 / 0)
    assert h.ready() == ["broken: check failed: division by zero",
                         "watches: pods not listed/watched"]
    h.checks.pop("broken")
    state["why"] = None
    assert h.ready() == []
    h.beat("loop", 0.05)
    assert h.alive() == []
    time.sleep(0.1)
    assert [p.split(":")[0] for p in h.alive()] == ["loop"]
    assert h.ready() and h.ready()[0].startswith("loop: no progress")


def test_ledger_check_follows_the_latest_call():
    check = metrics.ledger_check(max_age=60)
    metrics.ledger_call("show", 0.001, ConnectionRefusedError("no socket"))
    assert "did not answer: no socket" in check()
    errors = sample("pyk8sres_ledger_errors_total", op="show")
    metrics.ledger_call("show", 0.001, None)
    assert check() is None
    assert sample("pyk8sres_ledger_errors_total", op="show") == errors
    assert metrics.ledger_check(max_age=-1)().startswith("no ledger call for")


def test_readiness_fails_while_the_ledger_answers_busy(tmp_path):
    """The ledger refuses a connection over its per-uid budget with one
    "busy" line and closes it: admission is refused, so /readyz must say
    so, and recover as soon as a connection is let in again."""
    path = str(tmp_path / "ledger.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    busy = {"on": True}
    busy_line = (b'{"ok":false,"code":"busy","error":"uid 1 already has 8 connections '
                 b'to the ledger (the limit)"}\n')

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                if busy["on"]:          # as ledger_clients.c: refuse at accept, close
                    conn.sendall(busy_line)
                    continue
                f = conn.makefile("rb")
                while f.readline():
                    conn.sendall(json.dumps({"ok": True, "nodes": {}}).encode() + b"\n")
    threading.Thread(target=serve, daemon=True).start()
    check = metrics.ledger_check(max_age=60)
    ledger = Ledger(path, timeout=5)
    refused = sample("pyk8sres_ledger_refused_total", op="show") or 0
    assert ledger.show()["code"] == "busy"
    assert "refused this process: uid 1 already has 8 connections" in check()
    health = metrics.Health()
    health.check("ledger", check)
    assert health.ready()[0].startswith("ledger: the ledger refused this process")
    assert sample("pyk8sres_ledger_refused_total", op="show") == refused + 1
    assert ledger.show()["code"] == "busy"          # asks again on a new connection
    busy["on"] = False
    assert ledger.show()["ok"] is True
    assert check() is None and health.ready() == []
    srv.close()


def view(cpu, mem, jobs, share, over=False):
    free = (cpu - jobs[0] - min(share[0], cpu - jobs[0]), mem - jobs[1] - min(share[1], mem - jobs[1]))
    return {"capacity": {"cpu": cpu, "mem": mem}, "jobs": {"cpu": jobs[0], "mem": jobs[1]},
            "share": {"cpu": share[0], "mem": share[1]}, "free": {"cpu": free[0], "mem": free[1]},
            "oversubscribed": over}


def test_node_gauges_from_show_and_stale_nodes_removed():
    g = metrics.NodeGauges()
    g.update({"ok": True, "nodes": {"gx1": view(8, 16000, (3, 4000), (2, 1000)),
                                    "gx2": view(8, 16000, (8, 0), (1, 0), over=True),
                                    "gx3": {"share": {"cpu": 0, "mem": 0}, "unknown": True},
                                    "gx4": view(4, 100, (0, 0), (0, 0))}}, only={"gx1", "gx2", "gx3"})
    assert sample("pyk8sres_node_allocated", node="gx1", resource="cpu", side="slurm") == 3
    assert sample("pyk8sres_node_allocated", node="gx1", resource="cpu", side="kubernetes") == 2
    assert sample("pyk8sres_node_allocated", node="gx1", resource="memory",
                  side="kubernetes") == 1000 * 2**20
    assert sample("pyk8sres_node_free", node="gx1", resource="cpu") == 3
    assert sample("pyk8sres_node_capacity", node="gx1", resource="memory") == 16000 * 2**20
    assert sample("pyk8sres_node_oversubscribed", node="gx2") == 1
    assert sample("pyk8sres_node_oversubscribed", node="gx1") == 0
    assert sample("pyk8sres_node_capacity", node="gx3", resource="cpu") is None   # unknown
    assert sample("pyk8sres_node_capacity", node="gx4", resource="cpu") is None   # not shared
    g.update({"ok": False, "error": "x"})                      # no answer: gauges kept
    assert sample("pyk8sres_node_free", node="gx2", resource="cpu") == 0
    g.update({"ok": True, "nodes": {"gx1": view(8, 16000, (0, 0), (0, 0))}})
    assert sample("pyk8sres_node_allocated", node="gx1", resource="cpu", side="slurm") == 0
    assert sample("pyk8sres_node_free", node="gx2", resource="cpu") is None
    assert sample("pyk8sres_node_oversubscribed", node="gx2") is None


def test_node_gauges_set_only_the_nodes_whose_view_changed():
    g = metrics.NodeGauges()
    before = {"ok": True, "nodes": {"gy1": view(8, 16000, (3, 4000), (2, 1000))}}
    g.update(before)
    metrics.NODE_FREE.labels("gy1", "cpu").set(99)     # marks the series: was it set again?
    g.update({"ok": True, "nodes": {"gy1": view(8, 16000, (3, 4000), (2, 1000))}})
    assert sample("pyk8sres_node_free", node="gy1", resource="cpu") == 99    # same view
    g.update({"ok": True, "nodes": {"gy1": view(8, 16000, (4, 4000), (2, 1000))}})
    assert sample("pyk8sres_node_free", node="gy1", resource="cpu") == 2
    g.update({"ok": True, "nodes": {}})
    assert sample("pyk8sres_node_free", node="gy1", resource="cpu") is None  # gone
    g.update(before)
    assert sample("pyk8sres_node_free", node="gy1", resource="cpu") == 3     # back


@pytest.mark.parametrize("text,addr", [
    ("127.0.0.1:9710", ("127.0.0.1", 9710)), (":9710", ("0.0.0.0", 9710)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
])
def test_parse_address(text, addr):
    assert metrics.parse_address(text) == addr


@pytest.mark.parametrize("text", ["9710", "host:", "host:http", "h:70000"])
def test_parse_address_errors(text):
    with pytest.raises(ValueError):
        metrics.parse_address(text)


def test_event_queue_never_blocks_and_counts_what_it_drops():
    """The admission path only queues; with the worker stuck (not started
    here) a full queue drops the Event at once and counts it."""
    r = Recorder(kube=None, component="test", queue_size=2)
    before = sample("pyk8sres_events_total", action="queue_full")
    t0 = time.perf_counter()
    for i in range(5):
        r.pod("ns", f"p{i}", None, "InsufficientSharedCapacity", "no room")
    assert time.perf_counter() - t0 < 0.05
    assert r.queue.qsize() == 2
    assert sample("pyk8sres_events_total", action="queue_full") == before + 3


def test_a_line_left_by_a_closing_ledger_is_not_an_answer(tmp_path):
    """At shutdown the ledger sends "notready" to every client and closes;
    the next request on that connection is asked again (and fails here:
    nothing listens), not answered with the stale line."""
    path = str(tmp_path / "ledger.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    done = threading.Event()

    def serve():
        conn, _ = srv.accept()
        conn.makefile("rb").readline()
        conn.sendall(b'{"ok":true,"nodes":{}}\n')
        conn.sendall(b'{"ok":false,"code":"notready","error":"shutting down"}\n')
        conn.close()
        srv.close()
        done.set()
    threading.Thread(target=serve, daemon=True).start()
    ledger = Ledger(path, timeout=5)
    assert ledger.show()["ok"] is True
    done.wait(5)
    with pytest.raises(LedgerError):
        ledger.show()
