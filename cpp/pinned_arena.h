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

class PinnedArena {
 public:
  // Transparent huge page size: the region is aligned and sized in these units so THP can back it.
  static constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

  // Maps and first-touches the region with `touch_threads` threads (0 = hardware concurrency).
  PinnedArena(std::size_t size_bytes, unsigned touch_threads);
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  std::uint8_t* data() const { return region_.data(); }
  std::size_t size_bytes() const { return size_bytes_; }
  std::size_t reserved_bytes() const { return region_.size(); }

  // Claims [offset, offset + size) chosen by the caller (for example by the arena planner).
  // Throws std::invalid_argument when out of range or overlapping a live allocation.
  void reserve(std::size_t offset, std::size_t size);
  // Best fit: the smallest free gap that holds `size` bytes at an address aligned to `alignment`.
  // Returns the offset. Throws ArenaOutOfMemory when no gap fits.
  std::size_t allocate(std::size_t size, std::size_t alignment);
  // Frees an allocation of either kind and merges it with neighbouring gaps.
  void release(std::size_t offset);

  ArenaStats stats() const;

 private:
  void claim(std::map<std::size_t, std::size_t>::iterator gap, std::size_t offset, std::size_t size);

  std::size_t size_bytes_;
  MappedRegion region_;
  mutable std::mutex mutex_;                 // guards everything below
  std::map<std::size_t, std::size_t> free_;  // gap offset -> gap size, never adjacent (coalesced)
  std::map<std::size_t, std::size_t> live_;  // allocation offset -> size
  std::size_t in_use_bytes_ = 0;
};

}  // namespace offload
