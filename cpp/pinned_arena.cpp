#include "pinned_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

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

// Writes one byte per OS page of [data, data + bytes) so the kernel backs every page now rather
// than page-faulting later inside cudaHostRegister or a copy. A write is needed: a read would only
// map the shared zero page. Each thread takes a contiguous run of whole huge pages, so with the
// kernel's first-touch policy each 2 MiB page lands on the NUMA node of the thread that touched it.
void touch_pages(std::uint8_t* data, std::size_t bytes, unsigned num_threads) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t huge_pages = (bytes + PinnedArena::kHugePageBytes - 1) / PinnedArena::kHugePageBytes;
  const std::size_t workers = std::clamp<std::size_t>(num_threads, 1, huge_pages);
  const std::size_t chunk = (huge_pages + workers - 1) / workers * PinnedArena::kHugePageBytes;

  std::vector<std::thread> threads;
  JoinAll join_all{threads};
  for (std::size_t begin = 0; begin < bytes; begin += chunk) {
    const std::size_t end = std::min(bytes, begin + chunk);
    auto work = [data, page, begin, end] {
      volatile std::uint8_t* p = data;  // volatile: the stores must not be elided
      for (std::size_t i = begin; i < end; i += page) p[i] = 0;  // mmap memory is zero already
    };
    if (end == bytes) {
      work();  // the calling thread takes the last chunk instead of idling in join()
    } else {
      threads.emplace_back(work);
    }
  }
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

PinnedArena::PinnedArena(std::size_t size_bytes, unsigned touch_threads)
    : size_bytes_(size_bytes), region_(size_bytes, kHugePageBytes) {
  if (size_bytes_ == 0) return;
  if (touch_threads == 0) touch_threads = std::max(1u, std::thread::hardware_concurrency());
  touch_pages(region_.data(), size_bytes_, touch_threads);
  free_.emplace(0, size_bytes_);
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
  // the address is what a caller's alignment requirement is about. A linear scan is enough: the
  // arena holds one allocation per bucket (hundreds), and a single ordered map stays simple.
  const auto base = reinterpret_cast<std::uintptr_t>(data());
  auto best = free_.end();
  std::size_t best_offset = 0;
  for (auto gap = free_.begin(); gap != free_.end(); ++gap) {
    const std::size_t misalignment = (base + gap->first) & (alignment - 1);
    const std::size_t padding = misalignment == 0 ? 0 : alignment - misalignment;
    const bool fits = padding <= gap->second && gap->second - padding >= size;
    if (fits && (best == free_.end() || gap->second < best->second)) {  // ties: lowest offset
      best = gap;
      best_offset = gap->first + padding;
    }
  }
  if (best == free_.end()) {
    std::size_t largest = 0;
    for (const auto& gap : free_) largest = std::max(largest, gap.second);
    throw ArenaOutOfMemory("PinnedArena.allocate: no free gap holds " + std::to_string(size) +
                           " bytes aligned to " + std::to_string(alignment) +
                           "; largest free gap is " + std::to_string(largest) + " bytes (arena " +
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
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
}

ArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ArenaStats s;
  s.size_bytes = size_bytes_;
  s.reserved_bytes = region_.size();
  s.in_use_bytes = in_use_bytes_;
  for (const auto& gap : free_) s.largest_free_bytes = std::max(s.largest_free_bytes, gap.second);
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
  free_.erase(gap);
  if (offset > gap_start) free_.emplace(gap_start, offset - gap_start);
  if (offset + size < gap_end) free_.emplace(offset + size, gap_end - offset - size);
  live_.emplace(offset, size);
  in_use_bytes_ += size;
}

}  // namespace offload
