// PinnedArena: one exact-size host region, sub-allocated by offset.
//
// Why not torch's CachingHostAllocator: it rounds every request up to a power of two (up to 2x
// pinned memory wasted) and cudaHostAlloc takes a driver-wide lock. We map one region of the exact
// size, touch it so it is really backed, and let Python pin it once with cudaHostRegister.
// Pinning is deliberately not done here: cpp/ knows nothing about CUDA (see DESIGN.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <utility>

namespace offload {

// Thrown when the OS cannot map the region or no free gap fits a request.
// Derives from std::bad_alloc so C++ callers can treat it as one; bindings map it to MemoryError.
class ArenaOutOfMemory : public std::bad_alloc {
 public:
  explicit ArenaOutOfMemory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// RAII owner of one anonymous mapping whose start is aligned to `alignment`.
// A zero-size region maps nothing and has data() == nullptr.
class MappedRegion {
 public:
  MappedRegion(std::size_t size_bytes, std::size_t alignment);
  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

struct ArenaStats {
  std::size_t size_bytes = 0;          // exactly what the caller asked for
  std::size_t reserved_bytes = 0;      // mapped: size_bytes rounded up to 2 MiB
  std::size_t in_use_bytes = 0;        // sum of live allocations (alignment padding excluded)
  std::size_t largest_free_bytes = 0;  // biggest gap, before any alignment padding
  std::size_t num_allocations = 0;     // live reserve() + allocate() results
  std::size_t num_free_gaps = 0;       // 1 for an empty non-zero arena: shows coalescing works
  std::size_t num_os_allocations = 0;  // mmaps made: 1, or 0 for a zero-size arena
};

// How the pages of a new arena are backed before it is handed out.
struct TouchOptions {
  unsigned threads = 0;  // 0: hardware concurrency
  // >= 0: the touching threads run on that NUMA node's CPUs, so with the kernel's first-touch policy
  // every page lands on it (the GPU's node; its memory is the fastest to register and copy from).
  // Best effort: a thread the OS will not move touches from where it is. -1: no binding.
  int numa_node = -1;
  // Back each thread's range with one madvise(MADV_POPULATE_WRITE) (Linux 5.14+) instead of a write
  // per 4 KiB page: no page fault per page. Falls back to writes where the kernel lacks it.
  bool populate = true;
};

class PinnedArena {
 public:
  // Transparent huge page size: the region is aligned and sized in these units so THP can back it.
  static constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

  // Maps and first-touches the region (see TouchOptions). Throws std::invalid_argument for a NUMA
  // node this machine does not have.
  PinnedArena(std::size_t size_bytes, const TouchOptions& touch);
  PinnedArena(std::size_t size_bytes, unsigned touch_threads) : PinnedArena(size_bytes, TouchOptions{touch_threads}) {}
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  std::uint8_t* data() const { return region_.data(); }
  std::size_t size_bytes() const { return size_bytes_; }
  std::size_t reserved_bytes() const { return region_.size(); }
  // "populate" or "write": how the pages were actually backed ("none" for a zero-size arena).
  const char* touch_method() const { return touch_method_; }

  // Claims [offset, offset + size) chosen by the caller (for example by the arena planner).
  // Throws std::invalid_argument when out of range or overlapping a live allocation.
  void reserve(std::size_t offset, std::size_t size);
  // Best fit: the smallest free gap that holds `size` bytes at an address aligned to `alignment`
  // (ties: lowest offset). O(log gaps) unless alignment padding makes many gaps too small. Never
  // maps memory: the steady state of allocate/release makes no OS allocation. Returns the offset.
  // Throws ArenaOutOfMemory when no gap fits.
  std::size_t allocate(std::size_t size, std::size_t alignment);
  // Frees an allocation of either kind and merges it with neighbouring gaps.
  void release(std::size_t offset);

  ArenaStats stats() const;

 private:
  void claim(std::map<std::size_t, std::size_t>::iterator gap, std::size_t offset, std::size_t size);
  void add_gap(std::size_t offset, std::size_t size);
  std::map<std::size_t, std::size_t>::iterator erase_gap(std::map<std::size_t, std::size_t>::iterator gap);
  std::size_t largest_gap() const;

  std::size_t size_bytes_;
  MappedRegion region_;
  const char* touch_method_ = "none";
  mutable std::mutex mutex_;                 // guards everything below
  std::map<std::size_t, std::size_t> free_;  // gap offset -> gap size, never adjacent (coalesced)
  std::set<std::pair<std::size_t, std::size_t>> free_by_size_;  // (gap size, gap offset): the same gaps
  std::map<std::size_t, std::size_t> live_;  // allocation offset -> size
  std::size_t in_use_bytes_ = 0;
};

}  // namespace offload
