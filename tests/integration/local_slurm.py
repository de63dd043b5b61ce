"""Shared by the integration tests: a real local Slurm cluster per module."""
import os
import shutil

import pytest

from pyk8sres.testbed import cluster

# pytestmark for modules that start Slurm daemons.
requires_slurm = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster runs daemons as root"),
    pytest.mark.skipif(not shutil.which("slurmctld") and not os.path.exists("/usr/sbin/slurmctld"),
                       reason="slurmctld not installed (apt-get install slurmctld slurmd)"),
]


def local_cluster(tmp_path_factory, name: str, **kwargs):
    """Fixture body: start a cluster (pyk8sres.testbed.cluster.up kwargs), point
    SLURM_CONF at it while the module runs, stop it by PID afterwards."""
    work = str(tmp_path_factory.mktemp(name))
    handle = cluster.up(work, **kwargs)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = handle.conf
    try:
        yield handle
    finally:
        cluster.down(work)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def port(default: int) -> int:
    """A test module's base port, moved by PYK8SRES_TEST_PORT_OFFSET so that
    two test runs on one machine (e.g. two checkouts) never collide."""
    return default + int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0"))
