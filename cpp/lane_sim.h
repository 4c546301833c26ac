// The step simulator's lane loop (offload/simulate.py `simulate`) in C++: the same arithmetic in the
// same order, so results are bitwise those of the Python reference (the loop has no multiply-add the
// compiler could contract: the build targets baseline x86-64/arm64 flags without -ffast-math). The Python side turns a Program into flat arrays, looking the per-copy seconds up in
// the HardwareModel; this only runs the four lanes. Tested against the reference in tests/test_simulate.py.
#pragma once

#include <cstdint>
#include <vector>

namespace offload {

struct LaneProgram {
  const std::vector<double>& compute;        // per event: seconds of compute
  const std::vector<std::int64_t>& h2d_event;  // per host-to-device copy: issuing event (-1: step start)
  const std::vector<double>& h2d_solo;       // per copy: seconds alone on the link
  const std::vector<std::int64_t>& wait_ptr;   // per event i: waits are wait_copy[wait_ptr[i]:wait_ptr[i+1]]
  const std::vector<std::int64_t>& wait_copy;
  const std::vector<std::int64_t>& d2h_event;  // per device-to-host copy: issuing event (n: end of backward)
  const std::vector<double>& d2h_solo;
  const std::vector<double>& adam_s;         // per device-to-host copy: seconds of its AdamW
  bool adam_after_backward;
  double duplex;
};

struct LaneResult {
  double step_s = 0, compute_s = 0, stall_s = 0, h2d_busy_s = 0, d2h_busy_s = 0, adam_s = 0, compute_end = 0;
  std::vector<double> stall_per_event, copy_credit;
  bool divided_by_zero = false;  // a stall on a zero-length busy period: the caller reruns the reference
};

LaneResult simulate_lanes(const LaneProgram& p);

}  // namespace offload
