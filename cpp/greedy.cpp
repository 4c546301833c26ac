#include "greedy.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "schedule_kernels.h"  // latest_issue

namespace offload {
namespace {

using i64 = std::int64_t;

// numpy's order for floats (its sorts and searchsorted): NaN after every number.
inline bool np_less(double a, double b) { return a < b || (b != b && a == a); }

// Range maximum over a fixed array (what offload/planning/arrays.py's `MaxTable` answers; integer maxima are exact
// however taken): blocks of 64 with each block's prefix and suffix maxima, and a sparse table over the block
// maxima, so that it builds in O(n) and answers a range within one block by a scan.
class MaxTable {
 public:
  void build(const std::vector<i64>& values) {
    v_ = values.data();
    const std::size_t n = values.size(), blocks = (n + kBlock - 1) / kBlock;
    prefix_.resize(n), suffix_.resize(n);
    levels_ = 1;
    while ((std::size_t{1} << levels_) <= blocks) ++levels_;
    table_.resize(levels_ * std::max<std::size_t>(blocks, 1));
    blocks_ = blocks;
    for (std::size_t k = 0; k < blocks; ++k) {
      const std::size_t lo = k * kBlock, hi = std::min(n, lo + kBlock);
      i64 m = values[lo];
      for (std::size_t i = lo; i < hi; ++i) prefix_[i] = m = std::max(m, values[i]);
      table_[k] = m;
      m = values[hi - 1];
      for (std::size_t i = hi; i-- > lo;) suffix_[i] = m = std::max(m, values[i]);
    }
    for (std::size_t j = 1; j < levels_; ++j) {
      const std::size_t h = std::size_t{1} << (j - 1), m = blocks - 2 * h + 1;
      const i64* prev = &table_[(j - 1) * blocks];
      i64* row = &table_[j * blocks];
      for (std::size_t i = 0; i < m; ++i) row[i] = std::max(prev[i], prev[i + h]);
    }
  }
  // max(values[lo:hi]); 0 for an empty range
  i64 query(i64 lo, i64 hi) const {
    if (hi <= lo) return 0;
    const i64 last = hi - 1, bl = lo / kBlock, br = last / kBlock;
    if (bl == br) {
      i64 m = v_[lo];
      for (i64 i = lo + 1; i <= last; ++i) m = std::max(m, v_[i]);
      return m;
    }
    i64 m = std::max(suffix_[static_cast<std::size_t>(lo)], prefix_[static_cast<std::size_t>(last)]);
    if (br - bl > 1) {  // the whole blocks between: two overlapping power-of-two spans
      const i64 a = bl + 1, len = br - a;
      const int j = 63 - __builtin_clzll(static_cast<unsigned long long>(len));
      const i64* row = &table_[static_cast<std::size_t>(j) * blocks_];
      m = std::max(m, std::max(row[a], row[br - (i64{1} << j)]));
    }
    return m;
  }

 private:
  static constexpr std::size_t kBlock = 64;
  const i64* v_ = nullptr;
  std::size_t levels_ = 1, blocks_ = 0;
  std::vector<i64> prefix_, suffix_, table_;
};

// A stable counting sort of indices [0, key.size()) by key in [0, bound): `order` and, per key value,
// where its run starts (`start`, bound + 1 entries); `fill` is scratch.
void counting_sort(const std::vector<i64>& key, i64 bound, std::vector<i64>& order, std::vector<i64>& start,
                   std::vector<i64>& fill) {
  start.assign(static_cast<std::size_t>(bound + 1), 0);
  for (i64 k : key) ++start[static_cast<std::size_t>(k + 1)];
  for (std::size_t v = 1; v < start.size(); ++v) start[v] += start[v - 1];
  order.resize(key.size());
  fill.assign(start.begin(), start.end() - 1);
  for (std::size_t i = 0; i < key.size(); ++i) order[static_cast<std::size_t>(fill[static_cast<std::size_t>(key[i])]++)] = static_cast<i64>(i);
}

struct Move {
  bool resident;  // else keep
  i64 bucket;
};

// One mode's move sequence; the member vectors are reused from point to point.
class Sequence {
 public:
  Sequence(const GreedyConstants& c, CopyMode mode)
      : c_(c), mode_(mode), resident_(static_cast<std::size_t>(c.nb), 0), kept_(static_cast<std::size_t>(c.nb), 0) {}

  GreedyRun run(i64 capacity) {
    GreedyRun out;
    std::vector<Move> moves;
    while (true) {
      place();
      const i64 peak = live_bytes();
      // no later point fits (its peak is at least this one's least_peak, which only grows); a point
      // over the capacity is simulated for its moves and left out ([Note: points over the capacity], greedy.py)
      if (peak > capacity && least_peak() > capacity) break;
      if (!copies()) return fallback(out, "need without a live buffer");
      GreedyPoint point;
      simulate_lanes(LaneProgram{c_.compute, h2d_event_, h2d_solo_, wait_ptr_, wait_copy_, c_.d2h_event, c_.d2h_solo,
                                 c_.adam_s, false, c_.duplex, c_.grad_wait_ptr, c_.grad_wait_copy, refresh_after_,
                                 c_.tail},
                     lane_scratch_, point.lanes);
      if (point.lanes.divided_by_zero) return fallback(out, "stall on a zero-length copy");
      for (i64 b : cb_) point.h2d_bytes += c_.nbytes[static_cast<std::size_t>(b)];
      for (i64 b = 0; b < c_.nb; ++b) {
        if (resident_[static_cast<std::size_t>(b)]) {
          point.resident.push_back(b);
          point.resident_bytes += c_.size[static_cast<std::size_t>(b)];
        }
      }
      point.peak = peak;
      point.flat.resize(3 * rows_p_.size());
      for (std::size_t r = 0; r < rows_p_.size(); ++r) {
        point.flat[3 * r] = rows_p_[r];
        point.flat[3 * r + 1] = rows_b_[r];
        point.flat[3 * r + 2] = rows_e_[r];
      }
      if (!next_moves(point.lanes, peak, moves)) return fallback(out, "zero score denominator");
      if (peak <= capacity) out.points.push_back(std::move(point));
      if (moves.empty()) break;
      for (const Move& mv : moves) {
        if (mv.resident) {
          resident_[static_cast<std::size_t>(mv.bucket)] = 1;
          kept_[static_cast<std::size_t>(mv.bucket)] = 0;
        } else {
          kept_[static_cast<std::size_t>(mv.bucket)] = 1;
        }
      }
    }
    return out;
  }

 private:
  static GreedyRun& fallback(GreedyRun& out, const char* why) {
    out.points.clear();
    out.fallback = why;
    return out;
  }

  // `Greedy.placed`: the streamed buffers (rows_p_, rows_b_, rows_e_), sorted by (issue, bucket, end).
  void place() {
    const std::size_t u = c_.use_b.size();
    std::vector<i64>& end = end_;
    end.assign(c_.use_e.begin(), c_.use_e.end());
    live_.assign(u, 1);
    for (std::size_t i = 0; i < u; ++i)
      if (resident_[static_cast<std::size_t>(c_.use_b[i])]) live_[i] = 0;
    for (i64 kb : c_.keepable) {  // a kept bucket's last forward and first backward intervals become one
      if (!kept_[static_cast<std::size_t>(kb)]) continue;
      end[static_cast<std::size_t>(c_.fwd_row[kb])] = c_.use_e[static_cast<std::size_t>(c_.bwd_row[kb])];
      live_[static_cast<std::size_t>(c_.bwd_row[kb])] = 0;
    }
    s_.resize(u), e_.resize(u), b_.resize(u);
    std::size_t l = 0;
    for (std::size_t i = 0; i < u; ++i) {
      s_[l] = c_.use_s[i], e_[l] = end[i], b_[l] = c_.use_b[i];
      l += live_[i];
    }
    s_.resize(l), e_.resize(l), b_.resize(l);
    p_.resize(l);
    if (mode_ == CopyMode::kJustInTime) {
      p_ = s_;
    } else if (mode_ == CopyMode::kLookahead) {  // the previous distinct need start
      std::vector<std::uint8_t>& starts = starts_;
      starts.assign(static_cast<std::size_t>(c_.n), 0);
      for (i64 s : s_) starts[static_cast<std::size_t>(s)] = 1;
      prev_.resize(static_cast<std::size_t>(c_.n));
      i64 last = -1;
      for (i64 ev = 0; ev < c_.n; ++ev) {
        prev_[static_cast<std::size_t>(ev)] = last;
        if (starts[static_cast<std::size_t>(ev)]) last = ev;
      }
      for (std::size_t i = 0; i < l; ++i) {
        const i64 prev = prev_[static_cast<std::size_t>(s_[i])];
        p_[i] = prev >= 0 ? prev : s_[i];
      }
    } else {  // latest: the copies in (need, bucket) order (stable by need: the rows are by bucket already)
      counting_sort(s_, c_.n, order_, start_, fill_);
      deadline_.resize(l), duration_.resize(l);
      for (std::size_t q = 0; q < l; ++q) {
        const auto i = static_cast<std::size_t>(order_[q]);
        deadline_[q] = c_.tau[static_cast<std::size_t>(s_[i])];
        duration_[q] = c_.dur[static_cast<std::size_t>(b_[i])];
      }
      std::vector<double>& latest = latest_;
      latest_issue(deadline_, duration_, latest);
      for (std::size_t q = 0; q < l; ++q) {
        const auto i = static_cast<std::size_t>(order_[q]);
        p_[i] = std::min(s_[i], std::max<i64>(0, reached_by(latest[q], s_[i]) - 1));
      }
    }
    // merge: a new buffer starts where the bucket changes or its copy comes after the previous end
    std::vector<i64>&gp = gp_, &gb = gb_, &ge = ge_;
    gp.resize(l), gb.resize(l), ge.resize(l);
    std::size_t g = 0;
    for (std::size_t i = 0; i < l; ++i) {
      if (i == 0 || b_[i] != b_[i - 1] || p_[i] > e_[i - 1]) gp[g] = p_[i], gb[g] = b_[i], ++g;
      ge[g - 1] = e_[i];
    }
    gp.resize(g), gb.resize(g), ge.resize(g);
    // sorted by (issue, bucket, end): a stable sort by issue suffices, as the rows come by bucket, and
    // a bucket's rows have strictly increasing issues (each issue > the previous buffer's end)
    counting_sort(gp, c_.n, order_, start_, fill_);
    rows_p_.resize(gp.size()), rows_b_.resize(gp.size()), rows_e_.resize(gp.size());
    for (std::size_t r = 0; r < gp.size(); ++r) {
      const auto k = static_cast<std::size_t>(order_[r]);
      rows_p_[r] = gp[k], rows_b_[r] = gb[k], rows_e_[r] = ge[k];
    }
  }

  // np.searchsorted(tau, x, side="right") for a copy needed at event s: the first event compute reaches
  // after x (in numpy's order). Where that is past s the caller takes s; else it is found searching back
  // from s in growing steps (a copy issues shortly before its need, mostly).
  i64 reached_by(double x, i64 s) const {
    const double* tau = c_.tau.data();
    if (!np_less(x, tau[s])) return s + 1;  // at least s + 1: min(s, result - 1) is s
    i64 hi = s, step = 1, lo;               // np_less(x, tau[hi]) holds
    while (true) {
      lo = hi - step;
      if (lo < 0) {
        lo = -1;
        break;
      }
      if (!np_less(x, tau[lo])) break;
      hi = lo, step *= 2;
    }
    return std::upper_bound(tau + lo + 1, tau + hi, x, np_less) - tau;  // in (lo, hi]
  }

  // diff_ as the grad slots' profile plus the resident buckets, held from the first event to the end: the start
  // of both live-byte profiles below.
  std::vector<i64>& resident_diff() {
    std::vector<i64>& diff = diff_;
    diff.assign(c_.grad_profile.begin(), c_.grad_profile.end());
    i64 res = 0;
    for (i64 b = 0; b < c_.nb; ++b)
      if (resident_[static_cast<std::size_t>(b)]) res += c_.size[static_cast<std::size_t>(b)];
    diff[0] += res;
    diff[static_cast<std::size_t>(c_.n)] -= res;
    return diff;
  }

  // `Greedy.least_peak`: the live bytes with the resident buckets and the others' need intervals only, at their
  // most (a lower bound of every later point's peak: [Note: points over the capacity] in greedy.py)
  i64 least_peak() {
    std::vector<i64>& diff = resident_diff();
    for (std::size_t i = 0; i < c_.use_b.size(); ++i) {
      const auto b = static_cast<std::size_t>(c_.use_b[i]);
      if (resident_[b]) continue;
      diff[static_cast<std::size_t>(c_.use_s[i])] += c_.size[b];
      diff[static_cast<std::size_t>(c_.use_e[i])] -= c_.size[b];
    }
    i64 acc = 0, peak = 0;
    for (i64 i = 0; i < c_.n; ++i) {
      acc += diff[static_cast<std::size_t>(i)];
      peak = std::max(peak, acc);
    }
    return peak;
  }

  // `Greedy.profile`: live arena bytes at each event (prof_); returns their max (0 without events).
  i64 live_bytes() {
    std::vector<i64>& diff = resident_diff();
    for (std::size_t r = 0; r < rows_p_.size(); ++r) {
      const i64 size = c_.size[static_cast<std::size_t>(rows_b_[r])];
      diff[static_cast<std::size_t>(rows_p_[r])] += size;
      diff[static_cast<std::size_t>(rows_e_[r])] -= size;
    }
    prof_.resize(static_cast<std::size_t>(c_.n));
    i64 acc = 0, peak = 0;
    for (i64 i = 0; i < c_.n; ++i) {
      acc += diff[static_cast<std::size_t>(i)];
      prof_[static_cast<std::size_t>(i)] = acc;
      peak = i == 0 ? acc : std::max(peak, acc);
    }
    return peak;
  }

  // `Greedy.copies`: the copies (refreshes, then the streamed buffers) and each event's waits. False where
  // a bucket with copies is needed where none ends after the need (the reference asserts).
  bool copies() {
    cb_.clear(), ce_.clear(), refresh_after_.clear();
    refresh_ = 0;
    for (i64 b = 0; b < c_.nb; ++b) {
      if (resident_[static_cast<std::size_t>(b)] && c_.updated[static_cast<std::size_t>(b)]) {
        cb_.push_back(b), ce_.push_back(c_.n);
        if (!c_.refresh_after.empty()) refresh_after_.push_back(c_.refresh_after[static_cast<std::size_t>(b)]);
        ++refresh_;
      }
    }
    cb_.insert(cb_.end(), rows_b_.begin(), rows_b_.end());
    ce_.insert(ce_.end(), rows_e_.begin(), rows_e_.end());
    h2d_event_.assign(static_cast<std::size_t>(refresh_), -1);
    h2d_event_.insert(h2d_event_.end(), rows_p_.begin(), rows_p_.end());
    h2d_solo_.resize(cb_.size());
    for (std::size_t k = 0; k < cb_.size(); ++k) h2d_solo_[k] = c_.dur[static_cast<std::size_t>(cb_[k])];
    // the copies by (bucket, end): stable by bucket, as a bucket's copies come in event order
    counting_sort(cb_, c_.nb, copy_order_, copy_start_, fill_);
    const i64 total = static_cast<i64>(cb_.size());
    wait_ptr_.assign(static_cast<std::size_t>(c_.n + 1), 0);
    wait_copy_.clear();
    for (std::size_t t = 0; t < c_.need_b.size(); ++t) {
      // the first copy of the bucket ending after the need: np.searchsorted over the (bucket, end) keys,
      // clipped to the last copy (which is the bucket's own where it is the last bucket with copies)
      const auto b = static_cast<std::size_t>(c_.need_b[t]);
      const i64 ev = c_.need_e[t], lo = copy_start_[b], hi = copy_start_[b + 1];
      i64 found = -1;
      for (i64 j = lo; j < hi; ++j) {
        const i64 k = copy_order_[static_cast<std::size_t>(j)];
        if (ce_[static_cast<std::size_t>(k)] > ev) {
          found = k;
          break;
        }
      }
      if (found < 0 && hi > lo) {
        if (hi != total) return false;
        found = copy_order_[static_cast<std::size_t>(total - 1)];
      }
      if (found >= 0) {
        wait_copy_.push_back(found);
        ++wait_ptr_[static_cast<std::size_t>(ev + 1)];
      }
    }
    for (std::size_t i = 1; i < wait_ptr_.size(); ++i) wait_ptr_[i] += wait_ptr_[i - 1];
    return true;
  }

  // `Greedy.moves`: the next batch, best first. False where a score would divide by zero (numpy raises).
  bool next_moves(const LaneResult& sim, i64 peak, std::vector<Move>& moves) {
    moves.clear();
    // the stall moves can remove: waits for host-to-device copies, not for grad copies (Greedy.moves)
    const double copy_stall = sim.stall_s - sim.grad_stall_s;
    const bool stalled = copy_stall > 0;
    const std::size_t nb = static_cast<std::size_t>(c_.nb), m = rows_b_.size();
    const double* credit = sim.copy_credit.data() + refresh_;
    count_.assign(nb, 0);
    gain_.assign(nb, 0.0);
    for (std::size_t r = 0; r < m; ++r) {  // sequential sums in copy order, as np.bincount adds
      const auto b = static_cast<std::size_t>(rows_b_[r]);
      ++count_[b];
      gain_[b] += stalled ? credit[r] : c_.dur[b];
    }
    if (!stalled)
      for (std::size_t b = 0; b < nb; ++b) gain_[b] = gain_[b] - c_.updated_dur[b];
    rmq_.build(prof_);
    // each bucket's buffers in event order: max live bytes inside them and in the gaps outside them
    counting_sort(rows_b_, c_.nb, order_, start_, fill_);
    inside_.assign(nb, 0), outside_.assign(nb, 0);
    for (std::size_t b = 0; b < nb; ++b) {
      const i64 lo = start_[b], hi = start_[b + 1];
      if (lo == hi) continue;
      i64 in = 0, out = 0, gap_from = 0;
      for (i64 j = lo; j < hi; ++j) {
        const auto k = static_cast<std::size_t>(order_[static_cast<std::size_t>(j)]);
        in = std::max(in, rmq_.query(rows_p_[k], rows_e_[k]));
        out = std::max(out, rmq_.query(gap_from, rows_p_[k]));
        gap_from = rows_e_[k];
      }
      inside_[b] = in;
      outside_[b] = std::max(out, rmq_.query(gap_from, c_.n));
    }
    cand_.clear();
    for (std::size_t b = 0; b < nb; ++b) {  // resident
      const double g = gain_[b];
      if (count_[b] == 0 || !(g > 0 || (g >= 0 && !stalled))) continue;
      const i64 size = c_.size[b];
      const i64 cost = std::max<i64>(0, std::max(outside_[b] + size, inside_[b]) - peak);
      const double den = static_cast<double>(cost) + static_cast<double>(size) / 1024;
      if (den == 0) return false;
      cand_.push_back({g / den, static_cast<i64>(b), 1, g});
    }
    for (i64 kb : c_.keepable) {  // keep
      const auto b = static_cast<std::size_t>(kb);
      if (count_[b] == 0 || kept_[b]) continue;
      // the buffers holding its last forward and first backward uses (searches over the (bucket, start)
      // keys, as numpy's; an index -1 wraps to the last buffer, as in numpy)
      const i64 fwd = buffer_at(kb, c_.fwd_at[b]), bwd = buffer_at(kb, c_.bwd_at[b]);
      if (fwd == bwd) continue;
      const auto wrap = [m](i64 j) { return static_cast<std::size_t>(j < 0 ? j + static_cast<i64>(m) : j); };
      const auto kf = static_cast<std::size_t>(order_[wrap(fwd)]);
      const auto kw = static_cast<std::size_t>(order_[wrap(bwd)]);
      const double g = stalled ? credit[kw] : c_.dur[b];
      if (!(g > 0)) continue;
      const i64 size = c_.size[b];
      const i64 cost = std::max<i64>(0, rmq_.query(rows_e_[kf], rows_p_[kw]) + size - peak);
      const double den = static_cast<double>(cost) + static_cast<double>(size) / 1024;
      if (den == 0) return false;
      cand_.push_back({g / den, kb, 0, g});
    }
    // best score first, then bucket, then keep before resident (np.lexsort((bs * 2 + kinds, -score)): a
    // total order, the keys being distinct). Each bucket's best move, in rank order, is taken until `cap`
    // moves or (while there is stall) until their gains, summed in that order, cover it. A bucket has at
    // most two candidates, so the first 2 * cap in rank order hold every move taken: only they are sorted.
    const auto better = [](const Candidate& a, const Candidate& b) {
      if (np_less(-a.score, -b.score)) return true;
      if (np_less(-b.score, -a.score)) return false;
      return a.bucket * 2 + a.kind < b.bucket * 2 + b.kind;
    };
    const i64 cap = std::max<i64>(1, (c_.n_used + c_.max_points - 1) / c_.max_points);
    const auto head = cand_.begin() + std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(cand_.size()), 2 * cap);
    std::nth_element(cand_.begin(), head, cand_.end(), better);  // nothing after `head` ranks before it
    std::sort(cand_.begin(), head, better);
    seen_.assign(nb, 0);
    double covered = 0;
    for (auto it = cand_.begin(); it != head && static_cast<i64>(moves.size()) < cap; ++it) {
      if (seen_[static_cast<std::size_t>(it->bucket)]) continue;
      seen_[static_cast<std::size_t>(it->bucket)] = 1;
      moves.push_back({it->kind == 1, it->bucket});
      covered = moves.size() == 1 ? it->gain : covered + it->gain;  // np.cumsum: sequential adds
      if (stalled && covered >= copy_stall) break;
    }
    return true;
  }

  // np.searchsorted(keys, bucket * (n + 1) + at, side="right") - 1 over the buffers' (bucket, start) keys
  // in order_ (sorted by bucket, then start): -1 where every key is larger.
  i64 buffer_at(i64 bucket, i64 at) const {
    const i64 big = c_.n + 1, key = bucket * big + at;
    const std::size_t nb = static_cast<std::size_t>(c_.nb);
    // keys before the bucket's run are smaller, keys after it larger: the answer is in the run or just before
    const auto b = std::min(nb, static_cast<std::size_t>(bucket));
    i64 lo = start_[b], hi = start_[std::min(nb, b + 1)];
    while (lo < hi) {
      const i64 mid = lo + (hi - lo) / 2;
      const auto k = static_cast<std::size_t>(order_[static_cast<std::size_t>(mid)]);
      if (rows_b_[k] * big + rows_p_[k] <= key)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo - 1;
  }

  struct Candidate {
    double score;
    i64 bucket;
    int kind;  // 1 resident, 0 keep
    double gain;
  };

  const GreedyConstants& c_;
  CopyMode mode_;
  std::vector<std::uint8_t> resident_, kept_, live_, seen_, starts_;
  std::vector<i64> end_, diff_, fill_, s_, e_, b_, p_, gp_, gb_, ge_, prev_, order_, start_, rows_p_, rows_b_, rows_e_, prof_;
  std::vector<i64> cb_, ce_, h2d_event_, copy_order_, copy_start_, wait_ptr_, wait_copy_, count_, inside_, outside_;
  std::vector<double> deadline_, duration_, latest_, h2d_solo_, gain_;
  std::vector<Candidate> cand_;
  i64 refresh_ = 0;
  std::vector<i64> refresh_after_;  // per refresh: the grad copy it follows (pipelined), else empty
  MaxTable rmq_;
  LaneScratch lane_scratch_;
};

void check_size(std::size_t got, std::size_t want, const char* name) {
  if (got != want)
    throw std::invalid_argument(std::string("greedy: ") + name + " has " + std::to_string(got) + " entries, expected " +
                                std::to_string(want));
}

void check_range(const std::vector<i64>& v, i64 lo, i64 hi, const char* name) {
  for (i64 x : v)
    if (x < lo || x >= hi)
      throw std::invalid_argument(std::string("greedy: ") + name + " has " + std::to_string(x) + ", outside [" +
                                  std::to_string(lo) + ", " + std::to_string(hi) + ")");
}

}  // namespace

void check_greedy_constants(const GreedyConstants& c) {
  if (c.n < 0 || c.nb < 0 || c.max_points < 1) throw std::invalid_argument("greedy: bad n, nb or max_points");
  const auto n = static_cast<std::size_t>(c.n), nb = static_cast<std::size_t>(c.nb), u = c.use_b.size();
  check_size(c.use_s.size(), u, "use_s");
  check_size(c.use_e.size(), u, "use_e");
  for (const auto* v : {&c.size, &c.nbytes, &c.fwd_row, &c.bwd_row, &c.fwd_at, &c.bwd_at}) check_size(v->size(), nb, "a per-bucket array");
  check_size(c.dur.size(), nb, "dur");
  check_size(c.updated_dur.size(), nb, "updated_dur");
  check_size(c.updated.size(), nb, "updated");
  check_size(c.tau.size(), n + 1, "tau");
  check_size(c.grad_profile.size(), n + 1, "grad_profile");
  check_size(c.compute.size(), n, "compute");
  check_size(c.need_e.size(), c.need_b.size(), "need_e");
  check_size(c.d2h_solo.size(), c.d2h_event.size(), "d2h_solo");
  check_size(c.adam_s.size(), c.d2h_event.size(), "adam_s");
  if (!c.grad_wait_ptr.empty()) check_size(c.grad_wait_ptr.size(), n + 1, "grad_wait_ptr");
  else check_size(c.grad_wait_copy.size(), 0, "grad_wait_copy");
  check_range(c.use_b, 0, c.nb, "use_b");
  check_range(c.use_s, 0, c.n, "use_s");
  check_range(c.use_e, 0, c.n + 1, "use_e");
  check_range(c.need_b, 0, c.nb, "need_b");
  check_range(c.need_e, 0, c.n, "need_e");
  check_range(c.keepable, 0, c.nb, "keepable");
  if (!c.refresh_after.empty()) {
    check_size(c.refresh_after.size(), nb, "refresh_after");
    check_range(c.refresh_after, -1, static_cast<i64>(c.d2h_event.size()), "refresh_after");
  }
  for (i64 kb : c.keepable) {
    const auto b = static_cast<std::size_t>(kb);
    if (c.fwd_row[b] < 0 || c.bwd_row[b] != c.fwd_row[b] + 1 || static_cast<std::size_t>(c.bwd_row[b]) >= u ||
        c.use_b[static_cast<std::size_t>(c.fwd_row[b])] != kb || c.use_b[static_cast<std::size_t>(c.bwd_row[b])] != kb)
      throw std::invalid_argument("greedy: a keepable bucket's rows are not two consecutive rows of its own");
  }
  for (std::size_t i = 1; i < u; ++i)
    if (c.use_b[i] < c.use_b[i - 1] || (c.use_b[i] == c.use_b[i - 1] && c.use_s[i] <= c.use_s[i - 1]))
      throw std::invalid_argument("greedy: need intervals are not grouped by bucket in event order");
  for (std::size_t i = 1; i < c.need_e.size(); ++i)
    if (c.need_e[i] < c.need_e[i - 1]) throw std::invalid_argument("greedy: needs are not in event order");
}

GreedyRun greedy_points(const GreedyConstants& c, CopyMode mode, std::int64_t capacity) {
  return Sequence(c, mode).run(capacity);
}

}  // namespace offload
