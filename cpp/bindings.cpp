// The only translation unit that includes pybind11: exposes the C++ core as `offload._C`.
// Error mapping: std::invalid_argument -> ValueError, ArenaOutOfMemory -> MemoryError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "arena_planner.h"
#include "cpu_adam.h"
#include "greedy.h"
#include "lane_sim.h"
#include "pinned_arena.h"
#include "schedule_kernels.h"

namespace py = pybind11;

namespace {

// Python ints are signed: take int64 and reject negatives with a ValueError that names the
// argument, instead of pybind11's generic TypeError for a failed size_t conversion.
std::size_t non_negative(std::int64_t value, const char* name) {
  if (value < 0) throw std::invalid_argument(std::string(name) + " must be >= 0, got " + std::to_string(value));
  return static_cast<std::size_t>(value);
}

py::dict stats_dict(const offload::ArenaStats& s) {
  py::dict d;
  d["size_bytes"] = s.size_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["largest_free_bytes"] = s.largest_free_bytes;
  d["num_allocations"] = s.num_allocations;
  d["num_free_gaps"] = s.num_free_gaps;
  d["num_os_allocations"] = s.num_os_allocations;
  return d;
}

using Sizes = std::vector<std::int64_t>;

// Returns (offsets, total bytes, winning heuristic, {heuristic: total bytes} for every heuristic run).
py::tuple plan_arena(const Sizes& sizes, const Sizes& starts, const Sizes& ends, std::int64_t alignment,
                     const std::string& heuristic, std::int64_t stop_at) {
  offload::ArenaPlan plan;
  {
    py::gil_scoped_release release;
    plan = heuristic == "best"
               ? offload::plan_arena_best({sizes, starts, ends}, alignment, stop_at)
               : offload::plan_arena({sizes, starts, ends}, alignment, offload::heuristic_from_name(heuristic));
  }
  py::dict totals;
  for (int h = 0; h < offload::kNumHeuristics; ++h) {
    if (plan.totals[h] >= 0) totals[offload::heuristic_name(h)] = plan.totals[h];
  }
  return py::make_tuple(plan.offsets, plan.total_bytes, offload::heuristic_name(plan.heuristic), totals);
}

std::int64_t arena_lower_bound(const Sizes& sizes, const Sizes& starts, const Sizes& ends,
                               std::int64_t alignment) {
  return offload::arena_lower_bound({sizes, starts, ends}, alignment);
}

// The lane loop's inputs arrive as numpy arrays (or sequences, converted once): the scheduler keeps them
// as arrays, so a simulated point converts no per-event Python objects.
using SecondsArray = py::array_t<double, py::array::c_style | py::array::forcecast>;
using IndexArray = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

template <typename T, typename A>
offload::View<T> view_of(const A& a, const char* name) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be one-dimensional");
  return {a.data(), static_cast<std::size_t>(a.shape(0))};
}

// plan_arena and arena_lower_bound for int64 numpy columns (no forcecast: other arrays and sequences take
// the std::vector overloads above, with their conversions and errors): a planner with its columns as arrays
// hands over 30,000 buffers without a Python int per value.
using IntColumn = py::array_t<std::int64_t, py::array::c_style>;

Sizes column(const IntColumn& a, const char* name) {
  const auto v = view_of<std::int64_t>(a, name);
  return {v.begin(), v.end()};
}

py::tuple plan_arena_columns(const IntColumn& sizes, const IntColumn& starts, const IntColumn& ends,
                             std::int64_t alignment, const std::string& heuristic, std::int64_t stop_at) {
  return plan_arena(column(sizes, "sizes"), column(starts, "starts"), column(ends, "ends"), alignment, heuristic,
                    stop_at);
}

std::int64_t arena_lower_bound_columns(const IntColumn& sizes, const IntColumn& starts, const IntColumn& ends,
                                       std::int64_t alignment) {
  const Sizes a = column(sizes, "sizes"), b = column(starts, "starts"), c = column(ends, "ends");
  py::gil_scoped_release release;
  return offload::arena_lower_bound({a, b, c}, alignment);
}

// Returns (step, compute, stall, h2d busy, d2h busy, adam, compute end, stall per event, copy credit,
// grad stall, refresh passes, divided by zero), the two per-item results as numpy arrays; offload/planning/simulate.py builds the SimResult.
py::tuple simulate_lanes(const SecondsArray& compute, const IndexArray& h2d_event, const SecondsArray& h2d_solo,
                         const IndexArray& wait_ptr, const IndexArray& wait_copy, const IndexArray& d2h_event,
                         const SecondsArray& d2h_solo, const SecondsArray& adam_s, bool adam_after_backward,
                         double duplex, const IndexArray& grad_wait_ptr, const IndexArray& grad_wait_copy,
                         const IndexArray& refresh_after, double tail) {
  const offload::LaneProgram program{
      view_of<double>(compute, "compute"),     view_of<std::int64_t>(h2d_event, "h2d_event"),
      view_of<double>(h2d_solo, "h2d_solo"),   view_of<std::int64_t>(wait_ptr, "wait_ptr"),
      view_of<std::int64_t>(wait_copy, "wait_copy"), view_of<std::int64_t>(d2h_event, "d2h_event"),
      view_of<double>(d2h_solo, "d2h_solo"),   view_of<double>(adam_s, "adam_s"),
      adam_after_backward,                     duplex,
      view_of<std::int64_t>(grad_wait_ptr, "grad_wait_ptr"), view_of<std::int64_t>(grad_wait_copy, "grad_wait_copy"),
      view_of<std::int64_t>(refresh_after, "refresh_after"), tail};
  offload::LaneResult r;
  {
    py::gil_scoped_release release;
    r = offload::simulate_lanes(program);
  }
  return py::make_tuple(r.step_s, r.compute_s, r.stall_s, r.h2d_busy_s, r.d2h_busy_s, r.adam_s, r.compute_end,
                        py::array_t<double>(static_cast<py::ssize_t>(r.stall_per_event.size()), r.stall_per_event.data()),
                        py::array_t<double>(static_cast<py::ssize_t>(r.copy_credit.size()), r.copy_credit.data()),
                        r.grad_stall_s, r.refresh_passes, r.divided_by_zero);
}

// The scheduler's two sequential loops (cpp/schedule_kernels.h).
py::array_t<double> latest_issue(const SecondsArray& deadline, const SecondsArray& duration) {
  const auto d = view_of<double>(deadline, "deadline");
  const auto t = view_of<double>(duration, "duration");
  std::vector<double> out;
  {
    py::gil_scoped_release release;
    out = offload::latest_issue(d, t);
  }
  return py::array_t<double>(static_cast<py::ssize_t>(out.size()), out.data());
}

py::tuple last_occupants(const IndexArray& issue, const IndexArray& release_at, const IndexArray& lo,
                         const IndexArray& hi) {
  const auto a = view_of<std::int64_t>(issue, "issue");
  const auto b = view_of<std::int64_t>(release_at, "release");
  const auto c = view_of<std::int64_t>(lo, "lo");
  const auto d = view_of<std::int64_t>(hi, "hi");
  offload::Occupants r;
  {
    py::gil_scoped_release release;
    r = offload::last_occupants(a, b, c, d);
  }
  return py::make_tuple(r.ptr, r.buffers);
}

// A numpy array that owns `v` (moved, not copied), of the given shape.
template <typename T>
py::array_t<T> owning_array(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(std::move(shape), owned->data(), free_when_done);
}

template <typename T, typename A>
std::vector<T> vector_of(const A& a, const char* name) {
  const offload::View<T> v = view_of<T>(a, name);
  return {v.begin(), v.end()};
}

// The greedy scheduler's move sequence (cpp/greedy.h): the constants once, then one call per copy mode.
class GreedyKernel {
 public:
  GreedyKernel(std::int64_t n, std::int64_t nb, const IndexArray& use_b, const IndexArray& use_s,
               const IndexArray& use_e, const IndexArray& size, const IndexArray& nbytes, const SecondsArray& dur,
               const SecondsArray& updated_dur, const IndexArray& updated, const IndexArray& fwd_row,
               const IndexArray& bwd_row, const IndexArray& fwd_at, const IndexArray& bwd_at,
               const IndexArray& keepable, const SecondsArray& tau, const IndexArray& grad_profile,
               const IndexArray& need_b, const IndexArray& need_e, const SecondsArray& compute,
               const IndexArray& d2h_event, const SecondsArray& d2h_solo, const SecondsArray& adam_s,
               const IndexArray& grad_wait_ptr, const IndexArray& grad_wait_copy, double duplex,
               std::int64_t n_used, std::int64_t max_points, const IndexArray& refresh_after, double tail) {
    c_.n = n, c_.nb = nb;
    c_.use_b = vector_of<std::int64_t>(use_b, "use_b");
    c_.use_s = vector_of<std::int64_t>(use_s, "use_s");
    c_.use_e = vector_of<std::int64_t>(use_e, "use_e");
    c_.size = vector_of<std::int64_t>(size, "size");
    c_.nbytes = vector_of<std::int64_t>(nbytes, "nbytes");
    c_.dur = vector_of<double>(dur, "dur");
    c_.updated_dur = vector_of<double>(updated_dur, "updated_dur");
    for (std::int64_t x : view_of<std::int64_t>(updated, "updated")) c_.updated.push_back(x != 0);
    c_.fwd_row = vector_of<std::int64_t>(fwd_row, "fwd_row");
    c_.bwd_row = vector_of<std::int64_t>(bwd_row, "bwd_row");
    c_.fwd_at = vector_of<std::int64_t>(fwd_at, "fwd_at");
    c_.bwd_at = vector_of<std::int64_t>(bwd_at, "bwd_at");
    c_.keepable = vector_of<std::int64_t>(keepable, "keepable");
    c_.tau = vector_of<double>(tau, "tau");
    c_.grad_profile = vector_of<std::int64_t>(grad_profile, "grad_profile");
    c_.need_b = vector_of<std::int64_t>(need_b, "need_b");
    c_.need_e = vector_of<std::int64_t>(need_e, "need_e");
    c_.compute = vector_of<double>(compute, "compute");
    c_.d2h_event = vector_of<std::int64_t>(d2h_event, "d2h_event");
    c_.d2h_solo = vector_of<double>(d2h_solo, "d2h_solo");
    c_.adam_s = vector_of<double>(adam_s, "adam_s");
    c_.grad_wait_ptr = vector_of<std::int64_t>(grad_wait_ptr, "grad_wait_ptr");
    c_.grad_wait_copy = vector_of<std::int64_t>(grad_wait_copy, "grad_wait_copy");
    c_.duplex = duplex;
    c_.n_used = n_used;
    c_.max_points = max_points;
    c_.refresh_after = vector_of<std::int64_t>(refresh_after, "refresh_after");
    c_.tail = tail;
    offload::check_greedy_constants(c_);
  }

  // (points, fallback): each point (resident, flat rows, step, compute, stall, h2d busy, d2h busy, adam,
  // compute end, stall per event, copy credit, h2d bytes, peak, resident bytes, grad stall, refresh passes);
  // arrays are numpy.
  py::tuple points(int mode, std::int64_t capacity) const {
    if (mode < 0 || mode > 2) throw std::invalid_argument("mode must be 0, 1 or 2, got " + std::to_string(mode));
    offload::GreedyRun run;
    {
      py::gil_scoped_release release;
      run = offload::greedy_points(c_, static_cast<offload::CopyMode>(mode), capacity);
    }
    py::list out;
    for (offload::GreedyPoint& p : run.points) {
      const auto rows = static_cast<py::ssize_t>(p.flat.size() / 3);
      const auto resident = static_cast<py::ssize_t>(p.resident.size());
      const auto events = static_cast<py::ssize_t>(p.lanes.stall_per_event.size());
      const auto copies = static_cast<py::ssize_t>(p.lanes.copy_credit.size());
      out.append(py::make_tuple(owning_array(std::move(p.resident), {resident}),
                                owning_array(std::move(p.flat), {rows, 3}), p.lanes.step_s, p.lanes.compute_s,
                                p.lanes.stall_s, p.lanes.h2d_busy_s, p.lanes.d2h_busy_s, p.lanes.adam_s,
                                p.lanes.compute_end, owning_array(std::move(p.lanes.stall_per_event), {events}),
                                owning_array(std::move(p.lanes.copy_credit), {copies}), p.h2d_bytes, p.peak,
                                p.resident_bytes, p.lanes.grad_stall_s, p.lanes.refresh_passes));
    }
    return py::make_tuple(out, run.fallback);
  }

 private:
  offload::GreedyConstants c_;
};

offload::ScalarType scalar_type(const std::string& name, const char* what) {
  if (name == "float32") return offload::ScalarType::kFloat32;
  if (name == "bfloat16") return offload::ScalarType::kBFloat16;
  if (name == "float16") return offload::ScalarType::kFloat16;
  throw std::invalid_argument(std::string(what) + " must be 'float32', 'bfloat16' or 'float16', got '" + name + "'");
}

// Pointers arrive as integers (tensor.data_ptr()); the Python wrapper (offload/host/cpu_adam.py) checks
// dtypes, lengths, contiguity and overlap before calling. lowp_dtype is read only when lowp_out is set.
offload::AdamWBuffers make_buffers(std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                                   std::uintptr_t grad, const std::string& grad_dtype, std::uintptr_t lowp_out,
                                   const std::string& lowp_dtype, std::int64_t numel) {
  offload::AdamWBuffers b;
  b.param = reinterpret_cast<float*>(param);
  b.exp_avg = reinterpret_cast<float*>(exp_avg);
  b.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
  b.grad = reinterpret_cast<const void*>(grad);
  b.grad_type = scalar_type(grad_dtype, "grad_dtype");
  b.lowp_out = reinterpret_cast<void*>(lowp_out);
  if (lowp_out != 0) b.lowp_type = scalar_type(lowp_dtype, "lowp_dtype");
  b.numel = non_negative(numel, "numel");
  return b;
}

bool adamw_step(std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t grad,
                const std::string& grad_dtype, std::uintptr_t lowp_out, const std::string& lowp_dtype,
                std::int64_t numel, std::int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay, double grad_scale, bool check_finite, int num_threads,
                const std::string& isa) {
  const offload::AdamWBuffers b =
      make_buffers(param, exp_avg, exp_avg_sq, grad, grad_dtype, lowp_out, lowp_dtype, numel);
  offload::AdamWHyper h;
  h.step = step;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.grad_scale = grad_scale;
  py::gil_scoped_release release;  // pure arithmetic on raw memory: other Python threads may run
  return offload::adamw_step(b, h, check_finite, num_threads, isa);
}

// [Note: segmented AdamW] in cpu_adam.h, from three tables given by address (the engine keeps them as flat
// int64 / float64 tensors, offload/host/segments.py): `table` rows [first, first + count) of 7 int64 each
// (param, exp_avg, exp_avg_sq addresses, the index of the segment's grad in `grads`, the low-precision copy's
// address or 0, numel, the index of its row in `hypers`), `grads` n_grads int64 addresses, `hypers` n_hypers
// rows of 7 float64 (step, lr, beta1, beta2, eps, weight_decay, grad_scale). Indices are checked here; returns
// adamw_step_segments' answer counted from `first`'s row (-1: none found inf).
std::int64_t adamw_step_segments(std::uintptr_t table, std::int64_t first, std::int64_t count, std::uintptr_t grads,
                                 std::int64_t n_grads, std::uintptr_t hypers, std::int64_t n_hypers,
                                 const std::string& grad_dtype, const std::string& lowp_dtype, bool check_finite,
                                 int num_threads, const std::string& isa) {
  constexpr int kCols = 7;
  non_negative(first, "first");
  const std::size_t n = non_negative(count, "count");
  const std::size_t ng = non_negative(n_grads, "n_grads");
  const std::size_t nh = non_negative(n_hypers, "n_hypers");
  if ((n > 0 && (table == 0 || grads == 0)) || (nh > 0 && hypers == 0)) {
    throw std::invalid_argument("adamw_step_segments: a table address is null");
  }
  const auto grad_type = scalar_type(grad_dtype, "grad_dtype");
  const auto lowp_type = scalar_type(lowp_dtype, "lowp_dtype");
  const auto* rows = reinterpret_cast<const std::int64_t*>(table) + first * kCols;
  const auto* grad_at = reinterpret_cast<const std::int64_t*>(grads);
  std::vector<offload::AdamWSegment> segments(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t* r = rows + i * kCols;
    if (r[3] < 0 || static_cast<std::size_t>(r[3]) >= ng || r[6] < 0 || static_cast<std::size_t>(r[6]) >= nh) {
      throw std::invalid_argument("adamw_step_segments: segment " +
                                  std::to_string(first + static_cast<std::int64_t>(i)) + " names grad " +
                                  std::to_string(r[3]) + " of " + std::to_string(ng) + " or hyper " +
                                  std::to_string(r[6]) + " of " + std::to_string(nh));
    }
    offload::AdamWSegment& s = segments[i];
    s.param = reinterpret_cast<float*>(static_cast<std::uintptr_t>(r[0]));
    s.exp_avg = reinterpret_cast<float*>(static_cast<std::uintptr_t>(r[1]));
    s.exp_avg_sq = reinterpret_cast<float*>(static_cast<std::uintptr_t>(r[2]));
    s.grad = reinterpret_cast<const void*>(static_cast<std::uintptr_t>(grad_at[r[3]]));
    s.lowp_out = reinterpret_cast<void*>(static_cast<std::uintptr_t>(r[4]));
    s.numel = non_negative(r[5], "numel");
    s.hyper = static_cast<std::size_t>(r[6]);
  }
  std::vector<offload::AdamWHyper> hyper(nh);
  const auto* h = reinterpret_cast<const double*>(hypers);
  for (std::size_t i = 0; i < nh; ++i) {
    const double* r = h + i * kCols;
    if (!(r[0] >= 1.0) || r[0] != static_cast<double>(static_cast<std::int64_t>(r[0]))) {
      throw std::invalid_argument("adamw_step_segments: hyper " + std::to_string(i) +
                                  "'s step must be an integer >= 1");
    }
    hyper[i].step = static_cast<std::int64_t>(r[0]);
    hyper[i].lr = r[1];
    hyper[i].beta1 = r[2];
    hyper[i].beta2 = r[3];
    hyper[i].eps = r[4];
    hyper[i].weight_decay = r[5];
    hyper[i].grad_scale = r[6];
  }
  py::gil_scoped_release release;  // pure arithmetic on raw memory: other Python threads may run
  const std::int64_t bad = offload::adamw_step_segments(segments.data(), n, hyper.data(), nh, grad_type, lowp_type,
                                                        check_finite, num_threads, isa);
  return bad < 0 ? bad : first + bad;
}

void adamw_memory_traffic(std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                          std::uintptr_t grad, const std::string& grad_dtype, std::uintptr_t lowp_out,
                          std::int64_t numel, int num_threads) {
  // The traffic probe takes no copy dtype: the bf16 and fp16 copies move the same bytes.
  const offload::AdamWBuffers b =
      make_buffers(param, exp_avg, exp_avg_sq, grad, grad_dtype, lowp_out, "bfloat16", numel);
  py::gil_scoped_release release;
  offload::adamw_memory_traffic(b, num_threads);
}

void bind_pinned_arena(py::module_& m) {
  using offload::PinnedArena;
  py::class_<PinnedArena>(m, "PinnedArena", py::buffer_protocol(),
                          "Exact-size, 2 MiB-aligned, first-touched host region with a best-fit sub-allocator.")
      // The GIL is released while the region is mapped and touched: that can take seconds for
      // tens of GiB, and other Python threads should keep running meanwhile.
      .def(py::init([](std::int64_t size_bytes, unsigned touch_threads, int numa_node, bool populate) {
             const std::size_t size = non_negative(size_bytes, "size_bytes");
             py::gil_scoped_release release;
             return std::make_unique<PinnedArena>(size, offload::TouchOptions{touch_threads, numa_node, populate});
           }),
           py::arg("size_bytes"), py::arg("touch_threads") = 0, py::arg("numa_node") = -1,
           py::arg("populate") = false)
      .def_property_readonly("touch_method", &PinnedArena::touch_method)
      .def_property_readonly("size_bytes", &PinnedArena::size_bytes)
      .def_property_readonly("reserved_bytes", &PinnedArena::reserved_bytes)
      .def_property_readonly("data_ptr",
                             [](const PinnedArena& a) { return reinterpret_cast<std::uintptr_t>(a.data()); })
      .def(
          "reserve",
          [](PinnedArena& a, std::int64_t offset, std::int64_t size) {
            a.reserve(non_negative(offset, "offset"), non_negative(size, "size"));
          },
          py::arg("offset"), py::arg("size"))
      .def(
          "allocate",
          [](PinnedArena& a, std::int64_t size, std::int64_t alignment) {
            return a.allocate(non_negative(size, "size"), non_negative(alignment, "alignment"));
          },
          py::arg("size"), py::arg("alignment") = 64)
      .def(
          "release", [](PinnedArena& a, std::int64_t offset) { a.release(non_negative(offset, "offset")); },
          py::arg("offset"))
      .def("stats", [](const PinnedArena& a) { return stats_dict(a.stats()); })
      .def("__repr__",
           [](const PinnedArena& a) {
             const offload::ArenaStats s = a.stats();
             return "PinnedArena(size_bytes=" + std::to_string(s.size_bytes) +
                    ", in_use_bytes=" + std::to_string(s.in_use_bytes) +
                    ", num_allocations=" + std::to_string(s.num_allocations) + ")";
           })
      // 1-D writable uint8 buffer over [0, size_bytes): torch.frombuffer(arena, dtype=torch.uint8)
      // shares the memory and holds a reference to the arena, keeping the mapping alive.
      .def_buffer([](PinnedArena& a) {
        return py::buffer_info(a.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.size_bytes())}, {py::ssize_t{1}},
                               /*readonly=*/false);
      });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload C++ core: pinned host arena, offline arena planner, fused CPU AdamW (no torch, no CUDA).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const offload::ArenaOutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  bind_pinned_arena(m);

  m.def("adamw_step", &adamw_step, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
        py::arg("grad_dtype"), py::arg("lowp_out"), py::arg("lowp_dtype"), py::arg("numel"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale") = 1.0, py::arg("check_finite") = false, py::arg("num_threads") = 1,
        py::arg("isa") = "auto",
        "Fused AdamW over raw fp32 buffers (addresses as ints). Returns found_inf; see cpp/cpu_adam.h.");
  m.def("adamw_step_segments", &adamw_step_segments, py::arg("table"), py::arg("first"), py::arg("count"),
        py::arg("grads"), py::arg("n_grads"), py::arg("hypers"), py::arg("n_hypers"), py::arg("grad_dtype"),
        py::arg("lowp_dtype"), py::arg("check_finite") = false, py::arg("num_threads") = 1, py::arg("isa") = "auto",
        "adamw_step over many segments in one call (tables by address); returns the first segment that found an "
        "inf, or -1. See [Note: segmented AdamW] in cpp/cpu_adam.h.");
  m.def("adamw_memory_traffic", &adamw_memory_traffic, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("grad"), py::arg("grad_dtype"), py::arg("lowp_out"), py::arg("numel"), py::arg("num_threads") = 1,
        "adamw_step's loads and stores without its arithmetic (overwrites the buffers): the bandwidth bound.");
  m.def("adamw_isa", &offload::adamw_isa, "Instruction set the CPU AdamW dispatches to on this CPU.");
  m.def("adamw_has_openmp", &offload::adamw_has_openmp, "Whether the CPU AdamW runs on OpenMP threads.");

  m.def("plan_arena", &plan_arena_columns, py::arg("sizes"), py::arg("starts"), py::arg("ends"),
        py::arg("alignment") = 256, py::arg("heuristic") = "best", py::arg("stop_at") = -1,
        "The same, for int64 numpy columns (no Python int per value).");
  m.def("plan_arena", &plan_arena, py::arg("sizes"), py::arg("starts"), py::arg("ends"),
        py::arg("alignment") = 256, py::arg("heuristic") = "best", py::arg("stop_at") = -1,
        "Best-fit offsets under each heuristic (or the one named); keeps the smallest. Returns (offsets in "
        "input order, total bytes, heuristic, {heuristic: total bytes}). With \"best\" and stop_at >= 0 (a "
        "lower bound): the first heuristic alone where its total is <= stop_at.");
  m.def("arena_lower_bound", &arena_lower_bound_columns, py::arg("sizes"), py::arg("starts"), py::arg("ends"),
        py::arg("alignment") = 256, "The same, for int64 numpy columns.");
  m.def("arena_lower_bound", &arena_lower_bound, py::arg("sizes"), py::arg("starts"), py::arg("ends"),
        py::arg("alignment") = 256, py::call_guard<py::gil_scoped_release>(),
        "Max over time of the sum of live aligned sizes.");
  m.def("simulate_lanes", &simulate_lanes, py::arg("compute"), py::arg("h2d_event"), py::arg("h2d_solo"),
        py::arg("wait_ptr"), py::arg("wait_copy"), py::arg("d2h_event"), py::arg("d2h_solo"), py::arg("adam_s"),
        py::arg("adam_after_backward"), py::arg("duplex"), py::arg("grad_wait_ptr") = IndexArray(0),
        py::arg("grad_wait_copy") = IndexArray(0), py::arg("refresh_after") = IndexArray(0), py::arg("tail") = 0.0,
        "The step simulator's lane loop over flat arrays (see cpp/lane_sim.h and offload/planning/simulate.py).");
  m.def("latest_issue", &latest_issue, py::arg("deadline"), py::arg("duration"),
        "The latest copy placement's backward pass (see cpp/schedule_kernels.h).");
  py::class_<GreedyKernel>(m, "GreedyKernel",
                           "The greedy scheduler's move sequence (cpp/greedy.h): constants once, points per mode.")
      .def(py::init<std::int64_t, std::int64_t, const IndexArray&, const IndexArray&, const IndexArray&,
                    const IndexArray&, const IndexArray&, const SecondsArray&, const SecondsArray&, const IndexArray&,
                    const IndexArray&, const IndexArray&, const IndexArray&, const IndexArray&, const IndexArray&,
                    const SecondsArray&, const IndexArray&, const IndexArray&, const IndexArray&, const SecondsArray&,
                    const IndexArray&, const SecondsArray&, const SecondsArray&, const IndexArray&,
                    const IndexArray&, double, std::int64_t, std::int64_t, const IndexArray&, double>(),
           py::arg("n"), py::arg("nb"), py::arg("use_b"), py::arg("use_s"), py::arg("use_e"), py::arg("size"),
           py::arg("nbytes"), py::arg("dur"), py::arg("updated_dur"), py::arg("updated"), py::arg("fwd_row"),
           py::arg("bwd_row"), py::arg("fwd_at"), py::arg("bwd_at"), py::arg("keepable"), py::arg("tau"),
           py::arg("grad_profile"), py::arg("need_b"), py::arg("need_e"), py::arg("compute"), py::arg("d2h_event"),
           py::arg("d2h_solo"), py::arg("adam_s"), py::arg("grad_wait_ptr"), py::arg("grad_wait_copy"),
           py::arg("duplex"), py::arg("n_used"), py::arg("max_points"), py::arg("refresh_after") = IndexArray(0),
           py::arg("tail") = 0.0)
      .def("points", &GreedyKernel::points, py::arg("mode"), py::arg("capacity"),
           "Every point of one copy mode's sequence (0 latest, 1 lookahead, 2 just in time) whose peak fits "
           "capacity: (points, fallback), fallback non-empty where the Python loop must run instead.");
  m.def("last_occupants", &last_occupants, py::arg("issue"), py::arg("release"), py::arg("lo"), py::arg("hi"),
        "Per buffer, the last earlier occupants of its bytes, flattened: (ptr, buffers).");
}
