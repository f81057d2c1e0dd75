// Transparent huge pages for the large weight tensors the CPU ops write: a
// repacked weight is streamed by every matvec, which runs below memory speed
// on 4 KB pages, and torch asks for huge pages only under
// THP_MEM_ALLOC_ENABLE=1 (csrc/cpu/README.md).
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace lowbit {
namespace cpu {

// Asks the kernel to back the whole 2 MB pages inside [p, p + bytes) with
// transparent huge pages: called before anything writes the range, so that
// its first touch faults them in whole. Only a hint (where THP is off, or
// the range holds no whole huge page, nothing changes), and the memory stays
// its allocator's: the advice goes with the mapping when it is freed.
inline void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace lowbit
