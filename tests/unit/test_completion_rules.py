"""What the completion policy asks of each node (pyk8sres.slurmctld.plans
.required): the rules of docs/job-requests.md one row each, held >=
allocated on every node for random shapes (an independent model of Slurm),
and the steps of plans._plan each on its own."""
import dataclasses
import random

import pytest

from completion_sites import (GPUS, LIMITED, SITE, SITE_2511, SMT, SMT_2302, SMT_2605,
                              SMT_CR_CORE_UNKNOWN, SMT_CR_CPU, SMT_ONE_TASK, SOCKETS,
                              SOCKETS_SMT, THREE, THREE_2411, TWO)
from pyk8sres import GRES_CPU as CPU, GRES_MEMORY as MEM
from pyk8sres.slurmctld import nodefigures
from pyk8sres.slurmctld.jobspec import Job, Partition
from pyk8sres.slurmctld.plans import required


# --- The rules (docs/job-requests.md), one row each -----------------------------
# (rule, site, job, per node, per task): what `required` asks.  8-CPU nodes, 16000 MB,
# DefMemPerCPU=100; SMT = 4 cores x 2 threads under CR_Core.
RULES = [
    ("no -n: one task per node", SITE, Job(), {CPU: 1, MEM: 100}, {}),
    ("-N 3 -c 2: one task per node", SITE, Job(min_nodes=3, max_nodes=3, cpus_per_task=2),
     {CPU: 2, MEM: 200}, {}),
    ("-N 2 --ntasks-per-node=2 -c 2: fixed", SITE,
     Job(num_tasks=4, min_nodes=2, max_nodes=2, ntasks_per_node=2, cpus_per_task=2),
     {CPU: 4, MEM: 400}, {}),
    ("-n 8 -N 1: all on one node", SITE, Job(num_tasks=8, min_nodes=1, max_nodes=1),
     {CPU: 8, MEM: 800}, {}),
    ("-n 4 -N 4: one each", SITE, Job(num_tasks=4, min_nodes=4, max_nodes=4), {CPU: 1, MEM: 100},
     {}),
    ("-n 5 -N 2: block packs n1 with 4: per task", SITE,
     Job(num_tasks=5, min_nodes=2, max_nodes=2), {}, {CPU: 1, MEM: 100}),
    ("-n 6 (no -N): per task", SITE, Job(num_tasks=6), {}, {CPU: 1, MEM: 100}),
    ("-n 3 -N 1-2 -c 3: per task (was refused)", SITE,
     Job(num_tasks=3, min_nodes=1, max_nodes=2, cpus_per_task=3), {}, {CPU: 3, MEM: 300}),
    ("-n 12 -N 1-3: per task (was refused)", SITE, Job(num_tasks=12, min_nodes=1, max_nodes=3),
     {}, {CPU: 1, MEM: 100}),
    ("-n 6 --ntasks-per-node=4 -N 2: every node gets 4 tasks' CPUs", SITE,
     Job(num_tasks=6, min_nodes=2, max_nodes=2, ntasks_per_node=4), {CPU: 4, MEM: 400}, {}),
    ("-n 5 -N 1-3 --ntasks-per-node=4 -c 2", SITE,
     Job(num_tasks=5, min_nodes=1, max_nodes=3, ntasks_per_node=4, cpus_per_task=2),
     {CPU: 8, MEM: 800}, {}),
    ("-O --ntasks-per-node=4 -n 8: one task's CPUs", SITE,
     Job(num_tasks=8, ntasks_per_node=4, overcommit=True), {CPU: 1, MEM: 100}, {}),
    ("-n 4 -c 2 --mem=3000: memory per node", SITE,
     Job(num_tasks=4, cpus_per_task=2, mem_per_node=3000), {MEM: 3000}, {CPU: 2}),
    ("--mincpus=6", SITE, Job(pn_min_cpus=6), {CPU: 6, MEM: 600}, {}),
    ("NumCPUs=4 on one task: the node gets 4", SITE, Job(num_tasks=1, min_cpus=4, cpus_per_task=2),
     {CPU: 4, MEM: 400}, {}),
    ("NumCPUs=6 -N 2 -c 2: the extra may land on one node", SITE,
     Job(min_nodes=2, max_nodes=2, min_cpus=6, cpus_per_task=2), {CPU: 4, MEM: 400}, {}),
    ("sbatch's own NumCPUs (nodes x c) adds nothing", SITE,
     Job(min_nodes=3, max_nodes=3, min_cpus=6, cpus_per_task=2), {CPU: 2, MEM: 200}, {}),
    ("NumCPUs=12 -n 4 spread: per node, capped", SITE, Job(num_tasks=4, min_cpus=12),
     {CPU: 8, MEM: 800}, {}),
    ("sbatch's own NumCPUs (n x c) adds nothing spread: -n 5 -c 2 --ntasks-per-node=2 gets "
     "c x 2 a node (was k8scpu:10 on a 12-CPU node: only that node could hold it)", SITE,
     Job(num_tasks=5, min_cpus=10, cpus_per_task=2, ntasks_per_node=2), {CPU: 4, MEM: 400}, {}),
    ("-n 4 --mincpus=3: not t x one task: per node, most a node can get", SITE,
     Job(num_tasks=4, pn_min_cpus=3), {CPU: 4, MEM: 400}, {}),
    ("-n 20 --mincpus=2: capped at the biggest node", SITE, Job(num_tasks=20, pn_min_cpus=2),
     {CPU: 8, MEM: 800}, {}),
    ("--exclusive -c 2: one task's figures (Slurm gives all)", SITE,
     Job(exclusive=True, cpus_per_task=2), {CPU: 2, MEM: 200}, {}),
    ("--exclusive -n 12 -N 1-3: one task's figures, never per task", SITE,
     Job(exclusive=True, num_tasks=12, min_nodes=1, max_nodes=3), {CPU: 1, MEM: 100}, {}),
    ("--mem=0 --exclusive: CPUs only", SITE, Job(exclusive=True, mem_per_node=0), {CPU: 1}, {}),
    ("-O -n 16 -N 1: one task's CPUs per node", SITE,
     Job(overcommit=True, num_tasks=16, min_nodes=1, max_nodes=1), {CPU: 1, MEM: 100}, {}),
    ("-O -n 6: one task's CPUs per node", SITE, Job(overcommit=True, num_tasks=6, cpus_per_task=2),
     {CPU: 2, MEM: 200}, {}),
    # SMT under CR_Core: whole cores
    ("SMT: bare job gets a whole core", SMT, Job(), {CPU: 2, MEM: 200}, {}),
    ("SMT: -c 3 gets 2 cores", SMT, Job(cpus_per_task=3), {CPU: 4, MEM: 400}, {}),
    ("SMT: -n 3 -N 1: 2 cores", SMT, Job(num_tasks=3, min_nodes=1, max_nodes=1),
     {CPU: 4, MEM: 400}, {}),
    ("SMT: -n 6 -c 2: even c: per task", SMT, Job(num_tasks=6, cpus_per_task=2), {},
     {CPU: 2, MEM: 200}),
    ("SMT: -n 3: odd c, fits with a core per task: per task, rounded", SMT, Job(num_tasks=3),
     {}, {CPU: 2, MEM: 200}),
    ("SMT: -n 3 -N 2-3 -c 3: 2 cores per task fit: per task", SMT,
     Job(num_tasks=3, min_nodes=2, max_nodes=3, cpus_per_task=3, min_cpus=9), {},
     {CPU: 4, MEM: 400}),
    ("SMT: -n 20: a core per task would not fit 3 nodes: per node, most, capped", SMT,
     Job(num_tasks=20), {CPU: 8, MEM: 800}, {}),
    ("SMT: -n 10 -N 1-2: would not fit 2 nodes: per node", SMT,
     Job(num_tasks=10, min_nodes=1, max_nodes=2), {CPU: 8, MEM: 800}, {}),
    ("SMT, node count unknown: per node", SMT_CR_CORE_UNKNOWN, Job(num_tasks=3),
     {CPU: 4, MEM: 400}, {}),
    ("SMT: -n 3 --ntasks-per-core=1: a core each: per task", SMT,
     Job(num_tasks=3, ntasks_per_core=1), {}, {CPU: 2, MEM: 200}),
    ("SMT: -n 3 -c 3 --ntasks-per-core=1: 2 cores each", SMT,
     Job(num_tasks=3, cpus_per_task=3, ntasks_per_core=1), {}, {CPU: 4, MEM: 400}),
    ("SMT: --hint=nomultithread -n 3: a core each, memory of 1 thread; per node", SMT,
     Job(num_tasks=3, threads_per_core=1), {CPU: 6, MEM: 300}, {}),
    ("SMT: --hint=nomultithread -n 3 -N 1: fixed", SMT,
     Job(num_tasks=3, min_nodes=1, max_nodes=1, threads_per_core=1), {CPU: 6, MEM: 300}, {}),
    ("SMT: --threads-per-core=1 --mem-per-cpu=300 -n 3", SMT,
     Job(num_tasks=3, threads_per_core=1, mem_per_cpu=300), {CPU: 6, MEM: 900}, {}),
    ("--hint=compute_bound -n 5 -N 2 -c 3: Slurm may pack 3 tasks on 8 CPUs: per node", SITE,
     Job(num_tasks=5, min_nodes=2, max_nodes=2, cpus_per_task=3, threads_per_core=1),
     {CPU: 8, MEM: 800}, {}),
    ("SMT: -O -n 16 -N 1: one core", SMT,
     Job(overcommit=True, num_tasks=16, min_nodes=1, max_nodes=1), {CPU: 2, MEM: 200}, {}),
    ("SMT: CR_ONE_TASK_PER_CORE: a core per task", SMT_ONE_TASK, Job(num_tasks=3), {},
     {CPU: 2, MEM: 200}),
    ("SMT nodes under CR_CPU: whole cores too (one job a core), per task rounded",
     SMT_CR_CPU, Job(num_tasks=3), {}, {CPU: 2, MEM: 200}),
    ("SMT nodes under CR_CPU: -n 5 -N 1 --mincpus=3: 3 cores (6 CPUs seen)", SMT_CR_CPU,
     Job(num_tasks=5, min_nodes=1, max_nodes=1, pn_min_cpus=3), {CPU: 6, MEM: 600}, {}),
    # CR_Socket (seen on 22.05, 2 x 4 cores: CPU_IDs and Mem of plain Slurm's jobs)
    ("CR_Socket: bare job gets a whole socket (0-3, Mem=400)", SOCKETS, Job(),
     {CPU: 4, MEM: 400}, {}),
    ("CR_Socket: -c 5 gets both sockets", SOCKETS, Job(cpus_per_task=5), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket: -c 2 --mem-per-cpu=200: a socket per core (one seen without -n: over)",
     SOCKETS, Job(cpus_per_task=2, mem_per_cpu=200), {CPU: 8, MEM: 1600}, {}),
    ("CR_Socket: -n 2 -N 1: a socket per core (cyclic), 0-7", SOCKETS,
     Job(num_tasks=2, min_nodes=1, max_nodes=1), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket: -n 3 -N 1: both sockets, not 3 of them", SOCKETS,
     Job(num_tasks=3, min_nodes=1, max_nodes=1), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket: -n 2 -N 2: a socket on each node", SOCKETS,
     Job(num_tasks=2, min_nodes=2, max_nodes=2), {CPU: 4, MEM: 400}, {}),
    ("CR_Socket: -n 4 -N 2: never per task (22.05 refuses -n 5 -N 3 so): per node, all",
     SOCKETS, Job(num_tasks=4, min_nodes=2, max_nodes=2), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket: -n 9: a socket per task does not fit: per node, all (8 + 4 seen)", SOCKETS,
     Job(num_tasks=9), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket: -n 4 -c 4: a task spans both sockets; per task would not fit: per node",
     SOCKETS, Job(num_tasks=4, cpus_per_task=4), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket on SMT: -n 1 -c 4 (2 cores): both sockets, as seen with any GRES",
     SOCKETS_SMT, Job(num_tasks=1, cpus_per_task=4), {CPU: 8, MEM: 800}, {}),
    ("CR_Socket on SMT: bare job gets a socket of 2 cores x 2 threads", SOCKETS_SMT, Job(),
     {CPU: 4, MEM: 400}, {}),
    ("CR_Socket on SMT: --threads-per-core=1 -c 3: 3 cores, 2 sockets", SOCKETS_SMT,
     Job(cpus_per_task=3, threads_per_core=1), {CPU: 8, MEM: 400}, {}),
    # memory settings
    ("MaxMemPerCPU=1000 --mem-per-cpu=4000: 4 CPUs of 1000", LIMITED, Job(mem_per_cpu=4000),
     {CPU: 4, MEM: 4000}, {}),
    ("MaxMemPerCPU=1000 -n 3 --mem-per-cpu=2500: 3 CPUs per task", LIMITED,
     Job(num_tasks=3, mem_per_cpu=2500), {}, {CPU: 3, MEM: 2502}),
    ("MaxMemPerCPU=1000 --mem=4000: 4 CPUs", LIMITED, Job(mem_per_node=4000),
     {CPU: 4, MEM: 4000}, {}),
    ("-p a,b: the larger partition default", TWO, Job(partition="a,b"), {CPU: 1, MEM: 500}, {}),
    ("-p b (DefMemPerCPU=500)", TWO, Job(partition="b", cpus_per_task=2), {CPU: 2, MEM: 1000},
     {}),
    ("-p n (DefMemPerNode=3000) -n 4: memory per node", TWO, Job(partition="n", num_tasks=4),
     {MEM: 3000}, {CPU: 1}),
    ("-p a,n -n 4: memory per task in one, per node in the other: per node, most", TWO,
     Job(partition="a,n", num_tasks=4), {CPU: 4, MEM: 3000}, {}),
    ("unknown partition: cluster default", TWO, Job(partition="nope"), {CPU: 1, MEM: 100}, {}),
    # more tasks than fit at c CPUs each: plain Slurm packs them onto fewer
    # CPUs, but with any GRES it refuses them (docs/job-requests.md, Known limits): per task
    ("-n 8 -c 3 --mem=1000 on three 8-CPU nodes: per task", THREE,
     Job(num_tasks=8, cpus_per_task=3, mem_per_node=1000), {MEM: 1000}, {CPU: 3}),
    # --spread-job: a per-task GRES with it crashes slurmctld 24.11
    ("22.05: -n 9 -N 3 --spread-job: per task", THREE,
     Job(num_tasks=9, min_nodes=3, max_nodes=3, spread_job=True), {}, {CPU: 1, MEM: 100}),
    ("24.11: -n 9 -N 3 --spread-job: per node, the most a node can get", THREE_2411,
     Job(num_tasks=9, min_nodes=3, max_nodes=3, spread_job=True), {CPU: 7, MEM: 700}, {}),
    ("24.11: -n 4 -N 1-2 --distribution=plane=2: per node (per task is never runnable)",
     THREE_2411, Job(num_tasks=4, min_nodes=1, max_nodes=2, plane_distribution=True),
     {CPU: 4, MEM: 400}, {}),
    ("22.05: -n 4 -N 1-2 --distribution=plane=2: per task", THREE,
     Job(num_tasks=4, min_nodes=1, max_nodes=2, plane_distribution=True), {},
     {CPU: 1, MEM: 100}),
    ("25.11: -n 9 -N 3 --spread-job: per task again (SPREAD_PER_TASK_CRASHES=0)",
     dataclasses.replace(THREE_2411, slurm_version=0x190B07, spread_per_task_crashes=False),
     Job(num_tasks=9, min_nodes=3, max_nodes=3, spread_job=True), {}, {CPU: 1, MEM: 100}),
    ("25.11: -n 4 -N 1-2 --distribution=plane=2: still per node",
     dataclasses.replace(THREE_2411, slurm_version=0x190B07, spread_per_task_crashes=False),
     Job(num_tasks=4, min_nodes=1, max_nodes=2, plane_distribution=True), {CPU: 4, MEM: 400}, {}),
    ("24.11: -n 9 -N 3 without --spread-job: per task", THREE_2411,
     Job(num_tasks=9, min_nodes=3, max_nodes=3), {}, {CPU: 1, MEM: 100}),
    # DefCpuPerGPU / DefMemPerGPU (cons_tres _set_gpu_defaults; each figure as seen on 22.05)
    ("GPU defaults: --gpus-per-node=1: 3 CPUs, 3000 MB (not DefMemPerCPU)", GPUS,
     Job(tres_per_node="gres:gpu:1"), {CPU: 3, MEM: 3000}, {}),
    ("GPU defaults: --gpus-per-node=2 -c 1: -c given, no CPU default; memory still", GPUS,
     Job(tres_per_node="gres:gpu:2", cpus_per_task=1), {CPU: 1, MEM: 6000}, {}),
    ("GPU defaults: --gpus=1 (per job)", GPUS, Job(tres_per_job="gres:gpu:1"),
     {CPU: 3, MEM: 3000}, {}),
    ("GPU defaults: --gpus=4: no node gets more than its 2", GPUS,
     Job(tres_per_job="gres:gpu:4"), {CPU: 6, MEM: 6000}, {}),
    ("--gpus=1 --mem-per-gpu=1000 on several nodes: each may count all its GPUs (22.05)", GPUS,
     Job(tres_per_job="gres:gpu:1", mem_per_tres="gres:gpu:1000", num_tasks=5, cpus_per_task=2,
         ntasks_per_node=2), {CPU: 4, MEM: 2000}, {}),
    ("--gpus=1 -n 2 -N 1: one node, one GPU", GPUS,
     Job(tres_per_job="gres:gpu:1", num_tasks=2, min_nodes=1, max_nodes=1),
     {CPU: 3, MEM: 3000}, {}),
    ("GPU defaults: --gpus-per-socket=1: CPUs for as many GPUs as a node has, all its memory"
     " (Slurm's memory figure there can exceed the node)", GPUS,
     Job(tres_per_socket="gres:gpu:1"), {CPU: 6, MEM: 16000}, {}),
    ("GPU defaults: -n 4 -c 4 --gpus-per-socket=1: per node (CPUs per GPU), the node's memory",
     GPUS, Job(num_tasks=4, cpus_per_task=4, tres_per_socket="gres:gpu:1"),
     {CPU: 8, MEM: 16000}, {}),
    ("GPU defaults: -n 2 --gpus-per-task=1: -c raised to 3, per node", GPUS,
     Job(num_tasks=2, tres_per_task="gres:gpu:1"), {CPU: 6, MEM: 6000}, {}),
    ("GPU defaults: -n 3 --gpus-per-node=1 --mem=500: --mem wins", GPUS,
     Job(num_tasks=3, tres_per_node="gres:gpu:1", mem_per_node=500), {CPU: 3, MEM: 500}, {}),
    ("GPU defaults: --mem-per-cpu=200: per CPU wins", GPUS,
     Job(tres_per_node="gres:gpu:1", mem_per_cpu=200), {CPU: 3, MEM: 600}, {}),
    ("GPU defaults: --cpus-per-gpu=4: the job's own", GPUS,
     Job(tres_per_node="gres:gpu:1", cpus_per_tres="gres:gpu:4"), {CPU: 4, MEM: 3000}, {}),
    ("GPU defaults: -p b: the partition's own", GPUS,
     Job(partition="b", tres_per_node="gres:gpu:2"), {CPU: 4, MEM: 3000}, {}),
    ("GPU defaults: -p z: a partition's 0s override the cluster's", GPUS,
     Job(partition="z", tres_per_node="gres:gpu:1"), {CPU: 1, MEM: 100}, {}),
    ("GPU defaults: a job without GPUs: none apply", GPUS, Job(cpus_per_task=2),
     {CPU: 2, MEM: 200}, {}),
    ("GPU defaults: 24.11's -n 2 --gpus-per-task=1 (gres/gpu=1)", GPUS,
     Job(num_tasks=2, tres_per_task="gres/gpu=1"), {CPU: 6, MEM: 6000}, {}),
    # several partitions: only those whose nodes can hold the job count
    ("-p b,a -n 2 -N 1 -c 4 --mem-per-cpu=1500: b would need 16 CPUs a node: a's figures",
     THREE, Job(num_tasks=2, min_nodes=1, max_nodes=1, cpus_per_task=4, mem_per_cpu=1500,
                partition="b,a"), {CPU: 8, MEM: 12000}, {}),
    ("-p a,b -c 2 --mem-per-cpu=1500: both can hold it: the larger (b: 3 CPUs of 1000)", THREE,
     Job(cpus_per_task=2, mem_per_cpu=1500, partition="a,b"), {CPU: 4, MEM: 3000}, {}),
    ("-p b -n 2 -N 1 -c 4 --mem-per-cpu=1500: one partition: its figures, too big as they are",
     THREE, Job(num_tasks=2, min_nodes=1, max_nodes=1, cpus_per_task=4, mem_per_cpu=1500,
                partition="b"), {CPU: 16, MEM: 12000}, {}),
    # -O with a TresPerTask (24.05+ sbatch writes cpu=<c> there for -c): laid out as without -O
    ("-O -n 6 -c 1 --ntasks-per-node=2, TresPerTask=cpu=1: 2 tasks' CPUs a node (seen on 25.11)",
     SITE, Job(overcommit=True, num_tasks=6, cpus_per_task=1, ntasks_per_node=2,
               tres_per_task="cpu=1"), {CPU: 2, MEM: 200}, {}),
    ("-O -n 6 -c 1 --ntasks-per-node=2 -p a,b, TresPerTask=cpu=1: b's memory", THREE,
     Job(overcommit=True, num_tasks=6, cpus_per_task=1, ntasks_per_node=2,
         tres_per_task="cpu=1", partition="a,b"), {CPU: 2, MEM: 600}, {}),
    ("-O -n 6 -c 2, TresPerTask=cpu=2: n - N + 1 tasks may share a node, capped", SITE,
     Job(overcommit=True, num_tasks=6, cpus_per_task=2, tres_per_task="cpu=2"),
     {CPU: 8, MEM: 800}, {}),
    ("-O -n 6 -c 1 -N 3, TresPerTask=cpu=1: up to 4 tasks on a node", SITE,
     Job(overcommit=True, num_tasks=6, cpus_per_task=1, min_nodes=3, max_nodes=3,
         tres_per_task="cpu=1"), {CPU: 4, MEM: 400}, {}),
    ("-O -n 4 -N 1 --gpus-per-task=1 (22.05's TresPerTask): all 4 tasks, c raised to 3", GPUS,
     Job(overcommit=True, num_tasks=4, min_nodes=1, max_nodes=1, tres_per_task="gres:gpu:1"),
     {CPU: 8, MEM: 6000}, {}),
    ("-O -n 16 -N 1 with our own per-task entry only: still one task's CPUs", SITE,
     Job(overcommit=True, num_tasks=16, min_nodes=1, max_nodes=1,
         tres_per_task="gres:k8scpu:1"), {CPU: 1, MEM: 100}, {}),
    # 26.05.3: CountOnly GRES no longer shape the cores Slurm picks (GRES_FITS_CORES=0)
    ("26.05.3 SMT: -n 3, odd c: per node, the most (never the rounded per-task figure)",
     SMT_2605, Job(num_tasks=3), {CPU: 4, MEM: 400}, {}),
    ("26.05.3 SMT: -n 12 -p b,a as the differential test drew it: per node, capped",
     SMT_2605, Job(num_tasks=12), {CPU: 8, MEM: 800}, {}),
    ("26.05.3 SMT: -n 6 -c 2, even c: per task as on every release", SMT_2605,
     Job(num_tasks=6, cpus_per_task=2), {}, {CPU: 2, MEM: 200}),
    # 23.02: a per-task k8scpu and k8smemory together are refused (PER_TASK_PAIR_LOST)
    ("23.02 SMT: -n 3 -c 3 (the differential test's): per node, the most", SMT_2302,
     Job(num_tasks=3, cpus_per_task=3), {CPU: 8, MEM: 800}, {}),
    ("23.02 SMT: -n 3 -c 3 --mem=900: a per-task k8scpu alone runs there", SMT_2302,
     Job(num_tasks=3, cpus_per_task=3, mem_per_node=900), {MEM: 900}, {CPU: 4}),
    ("23.02 SMT: -n 6 -c 2: the pair per task runs there", SMT_2302,
     Job(num_tasks=6, cpus_per_task=2), {}, {CPU: 2, MEM: 200}),
    ("23.02: -n 5 -N 2: the pair per task runs there", dataclasses.replace(
        THREE, slurm_version=0x170208, per_task_pair_lost=True),
     Job(num_tasks=5, min_nodes=2, max_nodes=2), {}, {CPU: 1, MEM: 100}),
    ("22.05 SMT: -n 3 -c 3: per task, the rounded figure", SMT,
     Job(num_tasks=3, cpus_per_task=3), {}, {CPU: 4, MEM: 400}),
    # 25.11 on: --ntasks-per-node=k puts k tasks on every node whatever -n (NTASKS_PER_NODE_FILLS)
    ("25.11: -n 1 --ntasks-per-node=4: 4 tasks' CPUs (seen on 26.05.3 with any GRES)", SITE_2511,
     Job(num_tasks=1, ntasks_per_node=4), {CPU: 4, MEM: 400}, {}),
    ("22.05: -n 1 --ntasks-per-node=4: one task's", SITE, Job(num_tasks=1, ntasks_per_node=4),
     {CPU: 1, MEM: 100}, {}),
    ("25.11: -O -n 1 --ntasks-per-node=4, no TresPerTask: still one task's", SITE_2511,
     Job(overcommit=True, num_tasks=1, ntasks_per_node=4), {CPU: 1, MEM: 100}, {}),
    ("26.05.3 SMT: -n 1 -N 1-2 --ntasks-per-node=8 -p b (the differential test's)", SMT_2605,
     Job(num_tasks=1, min_nodes=1, max_nodes=2, ntasks_per_node=8), {CPU: 8, MEM: 800}, {}),
]


@pytest.mark.parametrize("rule,site,job,per_node,per_task", RULES, ids=[r[0] for r in RULES])
def test_rule(rule, site, job, per_node, per_task):
    assert required(job, site) == (per_node, per_task)


# --- held >= allocated on every node, for every shape: an independent model of Slurm ----
def slurm_allocates(job: Job, t: int, tpc: int, whole_cores: bool,
                    fills: bool = False) -> tuple[int, int]:
    """(CPUs, MB) Slurm 22.05 gives a node with t tasks (DefMemPerCPU=100, no limits),
    written from cons_common/dist_tasks.c and job_test.c, not from the policy;
    fills: 25.11's _get_task_count (--ntasks-per-node tasks on every node)."""
    c = job.cpus_per_task or 1
    one_task = job.overcommit and not job.tres_per_task
    if one_task:
        t = 1  # dist_tasks.c: one task's CPUs per node (any TresPerTask: all of its tasks)
    least = job.pn_min_cpus or 0
    if job.ntasks_per_node and not job.overcommit and (
            job.num_tasks or job.ntasks_per_node * (job.min_nodes or 1)) > 1:
        least = max(least, c * job.ntasks_per_node)  # job_mgr.c: pn_min_cpus
    if fills and job.ntasks_per_node and not one_task:
        t = max(t, job.ntasks_per_node)
    cpus = max(t * c, least)
    if whole_cores and tpc > 1:
        vpus = tpc
        if job.ntasks_per_core:
            vpus = min(vpus, job.ntasks_per_core * c)
        if job.threads_per_core:
            vpus = min(vpus, job.threads_per_core)
        cores = -(-cpus // vpus)
        if job.ntasks_per_core == 1 and c > vpus:
            cores = cpus // c * -(-c // vpus)  # _block_sync_core_bitmap
        cpus = cores * tpc
        counted = cores * min(tpc, job.threads_per_core or tpc)
    else:
        counted = cpus
    mem = job.mem_per_node if job.mem_per_node else (job.mem_per_cpu or 100) * counted
    return cpus, mem


def tasks_possible(job: Job) -> range:
    if not job.num_tasks:
        return range(job.ntasks_per_node or 1, (job.ntasks_per_node or 1) + 1)
    if job.overcommit and job.ntasks_per_node and job.tres_per_task:
        return range(1, job.ntasks_per_node + 1)  # 25.11: ntasks-per-node on every node
    if job.overcommit and not job.tres_per_task:
        return range(1, job.num_tasks + 1)
    nodes = job.min_nodes or 1
    most = job.num_tasks - nodes + 1
    if job.ntasks_per_node:
        most = min(most, job.ntasks_per_node)
    least = 1
    if job.max_nodes == nodes and nodes == 1:
        least = job.num_tasks
    return range(least, most + 1)


def random_jobs(count: int, seed: int = 9):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.choice([None, 1, 2, 3, 4, 5, 7, 8, 12, 16])
        nodes = rng.choice([None, 1, 2, 3])
        ranged = nodes and rng.random() < 0.4
        c = rng.choice([None, 1, 2, 3, 4])
        yield Job(num_tasks=n, min_nodes=nodes, max_nodes=(nodes + 2 if ranged else nodes),
                  cpus_per_task=c,
                  # 24.05+ sbatch: -c also written as TresPerTask=cpu=<c>
                  tres_per_task=f"cpu={c}" if c and rng.random() < 0.5 else None,
                  ntasks_per_node=rng.choice([None, None, 1, 2, 3]),
                  pn_min_cpus=rng.choice([None, None, None, 2, 3]),
                  mem_per_node=rng.choice([None, None, 1000]),
                  mem_per_cpu=rng.choice([None, None, 300]),
                  ntasks_per_core=rng.choice([None, None, 1, 2]),
                  threads_per_core=rng.choice([None, None, 1]),
                  overcommit=rng.random() < 0.1)


@pytest.mark.parametrize("site,whole", [(SITE, True), (SMT, True), (SMT_CR_CPU, True),
                                        (SITE_2511, True), (SMT_2605, True)],
                         ids=["plain", "smt", "smt-cr-cpu", "plain-25.11", "smt-26.05.3"])
def test_held_covers_allocated_for_random_shapes(site, whole):
    tpc = site.all_nodes.threads_per_core
    checked = 0
    for job in random_jobs(600):
        if job.mem_per_node and job.mem_per_cpu:
            job = job._replace(mem_per_cpu=None)
        per_node, per_task = required(job, site)
        runnable = False
        for t in tasks_possible(job):
            cpus, mem = slurm_allocates(job, t, tpc, whole, site.ntasks_per_node_fills)
            if cpus > site.all_nodes.cpus:
                continue  # Slurm cannot put t tasks on one node
            runnable = True
            held_cpu = per_node.get(CPU, 0) + t * per_task.get(CPU, 0)
            held_mem = per_node.get(MEM, 0) + t * per_task.get(MEM, 0)
            assert held_cpu >= cpus and held_mem >= mem, (job, t, per_node, per_task)
            checked += 1
        if runnable:  # never more per node than a node has: runnable stays runnable
            assert per_node.get(CPU, 0) <= site.all_nodes.cpus, job
    assert checked > 1000


# --- The steps of plans._plan, each on its own ---------------------------------------------

ONE_TASK_PER_NODE = [
    ("no -O", Job(num_tasks=4), False),
    ("-O, no TresPerTask (22.05-23.11 sbatch, or no -c)", Job(overcommit=True, num_tasks=4),
     True),
    ("-O -c 2 from 24.05's sbatch: TresPerTask=cpu=2", Job(overcommit=True, tres_per_task="cpu=2"),
     False),
    ("-O --gpus-per-task=1", Job(overcommit=True, tres_per_task="gres/gpu=1"), False),
    ("-O with only our own per-task entries (folded into per node)",
     Job(overcommit=True, tres_per_task="gres/k8scpu:1,gres/k8smemory:100"), True),
]


@pytest.mark.parametrize("name,job,expected", ONE_TASK_PER_NODE,
                         ids=[c[0] for c in ONE_TASK_PER_NODE])
def test_one_task_per_node(name, job, expected):
    assert nodefigures.one_task_per_node(job) is expected


# (name, site, job, partition, (c, pn_min_cpus, per-node memory, per-CPU memory),
#  CPUs of a node with 1 and 3 tasks, memory of a node with 3 tasks on those CPUs)
NODE_FIGURES = [
    ("the cluster's DefMemPerCPU", SITE, Job(), "debug", (1, 0, None, 100), (1, 3), 300),
    ("MaxMemPerCPU=1000, --mem-per-cpu=2500: c x 3, 834 a CPU", LIMITED, Job(mem_per_cpu=2500),
     "lim", (3, 0, None, 834), (3, 9), 7506),
    ("MaxMemPerCPU=1000, --mem=4000 --ntasks-per-node=2: 4 CPUs, c 2", LIMITED,
     Job(mem_per_node=4000, ntasks_per_node=2, num_tasks=4), "lim", (2, 4, 4000, None),
     (4, 6), 4000),
    ("--ntasks-per-node=3 -n 6: pn_min_cpus 3", SITE, Job(num_tasks=6, ntasks_per_node=3),
     "debug", (1, 3, None, 100), (3, 3), 300),
    ("-O --ntasks-per-node=3 -n 6: pn_min_cpus not raised", SITE,
     Job(num_tasks=6, ntasks_per_node=3, overcommit=True), "debug", (1, 0, None, 100), (1, 3),
     300),
    ("SMT: whole cores, memory of the threads counted", SMT, Job(threads_per_core=1), "debug",
     (1, 0, None, 100), (2, 6), 300),
    ("GPU defaults of partition b: 2 CPUs, 1500 MB a GPU", GPUS, Job(tres_per_node="gres:gpu:2"),
     "b", (1, 0, None, None), (4, 4), 3000),
]


@pytest.mark.parametrize("name,site,job,part,options,cpus,mem", NODE_FIGURES,
                         ids=[c[0] for c in NODE_FIGURES])
def test_node_figures(name, site, job, part, options, cpus, mem):
    node = nodefigures.node_figures(job, site, site.partitions.get(part) or
                                    Partition(nodes=site.all_nodes))
    assert (node.c, node.min_cpus_node, node.mem_node, node.mem_cpu) == options
    assert (node.cpus(1), node.cpus(3)) == cpus
    assert node.memory(3, node.cpus(3)) == mem
