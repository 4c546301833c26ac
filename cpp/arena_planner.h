// Offline arena planning: byte offsets for buffers whose lifetimes are known ahead of time, so the
// device side is one allocation that never fragments.
//
// Algorithm: "greedy by size" with best fit (Pisarchyk & Lee, "Efficient Memory Management for Deep
// Neural Net Inference", 2020, as used by TFLite; XLA's best-fit heap simulator is the same idea).
// The Python reference in tests/test_arena_planner.py must return exactly the same offsets.
#pragma once

#include <cstdint>
#include <vector>

namespace offload {

// Buffer i needs sizes[i] bytes during the half-open event interval [starts[i], ends[i]).
struct BufferLifetimes {
  const std::vector<std::int64_t>& sizes;
  const std::vector<std::int64_t>& starts;
  const std::vector<std::int64_t>& ends;
};

struct ArenaPlan {
  std::vector<std::int64_t> offsets;  // in input order, each a multiple of the alignment
  std::int64_t total_bytes = 0;       // max over buffers of offset + aligned size
};

// Throws std::invalid_argument on mismatched lengths, size <= 0, end <= start, an alignment that
// is not a power of two, or aligned sizes whose sum overflows int64.
ArenaPlan plan_arena(const BufferLifetimes& buffers, std::int64_t alignment);

// Max over time of the sum of live aligned sizes: no layout of these buffers can be smaller.
std::int64_t arena_lower_bound(const BufferLifetimes& buffers, std::int64_t alignment);

}  // namespace offload
