# Sourced by gpu_check.sh, gpu_bench.sh and gpu_lease.sh (the GPU machine; see ../shared/GPU.md).
#
# gpu_setup LOG   the wheels the machine lacks (.whl/*.whl, carried: DeepSpeed, torchao, their deps) into
#                 /tmp/site on PYTHONPATH, then offload built in place (cpp/ with the machine's tools), its
#                 output in LOG; returns 1, with LOG's tail, when the build fails.
# gpu_info FILE   the GPU, its memory, driver and PCIe link (nvidia-smi), into FILE and on the screen.
gpu_setup() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$1" 2>&1 \
    || { echo "build failed, see $1"; tail -30 "$1"; return 1; }
}

gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,pcie.link.width.current \
    --format=csv | tee "$1"
}
