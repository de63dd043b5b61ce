"""The local test and demo cluster: real munged/slurmctld/slurmd and a real
Kubernetes API server on this host (`pyk8sres cluster up`).  Never imported
by slurmctld or by the coordinator."""
