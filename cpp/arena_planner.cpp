#include "arena_planner.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace offload {
namespace {

struct Placed {
  std::int64_t offset;
  std::int64_t size;  // aligned
  std::int64_t start;
  std::int64_t end;
};

// Validates the input and returns every size rounded up to the alignment.
std::vector<std::int64_t> aligned_sizes(const BufferLifetimes& b, std::int64_t alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("alignment must be a power of two, got " + std::to_string(alignment));
  }
  if (b.starts.size() != b.sizes.size() || b.ends.size() != b.sizes.size()) {
    throw std::invalid_argument("sizes, starts and ends must have the same length, got " +
                                std::to_string(b.sizes.size()) + ", " + std::to_string(b.starts.size()) +
                                " and " + std::to_string(b.ends.size()));
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> aligned(b.sizes.size());
  std::int64_t sum = 0;  // bounds every offset + size, so nothing downstream can overflow
  for (std::size_t i = 0; i < b.sizes.size(); ++i) {
    const std::string which = "buffer " + std::to_string(i) + ": ";
    if (b.sizes[i] <= 0) {
      throw std::invalid_argument(which + "size must be positive, got " + std::to_string(b.sizes[i]));
    }
    if (b.ends[i] <= b.starts[i]) {
      throw std::invalid_argument(which + "end (" + std::to_string(b.ends[i]) +
                                  ") must be greater than start (" + std::to_string(b.starts[i]) + ")");
    }
    if (b.sizes[i] > kMax - (alignment - 1)) {
      throw std::invalid_argument(which + "size " + std::to_string(b.sizes[i]) + " is too large");
    }
    aligned[i] = (b.sizes[i] + alignment - 1) / alignment * alignment;
    if (aligned[i] > kMax - sum) throw std::invalid_argument("total size of all buffers overflows int64");
    sum += aligned[i];
  }
  return aligned;
}

bool live_together(const Placed& p, std::int64_t start, std::int64_t end) {
  return p.start < end && start < p.end;
}

// Best fit among the placed buffers that are live at the same time, walked in offset order: the
// smallest gap between them that holds `size`, else just above the highest of them.
std::int64_t best_fit_offset(const std::vector<Placed>& by_offset, std::int64_t size,
                             std::int64_t start, std::int64_t end) {
  std::int64_t best_offset = -1;
  std::int64_t best_gap = std::numeric_limits<std::int64_t>::max();
  std::int64_t prev_end = 0;  // end of the highest conflicting buffer seen so far
  for (const Placed& p : by_offset) {
    if (!live_together(p, start, end)) continue;
    const std::int64_t gap = p.offset - prev_end;  // negative when conflicting buffers overlap
    if (gap >= size && gap < best_gap) {           // strict: ties keep the lowest offset
      best_gap = gap;
      best_offset = prev_end;
    }
    prev_end = std::max(prev_end, p.offset + p.size);
  }
  return best_offset >= 0 ? best_offset : prev_end;
}

}  // namespace

ArenaPlan plan_arena(const BufferLifetimes& buffers, std::int64_t alignment) {
  const std::vector<std::int64_t> size = aligned_sizes(buffers, alignment);
  const std::size_t n = size.size();

  // Biggest first: large buffers are the hardest to fit, small ones then fill the gaps.
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (size[a] != size[b]) return size[a] > size[b];
    if (buffers.starts[a] != buffers.starts[b]) return buffers.starts[a] < buffers.starts[b];
    return a < b;
  });

  // Kept sorted by offset, so each placement is one linear scan (O(n^2) overall: 10,000
  // buffers take tens of milliseconds, and no per-buffer sort is needed).
  std::vector<Placed> by_offset;
  by_offset.reserve(n);
  ArenaPlan plan;
  plan.offsets.assign(n, 0);
  for (const std::size_t i : order) {
    const Placed placed{best_fit_offset(by_offset, size[i], buffers.starts[i], buffers.ends[i]),
                        size[i], buffers.starts[i], buffers.ends[i]};
    const auto at = std::upper_bound(by_offset.begin(), by_offset.end(), placed.offset,
                                     [](std::int64_t offset, const Placed& p) { return offset < p.offset; });
    by_offset.insert(at, placed);
    plan.offsets[i] = placed.offset;
    plan.total_bytes = std::max(plan.total_bytes, placed.offset + placed.size);
  }
  return plan;
}

std::int64_t arena_lower_bound(const BufferLifetimes& buffers, std::int64_t alignment) {
  const std::vector<std::int64_t> size = aligned_sizes(buffers, alignment);
  // Sweep line over (time, delta). At equal times the negative deltas (ends) sort first: the
  // intervals are half-open, so a buffer ending at t and one starting at t are never live together.
  std::vector<std::pair<std::int64_t, std::int64_t>> events;
  events.reserve(2 * size.size());
  for (std::size_t i = 0; i < size.size(); ++i) {
    events.emplace_back(buffers.starts[i], size[i]);
    events.emplace_back(buffers.ends[i], -size[i]);
  }
  std::sort(events.begin(), events.end());
  std::int64_t live = 0;
  std::int64_t peak = 0;
  for (const auto& [time, delta] : events) {
    live += delta;
    peak = std::max(peak, live);
  }
  return peak;
}

}  // namespace offload
