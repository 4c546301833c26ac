#!/usr/bin/env bash
# Every CUDA check of this project in one call on a GPU machine (see ../shared/GPU.md), logs into $RESULTS.
#
#   RESULTS=$OUT bash benchmarks/gpu_check.sh          # from the repository root, on the GPU machine
#
# Then copy $RESULTS to benchmarks/results/<YYYY-MM-DD>-<gpu>/ and commit it, raw logs included.
# Under 8 minutes: the build of cpp/ (~20 s), then ONE pytest call for the whole suite and the GPU tests
# ("gpu or not slow"), spread over WORKERS processes with pytest-xdist where it is installed (every `gpu` test goes
# to one worker, one at a time: tests/conftest.py), verbose, as tests.log. tests_gpu.log holds the GPU tests alone
# with the figures they print (overlap ratio, device peak, memory after the first planned step), summary.txt the
# exit status and those figures. The pytest call is cut at TEST_DEADLINE seconds (SIGINT: pytest still writes its
# summary; a pytest still busy 30 s later is killed), so the script ends well inside the device tool's 10-minute limit.
# The last line of summary.txt is the verdict: FAIL (and a non-zero exit) where pytest failed, where no `gpu` test
# passed, where any `gpu` test was skipped (a GPU run verifies nothing by skipping), or where a file named in
# REQUIRE ("path:count ...") has fewer than `count` passed `gpu` tests (cut by the deadline, skipped, failed).
set -uo pipefail
: "${RESULTS:?set RESULTS to a folder that comes back, e.g. \$OUT}"
WORKERS=${WORKERS:-8}                 # 1: no pytest-xdist
MARKS=${MARKS:-gpu or not slow}       # gpu_lease.sh: "gpu" alone (the CPU suite crowded the GPU tests out of 210 s)
TEST_PATHS=${TEST_PATHS:-}            # test files/folders in the order to run them (default: the whole suite)
TEST_DEADLINE=${TEST_DEADLINE:-420}
REQUIRE=${REQUIRE:-}                  # "path:count ...": that many `gpu` tests of that file must pass
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
start=$SECONDS

source benchmarks/gpu_setup.sh
if [ -z "${SKIP_BUILD:-}" ]; then  # SKIP_BUILD=1: wheels and offload are installed already (gpu_lease.sh)
  gpu_setup "$RESULTS/build.log" || exit 1
fi
gpu_info "$RESULTS/gpu.txt"
python3 - "$RESULTS/env.json" <<'PY' | tee -a "$RESULTS/gpu.txt"
import json, os, platform, shutil, subprocess, sys
import psutil, torch
env = {
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
    "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else None,
    "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
    "host_ram_bytes": psutil.virtual_memory().total, "cpus": os.cpu_count(),
    "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
    "command": os.environ.get("OFFLOAD_RUN_COMMAND", "RESULTS=$OUT bash benchmarks/gpu_check.sh"),
}
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env, indent=2))
PY

export OFFLOAD_GPU_LOG="$RESULTS/tests_gpu.log"  # tests/conftest.py appends each gpu test's outcome and figures
: > "$OFFLOAD_GPU_LOG"
parallel=()
if [ "$WORKERS" -gt 1 ] && python3 -c "import xdist" > /dev/null 2>&1; then
  parallel=(-n "$WORKERS" --dist loadgroup -p no:benchmark)  # pytest-benchmark refuses to run beside xdist
fi
if python3 -c "import pytest_timeout" > /dev/null 2>&1; then  # one hung test must not eat the whole call
  parallel+=(--timeout "${TEST_TIMEOUT:-120}")
fi
timeout -k 30 -s INT "$TEST_DEADLINE" python3 -m pytest -m "$MARKS" -v -rfEs -p no:cacheprovider --durations=25 \
  "${parallel[@]}" --junitxml="$RESULTS/junit.xml" $TEST_PATHS 2>&1 | tee "$RESULTS/tests.log"
status=${PIPESTATUS[0]}

passed=$(grep -c '^PASSED' "$OFFLOAD_GPU_LOG") skipped=$(grep -c '^SKIPPED' "$OFFLOAD_GPU_LOG")
why=()
[ "$status" -ne 0 ] && why+=("pytest exit status $status")
[ "$passed" -eq 0 ] && why+=("no gpu test passed")
[ "$skipped" -ne 0 ] && why+=("$skipped gpu tests skipped")
for need in $REQUIRE; do
  got=$(grep -c "^PASSED *${need%:*}::" "$OFFLOAD_GPU_LOG")
  [ "$got" -lt "${need##*:}" ] && why+=("${need%:*}: $got of ${need##*:} gpu tests passed")
done
{
  echo "pytest exit status: $status (124/130: cut at ${TEST_DEADLINE} s) after $(( SECONDS - start )) s; ${#parallel[@]} xdist args: ${parallel[*]:-none}"
  echo "gpu tests: $passed passed, $(grep -c '^FAILED' "$OFFLOAD_GPU_LOG") failed, $skipped skipped"
  grep -hE "^ +(overlap|device peak|after the first planned step|rank [0-9]+ .* on cuda)" "$OFFLOAD_GPU_LOG" \
    | sed 's/^ *//'
  tail -1 "$RESULTS/tests.log"
  msg=$(printf '%s; ' "${why[@]}")
  if [ ${#why[@]} -eq 0 ]; then echo "verdict: PASS"; else echo "verdict: FAIL (${msg%; })"; fi
} | tee "$RESULTS/summary.txt"
[ ${#why[@]} -eq 0 ] || exit $(( status ? status : 1 ))
