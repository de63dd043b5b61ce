"""When the pods of a Kubernetes node a worker left stop counting on the
worker's Slurm node.

A worker (its slurmd: Slurm node X) moves from Kubernetes node A to B.  The
pods of A keep counting on X (coordinator/holds.py, sticky mappings), but
they only ever shared A's CPUs and memory with the jobs that ran on A: the
jobs Slurm shows on X that were there when the move was seen.  Later jobs
on X run on B, beside B's pods.  So A's pods stop counting on X once X is
placed again (a running worker maps it and its node's pods are counted)
and none of those jobs still runs or completes there, whether A's pods are
gone or not (a DaemonSet's, a service's never are).

Ground truth only, read after the move was seen: X with nothing allocated
and nothing completing (`scontrol show node`, the view the sync daemon
reads anyway) has none of them; otherwise the jobs Slurm lists on X
(running, completing, suspended: anything but pending), read once to learn
which ones were there and again whenever X changes, until none of them is
left.  Whatever is unknown keeps A's pods counted, and so does a busy X on
which no job is listed (PrivateData=jobs hides other users' jobs): never
released on a listing that cannot be complete.

And never before X's slurmd is another one than at the move (its
SlurmdStartTime changed): until the replacement registers, slurmctld still
sends X's jobs to the slurmd it knows, which may outlive its pod on A (a
forced delete returns before the containers stop, and never stops them on
a dead kubelet), beside A's pods.  Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Left:
    """A's pods, still counted on X since the move was seen at `since`
    (monotonic); jobs: the jobs on X at the first read after it (None: not
    read yet); slurmd: X's SlurmdStartTime in the view of the cycle that saw
    the move (None: not noted yet; "": unknown, never released)."""
    k8s_node: str
    slurm_node: str
    since: float
    jobs: frozenset | None = None
    slurmd: str | None = None


def restarted(left: Left, node) -> bool:
    """Is X's slurmd another one than at the move?  (node: X, not None.)"""
    now = node.slurmd_start
    return (bool(left.slurmd) and now not in ("", "None", "Unknown")
            and now != left.slurmd)


def idle(node) -> bool:
    """Nothing allocated on the Slurm node and nothing completing there."""
    return (node is not None and node.alloc_cpus == 0 and node.alloc_memory == 0
            and "COMPLETING" not in node.state)


def wants_jobs(left: Left, node, view_at: float) -> bool:
    """Should the jobs on X be read now (node: X in a view read from
    view_at on)?  Not on a view older than the move (it says nothing of
    the jobs that ran on A), nor while X is idle (none runs)."""
    return view_at > left.since and node is not None and not idle(node)


def step(left: Left, node, view_at: float, jobs_now: frozenset | None,
         placed: bool) -> Left | None:
    """The next state of `left`; None: A's pods stop counting on X.

    node: X as a view read from view_at shows it; jobs_now: the jobs on X
    read now (None: not read, or the read failed); placed: a running
    worker maps X again and its node's pods are counted there (and X's
    slurmd restarted since the move: restarted)."""
    if view_at <= left.since or node is None:
        return left                       # nothing known since the move
    placed = placed and restarted(left, node)
    if idle(node):
        return None if placed else left
    if not jobs_now:
        # Unknown, or none listed on a busy node: jobs hidden from us
        # (PrivateData=jobs) or a listing older than the view; kept.
        return left
    if left.jobs is None:
        # The first read after the move: every job of A's that still runs is
        # among these (later ones, on B, too: kept as well, never too few).
        left = replace(left, jobs=frozenset(jobs_now))
    if left.jobs & jobs_now:
        return left
    return None if placed else left
