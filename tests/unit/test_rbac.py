"""The RBAC the Helm chart renders (deploy/helm/pyk8sres, `helm template`
with the real helm that kube/build.sh builds) grants exactly the Kubernetes
calls the coordinator makes.

The calls are derived from the code, not listed by hand: every module of
pyk8sres/coordinator/ that calls into kube.py is assigned to the daemon that
runs it; from there the kube.py functions reached (through its own calls and
Kube methods) name the official client's methods they use, and the client's
own source says each method's HTTP method and path (its `_*_serialize`).
The path and method give (API group, resource, verb) by the API server's
request rules (GET on a collection is list, with watch=True watch; PUT is
update; ...).  That set must equal what the chart grants each daemon's
ServiceAccount, both ways: nothing missing, nothing extra.
"""
import ast
import functools
import inspect
import re
import tempfile
from pathlib import Path

import pytest

kubernetes = pytest.importorskip("kubernetes")
# After the skip: the chart module needs yaml, which comes with the kubernetes client.
from pyk8sres.testbed import chart, kubernetes as controlplane, pki  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
COORD = REPO / "pyk8sres" / "coordinator"
NAMESPACE = "pyk8sres-system"                # the release's: the ServiceAccounts
PLACEHOLDERS = "pyk8sres-placeholders"       # the placeholder pods' (a Role there)

# Which daemon (ServiceAccount) runs which module's Kubernetes calls.
DAEMONS = {
    "pyk8sres-sync": ["sync.py", "generic_nodes.py", "events.py", "gpus.py"],
    "pyk8sres-webhook": ["webhook.py", "confirm.py", "placeholder.py", "events.py"],
}
# Modules whose namespaced calls stay in the coordinator's namespace (a Role
# there, not a ClusterRole): the placeholder pods live in PLACEHOLDERS.
OWN_NAMESPACE_ONLY = {"placeholder.py", "gpus.py"}
# An Informer given a namespace (Informer(..., namespace=...)) reads only
# that one: Slurm's worker pods, in sync.workerNamespace (a Role there,
# rendered with WORKER_VALUES).
WORKERS = "slurm"
WORKER_VALUES = ["--set", "sync.workerPods=slinky", "--set", f"sync.workerNamespace={WORKERS}"]
# Run by an admin with the admin's own credentials, never by a daemon.
ADMIN_TOOLS = {"status.py"}
# Calls the code makes but that RBAC deliberately does not grant: ensure_crd
# takes a 403 as "the admin applied the CRD" (kube.py).
DENIED_ON_PURPOSE = {
    ("pyk8sres-sync", ("apiextensions.k8s.io", "customresourcedefinitions", "get")),
    ("pyk8sres-sync", ("apiextensions.k8s.io", "customresourcedefinitions", "create")),
}
APIS = {"core": "CoreV1Api", "custom": "CustomObjectsApi", "ext": "ApiextensionsV1Api",
        "admission": "AdmissionregistrationV1Api", "resource": "ResourceV1Api"}


def _kube_py():
    """kube.py's functions: {name: ast node}; Kube and Informer methods
    are named 'Kube.x' / 'Informer.x'.  Also GROUP and PLURAL."""
    tree = ast.parse((COORD / "kube.py").read_text())
    funcs, consts = {}, {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            funcs[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    funcs[f"{node.name}.{item.name}"] = item
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    consts[t.id] = node.value.value
    return funcs, consts


FUNCS, CONSTS = _kube_py()


def _resolve(name: str) -> str | None:
    """A called name -> the kube.py function it is (Kube methods by method name)."""
    if name in FUNCS:
        return name
    for owner in ("Kube", "Informer"):
        if f"{owner}.{name}" in FUNCS:
            return f"{owner}.{name}"
    return None


def _has_watch_kw(call: ast.Call) -> bool:
    return any(k.arg == "watch" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def _client_methods(func: str, watch: bool = False, seen=None) -> set:
    """(api, client method, watch) reached from a kube.py function."""
    seen = set() if seen is None else seen
    if (func, watch) in seen:
        return set()
    seen.add((func, watch))
    found = set()
    for node in ast.walk(FUNCS[func]):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in APIS:
            found.add((node.value.attr, node.attr, watch))
        if isinstance(node, ast.Call) and _raw_request(node):
            found.add(("raw", _raw_request(node), watch))
        if isinstance(node, ast.Call):
            f = node.func
            # A bare name is a module function (never a method: `list(...)`
            # is the builtin); `x.name(...)` may be a Kube/Informer method.
            callee = (f.id if isinstance(f, ast.Name) and f.id in FUNCS else
                      _resolve(f.attr) if isinstance(f, ast.Attribute) else None)
            if callee and callee != func:
                found |= _client_methods(callee, watch or _has_watch_kw(node), seen)
    return found


def _raw_request(call: ast.Call) -> str | None:
    """"METHOD PATH" of a Kube.request call (`x.request("PATCH", SOME_PATH, ...)`,
    the path one of kube.py's constants), else None."""
    f, args = call.func, call.args
    if not (isinstance(f, ast.Attribute) and f.attr == "request" and len(args) >= 2):
        return None
    method, path = args[0], args[1]
    assert isinstance(method, ast.Constant) and isinstance(path, ast.Name) \
        and path.id in CONSTS, "Kube.request: a literal method and one of kube.py's *_PATH"
    return f"{method.value} {CONSTS[path.id]}"


def _http(api: str, method: str) -> tuple[str, str]:
    """(HTTP method, path) of a client method, from the client's own source."""
    if api == "raw":            # Kube.request: "METHOD PATH"
        return tuple(method.split(" ", 1))
    cls = getattr(kubernetes.client, APIS[api])
    src = inspect.getsource(getattr(cls, f"_{method}_serialize"))
    m = re.search(r"method='(\w+)',\s*resource_path='([^']+)'", src)
    assert m, f"cannot read the path of {APIS[api]}.{method} in this client version"
    return m.group(1), m.group(2)


def _rule(http: str, path: str, watch: bool) -> tuple[tuple[str, str, str], bool]:
    """((group, resource, verb), namespaced) as the API server's RequestInfo sees it."""
    path = path.replace("{group}", CONSTS["GROUP"]).replace("{plural}", CONSTS["PLURAL"])
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    namespaced = rest[:1] == ["namespaces"] and len(rest) > 2
    if namespaced:
        rest = rest[2:]
    resource, named = rest[0], len(rest) > 1
    if len(rest) > 2:
        resource += "/" + rest[2]
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if named else "deletecollection"}.get(http)
    if http == "GET":
        verb = "get" if named else ("watch" if watch else "list")
    return (group, resource, verb), namespaced


def _module_entries(module: str) -> set:
    """kube.py functions a coordinator module calls (kube.x, also under an
    alias, self.kube.x, names imported from .kube)."""
    tree = ast.parse((COORD / module).read_text())
    imported, kube_aliases = set(), {"kube"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kube" and node.level == 1:
            imported |= {a.asname or a.name for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
            kube_aliases |= {a.asname or a.name for a in node.names if a.name == "kube"}
    entries = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in imported and _resolve(f.id):
            entries.add(_resolve(f.id))
        elif isinstance(f, ast.Attribute) and _resolve(f.attr):
            receiver = f.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else \
                receiver.id if isinstance(receiver, ast.Name) else ""
            if name in kube_aliases or name == "kube":
                entries.add(_resolve(f.attr))
        # Informer(kube, kind, ...).start() runs Informer.run for that kind
        # (any kind when it is not a constant).
        if (isinstance(f, ast.Name) and f.id == "Informer" and "Informer" in imported) or \
                (isinstance(f, ast.Attribute) and f.attr == "Informer"):
            kind = node.args[1] if len(node.args) > 1 else None
            scoped = "@ns" if any(k.arg == "namespace" for k in node.keywords) else ""
            entries.add(f"Informer.run[{kind.value}{scoped}]" if isinstance(kind, ast.Constant)
                        else "Informer.run")
    return {e for e in entries if e}


def _listers() -> dict:
    """kind -> the client method Kube._lister lists and watches it with."""
    out = {}
    for node in ast.walk(FUNCS["Kube._lister"]):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            kind = node.test.comparators[0].value
            out[kind] = node.body[0].value.attr
    return out


def _entry_methods(entry: str) -> set:
    """(api, client method, watch) an entry of _module_entries reaches."""
    if not entry.startswith("Informer.run["):
        return _client_methods(entry)
    kind = entry[len("Informer.run["):-1]
    scoped = kind.endswith("@ns")
    others = {m for k, m in _listers().items() if k != kind.removesuffix("@ns")}
    # One namespace's Informer lists with the namespaced lister, the others not.
    return {c for c in _client_methods("Informer.run")
            if c[1] not in others and c[1].startswith("list_namespaced_") == scoped}


@functools.lru_cache(maxsize=1)
def _code_calls() -> dict:
    """{serviceaccount: (cluster-wide rules, rules in PLACEHOLDERS, rules in WORKERS)}."""
    out = {sa: (set(), set(), set()) for sa in DAEMONS}
    for sa, modules in DAEMONS.items():
        for module in modules:
            for entry in _module_entries(module):
                for api, method, watch in _entry_methods(entry):
                    rule, namespaced = _rule(*_http(api, method), watch)
                    if namespaced and entry.endswith("@ns]"):
                        out[sa][2].add(rule)
                    elif namespaced and module in OWN_NAMESPACE_ONLY:
                        out[sa][1].add(rule)
                    else:
                        out[sa][0].add(rule)
    return out


def code_calls():
    """{serviceaccount: (cluster-wide rules, rules in PLACEHOLDERS)} the code needs."""
    return {sa: (set(c), set(p)) for sa, (c, p, _) in _code_calls().items()}


def code_calls_in_workers():
    """{serviceaccount: rules in the workers' namespace} the code needs."""
    return {sa: set(w) for sa, (_, _, w) in _code_calls().items()}


@functools.lru_cache(maxsize=2)
def _rendered(workers: bool = False) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        ca = pki.Authority(tmp, "ca", "any CA").cert_file
        values = chart.host_values(ca, "https://127.0.0.1:1/validate")
        return tuple(chart.render(controlplane.build().helm,
                                  values + (WORKER_VALUES if workers else []), "rbac.yaml"))


def chart_rbac(workers: bool = False) -> list[dict]:
    """The chart's templates/rbac.yaml, rendered by helm (workers: with
    sync.workerPods set, its workers' namespace WORKERS)."""
    return list(_rendered(workers))


def granted(docs: list[dict] | None = None, in_workers: bool = False):
    """{serviceaccount: (cluster-wide rules, rules in PLACEHOLDERS)} the chart
    grants (docs: the RBAC objects; default: as the chart renders them);
    in_workers: {serviceaccount: rules in WORKERS} instead."""
    docs = chart_rbac() if docs is None else docs
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]):
             {(g, r, v) for rule in d["rules"] for g in rule["apiGroups"]
              for r in rule["resources"] for v in rule["verbs"]}
             for d in docs if d["kind"] in ("ClusterRole", "Role")}
    out, workers = {}, {}
    for d in docs:
        if d["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        ref = d["roleRef"]
        ns = d["metadata"].get("namespace")
        rules = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        for s in d["subjects"]:
            assert s["kind"] == "ServiceAccount" and s["namespace"] == NAMESPACE, s
            cluster, local = out.setdefault(s["name"], (set(), set()))
            if d["kind"] == "ClusterRoleBinding":
                cluster |= rules
            elif ns == WORKERS:
                workers.setdefault(s["name"], set()).update(rules)
            else:
                assert ns == PLACEHOLDERS, d["metadata"]
                local |= rules
    return workers if in_workers else out


def test_every_module_calling_kubernetes_belongs_to_a_daemon():
    assigned = {m for ms in DAEMONS.values() for m in ms} | ADMIN_TOOLS
    calling = {p.name for p in COORD.glob("*.py")
               if p.name != "kube.py" and _module_entries(p.name)}
    assert calling - assigned == set(), \
        "these modules call Kubernetes: add them to DAEMONS (and the chart's RBAC) or ADMIN_TOOLS"
    assert assigned - ADMIN_TOOLS <= calling | {"placeholder.py"}


def test_the_extraction_sees_the_calls_we_know():
    calls = code_calls()
    # Informers: list then watch; the webhook reads the pod under admission.
    assert {("", "pods", "list"), ("", "pods", "watch")} <= calls["pyk8sres-sync"][0]
    assert ("", "pods", "get") in calls["pyk8sres-webhook"][0]
    assert ("", "pods/resize", "patch") in calls["pyk8sres-webhook"][1]


def test_rbac_grants_exactly_what_the_code_calls():
    calls, grants = code_calls(), granted()
    assert set(grants) == set(DAEMONS), "ServiceAccounts bound by the chart vs daemons"
    for sa in DAEMONS:
        needed_cluster = calls[sa][0] - {r for s, r in DENIED_ON_PURPOSE if s == sa}
        assert sorted(needed_cluster - grants[sa][0]) == [], f"{sa}: missing cluster-wide"
        assert sorted(grants[sa][0] - needed_cluster) == [], f"{sa}: granted but never called"
        assert sorted(calls[sa][1] - grants[sa][1] - grants[sa][0]) == [], \
            f"{sa}: missing in {PLACEHOLDERS}"
        assert sorted(grants[sa][1] - calls[sa][1]) == [], \
            f"{sa}: granted in {PLACEHOLDERS} but never called"
    for sa, rule in DENIED_ON_PURPOSE:        # the exemptions are still real calls
        assert rule in calls[sa][0], (sa, rule)


def test_worker_pods_are_read_only_in_their_namespace_and_only_when_set():
    """With sync.workerPods the webhook follows Slurm's worker pods: it may
    list and watch pods in sync.workerNamespace, nothing more there, and
    nowhere else; the sync daemon needs no grant there (it reads every pod
    already).  Without workerPods the chart grants nothing there."""
    calls = code_calls_in_workers()
    assert calls["pyk8sres-webhook"] == {("", "pods", "list"), ("", "pods", "watch")}
    assert calls["pyk8sres-sync"] == set()
    assert granted(chart_rbac(workers=True), in_workers=True) == \
        {sa: rules for sa, rules in calls.items() if rules}
    # The rest is what the chart grants without it.
    assert granted(chart_rbac(workers=True)) == granted()
    assert granted(in_workers=True) == {}


def test_the_webhook_may_touch_only_its_own_configuration():
    """resourceNames: updating any other ValidatingWebhookConfiguration (e.g.
    to switch off another product's webhook) is not granted, nor creating one."""
    docs = chart_rbac()
    rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]
             if "validatingwebhookconfigurations" in r["resources"]]
    assert rules and all(r.get("resourceNames") == ["pyk8sres-admission"] for r in rules)
    assert all("create" not in r["verbs"] for r in rules)


@pytest.mark.parametrize("path,http,watch,expected", [
    ("/api/v1/pods", "GET", False, (("", "pods", "list"), False)),
    ("/api/v1/pods", "GET", True, (("", "pods", "watch"), False)),
    ("/api/v1/namespaces/{namespace}/pods/{name}", "GET", False, (("", "pods", "get"), True)),
    ("/api/v1/namespaces/{namespace}/pods/{name}/binding", "POST", False,
     (("", "pods/binding", "create"), True)),
    ("/api/v1/namespaces/{namespace}/pods/{name}/resize", "PATCH", False,
     (("", "pods/resize", "patch"), True)),
    ("/apis/{group}/{version}/{plural}/{name}/status", "PATCH", False,
     (("pyk8sres.io", "genericnodes/status", "patch"), False)),
    ("/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}", "PUT",
     False, (("admissionregistration.k8s.io", "validatingwebhookconfigurations", "update"),
             False)),
    ("/api/v1/namespaces/{namespace}/pods", "DELETE", False,
     (("", "pods", "deletecollection"), True)),
])
def test_request_rules(path, http, watch, expected):
    assert _rule(http, path, watch) == expected
