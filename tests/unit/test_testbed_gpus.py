"""The test cluster's fake GPUs as each side is told of them: gres.conf and
the DRA objects NVIDIA's driver would publish (same index on both sides)."""
import os
import stat

import pytest

from pyk8sres.testbed import gpus, slurm_conf, workdir


def test_gres_conf_names_one_device_per_gpu_without_autodetect():
    text = slurm_conf.gres_conf_text("/w", 3)
    assert "AutoDetect=off\nName=gpu File=/w/dev/gpu[0-2]\n" in text
    assert slurm_conf.gpu_device_paths("/w", 3) == ["/w/dev/gpu0", "/w/dev/gpu1", "/w/dev/gpu2"]
    assert "gpu" not in slurm_conf.gres_conf_text("/w", 0)


def test_dra_objects():
    objs = gpus.dra_objects(["n1", "n2"], 2)
    assert [o["kind"] for o in objs] == ["DeviceClass", "ResourceSlice", "ResourceSlice"]
    assert objs[0]["metadata"]["name"] == "gpu.nvidia.com"
    assert objs[0]["spec"]["selectors"] == [
        {"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]
    spec = objs[2]["spec"]
    assert spec["driver"] == "gpu.nvidia.com" and spec["nodeName"] == "n2"
    assert spec["pool"] == {"name": "n2", "generation": 1, "resourceSliceCount": 1}
    assert [(d["name"], d["attributes"]["index"]) for d in spec["devices"]] == [
        ("gpu-0", {"int": 0}), ("gpu-1", {"int": 1})]
    assert all(o["apiVersion"] == "resource.k8s.io/v1" for o in objs)
    assert gpus.dra_objects(["n1"], 0) == []


def test_uuids_are_fixed_per_node_and_index_and_distinct():
    uuids = {gpus.device_uuid(n, i) for n in ("n1", "n2") for i in range(4)}
    assert len(uuids) == 8 and all(u.startswith("GPU-") for u in uuids)
    assert gpus.device_uuid("n1", 0) == gpus.device_uuid("n1", 0)
    assert gpus.resource_slice("n1", 1)["spec"]["devices"][0]["attributes"]["uuid"] == {
        "string": gpus.device_uuid("n1", 0)}


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_gpu_devices_are_character_devices_replacing_plain_files(tmp_path):
    old = tmp_path / "gpu0"
    old.write_text("")                          # an earlier cluster's empty file
    for _ in range(2):                          # a second `up` keeps them
        for p in (old, tmp_path / "gpu1"):
            workdir.make_gpu_device(str(p))
    for p in (old, tmp_path / "gpu1"):
        st = os.stat(p)
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3), p
