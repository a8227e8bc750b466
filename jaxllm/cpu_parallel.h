// What the CPU kernels share (an XLA FFI custom call's work split over XLA's thread pool).
#ifndef JAXLLM_CPU_PARALLEL_H_
#define JAXLLM_CPU_PARALLEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

// Runs work(part) for parts [0, n_parts) on the pool and the calling thread.
//
// Parts are claimed from a shared counter, so the caller finishes every part itself if the
// pool never gets to its tasks (a pool of one thread, or a busy one): it never waits on work
// nobody has started. Late tasks find nothing left and exit; the state they touch is shared.
template <typename Work>
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n_parts, const Work& work) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto run_parts = [shared, n_parts, &work]() {
    for (int64_t p; (p = shared->next.fetch_add(1)) < n_parts;) {
      work(p);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  // A task must not touch `work` (the caller's frame) unless it claimed a part, and a part
  // is only claimable while the caller is still waiting for it: that keeps `work` alive.
  for (int64_t t = 1; t < n_parts; ++t) pool.Schedule(decltype(run_parts)(run_parts));
  run_parts();
  while (shared->done.load(std::memory_order_acquire) < n_parts) std::this_thread::yield();
}

}  // namespace jaxllm

#endif  // JAXLLM_CPU_PARALLEL_H_
