"""The sync daemon's moved workers: when a Slurm worker pod leaves one
Kubernetes node for another, the pods of the node it left keep counting
on its Slurm node until it is placed again and no job that ran beside them
is left there (policy/moves.py says when; holds.py keeps their state).

A mixin of sync.Reconciler, run on its thread, on the Reconciler's state:
holds (holds.py), move_checks (each move's last node, view time and jobs
read time: moves.step's inputs), worker_nodes, unplaced, last_set and
shared, cfg and slurm.  Slurm is read only while a move waits (slurm.py:
the node, and the jobs of every waiting node in one squeue).
"""

from __future__ import annotations

import logging
import time

from ..policy import moves

log = logging.getLogger("pyk8sres.coordinator.sync")


class WorkerMoves:
    def _release_moves(self, view: dict, view_at: float, counted: dict) -> None:
        """The pods of a Kubernetes node a worker left stop counting on its
        Slurm node once it is placed again and no job that ran beside them
        is left there (policy/moves.py).  Placed: a running worker maps it
        from another node now and did in the last cycle, which counted that
        node's pods there (counted: its Slurm node -> Kubernetes node, {}
        when it was not trusted or a write failed).  Slurm is read only while
        a move waits: the node when the view is older than the move, the
        jobs of the busy ones that changed (or slurm_read_seconds passed),
        all in one squeue."""
        checks = {}
        for key, left in self.holds.moves.items():
            k, s = key
            if s not in self.worker_nodes:
                continue      # a host's mapping changed: its slurmd did not move
            node, at = view.get(s), view_at
            old, old_at, jobs_at = self.move_checks.get(key, (None, -1e9, -1e9))
            now = time.monotonic()
            if at <= left.since and old_at > at:
                node, at = old, old_at
            if at <= left.since and now - old_at >= self.cfg.resync_seconds:
                try:
                    node, at = self.slurm.get_node(s), now
                except Exception as e:
                    log.warning("cannot read Slurm node %s: %s", s, e)
            wants = moves.wants_jobs(left, node, at) and (
                left.jobs is None or node is not old
                or now - jobs_at >= self.cfg.slurm_read_seconds)
            checks[key] = (node, at, jobs_at, wants)
        read, read_at = self._jobs_on({key[1] for key, c in checks.items() if c[3]})
        for key, (node, at, jobs_at, wants) in checks.items():
            k, s = key
            left = self.holds.moves.get(key)
            if left is None:
                continue
            jobs = read.get(s) if wants else None    # None: kept, never released on it
            self.move_checks[key] = (node, at, read_at if jobs is not None else jobs_at)
            placed = (s not in self.unplaced and s in self.last_set
                      and counted.get(s) not in (None, k)
                      and (self.shared or {}).get(s) == counted.get(s))
            new = moves.step(left, node, at, jobs, placed)
            if new is None:
                self.holds.release(k, s)
            elif new != left:
                self.holds.moves[key] = new
        for key in set(self.move_checks) - set(self.holds.moves):
            del self.move_checks[key]

    def _jobs_on(self, nodes: set) -> tuple[dict, float]:
        """(Slurm node -> its jobs, when read) for the nodes whose moves
        wait on them: one read for them all, else one each (squeue refuses
        the lot for a name it does not know: a node deleted meanwhile).  A
        node whose read failed is left out: its move is kept."""
        now = time.monotonic()
        if not nodes:
            return {}, now
        try:
            return self.slurm.jobs_on_nodes(nodes), now
        except Exception as e:
            if len(nodes) == 1:
                log.warning("cannot read the jobs on Slurm node %s: %s", *nodes, e)
                return {}, now
        out: dict = {}
        for name in sorted(nodes):
            try:
                out.update(self.slurm.jobs_on_nodes({name}))
            except Exception as e:
                log.warning("cannot read the jobs on Slurm node %s: %s", name, e)
        return out, now
