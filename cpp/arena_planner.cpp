#include "arena_planner.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

namespace offload {
namespace {

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
    const auto which = [i] { return "buffer " + std::to_string(i) + ": "; };  // only for an error
    if (b.sizes[i] <= 0) {
      throw std::invalid_argument(which() + "size must be positive, got " + std::to_string(b.sizes[i]));
    }
    if (b.ends[i] <= b.starts[i]) {
      throw std::invalid_argument(which() + "end (" + std::to_string(b.ends[i]) +
                                  ") must be greater than start (" + std::to_string(b.starts[i]) + ")");
    }
    if (b.sizes[i] > kMax - (alignment - 1)) {
      throw std::invalid_argument(which() + "size " + std::to_string(b.sizes[i]) + " is too large");
    }
    aligned[i] = (b.sizes[i] + alignment - 1) / alignment * alignment;
    if (aligned[i] > kMax - sum) throw std::invalid_argument("total size of all buffers overflows int64");
    sum += aligned[i];
  }
  return aligned;
}

// Places buffers one at a time at their best-fit offset. Only placed buffers live at the same time as
// the new one matter; they are found through start-sorted indexes, one per lifetime class (lifetimes in
// [2^c, 2^(c+1))): a buffer of class c live at the same time as [start, end) starts before `end` and
// after `start - the longest lifetime of class c placed so far`. So a placement costs about the number
// of buffers near it in time (plus sorting those by offset), and a few long-lived buffers do not widen
// the scan for the short ones (one index for all made every placement scan a window as wide as the
// longest lifetime). O(n^2) remains the worst case (every buffer live at once). Which buffers are found
// does not depend on the indexing, so neither do the offsets.
class Placer {
 public:
  Placer(const std::vector<std::int64_t>& size, const BufferLifetimes& b) : size_(size), b_(b) {
    const std::size_t n = size.size();
    std::vector<std::size_t> by_start(n);
    std::iota(by_start.begin(), by_start.end(), 0);
    std::sort(by_start.begin(), by_start.end(), [&](std::size_t x, std::size_t y) {
      return b.starts[x] != b.starts[y] ? b.starts[x] < b.starts[y] : x < y;
    });
    class_of_.resize(n);
    position_.resize(n);
    for (const std::size_t i : by_start) {
      int c = 0;
      for (std::int64_t len = b.ends[i] - b.starts[i]; len > 1; len >>= 1) ++c;  // floor(log2(len)); len >= 1
      Class& k = classes_[c];
      class_of_[i] = c;
      position_[i] = k.starts.size();
      k.starts.push_back(b.starts[i]);
      k.entries.push_back(Entry{b.ends[i], 0, 0, false});
    }
  }

  // Best fit among the placed buffers live at the same time, walked in offset order: the smallest gap
  // between them that holds the buffer (ties: lowest offset), else just above the highest of them.
  std::int64_t place(std::size_t i) {
    const std::int64_t start = b_.starts[i];
    const std::int64_t end = b_.ends[i];
    constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
    live_.clear();
    for (const int c : used_) {
      const Class& k = classes_[c];
      const std::int64_t earliest = start < kMin + k.longest ? kMin : start - k.longest;  // exclusive
      const auto first = std::upper_bound(k.starts.begin(), k.starts.end(), earliest);
      const auto last = std::lower_bound(first, k.starts.end(), end);
      const Entry* e = k.entries.data();
      for (auto q = static_cast<std::size_t>(first - k.starts.begin()),
                stop = static_cast<std::size_t>(last - k.starts.begin());
           q < stop; ++q) {
        if (e[q].placed && e[q].end > start) live_.emplace_back(e[q].lo, e[q].hi);
      }
    }
    std::sort(live_.begin(), live_.end());
    std::int64_t best_offset = -1;
    std::int64_t best_gap = std::numeric_limits<std::int64_t>::max();
    std::int64_t prev_end = 0;  // end of the highest conflicting buffer seen so far
    for (const auto& [lo, hi] : live_) {
      const std::int64_t gap = lo - prev_end;       // negative when conflicting buffers overlap
      if (gap >= size_[i] && gap < best_gap) {      // strict: ties keep the lowest offset
        best_gap = gap;
        best_offset = prev_end;
      }
      prev_end = std::max(prev_end, hi);
    }
    const std::int64_t offset = best_offset >= 0 ? best_offset : prev_end;
    Class& k = classes_[class_of_[i]];
    Entry& mine = k.entries[position_[i]];
    mine.placed = true;
    mine.lo = offset;
    mine.hi = offset + size_[i];
    if (k.longest == 0) used_.push_back(class_of_[i]);
    k.longest = std::max(k.longest, end - start);
    return offset;
  }

 private:
  struct Entry {  // one per buffer, in start order within its class: what the scan reads, side by side
    std::int64_t end = 0;
    std::int64_t lo = 0;  // [lo, hi): its bytes, once placed
    std::int64_t hi = 0;
    bool placed = false;
  };
  struct Class {  // the buffers whose lifetime is in [2^c, 2^(c+1))
    std::vector<std::int64_t> starts;  // in start order
    std::vector<Entry> entries;        // the same order
    std::int64_t longest = 0;          // longest lifetime placed so far (0: none placed)
  };
  const std::vector<std::int64_t>& size_;
  const BufferLifetimes& b_;
  Class classes_[64];
  std::vector<int> used_;                 // classes with a placed buffer
  std::vector<int> class_of_;             // buffer id -> its class
  std::vector<std::size_t> position_;     // buffer id -> index in its class
  std::vector<std::pair<std::int64_t, std::int64_t>> live_;  // scratch: [offset, offset + size)
};

// Places with `slot` sizes (the aligned sizes, or their size classes); the arena's total counts the
// aligned sizes, since padding at the top is never touched.
ArenaPlan place(const std::vector<std::size_t>& order, const std::vector<std::int64_t>& slot,
                const std::vector<std::int64_t>& size, const BufferLifetimes& buffers) {
  Placer placer(slot, buffers);
  ArenaPlan plan;
  plan.offsets.assign(order.size(), 0);
  for (const std::size_t i : order) {
    plan.offsets[i] = placer.place(i);
    plan.total_bytes = std::max(plan.total_bytes, plan.offsets[i] + size[i]);
  }
  return plan;
}

// Rounds up to 8 significant bits (a multiple of a power of two, so alignment is kept).
std::int64_t size_class(std::int64_t size) {
  int bits = 0;
  while (bits < 63 && (std::int64_t{1} << bits) <= size) ++bits;
  const std::int64_t quantum = std::int64_t{1} << std::max(0, bits - 8);
  return (size + quantum - 1) / quantum * quantum;
}

// Sorts 0..n-1 by `key` (a tuple compared lexicographically; the index breaks the last tie, so every
// order is total and deterministic).
template <typename Key>
std::vector<std::size_t> sorted_by(std::size_t n, Key key) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto ka = key(a);
    const auto kb = key(b);
    return ka != kb ? ka < kb : a < b;
  });
  return order;
}

// Greedy by breadth. The steps are the distinct start times (live bytes only grow at a start, so
// every peak is at one). Steps are visited widest first (ties: earlier); each buffer is placed when
// the first step it is live at is visited, so its rank is the minimum step rank over its lifetime:
// a range-minimum query, answered from a sparse table.
std::vector<std::size_t> breadth_order(const std::vector<std::int64_t>& size, const BufferLifetimes& b) {
  const std::size_t n = size.size();
  std::vector<std::int64_t> steps(b.starts.begin(), b.starts.end());
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  const std::size_t t = steps.size();
  auto step_index = [&](std::int64_t time) {  // first step >= time
    return static_cast<std::size_t>(std::lower_bound(steps.begin(), steps.end(), time) - steps.begin());
  };
  // Live bytes at each step: +size at the buffer's first step, -size at the first step >= its end.
  std::vector<std::int64_t> delta(t + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    delta[step_index(b.starts[i])] += size[i];
    delta[step_index(b.ends[i])] -= size[i];
  }
  std::vector<std::int64_t> breadth(t);
  std::int64_t live = 0;
  for (std::size_t s = 0; s < t; ++s) breadth[s] = live += delta[s];
  const std::vector<std::size_t> step_order =
      sorted_by(t, [&](std::size_t s) { return std::make_pair(-breadth[s], steps[s]); });
  std::vector<std::size_t> rank(t);
  for (std::size_t r = 0; r < t; ++r) rank[step_order[r]] = r;

  // Sparse table: table[k][s] = min rank over steps [s, s + 2^k).
  std::vector<std::vector<std::size_t>> table{rank};
  for (std::size_t k = 1; (std::size_t{1} << k) <= t; ++k) {
    const std::vector<std::size_t>& prev = table.back();
    const std::size_t half = std::size_t{1} << (k - 1);
    std::vector<std::size_t> next(t - (std::size_t{1} << k) + 1);
    for (std::size_t s = 0; s < next.size(); ++s) next[s] = std::min(prev[s], prev[s + half]);
    table.push_back(std::move(next));
  }
  std::vector<std::size_t> buffer_rank(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t lo = step_index(b.starts[i]);
    const std::size_t hi = step_index(b.ends[i]);  // exclusive; > lo since the buffer's start is a step
    std::size_t k = 0;
    while ((std::size_t{2} << k) <= hi - lo) ++k;
    buffer_rank[i] = std::min(table[k][lo], table[k][hi - (std::size_t{1} << k)]);
  }
  return sorted_by(n, [&](std::size_t i) { return std::make_tuple(buffer_rank[i], -size[i], b.starts[i]); });
}

std::vector<std::size_t> ordering(Ordering o, const std::vector<std::int64_t>& size, const BufferLifetimes& b) {
  switch (o) {
    case Ordering::kBySize:
      // Biggest first: large buffers are the hardest to fit, small ones then fill the gaps.
      return sorted_by(size.size(), [&](std::size_t i) { return std::make_pair(-size[i], b.starts[i]); });
    case Ordering::kByBreadth:
      return breadth_order(size, b);
    case Ordering::kByLifetime:
      // Longest-lived first: they constrain every other buffer; short ones then slot in around them.
      return sorted_by(size.size(), [&](std::size_t i) {
        return std::make_tuple(-(b.ends[i] - b.starts[i]), -size[i], b.starts[i]);
      });
  }
  throw std::invalid_argument("unknown ordering");
}

ArenaPlan run_heuristic(int heuristic, const std::vector<std::int64_t>& size,
                        const std::vector<std::int64_t>& classes, const BufferLifetimes& b) {
  const auto o = static_cast<Ordering>(heuristic % 3);
  const std::vector<std::int64_t>& slot = heuristic < 3 ? size : classes;
  ArenaPlan plan = place(ordering(o, slot, b), slot, size, b);
  plan.heuristic = heuristic;
  return plan;
}

std::vector<std::int64_t> size_classes(const std::vector<std::int64_t>& size) {
  std::vector<std::int64_t> out(size.size());
  std::transform(size.begin(), size.end(), out.begin(), size_class);
  return out;
}

}  // namespace

const char* heuristic_name(int heuristic) {
  static const char* const kNames[kNumHeuristics] = {
      "greedy_by_size",           "greedy_by_breadth",           "best_fit_by_lifetime",
      "greedy_by_size+size_classes", "greedy_by_breadth+size_classes", "best_fit_by_lifetime+size_classes"};
  return heuristic >= 0 && heuristic < kNumHeuristics ? kNames[heuristic] : "unknown";
}

int heuristic_from_name(const std::string& name) {
  std::string known;
  for (int h = 0; h < kNumHeuristics; ++h) {
    if (name == heuristic_name(h)) return h;
    known += (h ? ", " : "") + std::string(heuristic_name(h));
  }
  throw std::invalid_argument("unknown arena heuristic '" + name + "': expected one of " + known);
}

ArenaPlan plan_arena(const BufferLifetimes& buffers, std::int64_t alignment, int heuristic) {
  if (heuristic < 0 || heuristic >= kNumHeuristics) {
    throw std::invalid_argument("unknown arena heuristic " + std::to_string(heuristic));
  }
  const std::vector<std::int64_t> size = aligned_sizes(buffers, alignment);
  ArenaPlan plan = run_heuristic(heuristic, size, size_classes(size), buffers);
  plan.totals.assign(kNumHeuristics, -1);
  plan.totals[heuristic] = plan.total_bytes;
  return plan;
}

ArenaPlan plan_arena(const BufferLifetimes& buffers, std::int64_t alignment) {
  return plan_arena_best(buffers, alignment, -1);
}

ArenaPlan plan_arena_best(const BufferLifetimes& buffers, std::int64_t alignment, std::int64_t stop_at) {
  const std::vector<std::int64_t> size = aligned_sizes(buffers, alignment);
  const std::vector<std::int64_t> classes = size_classes(size);
  std::vector<ArenaPlan> plans(kNumHeuristics);
  int first = 0;  // heuristics [0, first) already run
  if (stop_at >= 0) {
    // The first heuristic alone: where it reaches ``stop_at`` (the caller's lower bound), no other can be
    // smaller and ties keep the earlier, so it is the one the full run would keep.
    plans[0] = run_heuristic(0, size, classes, buffers);
    first = 1;
    if (plans[0].total_bytes <= stop_at) {
      ArenaPlan out = std::move(plans[0]);
      out.totals.assign(kNumHeuristics, -1);
      out.totals[0] = out.total_bytes;
      return out;
    }
  }
  // The heuristics are independent: large inputs run them on parallel threads (each is pure and
  // deterministic, so the result does not depend on the thread count).
  // Where every size is its own size class (e.g. equal power-of-two buckets), the size-class heuristics
  // are the exact ones run again: they are not run, and take the exact ones' totals (a tie, so an exact
  // one wins as it would).
  const int to_run = classes == size ? kNumHeuristics / 2 : kNumHeuristics;
  auto run = [&](int h) { plans[h] = run_heuristic(h, size, classes, buffers); };
  constexpr std::size_t kParallelFrom = 2000;  // buffers; below this a thread costs more than a heuristic
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (size.size() < kParallelFrom || cores == 1) {
    for (int h = first; h < to_run; ++h) run(h);
  } else {
    std::atomic<int> next{first};
    auto worker = [&] {
      for (int h = next++; h < to_run; h = next++) run(h);
    };
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < std::min<unsigned>(cores, static_cast<unsigned>(to_run - first)); ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
  }
  for (int h = to_run; h < kNumHeuristics; ++h) plans[h].total_bytes = plans[h - to_run].total_bytes;
  int best = 0;
  for (int h = 1; h < kNumHeuristics; ++h) {
    if (plans[h].total_bytes < plans[best].total_bytes) best = h;  // ties keep the earlier
  }
  std::vector<std::int64_t> totals(kNumHeuristics);
  for (int h = 0; h < kNumHeuristics; ++h) totals[h] = plans[h].total_bytes;
  ArenaPlan out = std::move(plans[best]);
  out.totals = std::move(totals);
  return out;
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
