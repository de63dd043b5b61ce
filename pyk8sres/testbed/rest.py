"""`pyk8sres cluster up --rest`: slurmrestd with JWT, as sites set it up.

slurmctld gets `AuthAltTypes=auth/jwt` and a fresh HS256 key
(etc/jwt_hs256.key, 0600, owned by SlurmUser: only slurmctld reads it);
`scontrol token` then hands out tokens.  slurmrestd runs `rest_auth/jwt`,
which only passes each request's token on to slurmctld, so it needs no key
and no munge.  Slurm's rules (22.05 slurmrestd.c): it may run neither as
root, nor with root's group, nor as SlurmUser or with SlurmUser's group; it
runs as `nobody`:`nogroup` (-u/-g: set right after binding its socket,
before reading slurm.conf), listening on 127.0.0.1 only.  They are given
by number: from 25.11 on, Slurm's uid_from_string() answers the name
"nobody" with its own SLURM_AUTH_NOBODY as an error code, and slurmrestd
stops with `fatal: Unable to resolve user: nobody`.

It reads slurm.conf as `nobody`: it gets a world-readable copy
(rest/slurm.conf) whose PluginDir is Slurm's own, so the work directory
must be traversable by others.
"""
from __future__ import annotations

import glob
import grp
import json
import os
import pwd
import re
import secrets
import socket
import subprocess
import urllib.error
import urllib.request

from .. import install
from . import daemons

REST_USER, REST_GROUP = "nobody", "nogroup"


def api_version(plugin_dir: str) -> tuple[str, str]:
    """(slurmrestd -s argument, URL version) of the newest slurmctld API this
    Slurm serves: 22.05 ships openapi/v0.0.36..38 (-> "openapi/v0.0.38",
    "v0.0.38"); 23.11+ serve it through openapi/slurmctld with data_parser
    plugins named after the versions."""
    def newest(pattern: str) -> str | None:
        found = []
        for path in glob.glob(os.path.join(plugin_dir, pattern)):
            m = re.search(r"_v(\d+)_(\d+)_(\d+)\.so$", path)
            if m:
                found.append(tuple(map(int, m.groups())))
        return "v%d.%d.%d" % max(found) if found else None
    legacy = newest("openapi_v*.so")
    if legacy:
        return f"openapi/{legacy}", legacy
    parser = newest("data_parser_v*.so")
    if parser and os.path.exists(os.path.join(plugin_dir, "openapi_slurmctld.so")):
        return "openapi/slurmctld", parser
    raise daemons.ClusterError(f"no slurmctld REST API plugin (openapi_v*.so) in {plugin_dir}: "
                               "apt-get install slurmrestd")


def db_plugin(plugin_dir: str) -> str | None:
    """The slurmrestd -s argument of the accounting (slurmdbd) API, if the
    release ships it: 22.05 openapi/dbv0.0.38 (served under /slurmdb/v0.0.38),
    23.11+ openapi/slurmdbd."""
    _, version = api_version(plugin_dir)
    legacy = "openapi_db" + version.replace(".", "_") + ".so"
    if os.path.exists(os.path.join(plugin_dir, legacy)):
        return "openapi/db" + version
    if os.path.exists(os.path.join(plugin_dir, "openapi_slurmdbd.so")):
        return "openapi/slurmdbd"
    return None


def check_installed(release) -> None:
    daemons.need("slurmrestd", "slurmrestd", release)
    for plugin in ("auth_jwt", "rest_auth_jwt"):
        if not release.has_plugin(plugin):
            raise daemons.ClusterError(f"Slurm {release.name} has no {plugin}.so: "
                                       "apt-get install slurm-wlm-jwt-plugin")
    api_version(release.plugin_dir)


def write_jwt_key(work: str, slurm_user: str) -> str:
    """A new random HS256 key, 0600 and owned by SlurmUser (slurmctld's, and
    slurmdbd's when it validates tokens too); returns its path."""
    path = os.path.join(os.path.abspath(work), "etc", "jwt_hs256.key")
    daemons.write_private(path, secrets.token_bytes(32), slurm_user)
    return path


def slurm_conf_lines(key: str) -> str:
    return f"AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key={key}\n"


def start(c: daemons.SlurmHandle, port: int, accounting: bool = False) -> str:
    """Start slurmrestd for cluster `c` on 127.0.0.1:port; returns its URL.
    accounting: also serve slurmdbd's API (/slurmdb/...: jobs with their
    TRES, as sacct), where the release has it."""
    binary = daemons.need("slurmrestd", "slurmrestd", c.release)
    plugin_arg, _ = api_version(c.release.plugin_dir)
    db = db_plugin(c.release.plugin_dir) if accounting else None
    if db:
        plugin_arg += "," + db
    rest_dir = os.path.join(c.work, "rest")
    os.makedirs(rest_dir, exist_ok=True)
    os.chmod(rest_dir, 0o755)
    conf = os.path.join(rest_dir, "slurm.conf")
    with open(c.conf) as f:
        text = re.sub(r"(?m)^PluginDir=.*$", f"PluginDir={c.release.plugin_dir}", f.read())
    with open(conf, "w") as f:
        f.write(text)
    os.chmod(conf, 0o644)
    blocked = install.unreadable_by_others(conf)
    if blocked:
        raise daemons.ClusterError(f"{blocked} cannot be entered by {REST_USER} (slurmrestd "
                                   "reads slurm.conf as that user): use a work directory "
                                   "others can traverse (chmod 755)")
    # SLURM_JWT=daemon: slurmrestd talks to slurmctld with each caller's
    # token (auth/jwt) instead of munge.
    env = dict(c.env, SLURM_CONF=conf, SLURM_JWT="daemon")
    daemons.start_process(c.work, "slurmrestd", [
        binary, "-f", conf, "-u", str(pwd.getpwnam(REST_USER).pw_uid),
        "-g", str(grp.getgrnam(REST_GROUP).gr_gid), "-s", plugin_arg,
        "-a", "rest_auth/jwt", f"127.0.0.1:{port}"], env=env, cwd="/")

    def listening():
        if not daemons.running(c.work, "slurmrestd"):
            raise daemons.ClusterError("slurmrestd exited: "
                                       + daemons.log_tail(c.work, "slurmrestd.out"))
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0
    daemons.wait_until(listening, f"slurmrestd to listen on {port}", 30)
    return f"http://127.0.0.1:{port}"


def token(c: daemons.SlurmHandle, user: str = "root", lifespan: int = 3600) -> str:
    """A JWT from `scontrol token` (only root or SlurmUser may name another user)."""
    proc = subprocess.run(["scontrol", "token", f"username={user}", f"lifespan={lifespan}"],
                          capture_output=True, text=True, env=c.env, timeout=30, cwd="/")
    m = re.search(r"SLURM_JWT=(\S+)", proc.stdout)
    if proc.returncode or not m:
        raise daemons.ClusterError(f"scontrol token failed: {proc.stderr.strip()}")
    return m.group(1)


def request(url: str, method: str, path: str, body=None, *, user: str, token: str,
            timeout: float = 30) -> tuple[int, dict]:
    """(HTTP status, decoded JSON) of one request with the JWT headers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "Content-Type": "application/json", "X-SLURM-USER-NAME": user,
        "X-SLURM-USER-TOKEN": token})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"raw": raw.decode(errors="replace")}
