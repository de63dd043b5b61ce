"""The state file contract between the sync daemon and node_features."""
import json
import os

import pytest

from pyk8sres.slurmctld import nodestate
from pyk8sres.slurmctld.nodestate import StateError, read_state, write_state

GOOD = {"version": 1, "nodes": {"n1": {"k8scpu": 3, "k8smemory": 4000}},
        "unmanaged": ["login*"]}


def _with(**changes):
    doc = json.loads(json.dumps(GOOD))
    doc.update(changes)
    return doc


@pytest.mark.parametrize("text, problem", [
    ("", "not valid JSON"),
    ("{", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    ("[]", "top level must be a JSON object"),
    (json.dumps(_with(version=2)), "unsupported version 2"),
    (json.dumps({"nodes": {}}), "unsupported version None"),
    (json.dumps(_with(nodes=[])), "'nodes' must be an object"),
    (json.dumps(_with(nodes={"n1": 3})), "counts must be an object"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": 3}})), "missing: ['k8smemory']"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": 3, "k8smemory": 1, "gpu": 1}})), "unknown: ['gpu']"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": -1, "k8smemory": 1}})), "non-negative integer"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": 1.5, "k8smemory": 1}})), "non-negative integer"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": "2", "k8smemory": 1}})), "non-negative integer"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": True, "k8smemory": 1}})), "non-negative integer"),
    (json.dumps(_with(nodes={"n1": {"k8scpu": 1 << 64, "k8smemory": 1}})), "too large"),
    (json.dumps(_with(nodes={"": {"k8scpu": 1, "k8smemory": 1}})), "empty node name"),
    (json.dumps(_with(unmanaged="n1")), "'unmanaged' must be a list"),
    (json.dumps(_with(unmanaged=[""])), "'unmanaged' must be a list"),
])
def test_read_rejects(tmp_path, text, problem):
    path = tmp_path / "state"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(StateError) as err:
        read_state(str(path))
    assert problem in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("doc, nodes, unmanaged", [
    (GOOD, {"n1": {"k8scpu": 3, "k8smemory": 4000}}, ["login*"]),
    ({"version": 1}, {}, []),
    (_with(updated=12.5, writer="sync"), GOOD["nodes"], ["login*"]),  # extra keys ignored
    (_with(nodes={"n1": {"k8scpu": 0, "k8smemory": 0}}), {"n1": {"k8scpu": 0, "k8smemory": 0}}, ["login*"]),
])
def test_read_accepts(tmp_path, doc, nodes, unmanaged):
    path = tmp_path / "state"
    path.write_text(json.dumps(doc))
    state = read_state(str(path))
    assert state["nodes"] == nodes
    assert state["unmanaged"] == unmanaged


def test_absent_file_is_not_a_state_error(tmp_path):
    # The caller decides what "absent" means (nodefeatures: hold).
    with pytest.raises(FileNotFoundError):
        read_state(str(tmp_path / "missing"))


def test_write_then_read_round_trip(tmp_path):
    path = str(tmp_path / "state")
    counts = {"n1": {"k8scpu": 2, "k8smemory": 1000}, "n2": {"k8scpu": 0, "k8smemory": 0}}
    write_state(path, counts, unmanaged=["login[1-2]", "gpu*"])
    state = read_state(path)
    assert state["nodes"] == counts
    assert state["unmanaged"] == ["login[1-2]", "gpu*"]
    assert isinstance(state["updated"], float)
    assert os.stat(path).st_mode & 0o777 == 0o644


@pytest.mark.parametrize("counts", [
    {"n1": {"k8scpu": -1, "k8smemory": 0}},
    {"n1": {"k8scpu": 1}},
    {"n1": {"k8scpu": 1, "k8smemory": "x"}},
])
def test_bad_write_keeps_old_file_and_leaves_no_temp(tmp_path, counts):
    path = str(tmp_path / "state")
    write_state(path, {"n1": {"k8scpu": 1, "k8smemory": 1}})
    with pytest.raises(StateError):
        write_state(path, counts)
    assert read_state(path)["nodes"] == {"n1": {"k8scpu": 1, "k8smemory": 1}}
    assert os.listdir(tmp_path) == ["state"]


def test_write_replaces_by_rename(tmp_path):
    # A reader holding the old file keeps a complete old file (new inode).
    path = str(tmp_path / "state")
    write_state(path, {"n1": {"k8scpu": 1, "k8smemory": 1}})
    with open(path) as old:
        ino = os.fstat(old.fileno()).st_ino
        write_state(path, {"n1": {"k8scpu": 2, "k8smemory": 2}})
        assert json.load(old)["nodes"]["n1"]["k8scpu"] == 1
    assert os.stat(path).st_ino != ino
    assert read_state(path)["nodes"]["n1"]["k8scpu"] == 2


def test_cli_write_and_show(tmp_path, capsys):
    path = str(tmp_path / "state")
    assert nodestate._main(["write", path, "--node", "n1=3,4000", "--unmanaged", "n9"]) == 0
    assert nodestate._main(["show", path]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["nodes"] == {"n1": {"k8scpu": 3, "k8smemory": 4000}}
    assert nodestate._main(["write", path, "--node", "n1=3"]) == 1


def test_cached_read_sees_every_atomic_write(tmp_path):
    path = str(tmp_path / "state")
    for n in range(5):
        write_state(path, {"n1": {"k8scpu": n, "k8smemory": n}})
        assert nodestate.read_state_cached(path)["nodes"]["n1"]["k8scpu"] == n
    assert nodestate.read_state_cached(path) is nodestate.read_state_cached(path)
    os.unlink(path)
    with pytest.raises(FileNotFoundError):
        nodestate.read_state_cached(path)
