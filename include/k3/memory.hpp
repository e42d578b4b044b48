// k3/memory.hpp — the allocator of k3's large read-mostly buffers (the packed weights of the CPU
// MoE and linear layers; docs/cpu_moe.md, "Huge pages").
//
// A decode step streams hundreds of MiB of weights once. With 4 KiB pages that is a TLB miss every
// 4 KiB of the stream, and in a virtual machine each miss walks two page tables. Buffers of at
// least kHugePageBytes are therefore aligned to 2 MiB and advised for transparent huge pages
// (Linux madvise(MADV_HUGEPAGE)): where the kernel's THP mode is "always" or "madvise" (the
// default of Debian and Ubuntu) they are backed by 2 MiB pages. Under "never", or on other
// systems, the advice does nothing and the buffer is an ordinary aligned allocation. Smaller
// buffers are 64-byte aligned. Contents and results never depend on the page size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace k3 {

inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

namespace detail {
// bytes >= kHugePageBytes: 2 MiB aligned, rounded up to a multiple of 2 MiB and advised for huge
// pages; else 64-byte aligned. Throws std::bad_alloc when out of memory, as operator new does.
void* huge_page_allocate(std::size_t bytes);
void huge_page_deallocate(void* p, std::size_t bytes) noexcept;
}  // namespace detail

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)
  T* allocate(std::size_t n) { return static_cast<T*>(detail::huge_page_allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { detail::huge_page_deallocate(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

// Whether the whole of [p, p + bytes) lies in mappings the kernel may back with huge pages
// ("THPeligible: 1" in /proc/self/smaps; false where that is unknown, e.g. not Linux or THP
// "never"). For tests and `k3 info`.
bool huge_pages_eligible(const void* p, std::size_t bytes);
// The kernel's transparent-huge-page mode: "always", "madvise", "never", or "unavailable".
const char* huge_page_mode();

}  // namespace k3
