#!/usr/bin/env bash
# Every check that needs a GPU, as one command that ends within 10 minutes on one H100:
#   1. the CUDA kernels built for this GPU as their first use builds them, with the compiler's
#      output on failure, then checked against the pure-PyTorch reference, bit for bit
#      (pytest -m cuda);
#   2. the benchmark harness's GPU suite: memory, speed, largest batch, accuracy;
#   3. every step's peak, recalibrations included, where time is left.
# Results go to $OUT when it is set, else to benchmarks/results.
#
# The GPU machine has no ../shared: copy the data into the git-ignored .data/ first, from
# the repository root:
#   mkdir -p .data && cp -r ../shared/data/{cifar10,planetoid,tinyshakespeare} .data/
#
#   bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
# The GPU image has torch and the rest but not this package: import it from the checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/results}"
DATA_DIR="${DATA_DIR:-.data}"
# The harness stops starting new work this many seconds after this script started, so its
# results are written before a 10-minute limit (each part also has its own budget). Work
# started just before then still finishes: a largest-batch try may take up to 90 s more.
TOTAL_S="${TOTAL_S:-480}"
mkdir -p "$OUT"

for needed in cifar10/cifar10_jpeg_train.npz cifar10/cifar10_jpeg_test.npz planetoid/Cora/raw tinyshakespeare/input.txt; do
    if [ ! -e "$DATA_DIR/$needed" ]; then
        echo "missing $DATA_DIR/$needed: copy ../shared/data there first (see the top of $0)" >&2
        exit 2
    fi
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

python -m lightning_act.ops --build cuda 2>&1 | tee "$OUT/harness_gpu_build.txt"
build_status=${PIPESTATUS[0]}
python -m pytest -q -m cuda tests/ 2>&1 | tee "$OUT/harness_gpu_pytest.txt"
tests_status=$(( PIPESTATUS[0] || build_status ))
echo "== CUDA kernel tests: exit ${tests_status}, ${SECONDS} s so far"

python benchmarks/harness.py --suite gpu --data-dir "$DATA_DIR" --out "$OUT" --time-limit $((TOTAL_S - SECONDS))
harness_status=$?
echo "== harness: exit ${harness_status}, ${SECONDS} s in all"

# Every step's peak against max_memory_allocated, recalibrations included, while time is left.
if [ "$SECONDS" -lt 520 ]; then
    timeout $((590 - SECONDS)) python benchmarks/recalibration_memory.py --models resnet18_cifar transformer \
        --data "$DATA_DIR" --output "$OUT/recalibration_memory_eager_gpu.json"
    echo "== recalibration memory: exit $?, ${SECONDS} s in all"
fi

echo "== summary"
tail -n 1 "$OUT/harness_gpu_pytest.txt"
if [ -f "$OUT/harness_gpu.md" ]; then cat "$OUT/harness_gpu.md"; fi
ls -l "$OUT"
exit $((tests_status != 0 || harness_status != 0))
