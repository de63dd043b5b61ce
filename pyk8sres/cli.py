"""The `pyk8sres` command."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from . import install
from .policy.quantities import parse_quantity

# The testbed and the coordinator are imported by the subcommands that run
# them: they load the Kubernetes client and the daemons' code, which every
# other subcommand (install-plugins on a Slurm host, ledger) does without.


def _node_sizes(text: str) -> list[tuple[int, int]]:
    """--node-sizes 8:16000,4:8000 -> [(8, 16000), (4, 8000)]."""
    try:
        sizes = [tuple(int(v) for v in item.split(":")) for item in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected CPUS:MB[,CPUS:MB...], e.g. 8:16000,4:8000")
    return sizes


def _cluster_up(args) -> int:
    from .testbed import cluster, releases
    node_features = {"auto": None, "yes": True, "no": False}[args.node_features]
    if args.containerized and not args.kubernetes:
        raise cluster.ClusterError("--containerized needs --kubernetes (its workers are pods)")
    if args.workers is not None and not args.containerized:
        raise cluster.ClusterError("--workers needs --containerized")
    # A release not built yet is built first (from Debian's source, or --slurm-source).
    args.slurm = releases.ensure(args.slurm, args.slurm_source).name
    if args.node_sizes:
        args.nodes = len(args.node_sizes)
    if args.containerized:
        return _containerized_up(args)
    if args.kubernetes:
        from .testbed import hybrid
        c, kas = hybrid.up(args.workdir, nodes=args.nodes, cpus=args.cpus, memory=args.memory,
                           base_port=args.base_port, kube_port=args.kube_port,
                           node_features=node_features, slurm=args.slurm, auth=args.auth,
                           sockets=args.sockets, cores_per_socket=args.cores_per_socket,
                           threads_per_core=args.threads_per_core, gpus=args.gpus,
                           node_sizes=args.node_sizes, accounting=args.accounting,
                           rest=args.rest, backup_controller=args.backup_controller,
                           scale_nodes=args.scale_nodes)
    else:
        c = cluster.up(args.workdir, nodes=args.nodes, cpus=args.cpus, memory=args.memory,
                       base_port=args.base_port, node_features=node_features,
                       slurm=args.slurm, auth=args.auth,
                       sockets=args.sockets, cores_per_socket=args.cores_per_socket,
                       threads_per_core=args.threads_per_core, gpus=args.gpus,
                       node_sizes=args.node_sizes, accounting=args.accounting, rest=args.rest,
                       backup_controller=args.backup_controller,
                       scale_nodes=args.scale_nodes)
    if args.scale_nodes:
        print(f"# {args.scale_nodes} scale nodes {cluster.SCALE_PREFIX}[1-{args.scale_nodes}] "
              f"without slurmd, in partition {cluster.SCALE_PARTITION} (they stay UNKNOWN; "
              "the ledger works on them; jobs run on the n nodes)")
    print(f"# local Slurm cluster up in {c.work}: nodes {','.join(cluster.node_names(args.nodes))}"
          f", Slurm {c.release.name}")
    print(f"export SLURM_CONF={c.conf}")
    if args.backup_controller:
        print(f"# backup slurmctld on 127.0.0.2:{args.base_port} (log: "
              f"{c.work}/backup/log/slurmctld.log)")
    if c.release.bin_dirs:
        print(f"export PATH={os.pathsep.join(c.release.bin_dirs)}:$PATH  # Slurm {c.release.name}")
    if args.accounting:
        ports = cluster.service_ports(args.base_port, args.nodes)
        print(f"# accounting: slurmdbd on 127.0.0.1:{ports['slurmdbd']}, MariaDB on "
              f"127.0.0.1:{ports['mariadb']} (private, {c.work}/mysql); "
              "sacct -o JobID,AllocTRES%60 shows each job's k8scpu/k8smemory")
    if args.rest:
        from .testbed import rest
        _, version = rest.api_version(c.release.plugin_dir)
        db = f", accounting {c.rest_url}/slurmdb/{version}/" if args.accounting and \
            rest.db_plugin(c.release.plugin_dir) else ""
        print(f"# slurmrestd (JWT): {c.rest_url}/slurm/{version}/{db}  token: `scontrol token`, "
              "then headers X-SLURM-USER-NAME and X-SLURM-USER-TOKEN")
        print(f"export SLURMRESTD_URL={c.rest_url}")
    if args.kubernetes:
        _print_kubernetes(c, kas)
    return 0


def _containerized_up(args) -> int:
    """`up --kubernetes --containerized LAYOUT`: Slurm's workers as pods."""
    from .testbed import containerized
    c, kube = containerized.up(args.workdir, layout=args.containerized, nodes=args.nodes,
                               workers=args.workers, cpus=args.cpus, memory=args.memory,
                               base_port=args.base_port, kube_port=args.kube_port,
                               slurm=args.slurm, auth=args.auth)
    if args.containerized == containerized.SLINKY:
        workers = (f"pods {containerized.NAMESPACE}/{containerized.slinky.pod_name(0)}, ... "
                   f"(labelled as slurm-operator's NodeSet labels them), their Slurm nodes "
                   f"{containerized.slinky.slurm_node_name(0)}, ...")
    else:
        workers = (f"StatefulSet {containerized.NAMESPACE}/{containerized.statefulset_name()}, "
                   "its pods are the Slurm nodes")
    print(f"# Slurm inside Kubernetes ({args.containerized}): Kubernetes nodes "
          f"{', '.join(containerized.kube_node_names(args.nodes))}; {workers} (dynamic, "
          f"slurmd -Z), started by {c.work}/log/{containerized.RUNTIME}.out")
    print(f"export SLURM_CONF={c.conf}")
    if c.release.bin_dirs:
        print(f"export PATH={os.pathsep.join(c.release.bin_dirs)}:$PATH  # Slurm {c.release.name}")
    print(f"export KUBECONFIG={kube.kubeconfig}")
    print(f"export PATH={os.path.dirname(kube.bin.kubectl)}:$PATH  # kubectl")
    print(f"# pyk8sres sync and webhook with worker_pods = \"{args.containerized}\", "
          f"worker_namespace = "
          f"\"{containerized.NAMESPACE}\" (logs: {c.work}/log/sync.out, webhook.out); "
          "`kubectl get genericnode`: NAME the Kubernetes node, ALIAS its worker")
    return 0


def _print_kubernetes(c, kube) -> None:
    print(f"# Kubernetes {kube.url}: kube-apiserver, kube-controller-manager, kube-scheduler, "
          f"kwok (logs under {kube.work}/log); pyk8sres sync and webhook running as uid "
          f"pyk8sres (logs: {c.work}/log/sync.out, webhook.out; their files: "
          f"{c.work}/coordinator)")
    print("# identities (kubeconfigs): admin (below), developer (namespace default only): "
          f"{kube.identity('developer')}")
    print(f"#   kubelets: {kube.node_identity('<node>')}; coordinator: "
          f"{c.work}/coordinator/pyk8sres-sync.kubeconfig, pyk8sres-webhook.kubeconfig")
    print(f"export KUBECONFIG={kube.kubeconfig}")
    print(f"export PATH={os.path.dirname(kube.bin.kubectl)}:$PATH  # kubectl")
    print(f"# metrics and health: http://127.0.0.1:{kube.ports.sync_metrics}/metrics (sync), "
          f"http://127.0.0.1:{kube.ports.webhook_metrics}/metrics (webhook); /healthz, /readyz")


def _cluster_down(args) -> int:
    from .testbed import hybrid
    stopped = hybrid.down(args.workdir)
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def _install_plugins(args) -> int:
    for path in install.install_plugins(args.plugin_dir, check_version=not args.force):
        print(path)
    for warning in install.readability_warnings():
        print(f"pyk8sres: warning: {warning}", file=sys.stderr)
    return 0


def _ledger(args) -> int:
    """`pyk8sres ledger ...`: the operator's view of what Kubernetes holds."""
    from .coordinator import slurm
    ledger = slurm.Ledger(args.socket or slurm.ledger_socket_path())
    if args.action == "show":
        reply = ledger.show(args.node)
    elif args.action == "reserve":
        reply = ledger.reserve(args.node, args.key,
                               math.ceil(parse_quantity(args.cpu) * 1000),
                               math.ceil(parse_quantity(args.memory)), _gpu_list(args.gpus))
    else:
        reply = ledger.release(args.node, args.key)
    if getattr(args, "output", "") == "json" or args.action != "show" or not reply.get("ok"):
        print(json.dumps(reply, indent=1, sort_keys=True))
        return 0 if reply.get("ok") else 1
    print(f"{'NODE':<16} {'CAPACITY':>14} {'JOBS':>14} {'KUBERNETES':>14} {'FREE':>14} "
          f"{'GPU JOBS':>10} {'GPU K8S':>10}  NOTE")
    for name, n in sorted(reply["nodes"].items()):
        def cell(part):
            v = n.get(part)
            return f"{v['cpu']}/{v['mem']}" if v else "-"
        gpus = n.get("gpus")
        note = ("unknown to slurmctld" if n.get("unknown") else
                "OVERSUBSCRIBED: pods hold more than jobs leave" if n.get("oversubscribed") else
                f"GPUs: {gpus['problem']}" if gpus and gpus.get("problem") else
                "new node: held whole until the coordinator counts its pods"
                if n.get("registered") else "")
        print(f"{name:<16} {cell('capacity'):>14} {cell('jobs'):>14} {cell('share'):>14} "
              f"{cell('free'):>14} {_indices(gpus, 'jobs'):>10} {_indices(gpus, 'share'):>10}"
              f"  {note}".rstrip())
    print("(CPUs/MB; KUBERNETES is the pods' share the ledger holds inside slurmctld; "
          "GPU columns: gpu GRES indices)")
    return 0


def _gpu_list(text: str | None) -> tuple:
    """--gpus 0,1,3 -> (0, 1, 3)."""
    if not text:
        return ()
    try:
        return tuple(int(i) for i in text.split(","))
    except ValueError:
        raise SystemExit(f"pyk8sres ledger: --gpus takes gpu indices like 0,1, not {text!r}")


def _indices(gpus: dict | None, part: str) -> str:
    if not gpus:
        return "-"
    return ",".join(map(str, gpus.get(part, ()))) or "none"


def _status(args) -> int:
    from .coordinator import status
    return status.main(args)


def _add_install_plugins(sub) -> None:
    p = sub.add_parser("install-plugins", help="install the Slurm plugins into a PluginDir")
    p.add_argument("--plugin-dir", required=True)
    p.add_argument("--force", action="store_true", help="skip the Slurm version check")
    p.set_defaults(func=_install_plugins)


def _add_cluster(sub) -> None:
    c = sub.add_parser("cluster", help="a local Slurm (+ Kubernetes API) cluster for tests and demos")
    csub = c.add_subparsers(dest="action", required=True)
    u = csub.add_parser("up")
    u.add_argument("--workdir", required=True)
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--cpus", type=int, default=4)
    u.add_argument("--memory", type=int, default=8000, help="MB per node")
    u.add_argument("--sockets", type=int, help="sockets per node (--cpus = sockets x cores x threads)")
    u.add_argument("--cores-per-socket", type=int)
    u.add_argument("--threads-per-core", type=int, help="e.g. 2: SMT nodes (Slurm allocates whole cores)")
    u.add_argument("--gpus", type=int, default=0,
                   help="fake GPUs per node: Gres=gpu:N, each a character device under "
                        "WORKDIR/dev (mknod); with --kubernetes also DeviceClass gpu.nvidia.com "
                        "and a ResourceSlice per node (DRA), as NVIDIA's driver publishes them")
    u.add_argument("--node-sizes", type=_node_sizes, metavar="CPUS:MB,...",
                   help="each node's CPUs and RealMemory, for nodes of different sizes "
                        "(e.g. 8:16000,4:8000,16:32000); replaces --nodes, --cpus and --memory")
    u.add_argument("--scale-nodes", type=int, default=0, metavar="N",
                   help="N more nodes s1..sN declared in slurm.conf without a slurmd, in "
                        "partition 'scale' (never registered: UNKNOWN; the ledger and the "
                        "plugins work on their records), and with --kubernetes as many kwok "
                        "nodes; refused when they would not fit in memory")
    u.add_argument("--base-port", type=int, default=17000,
                   help="slurmctld port; slurmd n<i> uses base+i")
    u.add_argument("--node-features", choices=("auto", "yes", "no"), default="auto",
                   help="use node_features/k8s_resources instead of Gres= in slurm.conf")
    u.add_argument("--slurm", default="installed",
                   help="installed (default), or another release, e.g. 24.11 or 26.05: built "
                        "first if it is not (tools/slurm-build.sh from Debian's source, then "
                        "tools/release-plugins.sh; from a checkout)")
    u.add_argument("--slurm-source", metavar="DIR",
                   help="build the Slurm of this unpacked source tree (e.g. `git archive` of a "
                        "release tag of SchedMD's repository) and run it; --slurm may name its "
                        "release too")
    u.add_argument("--auth", choices=("auto", "munge", "slurm"), default="auto",
                   help="auto: munge if munged is installed, else auth/slurm (23.11+)")
    u.add_argument("--kubernetes", action="store_true", help="also start the Kubernetes control plane and the coordinator")
    u.add_argument("--accounting", action="store_true",
                   help="also a private MariaDB and slurmdbd (ports after the slurmd ones), "
                        "AccountingStorageTRES=gres/k8scpu,gres/k8smemory")
    u.add_argument("--rest", action="store_true",
                   help="also slurmrestd with JWT on 127.0.0.1 (port after slurmdbd's and MariaDB's)")
    u.add_argument("--backup-controller", action="store_true",
                   help="also a backup slurmctld (two SlurmctldHost lines, one StateSaveLocation): "
                        "the primary listens on 127.0.0.1, the backup on 127.0.0.2, both on "
                        "--base-port; `scontrol takeover` or stopping the primary fails over")
    u.add_argument("--containerized", choices=("ack", "slinky"),
                   help="with --kubernetes: Slurm inside Kubernetes, as ACK's operator (ack) or "
                        "SchedMD's slurm-operator (slinky) runs it: kwok nodes named like a "
                        "cloud's, worker pods in namespace slurm that are the Slurm nodes "
                        "(each a real dynamic slurmd)")
    u.add_argument("--workers", type=int, help="with --containerized: worker pods (default "
                                                "--nodes - 1: one node stays free)")
    u.add_argument("--kube-port", type=int, default=16443)
    u.set_defaults(func=_cluster_up)
    d = csub.add_parser("down")
    d.add_argument("--workdir", required=True)
    d.set_defaults(func=_cluster_down)


def _add_ledger(sub) -> None:
    g = sub.add_parser("ledger", help="what Kubernetes holds per node, inside slurmctld")
    g.add_argument("--socket", help="the ledger socket (default: from slurm.conf)")
    gsub = g.add_subparsers(dest="action", required=True)
    s = gsub.add_parser("show", help="capacity, Slurm jobs, Kubernetes share, free per node")
    s.add_argument("node", nargs="?")
    s.add_argument("-o", "--output", choices=("table", "json"), default="table")
    r = gsub.add_parser("reserve", help="reserve for KEY (e.g. a pod UID) on NODE, if it fits")
    r.add_argument("node")
    r.add_argument("key")
    r.add_argument("--cpu", required=True, help="Kubernetes quantity, e.g. 2735m")
    r.add_argument("--memory", required=True, help="Kubernetes quantity, e.g. 3417Mi")
    r.add_argument("--gpus", help="the node's gpu GRES indices (Slurm's IDX), e.g. 0,1")
    r = gsub.add_parser("release", help="release what KEY holds on NODE")
    r.add_argument("node")
    r.add_argument("key")
    for action in gsub.choices.values():
        action.set_defaults(func=_ledger)


def _add_status(sub) -> None:
    st = sub.add_parser("status", help="per shared node: capacity, Slurm jobs, Kubernetes share, "
                                       "free, and whether the ledger agrees with the bound pods")
    st.add_argument("--kubeconfig", help="default: in-cluster, then $KUBECONFIG or ~/.kube/config")
    st.add_argument("--config", help="the coordinator's TOML (node mapping, Slurm workers)")
    st.add_argument("--socket", help="the ledger socket (default: from slurm.conf)")
    st.add_argument("-o", "--output", choices=("table", "json"), default="table")
    st.set_defaults(func=_status)


def _add_daemons(sub) -> None:
    # `sync` has its own parser (pyk8sres/coordinator/sync.py); listed here for --help.
    sub.add_parser("sync", help="keep Slurm and Kubernetes in step (daemon); see `pyk8sres sync -h`")
    sub.add_parser("webhook", help="admission webhook + placeholder pods (daemon); "
                                   "see `pyk8sres webhook -h`")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyk8sres", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_install_plugins(sub)
    _add_cluster(sub)
    _add_ledger(sub)
    _add_status(sub)
    _add_daemons(sub)
    return parser


# What a subcommand raises for bad input or a failed step: one clear line,
# not a traceback.
_CLEAR_ERRORS = ("ClusterError", "InstallError", "SlurmError", "ConfigError", "BuildError",
                 "ReleaseError", "StartError", "LedgerError", "QuantityError")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sync"]:
        from .coordinator import sync
        return sync.main(argv[1:])
    if argv[:1] == ["webhook"]:
        from .coordinator import webhook
        return webhook.main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:
        if type(exc).__name__ in _CLEAR_ERRORS:
            print(f"pyk8sres: error: {exc}", file=sys.stderr)
            return 1
        raise

if __name__ == "__main__":
    sys.exit(main())
