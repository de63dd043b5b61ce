"""The package is arranged by where code runs (docs/development.md, Layout): these tests
keep the rooms apart."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import yaml

import pyk8sres
from pyk8sres import data
from pyk8sres.coordinator import kube

PACKAGE = Path(pyk8sres.__file__).resolve().parent
# Anything that talks to the network: never inside slurmctld.
NETWORK_MODULES = ("kubernetes", "urllib3", "requests", "http", "http.client", "urllib.request",
                   "ssl", "socket", "asyncio", "selectors", "websocket", "yaml")


def _modules_after_import(names: list[str]) -> set:
    code = (f"import json, sys\nsys.path.insert(0, {str(PACKAGE.parent)!r})\n" + "".join(f"import {n}\n" for n in names) +
            "print(json.dumps(sorted(sys.modules)))")
    # -I: a clean interpreter (no PYTHONPATH, no user site), as slurmctld's is.
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                         cwd="/", check=True).stdout
    return set(json.loads(out))


def _room_modules(room: str) -> list[str]:
    return sorted(f"pyk8sres.{room}.{p.stem}" for p in (PACKAGE / room).glob("*.py")
                  if p.stem != "__init__" and not p.stem.startswith("_core_build"))


def test_slurmctld_side_never_loads_a_network_library():
    names = _room_modules("slurmctld") + _room_modules("policy")
    assert {"pyk8sres.slurmctld.embed", "pyk8sres.slurmctld.completion",
            "pyk8sres.slurmctld.plans", "pyk8sres.slurmctld.nodefigures",
            "pyk8sres.slurmctld.jobspec", "pyk8sres.policy.usage",
            "pyk8sres.policy.quantities"} <= set(names)
    loaded = _modules_after_import(names)
    assert set(names) <= loaded
    assert not loaded & set(NETWORK_MODULES), sorted(loaded & set(NETWORK_MODULES))


def test_the_check_would_see_a_network_import():
    # The coordinator does load them: proof that the check above can fail.
    loaded = _modules_after_import(["pyk8sres.coordinator.kube"])
    assert {"kubernetes", "urllib3", "socket"} <= loaded


def _imports(path: Path) -> set:
    """Absolute names of the modules `path` imports (relative ones resolved)."""
    package = "pyk8sres." + path.parent.name
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_slurmctld_and_policy_import_nothing_from_the_coordinator_or_testbed():
    for room in ("slurmctld", "policy"):
        for path in (PACKAGE / room).glob("*.py"):
            wrong = [n for n in _imports(path)
                     if n.startswith(("pyk8sres.coordinator", "pyk8sres.testbed"))]
            assert not wrong, (path, wrong)
    # The rule is checkable: the coordinator's sync does import its own room.
    assert "pyk8sres.coordinator.kube.Informer" in _imports(PACKAGE / "coordinator" / "sync.py")


def test_generic_node_crd_has_one_definition():
    shipped = yaml.safe_load(data.path("deploy", "helm", "pyk8sres", "crds",
                                       "genericnode.yaml").read_text())
    assert kube.generic_node_crd() == shipped
    columns = [c["name"] for c in shipped["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["ClusterName", "Alias", "Type", "AllocatedResources", "GPU"]
    for path in PACKAGE.rglob("*.py"):
        assert "additionalPrinterColumns" not in path.read_text(), f"a second CRD in {path}"


def test_python_dash_m_is_the_command():
    out = subprocess.run([sys.executable, "-m", "pyk8sres", "--help"], capture_output=True,
                         text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "install-plugins" in out.stdout and "cluster" in out.stdout and "sync" in out.stdout


def _runtime_imports(path: Path) -> set:
    """Modules of the package `path` imports when it runs (at the top or in
    a function), leaving out what only a type checker reads."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    package = "pyk8sres." + path.parent.name
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            # `from . import x` names module x; `from .x import y` names module x.
            names.update(f"{module}.{a.name}" for a in node.names)
            names.add(module)
    return {n for n in names if n.startswith("pyk8sres.")}


def _import_graph() -> dict:
    modules = {f"pyk8sres.{p.parent.name}.{p.stem}": p
               for room in ("coordinator", "testbed", "policy", "slurmctld")
               for p in (PACKAGE / room).glob("*.py") if p.stem != "__init__"}
    return {name: {n for n in _runtime_imports(path) if n in modules and n != name}
            for name, path in modules.items()}


def _circles(graph: dict) -> list:
    found = []

    def walk(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif len(path) < 8:
                walk(nxt, path + [nxt])
    for start in sorted(graph):
        walk(start, [start])
    return found


def test_no_import_circles():
    graph = _import_graph()
    # testbed/daemons.py holds what accounting.py and rest.py share with
    # cluster.py; coordinator/scope.py what placeholder.py and webhook.py share.
    assert "pyk8sres.testbed.daemons" in graph["pyk8sres.testbed.accounting"]
    assert "pyk8sres.coordinator.scope" in graph["pyk8sres.coordinator.placeholder"]
    # The job_submit policy, top down: completion (the entry points) -> plans
    # (per-option rules) -> nodefigures (per-node arithmetic) -> jobspec (data);
    # the sync policy: usage (desired state) -> quantities.
    assert "pyk8sres.slurmctld.plans" in graph["pyk8sres.slurmctld.completion"]
    assert "pyk8sres.slurmctld.nodefigures" in graph["pyk8sres.slurmctld.plans"]
    assert "pyk8sres.slurmctld.jobspec" in graph["pyk8sres.slurmctld.nodefigures"]
    assert not graph["pyk8sres.slurmctld.jobspec"]
    assert "pyk8sres.policy.quantities" in graph["pyk8sres.policy.usage"]
    assert not graph["pyk8sres.policy.quantities"]
    assert _circles(graph) == []
    # The check can fail: a made-up edge back from daemons closes a circle.
    graph["pyk8sres.testbed.daemons"] = {"pyk8sres.testbed.cluster"}
    assert _circles(graph)


def test_testbed_imports_run_one_way_even_for_the_type_checker():
    # accounting.py and rest.py take the cluster as a daemons.SlurmHandle:
    # neither imports cluster.py, not even under TYPE_CHECKING.
    modules = {f"pyk8sres.testbed.{p.stem}": p for p in (PACKAGE / "testbed").glob("*.py")
               if p.stem != "__init__"}
    graph = {name: {n for n in _imports(path) | {n.rsplit(".", 1)[0] for n in _imports(path)}
                    if n in modules and n != name}
             for name, path in modules.items()}
    assert "pyk8sres.testbed.accounting" in graph["pyk8sres.testbed.cluster"]
    assert _circles(graph) == []
