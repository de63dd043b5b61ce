"""pyk8sres: Slurm jobs and Kubernetes pods sharing the same nodes."""

__version__ = "0.1.0"

# The two count-only GRES that carry the shared capacity.
GRES_CPU = "k8scpu"
GRES_MEMORY = "k8smemory"
