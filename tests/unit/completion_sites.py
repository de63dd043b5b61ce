"""The sites (slurm.conf shapes: nodes, partitions, memory and GPU defaults,
Slurm versions) the completion policy's unit tests complete jobs for
(test_completion.py, test_completion_rules.py)."""
import dataclasses

from pyk8sres.slurmctld.jobspec import (CR_CORE, CR_CPU, CR_MEMORY, CR_ONE_TASK_PER_CORE,
                                        CR_SOCKET, GpuDefault, MemDefault, Nodes, Partition, Site)

V2205 = 0x160508
V2411 = 0x180B05
NODES = Nodes(threads_per_core=1, cpus=8, memory=16000)
SMT_NODES = Nodes(threads_per_core=2, cpus=8, memory=16000, count=3, least_cpus=8)
SITE = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=NODES,
            partitions={"debug": Partition(nodes=NODES)}, default_partition="debug")
SMT = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=SMT_NODES,
           partitions={"debug": Partition(nodes=SMT_NODES)}, default_partition="debug")
SMT_2605 = dataclasses.replace(SMT, gres_fits_cores=False, ntasks_per_node_fills=True)
SITE_2511 = dataclasses.replace(SITE, ntasks_per_node_fills=True)
SMT_2302 = dataclasses.replace(SMT, slurm_version=0x170208, per_task_pair_lost=True)
SMT_CR_CORE_UNKNOWN = Site(cluster_mem=MemDefault(per_cpu=100),
                           all_nodes=Nodes(threads_per_core=2, cpus=8, memory=16000))
SMT_CR_CPU = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=SMT_NODES,
                  select_type_param=CR_CPU)
SMT_ONE_TASK = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100),
                    all_nodes=SMT_NODES, select_type_param=CR_CORE | CR_ONE_TASK_PER_CORE)
# CR_Socket: 2 nodes of 2 sockets x 4 cores; and of 2 sockets x 2 cores x 2 threads
SOCKET_NODES = Nodes(threads_per_core=1, cpus=8, memory=16000, count=2, least_cpus=8,
                     cores_per_socket=(4,))
SOCKETS = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=SOCKET_NODES,
               select_type_param=CR_SOCKET | CR_MEMORY)
SOCKETS_SMT = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100),
                   all_nodes=Nodes(threads_per_core=2, cpus=8, memory=16000, count=2,
                                   least_cpus=8, cores_per_socket=(2,)),
                   select_type_param=CR_SOCKET | CR_MEMORY)
# a partition of nodes of 8, 4 and 12 CPUs
MIXED_NODES = Nodes(threads_per_core=1, cpus=12, memory=24000, count=3, least_cpus=4,
                    least_memory=8000, cpu_counts=((12, 1), (8, 1), (4, 1)))
MIXED = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=MIXED_NODES)
LIMITED = Site(cluster_mem=MemDefault(per_cpu=100), all_nodes=NODES, default_partition="lim",
               partitions={"lim": Partition(max_mem_per_cpu=1000, nodes=NODES)})
PLAIN3 = Nodes(threads_per_core=1, cpus=8, memory=16000, count=3, least_cpus=8)
THREE = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=PLAIN3,
             partitions={"a": Partition(mem=MemDefault(per_cpu=100), nodes=PLAIN3),
                         "b": Partition(mem=MemDefault(per_cpu=300), max_mem_per_cpu=1000,
                                        nodes=PLAIN3)},
             default_partition="a")
THREE_2411 = Site(slurm_version=V2411, spread_per_task_crashes=True,
                  cluster_mem=MemDefault(per_cpu=100), all_nodes=PLAIN3,
                  partitions={"a": Partition(mem=MemDefault(per_cpu=100), nodes=PLAIN3)},
                  default_partition="a")
# 2 GPUs a node; DefCpuPerGPU=3 DefMemPerGPU=3000 for the cluster, b's own, z's own 0s
GPU_NODES = Nodes(threads_per_core=1, cpus=8, memory=16000, count=2, least_cpus=8, gpus=2)
GPUS = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100), all_nodes=GPU_NODES,
            cluster_gpu=GpuDefault(cpus=3, mem=3000), default_partition="a",
            partitions={"a": Partition(nodes=GPU_NODES),
                        "b": Partition(nodes=GPU_NODES, gpu=GpuDefault(cpus=2, mem=1500)),
                        "z": Partition(nodes=GPU_NODES, gpu=GpuDefault(cpus=0, mem=0))})
TWO = Site(cluster_mem=MemDefault(per_cpu=100), all_nodes=NODES, default_partition="a",
           partitions={"a": Partition(nodes=NODES),
                       "b": Partition(mem=MemDefault(per_cpu=500), nodes=NODES),
                       "n": Partition(mem=MemDefault(per_node=3000), nodes=NODES)})
