#!/usr/bin/env bash
# One-shot GPU check: prints ONE JSON line on stdout (progress and logs go to stderr) and
# exits 0 when the check passed. What it measures: kvtier.bench.gpu_check.
#
#   bash scripts/gpu_check.sh
#   PYTHON=/path/to/python3 bash scripts/gpu_check.sh   # a Python with torch
#
# Nothing is installed: kvtier is imported from this checkout, so any Python with torch,
# numpy and msgpack will do (default: the checkout's .venv, else python3). Without CUDA it
# runs the same code on the CPU and says "cuda": false.
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-}
if [ -z "$python" ] && [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; fi
python=${python:-python3}
limit_s=${KVTIER_GPU_CHECK_TIMEOUT_S:-280}  # under 5 minutes, whatever happens

# kvtier maps its subpackages to the checkout's top-level folders (pyproject's package-dir):
# kvtier.engine is engine/, so the checkout's root joins the package's search path.
timeout --kill-after=10 "$limit_s" "$python" -c '
import json, sys
root = sys.argv[1]
try:
    sys.path.insert(0, root)
    import kvtier
    sys.path.remove(root)  # only kvtier comes from here, not every top-level folder
    kvtier.__path__.append(root)
    from kvtier.bench.gpu_check import main
except ImportError as exc:
    print(json.dumps({"check": "kvtier-gpu", "ok": False, "error": f"{exc}: {sys.executable} "
                      f"needs torch, numpy and msgpack to import kvtier from {root}"}))
    sys.exit(1)
sys.exit(main())
' "$root"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "{\"check\": \"kvtier-gpu\", \"ok\": false, \"error\": \"timed out after ${limit_s} s\"}"
fi
exit "$rc"
