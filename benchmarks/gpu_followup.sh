#!/usr/bin/env bash
# A short second call after gpu_lease.sh (see ../shared/GPU.md): this engine alone on a few cases, once per
# host-thread variant, to see what paces the CPU AdamW lane inside a step. The probe's kernel alone does 5.2e9
# params/s on the H200's 16-vCPU host; inside gpt2-xl's step the lane reached 2.9-4.2e9 (runs 5 and 7), and on the
# 2-vCPU VM libgomp's default wait policy cost far more than the work split beside a busy core
# (benchmarks/results/cpu-2026-11-27/README.md). Nothing to carry (no baselines); about 60-70 s a variant per case.
#
#   RESULTS=$OUT bash benchmarks/gpu_followup.sh                      # gpt2-xl@8GiB offload, three variants
#   RESULTS=$OUT CASES=gpt3-2.7b@8GiB SYSTEMS=offload,offload_devopt VARIANTS=default bash benchmarks/gpu_followup.sh
#
# Variants: default (as a user runs it), passive (OMP_WAIT_POLICY=passive: idle OpenMP workers sleep instead of
# spinning; torch's own pool too), threadsN (OMP_NUM_THREADS=N: torch's threads, and so the lane's AdamW workers,
# N). Each variant's folder comes back as one tarball (the device tool returns at most 8 files), packed as soon as
# it ends: vs_baselines.{json,log}, logs/, profiles/ (one torch.profiler trace of a step per run). On the CPU
# machine unpack them into benchmarks/results/<YYYY-MM-DD>-<gpu>/<run>/, run benchmarks/trace_timeline.py on each
# profile (its CPU-lane line gives the lane's rate and per-item cost), and commit.
# A dry run on a CPU machine:
#   RESULTS=/tmp/fu SKIP_BUILD=1 CASES=tiny-gpt@768KiB HW=pcie5 EXTRA_ARGS="--smoke --no-skip --device cpu" \
#     bash benchmarks/gpu_followup.sh
set -uo pipefail
: "${RESULTS:?set RESULTS to a folder that comes back, e.g. RESULTS=\$OUT}"
CASES=${CASES:-gpt2-xl@8GiB}
SYSTEMS=${SYSTEMS:-offload}
VARIANTS=${VARIANTS:-default,passive,threads14}
DEADLINE=${DEADLINE:-540}         # seconds this script may take in all (the call's limit is 600)
CHILD_TIMEOUT=${CHILD_TIMEOUT:-120}
BENCH_ARGS=${BENCH_ARGS:---steps 5 --warmup 2}
EXTRA_ARGS=${EXTRA_ARGS:-}
WORK=${WORK:-/tmp/followup}
# The link and CPU AdamW figures for the bound: the H200's probe of run 7 where it is there (the same machine
# kind; the probe costs ~20 s a call), else a fresh probe
HW=${HW:-benchmarks/results/2026-11-27-h200/run7/bench/probe.json}
mkdir -p "$RESULTS" "$WORK"
export PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $(( DEADLINE - (SECONDS - start) )); }

source benchmarks/gpu_setup.sh
if [ -z "${SKIP_BUILD:-}" ]; then
  gpu_setup "$RESULTS/build.log" || exit 1
  gpu_info "$RESULTS/gpu.txt"
fi
if [ ! -s "$HW" ] && [ "$HW" != pcie4 ] && [ "$HW" != pcie5 ]; then
  python3 -m offload probe --json "$RESULTS/probe.json" > "$RESULTS/probe.log" 2>&1 || echo "probe failed: probe.log"
  HW=$RESULTS/probe.json
  [ -s "$HW" ] || HW=pcie5
fi
echo "set up after $(( SECONDS - start )) s; hw $HW" | tee "$RESULTS/summary.txt"

for variant in ${VARIANTS//,/ }; do
  case "$variant" in
    default) env=() ;;
    passive) env=(OMP_WAIT_POLICY=passive) ;;
    threads[0-9]*) env=("OMP_NUM_THREADS=${variant#threads}") ;;
    *) echo "unknown variant $variant (default, passive, threadsN)" | tee -a "$RESULTS/summary.txt"; continue ;;
  esac
  if [ "$(left)" -lt 60 ]; then
    echo "$variant: not run (time: $(left) s left)" | tee -a "$RESULTS/summary.txt"
    continue
  fi
  out=$WORK/$variant
  mkdir -p "$out"
  # ${env[@]+...}: an empty array under `set -u` (bash < 4.4)
  env ${env[@]+"${env[@]}"} OFFLOAD_RUN_COMMAND="RESULTS=\$OUT bash benchmarks/gpu_followup.sh ($variant: ${env[*]:-} CASES=$CASES SYSTEMS=$SYSTEMS)" \
    python3 benchmarks/vs_baselines.py --cases "$CASES" --systems "$SYSTEMS" --hw "$HW" --timeout "$CHILD_TIMEOUT" \
    --time-budget "$(( $(left) - 20 ))" --logs "$out/logs" --profile "$out/profiles" --json "$out/vs_baselines.json" \
    $BENCH_ARGS $EXTRA_ARGS > "$out/vs_baselines.log" 2>&1
  echo "$variant (${env[*]:-no env}): exit status $? after $(( SECONDS - start )) s" | tee -a "$RESULTS/summary.txt"
  grep -E "s/step|: (oom|error|timeout)" "$out/vs_baselines.log" | sed "s/^/  /" | tee -a "$RESULTS/summary.txt"
  tar czf "$RESULTS/$variant.tar.gz" -C "$WORK" "$variant"
done
cat "$RESULTS/summary.txt"
