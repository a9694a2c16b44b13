#!/usr/bin/env bash
# The fork server's "never CUDA" check (review GPU #14) with the CUDA build of torch, on any machine.
#
#   scripts/check_forkserver_cuda.sh [VENV_DIR]     # default: $TMPDIR/disttrain-cuda-venv (reused)
#
# tests/unit/test_launch_forkserver.py runs tests/unit/cuda_probe.py with the torch the suite has (the
# CPU build in CI). The CUDA build imports more while preloading (torch._dynamo imports triton, whose
# driver probe has poisoned forks elsewhere) and has the torch._C cuda functions a probe would call.
# This installs torch's CUDA build (the same version) and its nvidia-*/triton wheels from PyPI into a
# separate venv, ~3.5 GB: too much for CI's 8 minutes, so it is run by hand after a torch upgrade
# (see docs/development.md). No GPU is needed: the check is that nothing asks for one. Exit 1 on a
# probe or an initialised CUDA.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${TMPDIR:-/tmp}/disttrain-cuda-venv}
python=${PYTHON:-python3}
version=$("$python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo 2.13.0)
started=$SECONDS
if [ ! -x "$venv/bin/python" ]; then "$python" -m venv "$venv"; fi
# --isolated: from PyPI only (a configured mirror or find-links may hold the +cpu build of the
# same version, which would satisfy the pin).
"$venv/bin/pip" install --isolated --quiet --index-url https://pypi.org/simple "torch==$version"
# disttrain's other runtime dependencies (pyproject.toml), from wherever pip is configured to look.
"$venv/bin/pip" install --quiet "hydra-core>=1.3,<1.4" "omegaconf>=2.3" "rich>=13" "tensorboard>=2.14" \
    "numpy>=1.24" "pyyaml>=6" "safetensors>=0.4" "xxhash>=3.0" "setproctitle>=1.3"
echo "check_forkserver_cuda: venv ready in $((SECONDS - started)) s ($(du -sh "$venv" | cut -f1))"
cd "$repo"
PYTHONPATH="$repo" "$venv/bin/python" - <<'PY'
import json, subprocess, sys

out = subprocess.run([sys.executable, "tests/unit/cuda_probe.py"], capture_output=True, text=True)
if out.returncode:
    sys.exit(f"cuda_probe failed:\n{out.stderr[-3000:]}")
NOT_PROBES = ("torch/cuda/__init__.py:_is_compiled ",)  # as in tests/unit/test_launch_forkserver.py
bad = False
for line in out.stdout.splitlines():
    r = json.loads(line)
    probes = [p for p in r["probes"] if not p.startswith(NOT_PROBES)]
    print(f"{r['strategy']}: torch {r['torch']} (CUDA {r['cuda_build']}), triton imported: "
          f"{r['triton_imported']}, CUDA initialised: {r['cuda_initialized']}, probes: {probes or 'none'}")
    bad = bad or bool(probes) or r["cuda_initialized"] or r["cuda_build"] is None
sys.exit(1 if bad else 0)
PY
echo "check_forkserver_cuda: passed in $((SECONDS - started)) s"
