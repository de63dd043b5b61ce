"""Pure parts of `cluster up --accounting/--rest`: the port scheme, which REST
API a Slurm serves (from its plugin file names), and that slurm-conf/
documents the accounting lines the testbed really uses."""
import re
from pathlib import Path

import pytest

from pyk8sres.testbed import accounting, cluster, rest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("base,nodes,expected", [
    (17000, 2, {"slurmdbd": 17003, "mariadb": 17004, "slurmrestd": 17005}),
    (17000, 3, {"slurmdbd": 17004, "mariadb": 17005, "slurmrestd": 17006}),
    (29200, 1, {"slurmdbd": 29202, "mariadb": 29203, "slurmrestd": 29204}),
])
def test_service_ports_follow_the_slurmd_ones(base, nodes, expected):
    ports = cluster.service_ports(base, nodes)
    assert ports == expected
    assert min(ports.values()) > base + nodes      # never a slurmd's port


@pytest.mark.parametrize("files,expected", [
    # 22.05: openapi/v0.0.36..38 (and dbv0.0.38 for slurmdbd, not ours)
    (["openapi_v0_0_36.so", "openapi_v0_0_37.so", "openapi_v0_0_38.so", "openapi_dbv0_0_38.so"],
     ("openapi/v0.0.38", "v0.0.38")),
    # 24.11: one openapi/slurmctld plugin, versions are data parsers
    (["openapi_slurmctld.so", "openapi_slurmdbd.so", "data_parser_v0_0_39.so",
      "data_parser_v0_0_40.so", "data_parser_v0_0_42.so"], ("openapi/slurmctld", "v0.0.42")),
    (["openapi_v0_0_9.so", "openapi_v0_0_10.so"], ("openapi/v0.0.10", "v0.0.10")),  # numeric
])
def test_rest_api_version(tmp_path, files, expected):
    for name in files:
        (tmp_path / name).write_bytes(b"")
    assert rest.api_version(str(tmp_path)) == expected


def test_no_rest_plugin_is_a_clear_error(tmp_path):
    (tmp_path / "openapi_dbv0_0_38.so").write_bytes(b"")
    with pytest.raises(cluster.ClusterError, match="apt-get install slurmrestd"):
        rest.api_version(str(tmp_path))


def _documented(path):
    """`#Key=value` / `Key=value` lines of a slurm-conf/ file."""
    return dict(re.findall(r"(?m)^#?([A-Z]\w+)=(\S+)$", (REPO / path).read_text()))


def test_slurm_conf_documents_the_accounting_lines():
    doc = _documented("slurm-conf/slurm.conf")
    used = dict(re.findall(r"(?m)^(\w+)=(\S+)$", accounting.slurm_conf_lines("/w", 6819, "munge")))
    for key in ("AccountingStorageType", "AccountingStorageTRES", "JobCompType"):
        assert doc[key] == used[key], key
    assert doc["AccountingStorageTRES"] == "gres/k8scpu,gres/k8smemory"
    assert doc["AuthAltTypes"] == "auth/jwt"
    assert rest.slurm_conf_lines("/k").startswith("AuthAltTypes=auth/jwt\n")


def test_slurmdbd_conf_documents_what_the_testbed_writes():
    doc = _documented("slurm-conf/slurmdbd.conf")
    used = dict(re.findall(r"(?m)^(\w+)=(\S+)$", accounting.slurmdbd_conf_text(
        "/w", dbd_port=1, mysql_port=2, password="x", auth="munge")))
    for key in ("StorageType", "StorageLoc", "StorageUser", "SlurmUser", "AuthType"):
        assert doc[key] == used[key], key
    assert set(doc) <= set(used), set(doc) - set(used)


@pytest.mark.parametrize("files,expected", [
    (["openapi_v0_0_37.so", "openapi_v0_0_38.so", "openapi_dbv0_0_38.so"], "openapi/dbv0.0.38"),
    (["openapi_v0_0_38.so"], None),                          # no slurmdbd API shipped
    (["openapi_slurmctld.so", "openapi_slurmdbd.so", "data_parser_v0_0_41.so"],
     "openapi/slurmdbd"),
])
def test_rest_db_plugin(tmp_path, files, expected):
    for name in files:
        (tmp_path / name).write_bytes(b"")
    assert rest.db_plugin(str(tmp_path)) == expected


def test_slurmdbd_checks_jwt_only_with_rest():
    with_key = accounting.slurmdbd_conf_text("/w", dbd_port=1, mysql_port=2, password="x",
                                             auth="munge", jwt_key="/w/etc/jwt_hs256.key")
    assert "AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key=/w/etc/jwt_hs256.key\n" in with_key
    assert "AuthAlt" not in accounting.slurmdbd_conf_text("/w", dbd_port=1, mysql_port=2,
                                                          password="x", auth="munge")
