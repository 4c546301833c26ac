#include "schedule_kernels.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

namespace offload {

std::vector<double> latest_issue(View<double> deadline, View<double> duration) {
  std::vector<double> out;
  latest_issue(deadline, duration, out);
  return out;
}

void latest_issue(View<double> deadline, View<double> duration, std::vector<double>& out) {
  if (deadline.size() != duration.size()) throw std::invalid_argument("latest_issue: lengths differ");
  out.resize(deadline.size());
  double next = std::numeric_limits<double>::infinity();
  for (std::size_t q = deadline.size(); q-- > 0;) {
    next = std::min(deadline[q], next) - duration[q];
    out[q] = next;
  }
}

Occupants last_occupants(View<std::int64_t> issue, View<std::int64_t> release, View<std::int64_t> lo,
                         View<std::int64_t> hi) {
  const std::size_t n = issue.size();
  if (release.size() != n || lo.size() != n || hi.size() != n)
    throw std::invalid_argument("last_occupants: lengths differ");
  // (event, 0 release | 1 issue, buffer), in the order the Python sweep sorts its items
  std::vector<std::tuple<std::int64_t, int, std::int64_t>> items;
  items.reserve(2 * n);
  for (std::size_t k = 0; k < n; ++k) {
    if (lo[k] < 0 || hi[k] <= lo[k]) throw std::invalid_argument("last_occupants: empty or negative byte range");
    items.emplace_back(release[k], 0, static_cast<std::int64_t>(k));
    items.emplace_back(issue[k], 1, static_cast<std::int64_t>(k));
  }
  std::sort(items.begin(), items.end());
  // segment start -> the buffer that last released it (-1: none); a segment runs to the next start
  std::map<std::int64_t, std::int64_t> owner{{0, -1}};
  auto split = [&](std::int64_t at) {  // make `at` a segment start
    auto it = std::prev(owner.upper_bound(at));
    if (it->first != at) owner.emplace_hint(std::next(it), at, it->second);
  };
  std::vector<std::vector<std::int64_t>> got(n);
  for (const auto& [event, is_issue, k] : items) {
    const std::int64_t a = lo[k], b = hi[k];
    if (is_issue) {
      std::vector<std::int64_t>& mine = got[static_cast<std::size_t>(k)];
      for (auto it = std::prev(owner.upper_bound(a)); it != owner.end() && it->first < b; ++it)
        if (it->second >= 0) mine.push_back(it->second);
      std::sort(mine.begin(), mine.end());
      mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
    } else {
      split(a);
      split(b);
      auto first = owner.find(a);
      owner.erase(std::next(first), owner.find(b));
      first->second = k;
    }
  }
  Occupants out;
  out.ptr.assign(n + 1, 0);
  for (std::size_t k = 0; k < n; ++k) out.ptr[k + 1] = out.ptr[k] + static_cast<std::int64_t>(got[k].size());
  out.buffers.reserve(static_cast<std::size_t>(out.ptr[n]));
  for (const auto& g : got) out.buffers.insert(out.buffers.end(), g.begin(), g.end());
  return out;
}

}  // namespace offload
