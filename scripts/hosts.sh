#!/usr/bin/env bash
# Several "hosts" on this machine for trying kvtier across a network (root, Linux `ip`):
#   scripts/hosts.sh up 3        # three network namespaces on a private bridge, 198.18.K.1..3
#   scripts/hosts.sh list
#   scripts/hosts.sh down [TAG]  # stop every process in them (by PID) and delete them
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${VENV:-.venv}/bin/python" -m kvtier.hosts "$@"
