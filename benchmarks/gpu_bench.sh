#!/usr/bin/env bash
# The baseline benchmarks (issue 10) in one call on a GPU machine (see ../shared/GPU.md), under ~9.5 minutes;
# everything lands in $RESULTS. Three parts, one call each (each fits the device tool's 10-minute limit):
#
#   RESULTS=$OUT PART=vs       bash benchmarks/gpu_bench.sh   # vs_baselines on $CASES (below)
#   RESULTS=$OUT PART=max      bash benchmarks/gpu_bench.sh   # max_model: the baselines, 24 GiB
#   RESULTS=$OUT PART=max-ours bash benchmarks/gpu_bench.sh   # max_model: this engine up to its host-RAM bound
#
# First, on the CPU machine, in the project root (DeepSpeed and torchao are not in the GPU image):
#   echo /.whl/ >> .git/info/exclude && bash ../shared/gpu/prepare_wheels.sh .whl
# and let the run tool carry .whl. Without .whl the DeepSpeed and torchao rows say "not_installed".
# Then copy $RESULTS to benchmarks/results/<YYYY-MM-DD>-<gpu>/, run
#   python benchmarks/plot.py benchmarks/results/<dir>/*.json --out benchmarks/results/<dir>/
# on the CPU machine (matplotlib), and commit everything, logs included.
#
# The full grid (5 models x 3 budgets x 6 systems) does not fit one call: CASES picks the model@budget cases
# of the vs part, most informative first; runs that the time budget leaves out are recorded as "not_run".
# Later calls cover the rest, e.g. CASES=gpt3-2.7b@16GiB,gpt3-6.7b@16GiB,bert-large@8GiB, and
# CASES=gpt2-large@8GiB,gpt2-large@16GiB,gpt2-xl@16GiB,gpt3-2.7b@24GiB,gpt3-6.7b@24GiB,bert-large@24GiB.
set -uo pipefail
: "${RESULTS:?set RESULTS to a folder that comes back, e.g. RESULTS=\$OUT}"
PART=${PART:-vs}
CASES=${CASES:-gpt2-xl@8GiB,gpt2-large@24GiB,gpt2-xl@24GiB}
DEADLINE=${DEADLINE:-560}          # seconds this script may take in all
CHILD_TIMEOUT=${CHILD_TIMEOUT:-240} # seconds one system's run may take
EXTRA_ARGS=${EXTRA_ARGS:-}          # more options for the benchmark; a dry run on a CPU machine:
#   RESULTS=/tmp/b PART=vs CASES=tiny-gpt@768KiB EXTRA_ARGS="--smoke --no-skip" SKIP_BUILD=1 \
#     bash benchmarks/gpu_bench.sh
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $(( DEADLINE - (SECONDS - start) )); }

source benchmarks/gpu_setup.sh
if [ -z "${SKIP_BUILD:-}" ]; then  # SKIP_BUILD=1: wheels and offload are installed already (a dry run, gpu_lease.sh)
  gpu_setup "$RESULTS/build.log" || exit 1
fi
gpu_info "$RESULTS/gpu.txt"

# DeepSpeed JIT-builds its CPU Adam on first use: build it once, before anything is timed, and reuse it.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
if [ "$PART" != "max-ours" ] && python3 -c "import deepspeed, torch; assert torch.cuda.is_available()" > /dev/null 2>&1; then
  echo "building DeepSpeed CPUAdam (once) ..."
  timeout 300 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    > "$RESULTS/deepspeed_build.log" 2>&1 || echo "DeepSpeed CPUAdam build failed: see deepspeed_build.log"
fi

# The link and CPU AdamW figures of this machine, for this engine's physical bound.
python3 -m offload probe --json "$RESULTS/probe.json" > "$RESULTS/probe.log" 2>&1 || echo "probe failed: probe.log"
HW=$RESULTS/probe.json
[ -s "$HW" ] || HW=pcie5

status=0
case "$PART" in
  vs)
    python3 benchmarks/vs_baselines.py --cases "$CASES" --hw "$HW" --timeout "$CHILD_TIMEOUT" \
      --time-budget "$(( $(left) - 20 ))" --logs "$RESULTS/logs" --profile "$RESULTS/profiles" \
      --json "$RESULTS/vs_baselines.json" $EXTRA_ARGS 2>&1 | tee "$RESULTS/vs_baselines.log"
    status=${PIPESTATUS[0]} ;;
  max)
    python3 benchmarks/max_model.py --systems "${SYSTEMS:-zero_offload,zero3_offload,torchao,torch}" \
      --budgets "${BUDGETS:-24GiB}" --timeout "$CHILD_TIMEOUT" --time-budget "$(( $(left) - 20 ))" \
      --logs "$RESULTS/logs" --json "$RESULTS/max_model.json" $EXTRA_ARGS 2>&1 | tee "$RESULTS/max_model.log"
    status=${PIPESTATUS[0]} ;;
  max-ours)
    python3 benchmarks/max_model.py --systems offload --budgets "${BUDGETS:-24GiB}" --timeout "$CHILD_TIMEOUT" \
      --time-budget "$(( $(left) - 20 ))" --logs "$RESULTS/logs" --json "$RESULTS/max_model_offload.json" \
      $EXTRA_ARGS 2>&1 | tee "$RESULTS/max_model_offload.log"
    status=${PIPESTATUS[0]} ;;
  *) echo "PART must be vs, max or max-ours; got $PART"; exit 2 ;;
esac
# The markdown table now (matplotlib may be missing here: the PNGs are drawn on the CPU machine).
python3 benchmarks/plot.py "$RESULTS"/*.json --out "$RESULTS" --no-png > "$RESULTS/plot.log" 2>&1 || true
echo "part $PART: exit status $status after $(( SECONDS - start )) s" | tee "$RESULTS/summary.txt"
exit "$status"
