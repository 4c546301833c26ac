#!/usr/bin/env bash
# Every CUDA check of this project in one call on a GPU machine (see ../shared/GPU.md), logs into $RESULTS.
#
#   RESULTS=$OUT bash benchmarks/gpu_check.sh          # from the repository root, on the GPU machine
#
# Then copy $RESULTS to benchmarks/results/<YYYY-MM-DD>-<gpu>/ and commit it, raw logs included.
# Runs in a few minutes: the build of cpp/ (~20 s), the GPU tests with their printed figures (overlap ratio,
# device peak, memory after the first planned step), then the default suite plus the GPU tests as tests.log.
set -uo pipefail
: "${RESULTS:?set RESULTS to a folder that comes back, e.g. RESULTS=\$OUT}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then  # wheels the machine lacks (only the baselines need any)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$RESULTS/build.log" 2>&1 \
  || { echo "build failed, see build.log"; tail -30 "$RESULTS/build.log"; exit 1; }

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,pcie.link.width.current \
  --format=csv | tee "$RESULTS/gpu.txt"
python3 - "$RESULTS/env.json" <<'PY' | tee -a "$RESULTS/gpu.txt"
import json, os, platform, subprocess, sys
import psutil, torch
env = {
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
    "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip(),
    "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
    "host_ram_bytes": psutil.virtual_memory().total, "cpus": os.cpu_count(),
    "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
    "command": "RESULTS=$OUT bash benchmarks/gpu_check.sh",
}
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env, indent=2))
PY

# 1. The GPU tests alone, verbose, with what they print (overlap ratio, device peak, flat memory).
python3 -m pytest -m gpu -v -rA -p no:cacheprovider 2>&1 | tee "$RESULTS/tests_gpu.log"
gpu_status=${PIPESTATUS[0]}
# 2. The whole default suite and the GPU tests together, as ../shared/GPU.md asks (tests.log).
python3 -m pytest -q -m "gpu or not slow" -p no:cacheprovider 2>&1 | tee "$RESULTS/tests.log"
all_status=${PIPESTATUS[0]}

echo "gpu tests exit status: $gpu_status; all tests exit status: $all_status" | tee "$RESULTS/summary.txt"
grep -hE "^(overlap|device peak|after the first planned step)" "$RESULTS/tests_gpu.log" | tee -a "$RESULTS/summary.txt"
exit $(( gpu_status || all_status ))
