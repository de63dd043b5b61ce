"""The quickstart (docs/quickstart.md), run as it stands, so the docs cannot rot.

The block after `<!-- quickstart -->` is split into steps: the commands up
to a run of `#>` lines, which are what those commands print (`...` stands
for anything; runs of spaces count as one).  The whole block runs in one
bash, as a reader pastes it, with three changes only: the work directory
(/tmp/qs) is a fresh one of this test's, `cluster up` gets this module's
ports (PYK8SRES_TEST_PORT_OFFSET moves them) and, for another release, its
`--slurm`, and `pyk8sres` is the package under test.  Between steps the test
waits as long as a reader typing the next command (READER_PAUSE).  Every
step must exit 0, except one whose output is an `Error from server` line,
which must fail.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest_kube import pick_ports
from local_slurm import SLURM, port, requires_slurm, tres
from pyk8sres.testbed import hybrid, releases

pytestmark = requires_slurm
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart.md"
QUICKSTART_WORKDIR = "/tmp/qs"
READER_PAUSE = 3      # seconds between steps, as a reader types
TIMEOUT = 600         # the whole block, cluster up and down included


def quickstart_block(text: str) -> str:
    m = re.search(r"<!-- quickstart -->\n```sh\n(.*?)```", text, re.S)
    assert m, "docs/quickstart.md has no ```sh block after <!-- quickstart -->"
    return m.group(1)


def steps(block: str) -> list[tuple[str, list[str]]]:
    """[(commands, expected output lines)], in the block's order."""
    out, code, expected = [], [], []
    for line in block.splitlines():
        if line.startswith("#>"):
            expected.append(line[2:].strip())
            continue
        if expected:
            out.append(("\n".join(code), expected))
            code, expected = [], []
        code.append(line)
    if code or expected:
        out.append(("\n".join(code), expected))
    return out


def _normal(line: str) -> str:
    return " ".join(line.split())


def matches(expected: str, output: str) -> bool:
    pattern = ".*".join(re.escape(_normal(part)) for part in expected.split("..."))
    return any(re.fullmatch(pattern, _normal(line)) for line in output.splitlines())


def test_steps_and_matching():
    """The parser and the matcher, on the shapes the quickstart uses (and a miss)."""
    block = "a one\n#> x ...\nb\n# c\nd <<'EOF'\ny\nEOF\n#> Error: ... no\n#> z\nlast\n"
    assert steps(block) == [("a one", ["x ..."]),
                            ("b\n# c\nd <<'EOF'\ny\nEOF", ["Error: ... no", "z"]),
                            ("last", [])]
    assert matches("2 debug wrap root PD 0:00 1 (Resources)",
                   "  JOBID PARTITION\n      2     debug     wrap     root PD       0:00      1 "
                   "(Resources)")
    pod = "web    1/1     Running   0          4s    10.244.0.2   {}     <none>"
    assert matches("web 1/1 Running 0 ... n2 ...", pod.format("n2"))
    assert not matches("web 1/1 Running 0 ... n2 ...", pod.format("n1"))
    assert not matches("2 RUNNING", "12 RUNNING")


def test_readme_names_the_two_commands():
    text = (REPO / "README.md").read_text()
    first = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    commands = [line.split()[0] for line in first.splitlines() if line.strip()]
    assert commands == ["tools/demo.sh", "tools/run-tests.sh"], commands
    for command in commands:
        assert os.access(REPO / command, os.X_OK), command
    # The ports a second demo on the same machine needs (README: BASE_PORT, KUBE_PORT).
    demo = (REPO / "tools" / "demo.sh").read_text()
    assert "--base-port \"$BASE_PORT\"" in demo and "--kube-port \"$KUBE_PORT\"" in demo


def _script(block: str, work: str, base_port: int, kube_port: int) -> tuple[str, list]:
    block = block.replace(QUICKSTART_WORKDIR, work)
    up = re.search(r"(?m)^pyk8sres cluster up ", block)
    assert up, "the quickstart starts no cluster"
    extra = f"--base-port {base_port} --kube-port {kube_port} "
    if SLURM != releases.INSTALLED:
        extra += f"--slurm {SLURM} "
    block = block[:up.end()] + extra + block[up.end():]
    parts = steps(block)
    lines = ["set -o pipefail",
             f'pyk8sres() {{ "{sys.executable}" -m pyk8sres "$@"; }}']
    for i, (code, _) in enumerate(parts):
        lines += [f"echo '@@step {i}'", code, f"echo \"@@rc {i} $?\"", f"sleep {READER_PAUSE}"]
    return "\n".join(lines) + "\n", parts


def test_quickstart_runs_as_written(kube_binaries):
    block = quickstart_block(QUICKSTART.read_text())
    tmp = tempfile.mkdtemp(prefix="pyk8sres-quickstart-")
    os.chmod(tmp, 0o755)
    work = os.path.join(tmp, "qs")
    script, parts = _script(block, work, port(17900), pick_ports(28000, 28190))
    assert sum(len(expected) for _, expected in parts) >= 10, parts
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "KUBECONFIG")}
    try:
        proc = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              env=env, cwd=tmp, timeout=TIMEOUT)
        output = proc.stdout
        for i, (code, expected) in enumerate(parts):
            m = re.search(rf"(?ms)^@@step {i}\n(.*?)^@@rc {i} (\d+)$", output)
            assert m, f"step {i} did not finish:\n{code}\n--- output:\n{output[-4000:]}"
            said, rc = m.group(1), int(m.group(2))
            failing = bool(expected) and expected[0].startswith("Error from server")
            assert (rc != 0) == failing, f"step {i} exited {rc}:\n{code}\n--- it printed:\n{said}"
            for line in expected:
                line = tres(line.replace(QUICKSTART_WORKDIR, work))
                assert matches(line, said), (f"step {i}:\n{code}\n--- docs/quickstart.md "
                                             f"says it prints:\n{line}\n--- it printed:\n{said}")
    finally:
        if os.path.isdir(work):
            hybrid.down(work)
        shutil.rmtree(tmp, ignore_errors=True)
