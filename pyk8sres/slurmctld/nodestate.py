"""The node state file: the sync daemon's word on each node's k8scpu/k8smemory.

The sync daemon owns the file and writes it *before* it applies the counts to
Slurm (`scontrol update NodeName=X Gres=...`); the node_features plugin reads it
inside slurmctld whenever a node registers, at startup and on reconfigure, so
a restarted slurmctld comes back with the lowered counts and no network call.

Format (JSON, one object, UTF-8)::

    {
      "version": 1,
      "nodes": {"n1": {"k8scpu": 3, "k8smemory": 4000}, ...},
      "unmanaged": ["login*", ...],
      "updated": 1730000000.5        # optional, informational
    }

- `nodes`: nodes the daemon manages, with the total count Slurm may use
  (capacity minus what Kubernetes holds; running Slurm jobs are NOT
  subtracted: Slurm tracks those itself).
- `unmanaged`: node names or fnmatch patterns the daemon declares it does not
  manage (no kubelet there): they get their full capacity.
- Other top-level keys are ignored (room for informational fields);
  a different `version` is an error (an incompatible change bumps it).

Written atomically (temporary file in the same directory, fsync, rename,
fsync of the directory): a reader sees the old file or the new one, never a
torn one, even across a crash.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Iterable, Mapping

from .. import GRES_CPU, GRES_MEMORY

VERSION = 1
KEYS = (GRES_CPU, GRES_MEMORY)
MAX_BYTES = 64 << 20  # a sanity bound: ~1M nodes


class StateError(ValueError):
    """The state file exists but cannot be trusted."""


def _check_count(where: str, key: str, value: object) -> int:
    # bool is an int subclass; true/false in a count is a writer bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateError(f"{where}: {key} must be a non-negative integer, not {value!r}")
    if value >= 1 << 63:
        raise StateError(f"{where}: {key} {value} is too large")
    return value


def validate(doc: object, *, source: str = "state") -> dict:
    """The checked, normalised state; StateError says what is wrong."""
    if not isinstance(doc, dict):
        raise StateError(f"{source}: top level must be a JSON object")
    version = doc.get("version")
    if version != VERSION:
        raise StateError(f"{source}: unsupported version {version!r} (this reader knows {VERSION})")
    nodes = doc.get("nodes", {})
    if not isinstance(nodes, dict):
        raise StateError(f"{source}: 'nodes' must be an object of node name -> counts")
    out_nodes: dict[str, dict[str, int]] = {}
    for name, entry in nodes.items():
        where = f"{source}: node {name!r}"
        if not name:
            raise StateError(f"{source}: empty node name")
        if not isinstance(entry, dict):
            raise StateError(f"{where}: counts must be an object")
        unknown = sorted(set(entry) - set(KEYS))
        missing = [k for k in KEYS if k not in entry]
        if unknown or missing:
            raise StateError(f"{where}: needs exactly {', '.join(KEYS)}"
                             f" (missing: {missing or 'none'}, unknown: {unknown or 'none'})")
        out_nodes[name] = {k: _check_count(where, k, entry[k]) for k in KEYS}
    unmanaged = doc.get("unmanaged", [])
    if not isinstance(unmanaged, list) or not all(
            isinstance(p, str) and p for p in unmanaged):
        raise StateError(f"{source}: 'unmanaged' must be a list of non-empty node names/patterns")
    return {"version": VERSION, "nodes": out_nodes, "unmanaged": list(unmanaged),
            "updated": doc.get("updated")}


def read_state(path: str) -> dict:
    """The validated state at `path`.

    FileNotFoundError propagates unchanged (the caller decides what an absent
    file means); anything unreadable or malformed raises StateError.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StateError(f"{path}: cannot read: {e.strerror or e}") from e
    if len(raw) > MAX_BYTES:
        raise StateError(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"{path}: not valid JSON: {e}") from e
    return validate(doc, source=path)


_cache: dict[str, tuple[tuple, dict]] = {}


def read_state_cached(path: str) -> dict:
    """read_state() that re-parses only when the file changed.

    slurmctld asks once per node at startup/reconfigure (N nodes -> N calls
    under its write locks); the writer always renames a new file into
    place, so (device, inode, size, mtime) identifies one content.
    """
    st = os.stat(path)  # FileNotFoundError propagates, as in read_state
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _cache.get(path)
    if hit and hit[0] == key:
        return hit[1]
    state = read_state(path)
    _cache[path] = (key, state)
    return state


def write_state(path: str, counts: Mapping[str, Mapping[str, int]], *,
                unmanaged: Iterable[str] = ()) -> None:
    """Atomically replace the state at `path` with `counts` (node -> k8scpu/k8smemory).

    Validates first: a bad value raises StateError and leaves the old file.
    """
    doc = {"version": VERSION,
           "nodes": {n: dict(c) for n, c in counts.items()},
           "unmanaged": list(unmanaged),
           "updated": round(time.time(), 3)}
    validate(doc, source="write_state")
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".k8s_resources.state.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # slurmctld may run as SlurmUser, not as the daemon's user.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # Make the rename itself durable.
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _main(argv: list[str] | None = None) -> int:
    """`python -m pyk8sres.slurmctld.nodestate show PATH` or
    `... write PATH [--node N=CPU,MEM]... [--unmanaged PATTERN]...`
    (for admins and tests; the sync daemon calls write_state directly)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m pyk8sres.slurmctld.nodestate")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show")
    s.add_argument("path")
    w = sub.add_parser("write")
    w.add_argument("path")
    w.add_argument("--node", action="append", default=[], metavar="NAME=K8SCPU,K8SMEMORY")
    w.add_argument("--unmanaged", action="append", default=[], metavar="PATTERN")
    a = p.parse_args(argv)
    try:
        if a.cmd == "show":
            print(json.dumps(read_state(a.path), indent=1, sort_keys=True))
            return 0
        counts = {}
        for spec in a.node:
            name, _, vals = spec.partition("=")
            cpu, _, mem = vals.partition(",")
            if not (name and cpu.isdigit() and mem.isdigit()):
                raise StateError(f"--node {spec!r}: expected NAME=K8SCPU,K8SMEMORY")
            counts[name] = {GRES_CPU: int(cpu), GRES_MEMORY: int(mem)}
        write_state(a.path, counts, unmanaged=a.unmanaged)
        return 0
    except (StateError, OSError) as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(_main())
