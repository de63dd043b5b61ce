#!/usr/bin/env python3
"""CPU per event of a watch read at once against one read in batches
(pyk8sres.coordinator.kube.READ_PAUSE), measured in the same run.

A local TLS server on 127.0.0.1 streams node status events the way the API
server does (one HTTP chunk per event, one event every 1/--rate s, each a
node object of 3.2 KB; kwok's are 3.8 KB).  The client is
Kube._events, the code every Informer reads with, first with no pause, then
with the nodes watch's pause.  Only the read path is measured: the cost of
waking up for every event, which was most of an idle coordinator's CPU at
3,000 nodes (per-thread CPU, docs/development.md).  The real cluster's
figures come from bench_scale.py.

  python bench/bench_watch_read.py [--rate 30] [--events 600] [--port P]

--rate 30 is what 10,000 nodes each reporting every ~5 minutes send.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import urllib3

from pyk8sres.coordinator import kube   # the installed package (tools/install-deps.sh)


def node_event(i: int) -> bytes:
    """A MODIFIED node event shaped like kwok's heartbeat (3.2 KB)."""
    stamp = "2026-12-04T19:38:48Z"
    conditions = [{"type": t, "status": "False", "lastHeartbeatTime": stamp,
                   "lastTransitionTime": stamp, "reason": "Kubelet" + t, "message": "x" * 30}
                  for t in ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure",
                            "NetworkUnavailable")]
    managed = [{"manager": m, "operation": "Update", "apiVersion": "v1", "time": stamp,
                "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:x": "y" * 400}}}
               for m in ("kube-controller-manager", "kwok", "kwok-status")]
    obj = {"kind": "Node", "apiVersion": "v1",
           "metadata": {"name": f"n{i}", "resourceVersion": str(1000 + i),
                        "labels": {"kubernetes.io/hostname": f"n{i}", "type": "kwok"},
                        "managedFields": managed},
           "spec": {},
           "status": {"capacity": {"cpu": "32", "memory": "125Gi", "pods": "110"},
                      "allocatable": {"cpu": "32", "memory": "125Gi", "pods": "110"},
                      "conditions": conditions, "nodeInfo": {"kubeletVersion": "kwok"}}}
    return json.dumps({"type": "MODIFIED", "object": obj}).encode() + b"\n"


def serve(listener: socket.socket, ctx: ssl.SSLContext, rate: float) -> None:
    """One watch stream per connection, an event every 1/rate seconds, until it closes."""
    while True:
        conn, _ = listener.accept()
        conn = ctx.wrap_socket(conn, server_side=True)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        due, i = time.monotonic(), 0
        try:
            while True:
                line = node_event(i)
                conn.sendall(b"%x\r\n%s\r\n" % (len(line), line))
                i += 1
                due += 1 / rate
                time.sleep(max(0.0, due - time.monotonic()))
        except OSError:
            conn.close()


def cpu_per_event(port: int, events: int, pause: float) -> tuple[float, float]:
    """(ms of this process's CPU per event, wall seconds it took: the
    stream's pace if the reader kept up)."""
    pool = urllib3.PoolManager(cert_reqs="CERT_NONE")
    resp = pool.request("GET", f"https://127.0.0.1:{port}/", preload_content=False,
                        timeout=urllib3.Timeout(connect=5, read=30))
    stream = kube.Kube._events(resp, pause)
    next(stream)
    cpu0, wall0 = time.process_time(), time.monotonic()
    for n, _ in enumerate(stream, 1):
        if n >= events:
            break
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    stream.close()
    return 1e3 * cpu / events, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=30.0, help="events per second")
    p.add_argument("--events", type=int, default=600)
    p.add_argument("--port", type=int,
                   default=27190 + int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0")))
    a = p.parse_args()
    urllib3.disable_warnings()
    with tempfile.TemporaryDirectory() as tmp:
        key, cert = f"{tmp}/key.pem", f"{tmp}/cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"],
                       check=True, capture_output=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        listener = socket.create_server(("127.0.0.1", a.port))
        # Its own process, so this one's CPU clock counts the reader alone.
        server = multiprocessing.Process(target=serve, args=(listener, ctx, a.rate), daemon=True)
        server.start()
        try:
            pause = kube.READ_PAUSE["nodes"]
            at_once, wall_once = cpu_per_event(a.port, a.events, 0.0)
            batched, wall_batched = cpu_per_event(a.port, a.events, pause)
        finally:
            server.kill()
    print(f"{a.events} node events at {a.rate:g}/s, over TLS on 127.0.0.1")
    print(f"  read at once:             {at_once:.3f} ms CPU per event ({wall_once:.1f} s)")
    print(f"  read with a {pause:g} s pause: {batched:.3f} ms CPU per event ({wall_batched:.1f} s)")
    print(f"  ratio batched / at once:  {batched / at_once:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
