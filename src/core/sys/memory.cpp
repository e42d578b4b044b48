// Huge-page-advised allocations of the packed weights (k3/memory.hpp).
#include "k3/memory.hpp"

#include <cstdlib>
#include <fstream>
#include <new>
#include <sstream>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace k3 {
namespace detail {

namespace {
constexpr std::size_t kSmallAlign = 64;
std::size_t round_up(std::size_t bytes) { return (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes; }
}  // namespace

void* huge_page_allocate(std::size_t bytes) {
  if (bytes < kHugePageBytes) return ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{kSmallAlign});
  const std::size_t size = round_up(bytes);
  void* p = std::aligned_alloc(kHugePageBytes, size);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Advice only: an error (no THP in this kernel) leaves an ordinary allocation.
  (void)::madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

void huge_page_deallocate(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes < kHugePageBytes) {
    ::operator delete(p, std::align_val_t{kSmallAlign});
  } else {
    std::free(p);
  }
}

}  // namespace detail

bool huge_pages_eligible(const void* p, std::size_t bytes) {
#if defined(__linux__)
  const auto lo = reinterpret_cast<std::uintptr_t>(p), hi = lo + bytes;
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false, found = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t start = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (line.find('-') < line.find(' ')) {  // "start-end perms offset dev inode path"
      head >> std::hex >> start >> dash >> end;
      if (dash == '-' && end > start) {
        inside = start < hi && lo < end;  // this mapping overlaps the range
        continue;
      }
    }
    if (inside && line.rfind("THPeligible:", 0) == 0) {
      if (line.find('1') == std::string::npos) return false;
      found = true;
    }
  }
  return found;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

const char* huge_page_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  if (!std::getline(f, s)) return "unavailable";
  if (s.find("[always]") != std::string::npos) return "always";
  if (s.find("[madvise]") != std::string::npos) return "madvise";
  if (s.find("[never]") != std::string::npos) return "never";
  return "unavailable";
}

}  // namespace k3
