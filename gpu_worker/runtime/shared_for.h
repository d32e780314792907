// shared_for: the projection kernels' split of rows between torch's threads (linear_kernel.cpp,
// int_kernel.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <omp.h>

// f(first, last) over [0, n) on torch's threads, in small ranges that each thread takes as it
// frees up (not one fixed range a thread): on a machine shared with other processes (the stack's
// own, on few cores) a thread that is descheduled for a while then delays the call by one small
// range, not by its whole share. Which thread computes an output never changes its operations.
template <typename F>
static void shared_for(int64_t n, const F& f) {
  const int threads = at::get_num_threads();
  if (threads == 1 || n < 2 || at::in_parallel_region()) return f(0, n);
  const int64_t step = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    at::internal::ThreadIdGuard guard(omp_get_thread_num());
    for (int64_t first; (first = next.fetch_add(step)) < n;) f(first, std::min(n, first + step));
  }
}
