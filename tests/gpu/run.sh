#!/usr/bin/env bash
# The GPU suite on a machine with one CUDA device and no network, from any directory:
#   bash tests/gpu/run.sh [pytest arguments]
# It installs what tests/gpu/requirements.txt names and the machine's Python lacks, from the
# wheels tests/gpu/fetch_wheels.sh put in .cache/gpu-wheels (git-ignored: carry that folder
# along), into that Python's own environment (pip keeps what already satisfies a requirement,
# torch above all), then runs `pytest -m gpu tests/gpu`, bounded to 8 minutes.
# PYTHON names the interpreter that holds the CUDA build of torch (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=.cache/gpu-wheels

"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"; print("torch", torch.__version__, torch.cuda.get_device_name())'
if [ -d "$WHEELS" ]; then
    "$PYTHON" -m pip install -q --no-index --no-compile --disable-pip-version-check \
        --find-links "$WHEELS" -r tests/gpu/requirements.txt
else
    echo "no $WHEELS (run tests/gpu/fetch_wheels.sh where PyPI is reachable, and carry it): using what is installed" >&2
fi
# Every child wait in the suite is bounded on its own; this bounds the whole run.
exec timeout --signal=INT --kill-after=30 480 "$PYTHON" -m pytest -q -m gpu -rA -p no:cacheprovider tests/gpu "$@"
