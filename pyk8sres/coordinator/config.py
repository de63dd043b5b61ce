"""The coordinator's settings: what they are, how a TOML file sets them,
and the checks that refuse a file before anything runs.

`SyncConfig` (the file's top level or its [sync] table) is read by the
sync daemon, the webhook, the scope they share and `pyk8sres status`, so a
node maps the same way everywhere; `WebhookConfig` (its [webhook] table)
by the webhook alone.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib

from . import slurm
from ..policy import gpus
from ..policy import usage
from ..policy import workers


@dataclasses.dataclass
class SyncConfig:
    kubeconfig: str | None = None          # None: in-cluster, else ~/.kube/config
    context: str | None = None
    # None: as k8s_resources.conf next to slurm.conf says, so the daemon
    # and the slurmctld plugin agree.
    ledger_socket: str | None = None
    # Node mapping, admin-owned only: node_map (here), else the node label
    # node_key (must be under node-restriction.kubernetes.io/: kubelets cannot
    # set it), else the same name (map_by_name).  Annotations are never read.
    node_key: str = usage.NODE_LABEL
    node_map: dict = dataclasses.field(default_factory=dict)   # k8s node -> Slurm node
    map_by_name: bool = True
    # Pods that hold nothing (Slurm's own workers): "namespace" or
    # "namespace/serviceaccount" entries.  Nothing a pod creator sets counts.
    slurm_workers: list = dataclasses.field(default_factory=list)
    # Slurm run inside Kubernetes (policy/workers.py): its worker pods are
    # the Slurm nodes.  "slinky" or "ack" (the operators' presets), "custom"
    # (worker_labels and worker_node_name say), "" (off).  Each worker in
    # worker_namespace (required: only the admin's namespace is trusted)
    # maps its spec.nodeName to its Slurm node where node_map, node_key and
    # map_by_name map nothing, and holds no share: it is a Slurm node.
    worker_pods: str = ""
    worker_namespace: str = ""
    worker_labels: dict = dataclasses.field(default_factory=dict)  # more labels a worker has
    worker_node_name: str = ""      # "pod-name", "hostname" or "label:<key>" ("": the preset's)
    placeholder_namespace: str = "pyk8sres-placeholders"  # slurm-share-<node> pods (the chart's)
    cluster_name: str | None = None             # GenericNode spec.clusterName; None: Slurm's
    resync_seconds: float = 1.0     # check health and retry failures even without events
    # Recompute every node at least this often even when nothing changed
    # (events, Slurm's view and the watches' health recompute at once).
    idle_full_seconds: float = 30.0
    # Read every Slurm node at least this often; each resync period in
    # between only if the ledger saw a node change (a job, a capacity).
    slurm_read_seconds: float = 10.0
    # Re-send unchanged shares this often where the ledger's show says it
    # may hold something else (reservations not seen bound, another share).
    repair_seconds: float = 30.0
    reservation_grace: float = 30.0  # keep an admitted pod's reservation this long before it
                                     # shows up bound (the webhook reserves before binding)
    # A pod that left the API server before its containers were seen gone (a
    # forced delete, pod GC after its Node went) keeps its share for what is
    # left of its grace period plus this long: the kubelet's own delay in
    # noticing and killing (policy/departures.py).  At least
    # kube-controller-manager's node-monitor-grace-period, so that a node
    # partitioned as the pod went is seen NotReady (and waited for) before
    # the hold ends.
    departed_margin_seconds: float = 60.0
    debounce_seconds: float = 0.005  # let a burst of pod events land in one cycle
    request_timeout: float = 10.0   # client-side timeout of every API call
    watch_timeout: int = 15         # server-side watch duration: a watch silent for this
                                    # plus request_timeout is stale (nothing released)
    backoff_max: float = 30.0
    generic_nodes: bool = True      # write GenericNode objects
    # GenericNode writes per second, sustained and at once (kube-controller-
    # manager's client defaults) for updates: under a burst of pods each
    # node's object lags, updated oldest change first with its newest state,
    # instead of one API write per pod.  Creating a node's object (once) is
    # not budgeted; the ledger and the placeholders are never throttled.
    generic_node_qps: float = 20.0
    generic_node_burst: int = 30
    # One node's GenericNode status is updated at most once per this many
    # seconds, with its newest state (policy/status_writes.py): the first
    # change at once, later ones folded into one write at the interval's
    # end.  0: every change is written (within the budget above).
    generic_node_min_interval_seconds: float = 2.0
    create_crd: bool = True         # create the GenericNode CRD if missing
    metrics_address: str = "127.0.0.1:9710"   # /metrics, /healthz, /readyz over HTTP ("": none)
    metrics_seconds: float = 5.0    # how often the ledger's show() refreshes the node gauges
    events: bool = True             # post Kubernetes Events (oversubscribed, ledger unreachable)
    event_update_seconds: float = 60.0   # a repeated node Event's count is written this often
    log_level: str = "INFO"
    # GPUs (docs/gpus.md): the DRA driver and DeviceClass of the GPUs
    # shared with Slurm, and how a device names its Slurm index (IDX):
    # "attribute" (the int attribute gpu_index_attribute), "name"
    # (gpu_name_pattern's one group) or "uuid" (the string attribute
    # gpu_uuid_attribute, found in gpu_uuids: Slurm node -> UUIDs in IDX order).
    gpu_driver: str = "gpu.nvidia.com"
    gpu_device_class: str = "gpu.nvidia.com"
    gpu_identity: str = "attribute"
    gpu_index_attribute: str = "index"
    gpu_name_pattern: str = r"gpu-(\d+)"
    gpu_uuid_attribute: str = "uuid"
    gpu_uuids: dict = dataclasses.field(default_factory=dict)
    # Device-plugin resources (counted, not named) on shared nodes:
    # legacy_gpu "refuse" refuses such pods there; "whole-node" admits one
    # only with every GPU of the node reserved for it, held while it is bound.
    legacy_gpu_resources: list = dataclasses.field(default_factory=lambda: ["nvidia.com/gpu"])
    legacy_gpu: str = "refuse"


class ConfigError(ValueError):
    pass


def load_config(path: str | None, base: SyncConfig | None = None) -> SyncConfig:
    """SyncConfig from a TOML file (keys as the field names; '-' may be '_').

    Unknown keys and wrong types are errors: a typo must not change policy.
    """
    cfg = base or SyncConfig()
    if not path:
        return cfg
    with open(path, "rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from e
    doc = doc.get("sync", doc)  # allow an optional [sync] table
    fields = {f.name: f for f in dataclasses.fields(SyncConfig)}
    values = {}
    for k, v in doc.items():
        name = k.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{path}: unknown setting {k!r} (known: {', '.join(fields)})")
        default = getattr(SyncConfig(), name)
        want = type(default) if default is not None else str
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{path}: {k} must be {want.__name__}, not {v!r}")
        values[name] = v
    out = dataclasses.replace(cfg, **values)
    try:
        usage.check_node_label(out.node_key)
        exemptions_of(out)
        gpus.check_identity(gpu_identity(out))
        gpus.check_legacy_mode(out.legacy_gpu)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    if out.reservation_grace <= out.watch_timeout + out.request_timeout:
        raise ConfigError(f"{path}: reservation_grace ({out.reservation_grace} s) must exceed "
                          f"watch_timeout + request_timeout ({out.watch_timeout} + "
                          f"{out.request_timeout} s): a silent watch must be caught before an "
                          "admitted pod's reservation may expire")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in out.node_map.items()):
        raise ConfigError(f"{path}: node_map maps Kubernetes node names to Slurm node names (strings)")
    if not (out.generic_node_qps > 0 and out.generic_node_burst >= 1):
        raise ConfigError(f"{path}: generic_node_qps must be > 0 and generic_node_burst >= 1 "
                          "(generic_nodes = false writes none)")
    if not 0 <= out.generic_node_min_interval_seconds <= 60:
        raise ConfigError(f"{path}: generic_node_min_interval_seconds must be 0 to 60 s "
                          "(how far behind a GenericNode may show its node)")
    return out


def exemptions_of(cfg: SyncConfig) -> usage.Exemptions:
    return usage.exemptions(cfg.slurm_workers, cfg.placeholder_namespace, worker_selector(cfg))


def gpu_identity(cfg: SyncConfig) -> gpus.Identity:
    return gpus.Identity(driver=cfg.gpu_driver, device_class=cfg.gpu_device_class,
                         mode=cfg.gpu_identity, attribute=cfg.gpu_index_attribute,
                         pattern=cfg.gpu_name_pattern, uuid_attribute=cfg.gpu_uuid_attribute,
                         uuids=dict(cfg.gpu_uuids))


def whole_node_gpu_resources(cfg: SyncConfig) -> tuple[str, ...]:
    """The resources whose pods hold every GPU of their node (none unless
    legacy_gpu is "whole-node")."""
    return tuple(cfg.legacy_gpu_resources) if cfg.legacy_gpu == "whole-node" else ()


def worker_selector(cfg: SyncConfig) -> workers.Selector | None:
    """The worker pods' selector (None: worker_pods is off); ValueError
    for settings that cannot be used."""
    return workers.selector(cfg.worker_pods, cfg.worker_namespace, cfg.worker_labels,
                            cfg.worker_node_name)


def fill_from_slurm_conf(cfg: SyncConfig) -> SyncConfig:
    """Take the ledger socket from slurm.conf/k8s_resources.conf where not set."""
    slurm_conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    return dataclasses.replace(
        cfg, ledger_socket=cfg.ledger_socket or slurm.ledger_socket_path(slurm_conf))


@dataclasses.dataclass
class WebhookConfig:
    listen: str = "0.0.0.0:8443"
    configuration: str = "pyk8sres-admission"     # ValidatingWebhookConfiguration name
    webhook_name: str = "admission.pyk8sres.io"
    url: str | None = None          # clientConfig.url (outside a cluster); else the manifest's service
    service_dns: tuple = ("pyk8sres-coordinator.pyk8sres-system.svc",)  # names in our certificate
    cert_dir: str = "/var/lib/pyk8sres/webhook-tls"
    tls_cert_file: str | None = None   # cert-manager: the mounted Secret's tls.crt/tls.key
    tls_key_file: str | None = None
    # Only the API server may ask for a reservation: the CA of the client
    # certificate it presents (AdmissionConfiguration kubeConfigFile), and
    # the names (certificate CN or DNS SAN) that CA issued to it.
    client_ca_file: str | None = None
    client_names: tuple = ("kube-apiserver",)
    cert_days: float = 90.0
    ca_days: float = 3650.0
    ca_promote_seconds: float = 120.0  # a new CA is in the bundle this long before it signs
    ledger_socket: str | None = None   # None: as sync's (k8s_resources.conf / StateSaveLocation)
    ledger_timeout: float = 2.0
    refresh_seconds: float = 5.0       # shared node list, certificates, configuration
    metrics_address: str = "127.0.0.1:9711"   # /metrics, /healthz, /readyz over HTTP ("": none)
    events: bool = True                # post Kubernetes Events for refusals
    # A reserved create (spec.nodeName) is read back this long after it was
    # admitted; one that never became a pod (ResourceQuota, AlreadyExists)
    # has its reservation released, and its namespace's creates on shared
    # nodes are refused for phantom_hold_seconds (0: never refused).
    confirm_create_seconds: float = 2.0
    phantom_hold_seconds: float = 10.0
    # Connection limits (webhook_server.py says how they work together).
    handshake_timeout: float = 5.0     # accept to finished TLS handshake
    request_timeout: float = 5.0       # a caller without the API server's certificate: one request
    idle_timeout: float = 120.0        # the API server's kept-alive connection between reviews
    max_pending_connections: int = 1024       # handshakes under way; one more closes the oldest
    max_anonymous_connections: int = 32       # no API server certificate; one more cuts the oldest
    max_api_server_connections: int = 256
    listener_stall_seconds: float = 30.0      # /healthz fails once the listener stops this long


def load_webhook_config(path: str | None) -> WebhookConfig:
    """[webhook] table of the coordinator config (unknown keys are errors)."""
    cfg = WebhookConfig()
    if not path:
        return cfg
    with open(path, "rb") as f:
        doc = tomllib.load(f).get("webhook") or {}
    fields = {f.name for f in dataclasses.fields(WebhookConfig)}
    values = {}
    for k, v in doc.items():
        name = k.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{path}: unknown webhook setting {k!r}")
        values[name] = tuple(v) if name in ("service_dns", "client_names") else v
    return dataclasses.replace(cfg, **values)


def check_webhook_config(wcfg: WebhookConfig, scfg: SyncConfig) -> None:
    """Refuse webhook settings that cannot work with the sync daemon's."""
    if not 0 < wcfg.confirm_create_seconds < scfg.reservation_grace:
        raise ConfigError(
            f"webhook: confirm_create_seconds ({wcfg.confirm_create_seconds}) must be above 0 "
            f"and below the sync daemon's reservation_grace ({scfg.reservation_grace})")
    if wcfg.phantom_hold_seconds < 0:
        raise ConfigError("webhook: phantom_hold_seconds must be 0 (never) or more")
