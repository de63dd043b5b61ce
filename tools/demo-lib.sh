# Shared by tools/demo.sh and tools/demo-gpus.sh (sourced): how each step
# and command is shown as it runs.
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }
pipe() { printf '$ %s\n' "$1"; eval "$1"; }
user() { printf 'developer$ %s\n' "$*"; KUBECONFIG=$DEV "$@"; }
