#include "pinned_arena.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__linux__) && !defined(MADV_POPULATE_WRITE)
#define MADV_POPULATE_WRITE 23  // Linux 5.14 uapi; older glibc headers lack the name
#endif

namespace offload {
namespace {

bool is_power_of_two(std::size_t x) { return x != 0 && (x & (x - 1)) == 0; }

std::size_t round_up(std::size_t value, std::size_t multiple) {
  const std::size_t remainder = value % multiple;
  if (remainder == 0) return value;
  if (value > SIZE_MAX - (multiple - remainder)) {
    throw ArenaOutOfMemory("PinnedArena: " + std::to_string(value) + " bytes is too large to map");
  }
  return value + (multiple - remainder);
}

// Joins every started thread on scope exit, so an exception while spawning cannot leave a
// joinable std::thread behind (whose destructor would call std::terminate).
struct JoinAll {
  std::vector<std::thread>& threads;
  ~JoinAll() {
    for (auto& t : threads) {
      if (t.joinable()) t.join();
    }
  }
};

// The CPUs of NUMA node `node`, from sysfs ("0-3,8-11"). Throws std::invalid_argument when the
// node does not exist.
std::vector<int> numa_node_cpus(int node) {
  const std::string path = "/sys/devices/system/node/node" + std::to_string(node) + "/cpulist";
  std::ifstream file(path);
  std::string list;
  if (node < 0 || !file || !std::getline(file, list)) {
    throw std::invalid_argument("PinnedArena: NUMA node " + std::to_string(node) + " does not exist on this machine (" +
                                path + " is not readable)");
  }
  std::vector<int> cpus;
  std::stringstream ranges(list);
  std::string range;
  while (std::getline(ranges, range, ',')) {
    if (range.empty()) continue;
    const std::size_t dash = range.find('-');
    const int lo = std::stoi(range.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(range.substr(dash + 1));
    for (int cpu = lo; cpu <= hi; ++cpu) cpus.push_back(cpu);
  }
  return cpus;
}

// Moves the calling thread onto `cpus` (best effort: a cgroup may forbid it; then the pages land
// wherever this thread runs, which is still correct, only possibly remote).
void bind_to(const std::vector<int>& cpus) {
#ifdef __linux__
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
  }
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
#else
  (void)cpus;
#endif
}

// Backs every page of [data, data + bytes) now, rather than page-faulting later inside
// cudaHostRegister or a copy. Each thread takes a contiguous run of whole huge pages, so with the
// kernel's first-touch policy each 2 MiB page lands on the NUMA node of the thread that backed it.
// A thread first asks the kernel to populate its run in one call (MADV_POPULATE_WRITE: no fault per
// page); where the kernel lacks that, it writes one byte per OS page (a write: a read would only map
// the shared zero page). Returns true when every run was populated by madvise.
bool touch_pages(std::uint8_t* data, std::size_t bytes, const TouchOptions& touch) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t huge_pages = (bytes + PinnedArena::kHugePageBytes - 1) / PinnedArena::kHugePageBytes;
  const unsigned threads = touch.threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : touch.threads;
  const std::size_t workers = std::clamp<std::size_t>(threads, 1, huge_pages);
  const std::size_t chunk = (huge_pages + workers - 1) / workers * PinnedArena::kHugePageBytes;
  const std::vector<int> cpus = touch.numa_node >= 0 ? numa_node_cpus(touch.numa_node) : std::vector<int>{};
  std::vector<char> populated((bytes + chunk - 1) / chunk, 0);

  auto work = [&, data, page](std::size_t run, std::size_t begin, std::size_t end) {
    bind_to(cpus);
#ifdef __linux__
    if (touch.populate && madvise(data + begin, end - begin, MADV_POPULATE_WRITE) == 0) {
      populated[run] = 1;
      return;
    }
#endif
    volatile std::uint8_t* p = data;  // volatile: the stores must not be elided
    for (std::size_t i = begin; i < end; i += page) p[i] = 0;  // mmap memory is zero already
  };
  std::vector<std::thread> pool;
  JoinAll join_all{pool};
  for (std::size_t run = 0, begin = 0; begin < bytes; ++run, begin += chunk) {
    const std::size_t end = std::min(bytes, begin + chunk);
    // The calling thread takes the last run instead of idling in join(), unless it would have to be
    // moved to another NUMA node for it.
    if (end == bytes && cpus.empty()) {
      work(run, begin, end);
    } else {
      pool.emplace_back(work, run, begin, end);
    }
  }
  for (auto& t : pool) t.join();
  return std::all_of(populated.begin(), populated.end(), [](char c) { return c != 0; });
}

}  // namespace

MappedRegion::MappedRegion(std::size_t size_bytes, std::size_t alignment) {
  if (size_bytes == 0) return;
  const std::size_t size = round_up(size_bytes, alignment);
  if (size > SIZE_MAX - alignment) {
    throw ArenaOutOfMemory("PinnedArena: " + std::to_string(size_bytes) + " bytes is too large to map");
  }
  // mmap only guarantees page alignment: over-map by one alignment unit, then trim head and tail.
  const std::size_t mapped = size + alignment;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    throw ArenaOutOfMemory("PinnedArena: could not map " + std::to_string(size) +
                           " bytes of host memory: " + std::strerror(errno));
  }
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (base + alignment - 1) & ~(std::uintptr_t{alignment} - 1);
  const std::size_t head = aligned - base;
  const std::size_t tail = mapped - head - size;
  if (head != 0) munmap(raw, head);
  if (tail != 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
  data_ = reinterpret_cast<std::uint8_t*>(aligned);
  size_ = size;
#ifdef MADV_HUGEPAGE
  // A hint only (THP may be off or "never"); 4 KiB pages still work, so failure is ignored.
  madvise(data_, size_, MADV_HUGEPAGE);
#endif
}

MappedRegion::~MappedRegion() {
  if (data_ != nullptr) munmap(data_, size_);
}

PinnedArena::PinnedArena(std::size_t size_bytes, const TouchOptions& touch)
    : size_bytes_(size_bytes), region_(size_bytes, kHugePageBytes) {
  if (touch.numa_node >= 0) numa_node_cpus(touch.numa_node);  // a bad node fails even for size 0
  if (size_bytes_ == 0) return;
  touch_method_ = touch_pages(region_.data(), size_bytes_, touch) ? "populate" : "write";
  add_gap(0, size_bytes_);
}

void PinnedArena::reserve(std::size_t offset, std::size_t size) {
  if (size == 0) throw std::invalid_argument("PinnedArena.reserve: size must be positive");
  if (offset > size_bytes_ || size > size_bytes_ - offset) {
    throw std::invalid_argument("PinnedArena.reserve: offset " + std::to_string(offset) + " + size " +
                                std::to_string(size) + " is past the end of the arena (" +
                                std::to_string(size_bytes_) + " bytes)");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // Gaps are disjoint, so only the last gap starting at or before `offset` can contain the range.
  auto gap = free_.upper_bound(offset);
  const bool inside_a_gap =
      gap != free_.begin() && std::prev(gap)->first + std::prev(gap)->second >= offset + size;
  if (!inside_a_gap) {
    throw std::invalid_argument("PinnedArena.reserve: [" + std::to_string(offset) + ", " +
                                std::to_string(offset + size) + ") overlaps an allocation in use");
  }
  claim(std::prev(gap), offset, size);
}

std::size_t PinnedArena::allocate(std::size_t size, std::size_t alignment) {
  if (size == 0) throw std::invalid_argument("PinnedArena.allocate: size must be positive");
  if (!is_power_of_two(alignment)) {
    throw std::invalid_argument("PinnedArena.allocate: alignment must be a power of two, got " +
                                std::to_string(alignment));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // Align the address, not the offset: they agree up to 2 MiB (the base is 2 MiB-aligned), and
  // the address is what a caller's alignment requirement is about. Gaps are visited smallest first
  // (ties: lowest offset), so the first that fits after padding is the best fit.
  const auto base = reinterpret_cast<std::uintptr_t>(data());
  auto best = free_.end();
  std::size_t best_offset = 0;
  for (auto it = free_by_size_.lower_bound({size, 0}); it != free_by_size_.end(); ++it) {
    const auto [gap_size, gap_offset] = *it;
    const std::size_t misalignment = (base + gap_offset) & (alignment - 1);
    const std::size_t padding = misalignment == 0 ? 0 : alignment - misalignment;
    if (padding <= gap_size && gap_size - padding >= size) {
      best = free_.find(gap_offset);
      best_offset = gap_offset + padding;
      break;
    }
  }
  if (best == free_.end()) {
    throw ArenaOutOfMemory("PinnedArena.allocate: no free gap holds " + std::to_string(size) +
                           " bytes aligned to " + std::to_string(alignment) +
                           "; largest free gap is " + std::to_string(largest_gap()) + " bytes (arena " +
                           std::to_string(size_bytes_) + " bytes, " + std::to_string(in_use_bytes_) +
                           " in use)");
  }
  claim(best, best_offset, size);
  return best_offset;
}

void PinnedArena::release(std::size_t offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto live = live_.find(offset);
  if (live == live_.end()) {
    throw std::invalid_argument("PinnedArena.release: offset " + std::to_string(offset) +
                                " is not a live allocation (released twice, or never allocated)");
  }
  std::size_t start = live->first;
  std::size_t size = live->second;
  in_use_bytes_ -= size;
  live_.erase(live);

  // Coalesce with the gap right after and the gap right before, so gaps are never adjacent and
  // largest_free_bytes is honest.
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + size) {
    size += next->second;
    next = erase_gap(next);
  }
  if (next != free_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      erase_gap(prev);
    }
  }
  add_gap(start, size);
}

ArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ArenaStats s;
  s.size_bytes = size_bytes_;
  s.reserved_bytes = region_.size();
  s.in_use_bytes = in_use_bytes_;
  s.largest_free_bytes = largest_gap();
  s.num_allocations = live_.size();
  s.num_free_gaps = free_.size();
  s.num_os_allocations = region_.data() == nullptr ? 0 : 1;
  return s;
}

// Caller holds mutex_. Carves [offset, offset + size) out of `gap`, which must contain it.
void PinnedArena::claim(std::map<std::size_t, std::size_t>::iterator gap, std::size_t offset,
                        std::size_t size) {
  const std::size_t gap_start = gap->first;
  const std::size_t gap_end = gap->first + gap->second;
  erase_gap(gap);
  if (offset > gap_start) add_gap(gap_start, offset - gap_start);
  if (offset + size < gap_end) add_gap(offset + size, gap_end - offset - size);
  live_.emplace(offset, size);
  in_use_bytes_ += size;
}

// Caller holds mutex_. The two gap indexes change together, only here.
void PinnedArena::add_gap(std::size_t offset, std::size_t size) {
  free_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

std::map<std::size_t, std::size_t>::iterator PinnedArena::erase_gap(std::map<std::size_t, std::size_t>::iterator gap) {
  free_by_size_.erase({gap->second, gap->first});
  return free_.erase(gap);
}

std::size_t PinnedArena::largest_gap() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

}  // namespace offload
