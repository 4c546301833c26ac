// Two sequential loops of the greedy scheduler (offload/planning/arrays.py, layout.py) in C++, each with its
// Python reference in offload/planning/_reference.py (tests/planning/test_schedule.py checks they agree
// exactly). Pure functions on arrays.
#pragma once

#include <cstdint>
#include <vector>

#include "lane_sim.h"  // View

namespace offload {

// The "latest" copy placement's backward pass: out[q] = min(deadline[q], out[q + 1]) - duration[q], with
// out[n] = +inf (each copy as late as the copy after it allows). The same operations in the same order
// as the Python loop (std::min(a, b) and Python's min(a, b) both return a unless b < a), so bitwise equal.
std::vector<double> latest_issue(View<double> deadline, View<double> duration);
// The same into `out` (resized; its memory reused by a caller that runs it many times).
void latest_issue(View<double> deadline, View<double> duration, std::vector<double>& out);

// For each buffer k, in ascending order, the buffers that last released the bytes [lo[k], hi[k]) before k
// was issued (each range non-empty, lo >= 0; see [Note: waits on earlier buffers] in offload/planning/plan.py). Buffers are swept in order of
// (event, release before issue, k), where k is released at release[k] and issued at issue[k]. Returns
// the lists flattened: buffer k's are out[ptr[k]:ptr[k + 1]].
struct Occupants {
  std::vector<std::int64_t> ptr, buffers;
};
Occupants last_occupants(View<std::int64_t> issue, View<std::int64_t> release, View<std::int64_t> lo,
                         View<std::int64_t> hi);

}  // namespace offload
