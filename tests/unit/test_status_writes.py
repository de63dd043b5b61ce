"""When a GenericNode's status may be written (policy/status_writes.py):
at most once per node and interval, the first change at once, the rest
folded into one write at the interval's end."""

import pytest

from pyk8sres.policy import status_writes


@pytest.mark.parametrize("last, now, interval, want", [
    (None, 100.0, 2.0, 100.0),       # not written lately: at once
    (90.0, 100.0, 2.0, 100.0),       # long ago: at once
    (99.0, 100.0, 2.0, 101.0),       # within the interval: at its end
    (98.0, 100.0, 2.0, 100.0),       # the interval just ended
    (99.5, 100.0, 0.0, 100.0),       # no interval: every change
])
def test_next_write(last, now, interval, want):
    assert status_writes.next_write(last, now, interval) == want


@pytest.mark.parametrize("waiting, written_at, want_ready, want_next", [
    ({}, {}, [], None),
    ({"a": 5.0}, {}, ["a"], None),
    # oldest change first, then by name
    ({"b": 3.0, "a": 4.0, "c": 3.0}, {}, ["b", "c", "a"], None),
    # a written 1 s ago waits for the end of its interval; b goes now
    ({"a": 9.5, "b": 9.8}, {"a": 9.0}, ["b"], 11.0),
    # the earliest of those held back
    ({"a": 9.5, "b": 9.8}, {"a": 9.0, "b": 8.5}, [], 10.5),
    # written exactly one interval ago: due now
    ({"a": 9.5}, {"a": 8.0}, ["a"], None),
    # a write of a node that waits for nothing holds nothing back
    ({"a": 9.5}, {"z": 9.9}, ["a"], None),
])
def test_split(waiting, written_at, want_ready, want_next):
    assert status_writes.split(waiting, written_at, 10.0, 2.0) == (want_ready, want_next)


@pytest.mark.parametrize("written_at, want", [
    ({}, {}),
    ({"a": 9.0, "b": 8.0, "c": 7.9}, {"a": 9.0}),   # b: exactly one interval ago
])
def test_recent_keeps_only_what_still_holds_a_node_back(written_at, want):
    assert status_writes.recent(written_at, 10.0, 2.0) == want
