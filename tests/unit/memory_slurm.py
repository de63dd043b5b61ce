"""An in-memory Slurm for the sync daemon's unit tests: its nodes, and the
real ledger code (pyk8sres.slurmctld.ledger, journal on disk) keeping their
Kubernetes share; and pods and Kubernetes nodes as the API server lists
them.  We check what the 'cluster' ends up leaving to jobs, not the calls."""

from dataclasses import dataclass, field
from fractions import Fraction

from pyk8sres.coordinator import slurm
from pyk8sres.policy import ledger
from pyk8sres.slurmctld.ledger import Ledger

MI = 1024 * 1024


def N(*cores):
    """cores -> nanocores, the unit PodUsage/NodeUsage use."""
    return int(Fraction(*cores) * 10**9)


@dataclass(frozen=True)
class SNode:
    name: str = "n1"
    cpus: int = 4
    real_memory: int = 8000
    gres: dict = field(default_factory=lambda: {"k8scpu": 4, "k8smemory": 8000})
    gres_used: dict = field(default_factory=dict)
    alloc_cpus: int = 0
    alloc_memory: int = 0
    state: str = "IDLE"
    reported_gres: dict = field(default_factory=lambda: {"k8scpu": 4, "k8smemory": 8000})
    slurmd_start: str = "2026-01-01T00:00:00"


class SlurmWorld:
    """An in-memory Slurm: nodes, and the real ledger code keeping their
    Kubernetes share on disk; 'restart' reloads it, like slurmctld does."""

    def __init__(self, directory, *names):
        self.nodes = {n: SNode(n) for n in names}
        self.completing: dict[str, tuple[int, int]] = {}   # node -> CPUs, MB of COMPLETING jobs
        self.jobs: dict[str, set[str]] = {}    # node -> IDs of the jobs Slurm lists there
        self.directory = directory
        self.restart()
        world = self

        class WorldLedger(slurm.Ledger):   # the real client, talking in-process
            def __init__(self):
                pass

            def call(self, op, **fields):
                ticket, reply = world.core.prepare(0, ledger.encode(op, **fields))
                return reply if not ticket else world.core.apply(
                    ticket, world.facts, lambda *a: None, node_names=lambda: world.nodes)
        self.ledger = WorldLedger()

    def facts(self, name):
        n = self.nodes.get(name)
        return None if n is None else ledger.Facts(n.gres["k8scpu"], n.gres["k8smemory"],
                                                   n.gres_used.get("k8scpu", 0),
                                                   n.gres_used.get("k8smemory", 0))

    def list_nodes(self):
        return list(self.nodes.values())

    def cluster_name(self):
        return "c1"

    def get_node(self, name):
        return self.nodes[name]

    def jobs_on_nodes(self, names):
        return {n: frozenset(self.jobs.get(n, ())) for n in names}

    def completing_allocations(self):
        return dict(self.completing), dict(getattr(self, "completing_gpus", {}))

    def restart(self):
        self.core = Ledger(self.directory)
        self.core.load()

    def counts(self, name):
        """What the node leaves to Slurm jobs: capacity minus Kubernetes' share."""
        facts = self.facts(name)
        share = ledger.applied(ledger.share_units(self.core.nodes.get(name, {})), facts)
        return facts.capacity_cpu - share[0], facts.capacity_mem - share[1]


def pod(name, node, cpu="1", mem="1Gi", phase="Running", labels=None, ns="ns"):
    return {"metadata": {"name": name, "namespace": ns, "labels": labels or {},
                         "resourceVersion": "1", "uid": f"uid-{name}"},
            "spec": {"nodeName": node,
                     "containers": [{"name": "c", "resources": {
                         "requests": {"cpu": cpu, "memory": mem}}}]},
            "status": {"phase": phase, **({"containerStatuses": [
                {"name": "c", "state": {"terminated": {"exitCode": 0}}}]}
                if phase in ("Succeeded", "Failed") else {})}}


def knode(name, **labels):
    return {"metadata": {"name": name, "annotations": {}, "labels": {"x": "y", **labels}}}
