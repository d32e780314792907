// y = residual + (x @ w^T + b) on the CPU with one fixed order of operations per output, whatever
// the number of rows of x: the projection `gpu_worker/model.py linear` runs (see linear_kernel.py).
//
// Every output y[m][n] is its own dot product: 8 lane partial sums over k (lane j takes
// k = 8c + j, c ascending, one fused multiply-add each), the lanes added as
// ((0+1)+(2+3))+((4+5)+(6+7)), the tail k >= 8*(K/8) added in order, then + b[n], then
// residual[m][n] + that, rounded once to the output dtype. The blocking (4 rows of w against
// up to 3 rows of x, so a row of w is read from memory once for every 3 rows of x) only
// decides which outputs are computed together, never the operations of one, and threads
// split the rows of w, never k. bfloat16 inputs are widened to float32 exactly.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float widen(float v) { return v; }
static inline float widen(at::BFloat16 v) { return float(v); }

template <typename T>
struct Args {
  const T* x; const T* w; const T* b; const T* residual; T* y;
  int64_t N, K;
};

template <typename T>
static inline void finish(const Args<T>& a, __m256 acc, int64_t m, int64_t n) {
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  const T *xr = a.x + m * a.K, *wr = a.w + n * a.K;
  for (int64_t k = a.K / 8 * 8; k < a.K; ++k) s += widen(xr[k]) * widen(wr[k]);
  if (a.b) s += widen(a.b[n]);
  if (a.residual) s = widen(a.residual[m * a.N + n]) + s;
  a.y[m * a.N + n] = T(s);
}

#define FMA4(a0, a1, a2, a3, xr) { __m256 u = load8(xr + k); \
  a0 = _mm256_fmadd_ps(u, v0, a0); a1 = _mm256_fmadd_ps(u, v1, a1); \
  a2 = _mm256_fmadd_ps(u, v2, a2); a3 = _mm256_fmadd_ps(u, v3, a3); }

// rows n0..n0+3 of w against rows m0..m0+MB-1 of x, MB in 1..3 (named accumulators: an array
// of them is kept in memory by the compiler)
template <typename T, int MB>
static inline void block4(const Args<T>& a, int64_t n0, int64_t m0) {
  const int64_t K = a.K, K8 = K / 8 * 8;
  const T *w0 = a.w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
  const T *x0 = a.x + m0 * K, *x1 = x0 + K, *x2 = x1 + K;
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 v0 = load8(w0 + k), v1 = load8(w1 + k), v2 = load8(w2 + k), v3 = load8(w3 + k);
    FMA4(a00, a01, a02, a03, x0);
    if constexpr (MB > 1) FMA4(a10, a11, a12, a13, x1);
    if constexpr (MB > 2) FMA4(a20, a21, a22, a23, x2);
  }
  finish(a, a00, m0, n0); finish(a, a01, m0, n0 + 1); finish(a, a02, m0, n0 + 2); finish(a, a03, m0, n0 + 3);
  if constexpr (MB > 1) {
    finish(a, a10, m0 + 1, n0); finish(a, a11, m0 + 1, n0 + 1);
    finish(a, a12, m0 + 1, n0 + 2); finish(a, a13, m0 + 1, n0 + 3);
  }
  if constexpr (MB > 2) {
    finish(a, a20, m0 + 2, n0); finish(a, a21, m0 + 2, n0 + 1);
    finish(a, a22, m0 + 2, n0 + 2); finish(a, a23, m0 + 2, n0 + 3);
  }
}

// one row n of w against one row m of x: the same operations as block4's
template <typename T>
static inline void block1(const Args<T>& a, int64_t n, int64_t m) {
  const T *wr = a.w + n * a.K, *xr = a.x + m * a.K;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.K / 8 * 8; k += 8) acc = _mm256_fmadd_ps(load8(xr + k), load8(wr + k), acc);
  finish(a, acc, m, n);
}

template <typename T>
static void run(const Args<T>& a, int64_t M) {
  at::parallel_for(0, (a.N + 3) / 4, 16, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      int64_t n0 = block * 4;
      if (n0 + 4 > a.N) {
        for (int64_t n = n0; n < a.N; ++n) for (int64_t m = 0; m < M; ++m) block1(a, n, m);
        continue;
      }
      int64_t m0 = 0;
      for (; m0 + 3 <= M; m0 += 3) block4<T, 3>(a, n0, m0);
      if (M - m0 == 2) block4<T, 2>(a, n0, m0);
      else if (M - m0 == 1) block4<T, 1>(a, n0, m0);
    }
  });
}

// x (M, K), w (N, K), b (N,) or None, residual (M, N) or None, all of one dtype (float32 or
// bfloat16) on the CPU -> (M, N) of that dtype
torch::Tensor fixed_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b,
                           c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "fixed_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.device().is_cpu() && w.device().is_cpu(),
              "fixed_linear: x and w of one dtype on the CPU");
  int64_t M = x.size(0), N = w.size(0);
  x = x.contiguous();
  w = w.contiguous();
  torch::Tensor bias = b.has_value() ? b->contiguous() : torch::Tensor();
  torch::Tensor res = residual.has_value() ? residual->contiguous() : torch::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.numel() == N && bias.scalar_type() == x.scalar_type()), "fixed_linear: b (N,)");
  TORCH_CHECK(!res.defined() || (res.size(0) == M && res.size(1) == N && res.scalar_type() == x.scalar_type()),
              "fixed_linear: residual (M, N)");
  auto y = torch::empty({M, N}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    Args<float> a{x.data_ptr<float>(), w.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                  res.defined() ? res.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, w.size(1)};
    run(a, M);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "fixed_linear: float32 or bfloat16");
    using B = at::BFloat16;
    Args<B> a{x.data_ptr<B>(), w.data_ptr<B>(), bias.defined() ? bias.data_ptr<B>() : nullptr,
              res.defined() ? res.data_ptr<B>() : nullptr, y.data_ptr<B>(), N, w.size(1)};
    run(a, M);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops: a service's event loop keeps running beside a forward
  m.def("fixed_linear", &fixed_linear, "residual + (x @ w^T + b), one fixed order per output",
        py::call_guard<py::gil_scoped_release>());
}
