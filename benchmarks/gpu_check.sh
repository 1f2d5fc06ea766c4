#!/usr/bin/env bash
# The CUDA path, checked and measured on one GPU in one short run (about 10 minutes; the run that made the README's figures stopped at 9.5 minutes before step 5, which then ran on its own):
#   1. the stand-in pair of benchmarks/shaped_pair.py (the default pair's shapes, random weights:
#      a GPU box that cannot fetch the default target's weights gets only its config and tokenizer);
#   2. greedy outputs through the three services (`specdec up --device cuda`, bfloat16), speculation
#      off / adaptive / K = 2 / K = 4, one request at a time and 8 at once: identical or not; then
#      adaptive alone with each request's controller estimates (adaptive-<dtype>.json);
#   3. benchmarks/bench_load.py on the GPU (streams 1..32, off / adaptive / K = 2, HF batched
#      generate in bfloat16 as the anchor);
#   4. benchmarks/batch_exactness.py on the GPU (float32 and bfloat16: outputs decoded alone vs in
#      shared passes, with the logit gap at each first difference);
#   5. step 2 in float32.
# Each step has its own time limit, so a failing step leaves the others' results.
#
#   CONFIG_DIR=~/.cache/specdec/SmolLM2-135M-Instruct-v1 bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
RESULTS=${OUT:-/tmp/gpu-check}
CONFIG_DIR=${CONFIG_DIR:-$HOME/.cache/specdec/SmolLM2-135M-Instruct-v1}
PAIR=${PAIR:-/tmp/shaped-pair}
PY=${PYTHON:-python3}
PORT=${PORT:-50190}
DEVICE=${DEVICE:-cuda}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu-check.log"
export PYTHONUNBUFFERED=1

step() { echo; echo "=== $(date -u +%H:%M:%S) $*"; }

exactness() {  # dtype: greedy outputs through the services, one at a time and 8 at once
    local dtype=$1
    step "services on $DEVICE, $dtype: greedy outputs across schedules"
    $PY -m specdec_cli.main up --target "$PAIR/target" --draft "$PAIR/draft" --device "$DEVICE" --dtype "$dtype" \
        --port "$PORT" --no-http > "/tmp/up-$dtype.log" 2>&1 &
    local up=$!
    for _ in $(seq 120); do
        grep -q "stops all three services" "/tmp/up-$dtype.log" && break
        kill -0 $up 2>/dev/null || break
        sleep 1
    done
    cat "/tmp/up-$dtype.log"
    timeout 120 $PY -m specdec_cli.main bench --orchestrator "127.0.0.1:$PORT" --limit 8 --max-new-tokens 48 \
        --schedules off,adaptive,k=2,k=4 --temperature 0 --quiet
    timeout 120 $PY -m specdec_cli.main bench --orchestrator "127.0.0.1:$PORT" --limit 16 --max-new-tokens 48 \
        --schedules off,adaptive,k=2 --temperature 0 --concurrency 8 --quiet
    # adaptive alone, each request's controller estimates at its end (why it chose its K)
    timeout 90 $PY -m specdec_cli.main bench --orchestrator "127.0.0.1:$PORT" --limit 8 --max-new-tokens 48 \
        --schedules adaptive --temperature 0 --json --quiet > "$RESULTS/adaptive-$dtype.json"
    kill -INT $up; wait $up
}

{
    step "machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import sys, torch, transformers, grpc, google.protobuf as pb
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| transformers', transformers.__version__, '| grpcio', grpc.__version__, '| protobuf', pb.__version__)
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"

    step "stand-in pair"
    timeout 120 $PY benchmarks/shaped_pair.py --config-dir "$CONFIG_DIR" --out "$PAIR"

    exactness bfloat16

    step "load: streams 1..32 on $DEVICE"
    timeout 330 $PY benchmarks/bench_load.py --device "$DEVICE" --target "$PAIR/target" --draft "$PAIR/draft" \
        --draft-method model --streams 1,4,8,16,32 --schedules off,adaptive,k=2 --seconds-per-cell 6 \
        --max-new-tokens 48 --drain-seconds 10 --hf-dtypes bfloat16 --hf-seconds 2 \
        --out "$RESULTS" --name gpu

    step "batch exactness on $DEVICE"
    timeout 120 $PY benchmarks/batch_exactness.py --device "$DEVICE" --target "$PAIR/target" --dtypes float32,bfloat16 \
        --out "$RESULTS"

    exactness float32
    step "done"
} 2>&1 | tee "$LOG"
