// Offline arena planning: byte offsets for buffers whose lifetimes are known ahead of time, so the
// device side is one allocation that never fragments.
//
// Three orderings feed one placement rule:
//   greedy by size        largest buffer first (Pisarchyk & Lee, "Efficient Memory Management for Deep
//                         Neural Net Inference", 2020; TFLite's default)
//   greedy by breadth     the time step with the most live bytes first, and within it its buffers
//                         largest first (the same paper's "greedy by breadth")
//   best fit by lifetime  longest-lived buffer first (XLA's heap simulator sorts by lifetime this way)
// Placement: each buffer, in that order, takes the smallest gap between the already-placed buffers
// live at the same time that holds it (ties: lowest offset), else goes just above the highest of them.
// Each ordering runs twice: with the exact sizes, and with sizes rounded up to size classes (8
// significant bits: at most 1/128 more). Buckets packed from parameters differ in size by a few KiB,
// and best fit cannot put a buffer into the slot of one a few KiB smaller; rounded, they share slots
// (GPT-2 1.5B's keep-within-phase plan: 1.084x the lower bound exact, 1.004x with size classes). The
// smallest of the six arenas wins (ties: the first in heuristic order).
// The Python reference in offload/planning/_reference.py must return exactly the same offsets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace offload {

// Buffer i needs sizes[i] bytes during the half-open event interval [starts[i], ends[i]).
struct BufferLifetimes {
  const std::vector<std::int64_t>& sizes;
  const std::vector<std::int64_t>& starts;
  const std::vector<std::int64_t>& ends;
};

// The orderings above.
enum class Ordering : int { kBySize = 0, kByBreadth = 1, kByLifetime = 2 };

// A heuristic is an ordering with exact sizes (0-2) or with size classes (3-5), in tie-break order:
// greedy_by_size, greedy_by_breadth, best_fit_by_lifetime, then the same names + "+size_classes".
constexpr int kNumHeuristics = 6;
const char* heuristic_name(int heuristic);
// The inverse; throws std::invalid_argument for an unknown name.
int heuristic_from_name(const std::string& name);

struct ArenaPlan {
  std::vector<std::int64_t> offsets;  // in input order, each a multiple of the alignment
  std::int64_t total_bytes = 0;       // max over buffers of offset + aligned size
  int heuristic = 0;                  // the one that produced it
  std::vector<std::int64_t> totals;   // total_bytes of each heuristic, by index (-1: not run)
};

// Runs every heuristic and keeps the smallest arena. Throws std::invalid_argument on mismatched
// lengths, size <= 0, end <= start, an alignment that is not a power of two, or aligned sizes whose
// sum overflows int64.
ArenaPlan plan_arena(const BufferLifetimes& buffers, std::int64_t alignment);

// The same, except that with ``stop_at >= 0`` (a lower bound on the total, e.g. arena_lower_bound) the
// first heuristic runs alone first, and where its total is <= ``stop_at`` it is returned without running
// the others (their totals are -1). Given a true lower bound the offsets, total and heuristic are those of
// plan_arena: no heuristic can be below it and ties keep the earlier. ``stop_at < 0``: plan_arena.
ArenaPlan plan_arena_best(const BufferLifetimes& buffers, std::int64_t alignment, std::int64_t stop_at);

// One heuristic only.
ArenaPlan plan_arena(const BufferLifetimes& buffers, std::int64_t alignment, int heuristic);

// Max over time of the sum of live aligned sizes: no layout of these buffers can be smaller.
std::int64_t arena_lower_bound(const BufferLifetimes& buffers, std::int64_t alignment);

}  // namespace offload
