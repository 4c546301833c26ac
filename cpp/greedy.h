// The greedy scheduler's move sequence (offload/planning/greedy.py `Greedy.candidates_reference`) in C++: for
// one copy mode, every point from "everything streamed" on, each placed, profiled, simulated (the lanes of
// cpp/lane_sim) and followed by its batch of moves, until no later point can fit the capacity or no move is
// left; a point over the capacity is simulated for its moves and left out ([Note: points over the capacity]).
// The Python loop is the reference (tests/test_greedy_kernel.py compares every field of every point).
//
// Bitwise agreement: the integer work (placing, merging, live bytes, range maxima) is exact in any order;
// every float is the same operation in the same order as the numpy code: per-bucket gains are summed in copy
// order from 0.0 (np.bincount with weights), the stall cut-off is a running sum (np.cumsum), scores are
// gain / (cost + size / 1024) in float64, sorts and searches compare as numpy does (NaN last).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lane_sim.h"

namespace offload {

// What the moves do not change, computed once by `GreedyInputs.of` (offload/planning/greedy_inputs.py;
// names as there).
struct GreedyConstants {
  std::int64_t n = 0;   // trace events
  std::int64_t nb = 0;  // buckets
  // the merged need intervals [use_s, use_e) of bucket use_b, grouped by bucket, each bucket's in event order
  std::vector<std::int64_t> use_b, use_s, use_e;
  // per bucket
  std::vector<std::int64_t> size;    // aligned bytes (what the arena counts)
  std::vector<std::int64_t> nbytes;  // bytes copied
  std::vector<double> dur;           // seconds of its host-to-device copy
  std::vector<double> updated_dur;   // dur where it is updated (has grads), else 0
  std::vector<std::uint8_t> updated;  // has grads: refreshed at the step start when resident
  std::vector<std::int64_t> fwd_row, bwd_row, fwd_at, bwd_at;  // keepable buckets: see `GreedyInputs`
  std::vector<std::int64_t> keepable;  // ascending
  std::vector<double> tau;             // n + 1: compute reaches event i at tau[i] (sequential sums)
  std::vector<std::int64_t> grad_profile;  // n + 1: live grad-slot bytes change at each event
  std::vector<std::int64_t> need_b, need_e;  // every (event, bucket) need, in event order
  // the lanes' inputs that no point changes
  std::vector<double> compute, d2h_solo, adam_s;
  std::vector<std::int64_t> d2h_event;
  // per event, compute's waits on grad copies (LaneProgram's grad_wait_*; both empty: none)
  std::vector<std::int64_t> grad_wait_ptr, grad_wait_copy;
  double duplex = 1.0;
  std::int64_t n_used = 0;      // buckets any event needs
  std::int64_t max_points = 32;  // MAX_POINTS
  // Per bucket, the grad copy its pipelined refresh follows (-1: none), or empty: refreshes at the step start
  // (LaneProgram.refresh_after, per point); tail: the device AdamW after compute ends (LaneProgram.tail).
  std::vector<std::int64_t> refresh_after;
  double tail = 0;
};

enum class CopyMode { kLatest = 0, kLookahead = 1, kJustInTime = 2 };  // MODES' order

struct GreedyPoint {
  std::vector<std::int64_t> resident;  // ascending
  std::vector<std::int64_t> flat;      // streamed buffers as rows (issue, bucket, end), row-major, copy order
  LaneResult lanes;
  std::int64_t h2d_bytes = 0;       // bytes copied host to device (refreshes included)
  std::int64_t peak = 0;            // max live arena bytes
  std::int64_t resident_bytes = 0;  // sum of the resident buckets' aligned sizes
};

struct GreedyRun {
  std::vector<GreedyPoint> points;
  // Empty, or why the Python loop must run instead (it then raises the reference's error at the same point):
  // "stall on a zero-length copy", "zero score denominator", "need without a live buffer".
  std::string fallback;
};

// Every point of `mode`'s sequence whose peak is <= capacity, in sequence order.
GreedyRun greedy_points(const GreedyConstants& c, CopyMode mode, std::int64_t capacity);

// Throws std::invalid_argument naming the first inconsistent length or out-of-range index.
void check_greedy_constants(const GreedyConstants& c);

}  // namespace offload
