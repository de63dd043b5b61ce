"""How a watch reads its stream: every event, in order, whatever the chunks;
the nodes watch pauses only when nothing more has arrived (one wake-up for
many node status reports), pod watches never pause."""

import json
import socket

import pytest

from pyk8sres.coordinator import kube


class Conn:
    def __init__(self, sock):
        self.sock = sock


class Response:
    """A urllib3 response: its chunks, and the socket they came from."""

    def __init__(self, chunks, sock=None):
        self.chunks, self.connection = chunks, Conn(sock)
        self.closed = False

    def stream(self, amt=None, decode_content=False):
        yield from self.chunks

    def close(self):
        self.closed = True

    def release_conn(self):
        pass


def line(i):
    return json.dumps({"type": "MODIFIED", "object": {"metadata": {"name": f"n{i}"}}}).encode() + b"\n"


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_nothing_waiting_asks_the_socket(pair):
    reader, writer = pair
    assert kube._nothing_waiting(Response([], reader))
    writer.sendall(b"x")
    assert not kube._nothing_waiting(Response([], reader))
    reader.recv(1)
    assert kube._nothing_waiting(Response([], reader))


@pytest.mark.parametrize("connection", [None, Conn(None)])
def test_without_a_socket_to_ask_a_watch_never_pauses(connection):
    resp = Response([])
    resp.connection = connection
    assert not kube._nothing_waiting(resp)


def test_a_closed_socket_is_left_to_the_read(pair):
    reader, _ = pair
    reader.close()
    assert not kube._nothing_waiting(Response([], reader))


@pytest.mark.parametrize("chunks", [
    [line(0) + line(1) + line(2)],                      # one chunk, three events
    [line(0), line(1), line(2)],                        # one each
    [line(0)[:7], line(0)[7:] + line(1)[:3], line(1)[3:] + line(2)],   # split anywhere
])
def test_every_event_in_order_whatever_the_chunks(chunks, pair, monkeypatch):
    monkeypatch.setattr(kube.time, "sleep", lambda s: None)
    got = [obj["metadata"]["name"] for _, obj in kube.Kube._events(Response(chunks, pair[0]), 0.5)]
    assert got == ["n0", "n1", "n2"]


def test_a_watch_pauses_after_a_chunk_only_when_nothing_more_has_arrived(pair, monkeypatch):
    reader, writer = pair
    slept = []
    monkeypatch.setattr(kube.time, "sleep", slept.append)
    resp = Response([line(0), line(1), line(2)], reader)
    events = kube.Kube._events(resp, 0.5)
    writer.sendall(b"more")          # the next chunk is already there: read on
    next(events)
    next(events)
    assert slept == []
    reader.recv(4)                   # drained: wait for more to gather
    assert next(events)[1]["metadata"]["name"] == "n2"
    assert slept == [0.5]
    assert list(events) == [] and resp.closed


def test_only_the_nodes_watch_pauses():
    assert kube.READ_PAUSE.get("nodes", 0) > 0
    assert kube.READ_PAUSE.get("pods", 0) == 0
