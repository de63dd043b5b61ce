"""The coordinator daemon, next to slurmctld or in the cluster.

It may block and talk to the network: kube.py owns every Kubernetes call,
slurm.py every Slurm call; sync.py is the level-triggered reconcile loop.
"""
