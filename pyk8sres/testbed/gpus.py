"""The test cluster's fake GPUs as Kubernetes sees them: what NVIDIA's DRA
driver (k8s-dra-driver-gpu) would publish for each node, written here by
hand since kwok runs no kubelet plugin.

    DeviceClass    gpu.nvidia.com: every device of driver gpu.nvidia.com
    ResourceSlice  one per node, driver gpu.nvidia.com, pool = the node's
                   name (generation 1, the pool's only slice), nodeName =
                   the node; devices gpu-<i> with attributes index (int, the
                   same i as Slurm's IDX of that node's GPU) and uuid
                   (string, fixed per node and index)

kube-scheduler allocates ResourceClaims against these slices (it needs no
driver for that) and binds the pod; kwok then runs it.  Nothing here
talks to the API server: hybrid.start_kubernetes applies the objects.
"""
from __future__ import annotations

import uuid

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
API_VERSION = "resource.k8s.io/v1"
# uuid5 namespace of the fake GPUs' UUIDs: the same node and index give the
# same UUID on every run, as a real GPU keeps its own.
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "gpus.testbed.pyk8sres")


def device_name(index: int) -> str:
    return f"gpu-{index}"


def device_uuid(node: str, index: int) -> str:
    """GPU-<uuid>, as nvidia-smi prints a GPU's UUID."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


def device_class() -> dict:
    return {"apiVersion": API_VERSION, "kind": "DeviceClass",
            "metadata": {"name": DEVICE_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}


def resource_slice(node: str, gpus: int) -> dict:
    devices = [{"name": device_name(i),
                "attributes": {"index": {"int": i}, "uuid": {"string": device_uuid(node, i)}}}
               for i in range(gpus)]
    return {"apiVersion": API_VERSION, "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}}


def dra_objects(nodes: list[str], gpus: int) -> list[dict]:
    """The DeviceClass and each node's ResourceSlice; none without GPUs."""
    if gpus <= 0:
        return []
    return [device_class()] + [resource_slice(n, gpus) for n in nodes]


def claim_template(name: str, count: int = 1, namespace: str = "default") -> dict:
    """A ResourceClaimTemplate asking for `count` GPUs of the class, as a user writes it."""
    return {"apiVersion": API_VERSION, "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": DEVICE_CLASS,
                                            "count": count}}]}}}}


def gpu_pod(name: str, template: str, node: str | None = None, namespace: str = "default",
            grace: int | None = None, labels: dict | None = None) -> dict:
    """A pod whose one claim comes from ResourceClaimTemplate `template`,
    pinned to `node` when given (its hostname label, as a user pins one);
    grace: its terminationGracePeriodSeconds (None: the API's default)."""
    resources = {"requests": {"cpu": "100m", "memory": "64Mi"}, "claims": [{"name": "gpu"}]}
    spec: dict = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                  "containers": [{"name": "c", "image": "busybox", "resources": resources}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    meta = {"name": name, "namespace": namespace, **({"labels": labels} if labels else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
