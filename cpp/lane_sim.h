// The step simulator's lane loop (offload/planning/simulate.py `simulate`) in C++: the same arithmetic in the
// same order, so results are bitwise those of the Python reference (the loop has no multiply-add the
// compiler could contract: the build targets baseline x86-64/arm64 flags without -ffast-math). The Python side turns a Program into flat arrays, looking the per-copy seconds up in
// the HardwareModel; this only runs the four lanes. Tested against the reference in tests/test_simulate.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace offload {

// A read-only view of n contiguous values (the caller's vector or array; it must outlive the call).
template <typename T>
struct View {
  const T* data = nullptr;
  std::size_t n = 0;
  View() = default;
  View(const T* d, std::size_t size) : data(d), n(size) {}
  View(const std::vector<T>& v) : data(v.data()), n(v.size()) {}  // NOLINT: implicit on purpose
  std::size_t size() const { return n; }
  const T& operator[](std::size_t i) const { return data[i]; }
  const T* begin() const { return data; }
  const T* end() const { return data + n; }
};

struct LaneProgram {
  View<double> compute;          // per event: seconds of compute
  View<std::int64_t> h2d_event;  // per host-to-device copy: issuing event (-1: step start)
  View<double> h2d_solo;         // per copy: seconds alone on the link
  View<std::int64_t> wait_ptr;   // per event i: waits are wait_copy[wait_ptr[i]:wait_ptr[i+1]]
  View<std::int64_t> wait_copy;
  View<std::int64_t> d2h_event;  // per device-to-host copy: issuing event (n: end of backward)
  View<double> d2h_solo;
  View<double> adam_s;           // per device-to-host copy: seconds of its AdamW
  bool adam_after_backward;
  double duplex;
  // Per event i, or empty (none): the device-to-host copies compute waits for before it, after the
  // host-to-device waits, grad_wait_copy[grad_wait_ptr[i]:grad_wait_ptr[i+1]]; each issued at an earlier
  // event ([Note: waits on a reused grad slot] in simulate.py).
  View<std::int64_t> grad_wait_ptr = {};
  View<std::int64_t> grad_wait_copy = {};
  // Empty: the copies at -1 (refreshes) are queued at the step's start. Else one entry per copy at -1, in
  // copy order: the device-to-host copy whose AdamW its refresh follows, and the step is the period of the
  // steady state where each refresh is issued in the previous step as that AdamW ends ([Note: the refresh
  // pipelined, modelled] in simulate.py; the Python reference is offload/planning/steady.py).
  View<std::int64_t> refresh_after = {};
  double tail = 0;  // with refresh_after: compute-lane seconds after compute ends (device AdamW) step() waits for
};

struct LaneResult {
  double step_s = 0, compute_s = 0, stall_s = 0, h2d_busy_s = 0, d2h_busy_s = 0, adam_s = 0, compute_end = 0;
  double grad_stall_s = 0;  // the part of stall_s spent waiting for grad copies (grad_wait_*)
  std::int64_t refresh_passes = 0;  // passes run to the steady state (0: refresh_after empty)
  std::vector<double> stall_per_event, copy_credit;
  bool divided_by_zero = false;  // a stall on a zero-length busy period: the caller reruns the reference
};

LaneResult simulate_lanes(const LaneProgram& p);

// Working buffers of the lane loop, reusable from call to call: a caller that simulates many programs
// (the greedy scheduler's points) keeps one and so does not fault fresh pages in at every call.
struct LaneScratch {
  std::vector<double> done, dur, cum, stall_at, d2h_done;
  std::vector<std::int64_t> period_of, h2d_ptr, h2d_copy, d2h_ptr, d2h_copy, fill;
  // the pipelined refresh: per refresh of the carry in, in its issue order, its copy, the grad copy it follows
  // (order, after) and the carry in (end from the step's start, seconds on the link); the same of the carry
  // out (out_*); the refreshes in the CPU lane's order (lane_order, lane_after); the copies in lane order for
  // the credit scan; each AdamW's end; each copy's first waiting event; the carry out's issue order (issue)
  std::vector<std::int64_t> order, after, lane, credit_order, out_order, out_after, lane_order, lane_after,
      first_use, issue;
  std::vector<double> carry_done, carry_dur, out_done, out_dur, adam_end;
};

// simulate_lanes(p) into `r` (its vectors reused), with `scratch`'s buffers: the same result.
void simulate_lanes(const LaneProgram& p, LaneScratch& scratch, LaneResult& r);

}  // namespace offload
