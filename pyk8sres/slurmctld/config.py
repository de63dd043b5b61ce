"""The admin's settings: `k8s_resources.conf`, next to slurm.conf.

Slurm style `Key=Value` lines, `#` comments, keys case-insensitive.  Unknown
keys and bad values are errors (a typo must not silently change policy).
Read at plugin init and on `scontrol reconfigure`, never per job.
"""
from __future__ import annotations

import dataclasses
import os

from ..policy.hostlist import ascii_digits as _digits

CONF_NAME = "k8s_resources.conf"


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Config:
    # What a job_submit internal failure (a bug, not bad user input) does:
    # "reject" the job with a message, or "accept" it unchanged.
    on_internal_error: str = "reject"
    # A job asking for less k8scpu/k8smemory than it uses: "correct" it up,
    # or "reject" it.
    under_request: str = "correct"
    # Who may call the ledger besides root and SlurmUser (numeric uids: no
    # user lookups inside slurmctld), e.g. the coordinator's service user.
    ledger_users: tuple = ()
    # The group (numeric gid) the ledger socket is opened to (mode 0660):
    # LedgerUsers must be members, and so must SlurmUser (to give the socket
    # to it).  None: mode 0600, only root and SlurmUser can connect.
    ledger_group: int | None = None
    # Connections one uid may hold to the ledger at once (one more is
    # answered "busy" and closed).  Every coordinator process of a site runs
    # as one uid: each webhook replica holds two (admission, placeholders),
    # the sync daemon one, `pyk8sres status` one while it runs.
    ledger_connections_per_user: int = 32
    # The ledger's socket; empty = StateSaveLocation/k8s_resources.socket.
    ledger_socket: str = ""
    # Capacity kept away from both schedulers (kubelet, system daemons).
    reserve_cpus: int = 0
    reserve_memory_mb: int = 0
    # Hold a node slurmctld newly registers at runtime (`slurmd -Z`,
    # `scontrol create node`) whole in the ledger until the coordinator's
    # first `set` there: under Slurm in Kubernetes a new worker pod's slurmd
    # may come up beside pods nobody has counted yet (docs/ledger.md).
    hold_new_nodes: str = "no"


# Each connection may hold a reply of up to 4 MiB in slurmctld.
MAX_CONNECTIONS_PER_USER = 1024

_CHOICES = {
    "on_internal_error": ("reject", "accept"),
    "under_request": ("correct", "reject"),
    "hold_new_nodes": ("no", "yes"),
}
_KEYS = {
    "oninternalerror": "on_internal_error",
    "underrequest": "under_request",
    "ledgerusers": "ledger_users",
    "ledgergroup": "ledger_group",
    "ledgersocket": "ledger_socket",
    "ledgerconnectionsperuser": "ledger_connections_per_user",
    "reservecpus": "reserve_cpus",
    "reservememory": "reserve_memory_mb",
    "holdnewnodes": "hold_new_nodes",
}


def parse(text: str, *, source: str = CONF_NAME, base: Config = Config()) -> Config:
    values: dict[str, object] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        field = _KEYS.get(key.strip().lower())
        if not sep or field is None:
            raise ConfigError(f"{source}:{lineno}: unknown setting {key.strip()!r}"
                              f" (known: {', '.join(sorted(_KEYS))})")
        value = value.strip()
        if field in _CHOICES:
            value = value.lower()
            if value not in _CHOICES[field]:
                raise ConfigError(f"{source}:{lineno}: {key.strip()} must be one of "
                                  f"{'/'.join(_CHOICES[field])}, not {value!r}")
        elif field == "ledger_users":
            uids = [u.strip() for u in value.split(",") if u.strip()]
            if not all(_digits(u) and int(u) < 1 << 32 for u in uids):
                raise ConfigError(f"{source}:{lineno}: {key.strip()} takes numeric uids "
                                  f"separated by commas, not {value!r}")
            value = tuple(int(u) for u in uids)
        elif field == "ledger_group":
            if not _digits(value) or int(value) >= 1 << 32:
                raise ConfigError(f"{source}:{lineno}: {key.strip()} takes a numeric gid, "
                                  f"not {value!r}")
            value = int(value)
        elif field == "ledger_connections_per_user":
            if not (value.isascii() and value.isdigit()
                    and 1 <= int(value) <= MAX_CONNECTIONS_PER_USER):
                raise ConfigError(f"{source}:{lineno}: {key.strip()} takes a number of "
                                  f"connections from 1 to {MAX_CONNECTIONS_PER_USER}, "
                                  f"not {value!r}")
            value = int(value)
        elif isinstance(getattr(base, field), int):
            if not _digits(value):
                raise ConfigError(f"{source}:{lineno}: {key.strip()} needs a "
                                  f"non-negative integer (digits 0-9), not {value!r}")
            value = int(value)
        values[field] = value
    return dataclasses.replace(base, **values)


def conf_path(slurm_conf_path: str) -> str:
    return os.path.join(os.path.dirname(slurm_conf_path) or ".", CONF_NAME)


def load(slurm_conf_path: str) -> Config:
    """The settings next to `slurm_conf_path`; defaults when the file is absent."""
    path = conf_path(slurm_conf_path)
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f.read(), source=path)
    except FileNotFoundError:
        return Config()
