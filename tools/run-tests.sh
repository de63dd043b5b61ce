#!/bin/bash
# The test command: install what is missing, then run every test (unit and
# integration: real slurmctld/slurmd/munged and a real Kubernetes API server,
# started and stopped by the tests themselves).  Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
# From tests/ so that `import pyk8sres` is the installed, built package; no
# path given, pytest collects every test there.
cd tests && exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider "$@"
