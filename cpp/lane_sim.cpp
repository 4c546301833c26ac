#include "lane_sim.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <utility>

namespace offload {
namespace {

// Copies grouped by issuing event, in copy order within an event (what the reference's dict of lists is):
// event e's copies are copy[ptr[e - lo]:ptr[e - lo + 1]].
void group_by_event(const View<std::int64_t>& event, std::int64_t lo, std::int64_t hi, std::vector<std::int64_t>& ptr,
                    std::vector<std::int64_t>& copy, std::vector<std::int64_t>& fill) {
  ptr.assign(static_cast<std::size_t>(hi - lo + 2), 0);
  for (std::int64_t e : event)
    if (e >= lo && e <= hi) ++ptr[static_cast<std::size_t>(e - lo + 1)];
  for (std::size_t i = 1; i < ptr.size(); ++i) ptr[i] += ptr[i - 1];
  copy.resize(static_cast<std::size_t>(ptr.back()));
  fill.assign(ptr.begin(), ptr.end() - 1);
  for (std::size_t k = 0; k < event.size(); ++k) {
    const std::int64_t e = event[k];
    if (e >= lo && e <= hi) copy[static_cast<std::size_t>(fill[static_cast<std::size_t>(e - lo)]++)] = static_cast<std::int64_t>(k);
  }
}


constexpr std::int64_t kMaxPasses = 16;  // steady.py's MAX_PASSES
constexpr double kSettled = 1e-9;        // steady.py's SETTLED

// One pass of the lanes over the step (grouped copies in `w`). `pipelined`: the refreshes are w.order (lane
// order), carried in as w.carry_done/w.carry_dur and issued at the end into w.out_done/w.out_dur (steady.py's
// PipelinedLanes); else the copies at -1 are queued at 0 (simulate.py's Lanes).
void run_pass(const LaneProgram& p, LaneScratch& w, LaneResult& r, bool pipelined) {
  const std::int64_t n = static_cast<std::int64_t>(p.compute.size());
  const std::size_t nh = p.h2d_solo.size();
  const std::vector<std::int64_t>&h2d_ptr = w.h2d_ptr, &h2d_copy = w.h2d_copy, &d2h_ptr = w.d2h_ptr,
                               &d2h_copy = w.d2h_copy;
  std::vector<double>&done = w.done, &dur = w.dur, &cum = w.cum, &stall_at = w.stall_at, &d2h_done = w.d2h_done,
                     &adam_end = w.adam_end;
  done.assign(nh, 0.0), dur.assign(nh, 0.0), cum.assign(nh, 0.0), stall_at.assign(nh, 0.0);
  d2h_done.assign(p.d2h_solo.size(), -1.0);
  adam_end.assign(p.d2h_solo.size(), 0.0);
  std::vector<std::int64_t>& period_of = w.period_of;
  period_of.assign(nh, 0);
  r.step_s = r.compute_s = r.stall_s = r.h2d_busy_s = r.d2h_busy_s = r.adam_s = r.compute_end = r.grad_stall_s = 0;
  r.divided_by_zero = false;
  r.stall_per_event.assign(static_cast<std::size_t>(n), 0.0);
  double h2d_free = 0, d2h_free = 0, cpu_free = 0, period_len = 0, t = 0;
  std::int64_t period_start = 0;
  bool fresh = true;  // pipelined: no copy on the lane yet (PipelinedLanes.fresh)
  std::vector<std::pair<std::int64_t, double>> pending;  // (copy, grads on the host at), AdamW after backward
  const bool grad_waits = p.grad_wait_ptr.size() != 0;

  auto issue_h2d = [&](std::int64_t k, double now) {
    const double start = std::max(now, h2d_free);
    if (start > h2d_free || (pipelined ? fresh : k == 0)) period_start = k, period_len = 0.0;
    fresh = false;
    const double d = d2h_free > start ? p.h2d_solo[k] / p.duplex : p.h2d_solo[k];
    h2d_free = start + d;
    dur[k] = d;
    done[k] = h2d_free;
    r.h2d_busy_s += d;
    period_len += d;
    period_of[k] = period_start;
    cum[k] = period_len;
  };
  auto issue_d2h = [&](std::int64_t k, double now) {
    const double start = std::max(now, d2h_free);
    const double d = h2d_free > start ? p.d2h_solo[k] / p.duplex : p.d2h_solo[k];
    d2h_free = start + d;
    d2h_done[k] = d2h_free;
    r.d2h_busy_s += d;
    r.adam_s += p.adam_s[k];
    if (p.adam_after_backward)
      pending.emplace_back(k, d2h_free);
    else
      cpu_free = adam_end[k] = std::max(cpu_free, d2h_free) + p.adam_s[k];
  };

  if (pipelined) {  // PipelinedLanes.start_step; its credit_order: the carried refreshes, then the others
    w.credit_order.assign(w.order.begin(), w.order.end());
    for (std::size_t k = 0; k < nh; ++k)
      if (p.h2d_event[k] != -1) w.credit_order.push_back(static_cast<std::int64_t>(k));
    for (std::size_t j = 0; j < w.order.size(); ++j) {
      const std::int64_t k = w.order[j];
      done[k] = w.carry_done[j], dur[k] = w.carry_dur[j];
      if (w.carry_done[j] > 0.0) {
        if (fresh) period_start = k, period_len = 0.0, fresh = false;
        period_len += w.carry_dur[j];
        h2d_free = w.carry_done[j];
        period_of[k] = period_start, cum[k] = period_len;
      } else {
        period_of[k] = k, cum[k] = w.carry_dur[j];
      }
    }
  } else {
    for (std::int64_t j = h2d_ptr[0]; j < h2d_ptr[1]; ++j) issue_h2d(h2d_copy[j], 0.0);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = h2d_ptr[i + 1]; j < h2d_ptr[i + 2]; ++j) issue_h2d(h2d_copy[j], t);
    for (std::int64_t j = p.wait_ptr[i]; j < p.wait_ptr[i + 1]; ++j) {
      const std::int64_t k = p.wait_copy[j];
      if (done[k] > t) {
        const double s = done[k] - t;
        r.stall_per_event[i] += s;
        if (cum[k] == 0.0) r.divided_by_zero = true;
        stall_at[k] += s / cum[k];
        t = done[k];
      }
    }
    if (grad_waits) {
      for (std::int64_t j = p.grad_wait_ptr[i]; j < p.grad_wait_ptr[i + 1]; ++j) {
        const double ready = d2h_done[p.grad_wait_copy[j]];
        if (ready > t) {
          const double s = ready - t;
          r.stall_per_event[i] += s;
          r.grad_stall_s += s;
          t = ready;
        }
      }
    }
    for (std::int64_t j = d2h_ptr[i]; j < d2h_ptr[i + 1]; ++j) issue_d2h(d2h_copy[j], t);
    t += p.compute[i];
  }
  r.compute_end = t;
  for (std::int64_t j = d2h_ptr[n]; j < d2h_ptr[n + 1]; ++j) issue_d2h(d2h_copy[j], t);
  for (const auto& [k, ready] : pending) cpu_free = adam_end[k] = std::max(std::max(cpu_free, ready), t) + p.adam_s[k];
  if (pipelined) {  // PipelinedLanes.finish
    r.step_s = std::max(std::max(t + p.tail, h2d_free), std::max(d2h_free, cpu_free));
    // steady.py's issue_order: step() issues first the refreshes whose AdamW has ended, in first-use order,
    // then the others in the lane's order as their AdamW ends; but the first-used one goes first where its
    // AdamW is the lane's next (the first not ended)
    const std::size_t m = w.lane_order.size();
    const auto used_before = [&](std::int64_t x, std::int64_t y) {
      const std::int64_t kx = w.lane_order[x], ky = w.lane_order[y];
      return w.first_use[kx] != w.first_use[ky] ? w.first_use[kx] < w.first_use[ky] : kx < ky;
    };
    w.issue.clear();
    for (std::size_t j = 0; j < m; ++j)
      if (adam_end[w.lane_after[j]] <= t) w.issue.push_back(static_cast<std::int64_t>(j));
    std::sort(w.issue.begin(), w.issue.end(), used_before);
    const std::size_t e = w.issue.size();
    for (std::size_t j = 0; j < m; ++j)
      if (adam_end[w.lane_after[j]] > t) w.issue.push_back(static_cast<std::int64_t>(j));
    if (e > 0 && e < m) {
      bool head = used_before(w.issue[e], w.issue[0]);
      for (std::size_t q = e + 1; head && q < m; ++q) head = used_before(w.issue[e], w.issue[q]);
      if (head) std::rotate(w.issue.begin(), w.issue.begin() + static_cast<std::ptrdiff_t>(e),
                            w.issue.begin() + static_cast<std::ptrdiff_t>(e + 1));
    }
    w.out_order.resize(m), w.out_after.resize(m), w.out_done.resize(m), w.out_dur.resize(m);
    for (std::size_t q = 0; q < m; ++q) {
      const std::size_t j = static_cast<std::size_t>(w.issue[q]);
      const std::int64_t k = w.lane_order[j], a = w.lane_after[j];
      const double start = std::max(std::max(t, adam_end[a]), h2d_free);
      const double d = d2h_free > start ? p.h2d_solo[k] / p.duplex : p.h2d_solo[k];
      h2d_free = start + d;
      r.h2d_busy_s += d;
      w.out_order[q] = k, w.out_after[q] = a, w.out_done[q] = h2d_free - r.step_s, w.out_dur[q] = d;
    }
  } else {
    r.step_s = std::max(std::max(t, h2d_free), std::max(d2h_free, cpu_free));
  }
  for (double c : p.compute) r.compute_s += c;
  for (double s : r.stall_per_event) r.stall_s += s;
  // credit[j] = dur[j] * (stall_at summed over j and the later copies of its busy period): a reverse scan, in
  // lane order (index order, or the refreshes in lane order first where pipelined)
  r.copy_credit.assign(nh, 0.0);
  double acc = 0.0;
  std::int64_t next = -1;
  for (std::size_t q = nh; q-- > 0;) {
    const std::int64_t j = pipelined ? w.credit_order[q] : static_cast<std::int64_t>(q);
    if (next >= 0 && period_of[next] != period_of[j]) acc = 0.0;
    acc += stall_at[j];
    r.copy_credit[j] = dur[j] * acc;
    next = j;
  }
}

// steady.py's Carry.settled: carry out == carry in (the same issue order), to kSettled of the step.
bool settled(const LaneScratch& w, double step) {
  if (w.order != w.out_order) return false;
  const double tol = kSettled * step;
  for (std::size_t j = 0; j < w.order.size(); ++j) {
    const double a = std::max(0.0, w.carry_done[j]), b = std::max(0.0, w.out_done[j]);
    if (std::fabs(a - b) > tol || ((a > 0.0 || b > 0.0) && std::fabs(w.carry_dur[j] - w.out_dur[j]) > tol))
      return false;
  }
  return true;
}

}  // namespace

LaneResult simulate_lanes(const LaneProgram& p) {
  LaneScratch scratch;
  LaneResult r;
  simulate_lanes(p, scratch, r);
  return r;
}

void simulate_lanes(const LaneProgram& p, LaneScratch& w, LaneResult& r) {
  const std::int64_t n = static_cast<std::int64_t>(p.compute.size());
  const std::size_t nh = p.h2d_solo.size();
  if (p.h2d_event.size() != nh || p.d2h_event.size() != p.d2h_solo.size() || p.adam_s.size() != p.d2h_solo.size() ||
      p.wait_ptr.size() != static_cast<std::size_t>(n + 1))
    throw std::invalid_argument("simulate_lanes: inconsistent program lengths");
  for (std::int64_t k : p.wait_copy)
    if (k < 0 || static_cast<std::size_t>(k) >= nh) throw std::invalid_argument("simulate_lanes: bad wait copy");
  const bool grad_waits = p.grad_wait_ptr.size() != 0;
  if (grad_waits) {
    if (p.grad_wait_ptr.size() != static_cast<std::size_t>(n + 1) || p.grad_wait_ptr[0] != 0 ||
        p.grad_wait_ptr[static_cast<std::size_t>(n)] != static_cast<std::int64_t>(p.grad_wait_copy.size()))
      throw std::invalid_argument("simulate_lanes: grad_wait_ptr needs one entry per event and one more");
    for (std::int64_t i = 0; i < n; ++i) {
      if (p.grad_wait_ptr[i + 1] < p.grad_wait_ptr[i]) throw std::invalid_argument("simulate_lanes: bad grad_wait_ptr");
      for (std::int64_t j = p.grad_wait_ptr[i]; j < p.grad_wait_ptr[i + 1]; ++j) {
        const std::int64_t k = p.grad_wait_copy[j];
        if (k < 0 || static_cast<std::size_t>(k) >= p.d2h_event.size() || p.d2h_event[k] >= i)
          throw std::invalid_argument("simulate_lanes: a grad wait names a copy not issued before its event");
      }
    }
  }
  group_by_event(p.h2d_event, -1, n - 1, w.h2d_ptr, w.h2d_copy, w.fill);
  group_by_event(p.d2h_event, 0, n, w.d2h_ptr, w.d2h_copy, w.fill);
  const std::int64_t m = w.h2d_ptr[1] - w.h2d_ptr[0];  // copies at -1
  const bool pipelined = p.refresh_after.size() != 0 && m > 0;
  r.refresh_passes = 0;
  if (!pipelined) {
    run_pass(p, w, r, false);
    return;
  }
  if (p.refresh_after.size() != static_cast<std::size_t>(m))
    throw std::invalid_argument("simulate_lanes: refresh_after needs one entry per copy at -1");
  for (std::int64_t a : p.refresh_after)
    if (a < 0 || static_cast<std::size_t>(a) >= p.d2h_event.size())
      throw std::invalid_argument("simulate_lanes: refresh_after names no device-to-host copy");
  // steady.py's first_carry: the refreshes in lane order (their grad copies' (event, index), stable)
  w.lane.resize(static_cast<std::size_t>(m));
  for (std::int64_t j = 0; j < m; ++j) w.lane[static_cast<std::size_t>(j)] = j;
  std::stable_sort(w.lane.begin(), w.lane.end(), [&](std::int64_t x, std::int64_t y) {
    const std::int64_t ax = p.refresh_after[x], ay = p.refresh_after[y];
    return p.d2h_event[ax] != p.d2h_event[ay] ? p.d2h_event[ax] < p.d2h_event[ay] : ax < ay;
  });
  w.order.resize(static_cast<std::size_t>(m)), w.after.resize(static_cast<std::size_t>(m));
  w.carry_done.assign(static_cast<std::size_t>(m), 0.0), w.carry_dur.resize(static_cast<std::size_t>(m));
  for (std::size_t j = 0; j < static_cast<std::size_t>(m); ++j) {
    const std::int64_t x = w.lane[j];
    w.order[j] = w.h2d_copy[static_cast<std::size_t>(w.h2d_ptr[0] + x)];
    w.after[j] = p.refresh_after[x];
    w.carry_dur[j] = p.h2d_solo[w.order[j]];
  }
  w.carry_done.back() = w.carry_dur.back();
  w.lane_order.assign(w.order.begin(), w.order.end()), w.lane_after.assign(w.after.begin(), w.after.end());
  // steady.py's first_use: per copy, the first event that waits for it (n: none)
  w.first_use.assign(nh, n);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = p.wait_ptr[i]; j < p.wait_ptr[i + 1]; ++j) {
      const std::size_t k = static_cast<std::size_t>(p.wait_copy[j]);
      if (w.first_use[k] == n) w.first_use[k] = i;
    }
  for (std::int64_t pass = 1; pass <= kMaxPasses; ++pass) {
    run_pass(p, w, r, true);
    r.refresh_passes = pass;
    if (r.divided_by_zero || settled(w, r.step_s)) break;
    std::swap(w.carry_done, w.out_done), std::swap(w.carry_dur, w.out_dur);
    std::swap(w.order, w.out_order), std::swap(w.after, w.out_after);
  }
}

}  // namespace offload
