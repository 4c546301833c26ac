#include "lane_sim.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace offload {
namespace {

// Copies grouped by issuing event, in copy order within an event (what the reference's dict of lists is).
struct ByEvent {
  std::vector<std::int64_t> ptr, copy;
  ByEvent(const View<std::int64_t>& event, std::int64_t lo, std::int64_t hi) {
    ptr.assign(static_cast<std::size_t>(hi - lo + 2), 0);
    for (std::int64_t e : event)
      if (e >= lo && e <= hi) ++ptr[static_cast<std::size_t>(e - lo + 1)];
    for (std::size_t i = 1; i < ptr.size(); ++i) ptr[i] += ptr[i - 1];
    copy.resize(static_cast<std::size_t>(ptr.back()));
    std::vector<std::int64_t> fill(ptr.begin(), ptr.end() - 1);
    for (std::size_t k = 0; k < event.size(); ++k) {
      const std::int64_t e = event[k];
      if (e >= lo && e <= hi) copy[static_cast<std::size_t>(fill[static_cast<std::size_t>(e - lo)]++)] = k;
    }
  }
};

}  // namespace

LaneResult simulate_lanes(const LaneProgram& p) {
  const std::int64_t n = static_cast<std::int64_t>(p.compute.size());
  const std::size_t nh = p.h2d_solo.size();
  if (p.h2d_event.size() != nh || p.d2h_event.size() != p.d2h_solo.size() || p.adam_s.size() != p.d2h_solo.size() ||
      p.wait_ptr.size() != static_cast<std::size_t>(n + 1))
    throw std::invalid_argument("simulate_lanes: inconsistent program lengths");
  for (std::int64_t k : p.wait_copy)
    if (k < 0 || static_cast<std::size_t>(k) >= nh) throw std::invalid_argument("simulate_lanes: bad wait copy");
  const ByEvent h2d_at(p.h2d_event, -1, n - 1), d2h_at(p.d2h_event, 0, n);
  std::vector<double> done(nh, 0.0), dur(nh, 0.0), cum(nh, 0.0), stall_at(nh, 0.0);
  std::vector<std::int64_t> period_of(nh, 0);
  LaneResult r;
  r.stall_per_event.assign(static_cast<std::size_t>(n), 0.0);
  double h2d_free = 0, d2h_free = 0, cpu_free = 0, period_len = 0, t = 0;
  std::int64_t period_start = 0;
  std::vector<std::pair<double, double>> pending;

  auto issue_h2d = [&](std::int64_t k, double now) {
    const double start = std::max(now, h2d_free);
    if (start > h2d_free || k == 0) period_start = k, period_len = 0.0;
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
    r.d2h_busy_s += d;
    r.adam_s += p.adam_s[k];
    if (p.adam_after_backward)
      pending.emplace_back(d2h_free, p.adam_s[k]);
    else
      cpu_free = std::max(cpu_free, d2h_free) + p.adam_s[k];
  };

  for (std::int64_t j = h2d_at.ptr[0]; j < h2d_at.ptr[1]; ++j) issue_h2d(h2d_at.copy[j], 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = h2d_at.ptr[i + 1]; j < h2d_at.ptr[i + 2]; ++j) issue_h2d(h2d_at.copy[j], t);
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
    for (std::int64_t j = d2h_at.ptr[i]; j < d2h_at.ptr[i + 1]; ++j) issue_d2h(d2h_at.copy[j], t);
    t += p.compute[i];
  }
  r.compute_end = t;
  for (std::int64_t j = d2h_at.ptr[n]; j < d2h_at.ptr[n + 1]; ++j) issue_d2h(d2h_at.copy[j], t);
  for (const auto& [ready, adam] : pending) cpu_free = std::max(std::max(cpu_free, ready), t) + adam;
  r.step_s = std::max(std::max(t, h2d_free), std::max(d2h_free, cpu_free));
  for (double c : p.compute) r.compute_s += c;
  for (double s : r.stall_per_event) r.stall_s += s;
  // credit[j] = dur[j] * (stall_at summed over j and the later copies of its busy period): a reverse scan
  r.copy_credit.assign(nh, 0.0);
  double acc = 0.0;
  for (std::size_t j = nh; j-- > 0;) {
    if (j + 1 < nh && period_of[j + 1] != period_of[j]) acc = 0.0;
    acc += stall_at[j];
    r.copy_credit[j] = dur[j] * acc;
  }
  return r;
}

}  // namespace offload
