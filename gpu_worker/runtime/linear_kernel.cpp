// y = residual + (x @ w^T + b) on the CPU with one fixed order of operations per output, whatever
// the number of rows of x: the projection `gpu_worker/runtime/model.py linear` runs (see linear_kernel.py).
//
// Every output y[m][n] is its own dot product: 8 lane partial sums over k (lane j takes
// k = 8c + j, c ascending, one fused multiply-add each), the lanes added as
// ((0+1)+(2+3))+((4+5)+(6+7)), the tail k >= 8*(K/8) added in order, then + b[n], then
// residual[m][n] + that, rounded once to the output dtype. The blocking (which rows of w and of
// x are multiplied together, chosen by the number of rows: `run`) only decides which outputs are
// computed together, never the operations of one, and threads split the rows of w, never k (`shared_for`).
// bfloat16 inputs are widened to float32 exactly.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <omp.h>
#include <type_traits>
#include <vector>
#include <c10/util/Half.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

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
static inline void finish(const Args<T>& a, __m256 acc, int64_t m, int64_t n, const T* wr) {
  // ((0+1)+(2+3))+((4+5)+(6+7)) in registers: each hadd adds neighbouring pairs per 128-bit half
  __m256 h = _mm256_hadd_ps(acc, acc);
  h = _mm256_hadd_ps(h, h);
  float s = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  const T* xr = a.x + m * a.K;  // wr: row n of w; a tail only where w is not paired (K % 8 != 0)
  for (int64_t k = a.K / 8 * 8; k < a.K; ++k) s += widen(xr[k]) * widen(wr[k]);
  if (a.b) s += widen(a.b[n]);
  if (a.residual) s = widen(a.residual[m * a.N + n]) + s;
  a.y[m * a.N + n] = T(s);
}

#include "shared_for.h"

// Where values k..k+7 of row i of a block starting at w lie: rows one after another (w (N, K)), or
// PAIRED (w (N/2, K/8, 2, 8), `pair_rows` in model.py) rows 2p and 2p+1 interleaved in chunks of 8,
// so that a block of rows is a few sequential streams, which the memory prefetchers follow.
template <bool PAIRED, typename T>
static inline const T* chunk(const T* w, int64_t K, int i, int64_t k) {
  return PAIRED ? w + (i / 2) * 2 * K + 2 * k + (i % 2) * 8 : w + i * K + k;
}

// rows n0..n0+NB-1 of w against rows m0..m0+MB-1 of x; NB * MB <= 12 accumulators, so that they
// and a row of w's 8 values stay in AVX2's 16 registers (the loops unroll fully). While it runs it
// asks for `next`'s NB rows of w (the block this thread takes next, or nullptr), so that memory
// streams weights while the multiply-adds run: a one-pass block of 5 rows is far from the memory
// bandwidth on its own. Not in a block of one float32 row of x: there the hardware prefetchers
// keep up alone, and requests of ours only compete with theirs (slower: ops/bench/RESULTS.md).
template <typename T, bool PAIRED, int NB, int MB>
static inline __attribute__((always_inline)) void block(const Args<T>& a, const T* w, int64_t n0, int64_t m0,
                                                        const T* next) {
  constexpr bool PREFETCH = MB * sizeof(float) / sizeof(T) >= 2;
  constexpr int STREAM = PAIRED ? 2 : 1;  // rows per sequential stream
  const int64_t K = a.K, K8 = K / 8 * 8, line = 64 / sizeof(T) / STREAM;  // k per cache line of a stream
  const T* x = a.x + m0 * K;  // w: rows n0..n0+NB-1 of the weight, as `chunk` lays them out
  __m256 acc[NB][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    if (PREFETCH && next && k % line == 0) {
#pragma GCC unroll 16
      for (int i = 0; i < NB; i += STREAM)
        _mm_prefetch(reinterpret_cast<const char*>(chunk<PAIRED>(next, K, i, k)), _MM_HINT_T0);
    }
    __m256 v[NB];
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) v[i] = load8(chunk<PAIRED>(w, K, i, k));
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) {
      __m256 u = load8(x + j * K + k);
#pragma GCC unroll 16
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(u, v[i], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) finish(a, acc[i][j], m0 + j, n0 + i, w + i * K);
}

// the last r < R rows of x, in one block
template <typename T, bool PAIRED, int NB, int R>
static inline void last_rows(const Args<T>& a, const T* w, int64_t n0, int64_t m0, int64_t r, const T* next) {
  if constexpr (R > 0) {
    if (r == R) block<T, PAIRED, NB, R>(a, w, n0, m0, next);
    else last_rows<T, PAIRED, NB, R - 1>(a, w, n0, m0, r, next);
  }
}

// Where a block's rows of w come from: the weight itself (`DenseRows`), or rows widened from
// GGUF blocks into a buffer of the thread's (`QuantRows`, below) which `block` then reads as
// float32 rows: the same code, hence the same operations per output, as on the widened weight.
template <typename T>
struct DenseRows {
  static constexpr bool BUFFERED = false;
  const T* w; int64_t K;
  const T* rows(int64_t n0, int, T*) const { return w + n0 * K; }
};

// blocks of NB rows of w, split between threads; each against all M rows of x, MB at a time
template <typename T, bool PAIRED, int NB, int MB, typename Rows>
static void blocks(const Args<T>& a, const Rows& src, int64_t M) {
  shared_for(a.N / NB, [&](int64_t first, int64_t last) {
    std::vector<T> buffer(Rows::BUFFERED ? NB * a.K : 0);
    for (int64_t i = first; i < last; ++i) {
      const T* w = src.rows(i * NB, NB, buffer.data());
      const T* next = !Rows::BUFFERED && i + 1 < last ? a.w + (i + 1) * NB * a.K : nullptr;
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) block<T, PAIRED, NB, MB>(a, w, i * NB, m0, next);
      last_rows<T, PAIRED, NB, MB - 1>(a, w, i * NB, m0, M - m0, next);
    }
  });
  constexpr int STREAM = PAIRED ? 2 : 1;  // N is even when PAIRED
  std::vector<T> buffer(Rows::BUFFERED ? STREAM * a.K : 0);
  for (int64_t n = a.N / NB * NB; n < a.N; n += STREAM) {
    const T* w = src.rows(n, STREAM, buffer.data());
    for (int64_t m = 0; m < M; ++m) block<T, PAIRED, STREAM, 1>(a, w, n, m, nullptr);
  }
}

// Up to 12 rows of x (a decode or verify step) read each row of w from memory once; more (a
// prefill) take 3 rows of x at a time against 4 of w held in cache. Even NB: whole pairs.
template <typename T, bool PAIRED, typename Rows>
static void run(const Args<T>& a, const Rows& src, int64_t M) {
  switch (M) {
    case 1: return blocks<T, PAIRED, 8, 1>(a, src, M);
    case 2: return blocks<T, PAIRED, 6, 2>(a, src, M);
    case 3: return blocks<T, PAIRED, 4, 3>(a, src, M);
    case 4: return blocks<T, PAIRED, 2, 4>(a, src, M);
    case 5: return blocks<T, PAIRED, 2, 5>(a, src, M);
    default: return M <= 12 ? blocks<T, PAIRED, 2, 6>(a, src, M) : blocks<T, PAIRED, 4, 3>(a, src, M);
  }
}

template <typename T>
static void run(const Args<T>& a, int64_t M, bool paired) {
  DenseRows<T> src{a.w, a.K};
  if (paired) run<T, true>(a, src, M);
  else run<T, false>(a, src, M);
}

// GGUF blocks of 32 weights along k (ggml's layouts, `gguf.quants`): Q4_1 is an fp16 scale d, an
// fp16 minimum m and 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31, each
// weight d * q + m; Q8_0 is an fp16 d and 32 int8 q, each weight d * q. Widened here as gguf's
// own dequantization computes them in float32: the product rounded, then the sum rounded (the
// build's -ffp-contract=off keeps the two roundings apart), so a widened row is bit for bit the
// float32 weight `specbus models pull` stores.
enum QuantKind : int64_t { Q4_1 = 0, Q8_0 = 1 };
static constexpr int64_t QK = 32;
static inline int64_t quant_block_bytes(int64_t kind) { return kind == Q4_1 ? 20 : 34; }
static inline float half_bits(const uint8_t* p) {  // exact, as every fp16 -> fp32 conversion
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
static inline int32_t load32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
static inline __m256 widen_q4(__m128i q, __m256 d, __m256 m) {
  return _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q))), m);
}

struct QuantRows {
  static constexpr bool BUFFERED = true;
  const uint8_t* blocks; int64_t K, row_bytes, kind;
  const float* rows(int64_t n0, int nb, float* out) const;
  const float* rows_avx2(int64_t n0, int nb, float* out) const {
    for (int r = 0; r < nb; ++r) {
      const uint8_t* row = blocks + (n0 + r) * row_bytes;
      float* o = out + r * K;
      for (int64_t c = 0; c < K / QK; ++c, o += QK) {
        if (kind == Q4_1) {
          const uint8_t* blk = row + c * 20;
          __m256 d = _mm256_set1_ps(half_bits(blk)), m = _mm256_set1_ps(half_bits(blk + 2));
          __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)), nib = _mm_set1_epi8(0x0F);
          __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
          _mm256_storeu_ps(o, widen_q4(lo, d, m));
          _mm256_storeu_ps(o + 8, widen_q4(_mm_srli_si128(lo, 8), d, m));
          _mm256_storeu_ps(o + 16, widen_q4(hi, d, m));
          _mm256_storeu_ps(o + 24, widen_q4(_mm_srli_si128(hi, 8), d, m));
        } else {
          const uint8_t* blk = row + c * 34;
          __m256 d = _mm256_set1_ps(half_bits(blk));
          for (int j = 0; j < 4; ++j) {
            __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * j));
            _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
          }
        }
      }
    }
    return out;
  }
};

// AVX-512F where the CPU has it (`use_avx512`): the same operations per output on 16 lanes, rows
// i and i+1 of w side by side in one register (lanes 0-7 row i, 8-15 row i+1), each lane still
// its own sequential chain of FMAs over k = 8c + j, then `finish` on each half. So the bits are
// those of the AVX2 code above (every lane operation is one IEEE rounding in both), only fewer
// instructions per weight. Widening into the buffer (`QuantRows::rows`) takes 16 weights at once.
static bool cpu_has_avx512() {
  __builtin_cpu_init();  // a static initializer may run before libgcc's own
  return __builtin_cpu_supports("avx512f");
}
static bool avx512_on = cpu_has_avx512();
// AVX-512: up to this many rows of x (a decode or verify step) widen each block as multiplied, in
// one or two groups of rows; more (a prefill) widen a block of rows once into a buffer
static constexpr int64_t QUANT_DIRECT_ROWS = 12;

#pragma GCC push_options
#pragma GCC target("avx512f")
// 8 floats of p twice: lanes 0-7 and 8-15
static inline __m512 twice8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
// {a, b, c, d} -> lanes 0-7 a, 8-15 c (lo) or 0-7 b, 8-15 d (odd)
static inline __m512 halves(__m128 v, bool odd) {
  const __m512i index = odd ? _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1)
                            : _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v));
}
// `finish` of rows n (lanes 0-7) and n + 1 (lanes 8-15) of w; wr, wr + K: those rows, for a tail
template <typename T>
static inline void finish_pair(const Args<T>& a, __m512 acc, int64_t m, int64_t n, const T* wr, int64_t K) {
  finish(a, _mm512_castps512_ps256(acc), m, n, wr);
  finish(a, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)), m, n + 1, wr ? wr + K : wr);
}
// the 4 chunks of 8 widened weights of block c of rows (i, i+1), starting at blk0 and blk1
static inline void widen_pair(const uint8_t* blk0, const uint8_t* blk1, int64_t kind, __m512 v[4]) {
  if (kind == Q4_1) {
    __m128 dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, load32(blk1), load32(blk0)));  // d0 m0 d1 m1
    __m512 d = halves(dm, false), m = halves(dm, true);
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk0 + 4));
    __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk1 + 4));
    __m128i lo0 = _mm_and_si128(q0, nib), hi0 = _mm_and_si128(_mm_srli_epi16(q0, 4), nib);
    __m128i lo1 = _mm_and_si128(q1, nib), hi1 = _mm_and_si128(_mm_srli_epi16(q1, 4), nib);
    __m128i q[4] = {_mm_unpacklo_epi64(lo0, lo1), _mm_unpackhi_epi64(lo0, lo1),
                    _mm_unpacklo_epi64(hi0, hi1), _mm_unpackhi_epi64(hi0, hi1)};
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p)
      v[p] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[p]))), m);
  } else {
    uint32_t two = uint32_t(uint16_t(load32(blk0))) | (uint32_t(load32(blk1)) << 16);  // d0 d1
    __m512 d = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                     _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(two)))));
    __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk0 + 2));
    __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk0 + 18));
    __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk1 + 2));
    __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk1 + 18));
    __m128i q[4] = {_mm_unpacklo_epi64(a0, a1), _mm_unpackhi_epi64(a0, a1),
                    _mm_unpacklo_epi64(b0, b1), _mm_unpackhi_epi64(b0, b1)};
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) v[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q[p])), d);
  }
}

// quant_block's outputs for NB (even) rows of w from n0 against rows m0..m0+MB-1 of x, a pair of
// rows of w a register
template <int NB, int MB>
static void quant_block_avx512(const Args<float>& a, const QuantRows& q, int64_t n0, int64_t m0) {
  constexpr int NP = NB / 2;
  const int64_t K = a.K, bytes = quant_block_bytes(q.kind);
  const float* x = a.x + m0 * K;
  __m512 acc[NP][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / QK; ++c) {
#pragma GCC unroll 16
    for (int i = 0; i < NP; ++i) {
      const uint8_t* blk = q.blocks + (n0 + 2 * i) * q.row_bytes + c * bytes;
      __m512 v[4];
      widen_pair(blk, blk + q.row_bytes, q.kind, v);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p)
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_fmadd_ps(twice8(x + j * K + c * QK + 8 * p), v[p], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) finish_pair(a, acc[i][j], m0 + j, n0 + 2 * i, static_cast<const float*>(nullptr), 0);
}

// the last r < R rows of x from m0, in one block
template <int NB, int R>
static inline void quant_last_rows_avx512(const Args<float>& a, const QuantRows& q, int64_t n0, int64_t m0, int64_t r) {
  if constexpr (R > 0) {
    if (r == R) quant_block_avx512<NB, R>(a, q, n0, m0);
    else quant_last_rows_avx512<NB, R - 1>(a, q, n0, m0, r);
  }
}

// blocks first..last-1 of NB rows of w against all M rows of x, MB at a time (each block of w is
// widened once per MB rows of x: for a verify of a few rows that costs less than a buffer)
template <int NB, int MB>
static void quant_range_avx512(const Args<float>& a, const QuantRows& q, int64_t M, int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    int64_t m0 = 0;
    for (; m0 + MB <= M; m0 += MB) quant_block_avx512<NB, MB>(a, q, i * NB, m0);
    quant_last_rows_avx512<NB, MB - 1>(a, q, i * NB, m0, M - m0);
  }
}

static const float* widen_rows_avx512(const QuantRows& q, int64_t n0, int nb, float* out) {
  for (int r = 0; r < nb; ++r) {
    const uint8_t* row = q.blocks + (n0 + r) * q.row_bytes;
    float* o = out + r * q.K;
    for (int64_t c = 0; c < q.K / QK; ++c, o += QK) {
      if (q.kind == Q4_1) {
        const uint8_t* blk = row + c * 20;
        __m512 d = _mm512_set1_ps(half_bits(blk)), m = _mm512_set1_ps(half_bits(blk + 2));
        __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)), nib = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(w, nib), hi = _mm_and_si128(_mm_srli_epi16(w, 4), nib);
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), m));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), m));
      } else {
        const uint8_t* blk = row + c * 34;
        __m512 d = _mm512_set1_ps(half_bits(blk));
        for (int h = 0; h < 2; ++h) {
          __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h));
          _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w)), d));
        }
      }
    }
  }
  return out;
}

// Dense rows on AVX-512 for two or more rows of x (a verify, a batch, a prefill): a pair of rows
// of w a register (lanes 0-7 row 2i, 8-15 row 2i+1), rows of x as float32 (bfloat16 widened
// exactly, once per call), each lane the AVX2 code's chain of FMAs over k = 8c + j, then `finish`
// on each half: the bits of `block`, at twice the multiply-adds an instruction, and up to 24
// accumulators in AVX-512's 32 registers instead of 12 in AVX2's 16.
static inline __m512 pair16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 pair16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 two8(const float* lo, const float* hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(lo))),
                                             _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}
static inline __m512 two8(const at::BFloat16* lo, const at::BFloat16* hi) {
  __m256i h = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)),
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// values k..k+7 of rows 2i and 2i+1 of a block of w starting at w, as `chunk` lays them out
template <bool PAIRED, typename T>
static inline __m512 load_pair(const T* w, int64_t K, int i, int64_t k) {
  return PAIRED ? pair16(w + 2 * i * K + 2 * k) : two8(w + 2 * i * K + k, w + (2 * i + 1) * K + k);
}

// rows n0..n0+2*NP-1 of w (block at w) against rows m0..m0+MB-1 of xf (float32 rows of x),
// prefetching `next`'s rows while it runs, as `block` does
template <typename T, bool PAIRED, int NP, int MB>
static inline __attribute__((always_inline)) void dense_block_avx512(const Args<T>& a, const float* xf, const T* w,
                                                                     int64_t n0, int64_t m0, const T* next) {
  const int64_t K = a.K, K8 = K / 8 * 8;
  constexpr int64_t line = PAIRED ? 32 / sizeof(T) : 64 / sizeof(T);  // k per cache line of a stream
  const float* x = xf + m0 * K;
  __m512 acc[NP][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    if (next && k % line == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < 2 * NP; r += PAIRED ? 2 : 1)
        _mm_prefetch(reinterpret_cast<const char*>(chunk<PAIRED>(next, K, r, k)), _MM_HINT_T0);
    }
    __m512 v[NP];
#pragma GCC unroll 16
    for (int i = 0; i < NP; ++i) v[i] = load_pair<PAIRED>(w, K, i, k);
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) {
      __m512 u = twice8(x + j * K + k);
#pragma GCC unroll 16
      for (int i = 0; i < NP; ++i) acc[i][j] = _mm512_fmadd_ps(u, v[i], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) finish_pair(a, acc[i][j], m0 + j, n0 + 2 * i, w + 2 * i * K, K);
}

template <typename T, bool PAIRED, int NP, int R>
static inline void dense_last_rows_avx512(const Args<T>& a, const float* xf, const T* w, int64_t n0, int64_t m0,
                                          int64_t r, const T* next) {
  if constexpr (R > 0) {
    if (r == R) dense_block_avx512<T, PAIRED, NP, R>(a, xf, w, n0, m0, next);
    else dense_last_rows_avx512<T, PAIRED, NP, R - 1>(a, xf, w, n0, m0, r, next);
  }
}

// blocks of 2*NP rows of w (at w, N rows, as `chunk` lays them out) between threads, each against
// all M rows of xf, MB at a time; the last N % (2*NP) rows a pair (or, unpaired and odd, a row) at a time
template <typename T, bool PAIRED, int NP, int MB>
static void dense_rows_avx512(const Args<T>& a, const float* xf, int64_t M) {
  constexpr int NB = 2 * NP;
  const int64_t K = a.K;
  shared_for(a.N / NB, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const T* w = a.w + i * NB * K;
      const T* next = i + 1 < last ? w + NB * K : nullptr;
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) dense_block_avx512<T, PAIRED, NP, MB>(a, xf, w, i * NB, m0, next);
      dense_last_rows_avx512<T, PAIRED, NP, MB - 1>(a, xf, w, i * NB, m0, M - m0, next);
    }
  });
  int64_t n = a.N / NB * NB;
  for (; n + 2 <= a.N; n += 2)
    for (int64_t m = 0; m < M; ++m) dense_block_avx512<T, PAIRED, 1, 1>(a, xf, a.w + n * K, n, m, nullptr);
  if (n < a.N)  // an odd last row of an unpaired w
    for (int64_t m = 0; m < M; ++m) block<T, false, 1, 1>(a, a.w + n * K, n, m, nullptr);
}

// fixed_linear's rows for M >= 2 on AVX-512: NP * MB accumulators, rows of x in one group of up
// to 6 (w read from memory once) or more groups, the w block then re-read from cache
template <typename T, bool PAIRED>
static void dense_avx512(const Args<T>& a, int64_t M) {
  std::vector<float> widened;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) xf = a.x;
  else {
    widened.resize(M * a.K);
    for (int64_t i = 0; i < M * a.K; ++i) widened[i] = float(a.x[i]);
    xf = widened.data();
  }
  switch (M <= 6 ? M : M <= 12 ? (M + 1) / 2 : 6) {
    case 2: return dense_rows_avx512<T, PAIRED, 6, 2>(a, xf, M);
    case 3: return dense_rows_avx512<T, PAIRED, 4, 3>(a, xf, M);
    case 4: return dense_rows_avx512<T, PAIRED, 4, 4>(a, xf, M);
    case 5: return dense_rows_avx512<T, PAIRED, 4, 5>(a, xf, M);
    default: return dense_rows_avx512<T, PAIRED, 4, 6>(a, xf, M);
  }
}

// quant_linear's rows for more than QUANT_DIRECT_ROWS rows of x (a tree verify, a batch, a
// prefill): each block of 8 rows of w widened once into a thread's buffer as pairs (`widen_pair`'s
// registers stored in turn: rows paired as `pair_rows` lays them out), then dense_block_avx512
// on it: the operations of fixed_linear on the widened weight
static void widen_pairs_avx512(const QuantRows& q, int64_t n0, int np, float* out) {
  const int64_t bytes = quant_block_bytes(q.kind);
  for (int i = 0; i < np; ++i) {
    const uint8_t* row = q.blocks + (n0 + 2 * i) * q.row_bytes;
    for (int64_t c = 0; c < q.K / QK; ++c) {
      __m512 v[4];
      widen_pair(row + c * bytes, row + q.row_bytes + c * bytes, q.kind, v);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) _mm512_storeu_ps(out + 2 * i * q.K + (4 * c + p) * 16, v[p]);
    }
  }
}

static void quant_buffered_avx512(const Args<float>& a, const QuantRows& q, int64_t M) {
  constexpr int NP = 4, NB = 2 * NP, MB = 6;
  shared_for(a.N / NB, [&](int64_t first, int64_t last) {
    std::vector<float> buffer(NB * a.K);
    for (int64_t i = first; i < last; ++i) {
      widen_pairs_avx512(q, i * NB, NP, buffer.data());
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) dense_block_avx512<float, true, NP, MB>(a, a.x, buffer.data(), i * NB, m0, nullptr);
      dense_last_rows_avx512<float, true, NP, MB - 1>(a, a.x, buffer.data(), i * NB, m0, M - m0, nullptr);
    }
  });
}
#pragma GCC pop_options

// bfloat16 weights on AMX tiles where the CPU and the OS offer them (`use_amx`): TDPBF16PS adds
// to a float32 tile C (16 rows of x by 16 rows of w) the products of a tile of x's rows (16 by
// 32 values of k) and a tile of w in the "VNNI" layout (`model.amx_rows`: 16 pairs of k by 16
// rows of w, the two values of a pair side by side). Every output is computed by the same tile
// operations whatever the number of rows: x's rows go 16 at a time into a zero-padded tile (a
// row's place in it changes nothing: tests), chunks of 32 k are added in ascending order into a
// zeroed C, then + b[n], then residual + that, rounded once to bfloat16. How the hardware adds a
// chunk's 32 products is its own (not a chain of FMAs: measured), so the bits are not the AVX
// code's; they are the same at every row count and thread count, which is what the forward's
// identities need (and the bits of each CPU kind are its own: docs/PROTOCOL.md). Why: 16 x 16 x
// 32 multiply-adds an instruction, so a 16-row verify reads the weights once at tile speed
// (figures: ops/bench/RESULTS.md, "bfloat16 on AMX tiles").
using BF = at::BFloat16;
static bool cpu_has_amx() {  // CPUID.(7, 0):EDX bit 24 AMX-TILE, bit 22 AMX-BF16
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  // Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
static const bool amx_offered = avx512_on && cpu_has_amx();
static bool amx_on = amx_offered;
static bool amx_runs() { return amx_on && avx512_on; }  // `use_amx` and not `use_avx512(false)`
static constexpr int AMX_BLOCKS = 3;  // tiles of 16 rows of w a pass: 3 C, 3 w, 1 x of the 8

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,amx-tile,amx-bf16")
struct TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// 16 float32 -> bfloat16 as c10::BFloat16(float) rounds: to nearest even, a NaN to 0x7FC0
static inline void store_bf16(BF* p, __m512 s) {
  __m512i u = _mm512_castps_si512(s);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// rows of w in blocks NB..NB+B-1 (16 each) against the 16 rows of xp from m0 (xp: x's rows
// zero-padded to a multiple of 16); outputs of the first `rows` of them
template <int B>
static void amx_pass(const Args<BF>& a, const BF* xp, int64_t nb, int64_t m0, int64_t rows) {
  const int64_t K = a.K, chunks = K / 32;
  const BF* w = a.w + nb * 16 * K;  // block nb + i at w + i * 16 * K, chunk c at + c * 512
  _tile_zero(0);
  if constexpr (B > 1) _tile_zero(1);
  if constexpr (B > 2) _tile_zero(2);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(6, xp + m0 * K + 32 * c, 2 * K);
    _tile_loadd(3, w + c * 512, 64);
    _tile_dpbf16ps(0, 6, 3);
    if constexpr (B > 1) { _tile_loadd(4, w + 16 * K + c * 512, 64); _tile_dpbf16ps(1, 6, 4); }
    if constexpr (B > 2) { _tile_loadd(5, w + 32 * K + c * 512, 64); _tile_dpbf16ps(2, 6, 5); }
  }
  alignas(64) float out[B][16][16];
  _tile_stored(0, out[0], 64);
  if constexpr (B > 1) _tile_stored(1, out[1], 64);
  if constexpr (B > 2) _tile_stored(2, out[2], 64);
  for (int64_t j = 0; j < rows; ++j)
    for (int i = 0; i < B; ++i) {
      const int64_t n = (nb + i) * 16, m = m0 + j;
      __m512 s = _mm512_load_ps(out[i][j]);
      if (a.b) s = _mm512_add_ps(s, pair16(a.b + n));  // pair16: 16 bfloat16 values widened
      if (a.residual) s = _mm512_add_ps(pair16(a.residual + m * a.N + n), s);
      store_bf16(a.y + m * a.N + n, s);
    }
}

// fixed_linear for w as `model.amx_rows` lays it out (N % 16 == 0, K % 32 == 0)
static void amx_linear(const Args<BF>& a, int64_t M) {
  const int64_t K = a.K, padded = (M + 15) / 16 * 16, blocks = a.N / 16;
  std::vector<BF> xp(padded * K, BF(0.0f));
  std::copy(a.x, a.x + M * K, xp.begin());
  shared_for((blocks + AMX_BLOCKS - 1) / AMX_BLOCKS, [&](int64_t first, int64_t last) {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    for (int64_t g = first; g < last; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int64_t nb = g * AMX_BLOCKS, rows = std::min<int64_t>(16, M - m0);
        switch (std::min<int64_t>(AMX_BLOCKS, blocks - nb)) {
          case 3: amx_pass<3>(a, xp.data(), nb, m0, rows); break;
          case 2: amx_pass<2>(a, xp.data(), nb, m0, rows); break;
          default: amx_pass<1>(a, xp.data(), nb, m0, rows); break;
        }
      }
    _tile_release();
  });
}
#pragma GCC pop_options

const float* QuantRows::rows(int64_t n0, int nb, float* out) const {
  return avx512_on ? widen_rows_avx512(*this, n0, nb, out) : rows_avx2(n0, nb, out);
}

// A block of NB rows of GGUF blocks against MB rows of x, each 8 widened weights multiplied as
// they are widened (no buffer): the same operations per output as `block` on the widened rows
// (lane j takes k = 8c + j, c ascending, one FMA each, then `finish`).
template <int NB, int MB>
static inline __attribute__((always_inline)) void quant_block(const Args<float>& a, const QuantRows& q, int64_t n0,
                                                              int64_t m0) {
  const int64_t K = a.K;
  const float* x = a.x + m0 * K;
  __m256 acc[NB][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / QK; ++c) {
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) {
      const uint8_t* blk = q.blocks + (n0 + i) * q.row_bytes + c * quant_block_bytes(q.kind);
      __m256 v[4];
      if (q.kind == Q4_1) {
        __m256 d = _mm256_set1_ps(half_bits(blk)), m = _mm256_set1_ps(half_bits(blk + 2));
        __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)), nib = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(w, nib), hi = _mm_and_si128(_mm_srli_epi16(w, 4), nib);
        v[0] = widen_q4(lo, d, m);
        v[1] = widen_q4(_mm_srli_si128(lo, 8), d, m);
        v[2] = widen_q4(hi, d, m);
        v[3] = widen_q4(_mm_srli_si128(hi, 8), d, m);
      } else {
        __m256 d = _mm256_set1_ps(half_bits(blk));
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p)
          v[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * p)))), d);
      }
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p)
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(load8(x + j * K + c * QK + 8 * p), v[p], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) finish(a, acc[i][j], m0 + j, n0 + i, static_cast<const float*>(nullptr));
}

// rows of w NB at a time between threads (the last N % NB one at a time) against the M rows of x
// (AVX2: M == MB)
template <int NB, int MB, bool AVX512>
static void quant_blocks(const Args<float>& a, const QuantRows& q, int64_t M) {
  static_assert(!AVX512 || NB % 2 == 0, "AVX-512 takes rows of w in pairs");
  shared_for(a.N / NB, [&](int64_t first, int64_t last) {
    if constexpr (AVX512) quant_range_avx512<NB, MB>(a, q, M, first, last);
    else for (int64_t i = first; i < last; ++i) quant_block<NB, MB>(a, q, i * NB, 0);
  });
  for (int64_t n = a.N / NB * NB; n < a.N; ++n)
    for (int64_t m = 0; m < M; ++m) quant_block<1, 1>(a, q, n, m);
}

// x (M, K) float32, blocks (N, K/32 * block bytes) uint8 of `kind`, b (N,) or None, residual (M, N)
// or None, float32 -> (M, N) float32: fixed_linear's operations on the widened weight
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t kind, c10::optional<torch::Tensor> b,
                           c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0, "quant_linear: kind 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && x.scalar_type() == torch::kFloat &&
              blocks.scalar_type() == torch::kUInt8 && x.device().is_cpu() && blocks.device().is_cpu(),
              "quant_linear: x (M, K) float32, blocks (N, bytes) uint8, on the CPU");
  int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % QK == 0 && blocks.size(1) == K / QK * quant_block_bytes(kind),
              "quant_linear: blocks of ", QK, " weights along K = ", K);
  x = x.contiguous();
  blocks = blocks.contiguous();
  torch::Tensor bias = b.has_value() ? b->contiguous() : torch::Tensor();
  torch::Tensor res = residual.has_value() ? residual->contiguous() : torch::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "quant_linear: b (N,)");
  TORCH_CHECK(!res.defined() || (res.size(0) == M && res.size(1) == N && res.scalar_type() == torch::kFloat),
              "quant_linear: residual (M, N)");
  auto y = torch::empty({M, N}, x.options());
  Args<float> a{x.data_ptr<float>(), nullptr, bias.defined() ? bias.data_ptr<float>() : nullptr,
                res.defined() ? res.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, K};
  QuantRows q{blocks.data_ptr<uint8_t>(), K, blocks.size(1), kind};
  // AVX2: one or two rows (decode steps) widened as multiplied; more: widened once per block of rows
  if (avx512_on && M <= QUANT_DIRECT_ROWS) {  // rows of x MB at a time, M <= 12 in one or two groups
    switch (M <= 6 ? M : (M + 1) / 2) {
      case 1: quant_blocks<8, 1, true>(a, q, M); break;
      case 2: quant_blocks<4, 2, true>(a, q, M); break;
      case 3: quant_blocks<4, 3, true>(a, q, M); break;
      case 4: quant_blocks<4, 4, true>(a, q, M); break;
      case 5: quant_blocks<4, 5, true>(a, q, M); break;
      default: quant_blocks<4, 6, true>(a, q, M); break;
    }
  } else if (avx512_on) {
    quant_buffered_avx512(a, q, M);
    for (int64_t n = a.N / 8 * 8; n < a.N; ++n)
      for (int64_t m = 0; m < M; ++m) quant_block<1, 1>(a, q, n, m);
  } else if (M == 1) quant_blocks<4, 1, false>(a, q, M);
  else if (M == 2) quant_blocks<3, 2, false>(a, q, M);
  else run<float, false>(a, q, M);
  return y;
}

// one row of x on AVX2 (memory-bound: `block`'s prefetching tuned for it), more on AVX-512 where the CPU has it
template <typename T>
static void dense(const Args<T>& a, int64_t M, bool paired) {
  if (!avx512_on || M < 2) return run(a, M, paired);
  if (paired) dense_avx512<T, true>(a, M);
  else dense_avx512<T, false>(a, M);
}

// x (M, K), w (N, K) or its rows paired (N/2, K/8, 2, 8), b (N,) or None, residual (M, N) or None,
// all of one dtype (float32 or bfloat16) on the CPU -> (M, N) of that dtype
torch::Tensor fixed_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b,
                           c10::optional<torch::Tensor> residual) {
  bool paired = w.dim() == 4 && w.size(2) == 2 && w.size(3) == 8, tiled = w.dim() == 4 && w.size(2) == 16 && w.size(3) == 32;
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || paired || tiled),
              "fixed_linear: x (M, K), w (N, K), (N/2, K/8, 2, 8) or (N/16, K/32, 16, 32)");
  TORCH_CHECK(!tiled || (w.scalar_type() == torch::kBFloat16 && amx_runs()),
              "fixed_linear: w in AMX tiles (N/16, K/32, 16, 32) is bfloat16, where use_amx is on");
  int64_t M = x.size(0), N = paired ? 2 * w.size(0) : tiled ? 16 * w.size(0) : w.size(0);
  int64_t K = paired ? 8 * w.size(1) : tiled ? 32 * w.size(1) : w.size(1);
  TORCH_CHECK(x.size(1) == K, "fixed_linear: x (M, K) against w of K = ", K);
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.device().is_cpu() && w.device().is_cpu(),
              "fixed_linear: x and w of one dtype on the CPU");
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
                  res.defined() ? res.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, K};
    dense(a, M, paired);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "fixed_linear: float32 or bfloat16");
    using B = at::BFloat16;
    Args<B> a{x.data_ptr<B>(), w.data_ptr<B>(), bias.defined() ? bias.data_ptr<B>() : nullptr,
              res.defined() ? res.data_ptr<B>() : nullptr, y.data_ptr<B>(), N, K};
    if (tiled) amx_linear(a, M);
    else dense(a, M, paired);
  }
  return y;
}

// f(T{}) for t's dtype T, float or at::BFloat16 (the dtypes these kernels take)
template <typename F>
static void on_dtype(const torch::Tensor& t, const char* what, F&& f) {
  if (t.scalar_type() == torch::kFloat) return f(float{});
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, what, ": float32 or bfloat16");
  f(at::BFloat16{});
}

// RMS_LANES partial sums of squares per row, then added as a tree: the fixed order of `rms_norm`
constexpr int RMS_LANES = 16;

// rows first..last-1 of x (M, E): y = T(T(x * rstd) * w), rstd = 1 / sqrt(sum / E + eps), where
// sum is the row's squares added on RMS_LANES lanes (lane j takes e = 16c + j, c ascending, one
// multiply and one add each, the tail e >= 16*(E/16) too) and the lanes then pairwise, as
// ((0+1)+(2+3))+... The same operations for a row at every row count; the rounding of x * rstd to
// T before the weight (a no-op in float32) is how Llama's RMSNorm rounds in bfloat16.
template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t E, float eps, int64_t first, int64_t last) {
  for (int64_t m = first; m < last; ++m) {
    const T* xr = x + m * E;
    T* yr = y + m * E;
    float acc[RMS_LANES] = {};
    int64_t e = 0;
    for (; e + RMS_LANES <= E; e += RMS_LANES)
#pragma GCC unroll 16
      for (int j = 0; j < RMS_LANES; ++j) {
        float v = widen(xr[e + j]);
        acc[j] += v * v;
      }
    for (int j = 0; e + j < E; ++j) {
      float v = widen(xr[e + j]);
      acc[j] += v * v;
    }
    for (int width = RMS_LANES / 2; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) acc[j] = acc[2 * j] + acc[2 * j + 1];
    const float rstd = 1.0f / std::sqrt(acc[0] / float(E) + eps);
    for (int64_t i = 0; i < E; ++i) yr[i] = T(widen(T(widen(xr[i]) * rstd)) * widen(w[i]));
  }
}

// x (..., E), w (E,), one dtype (float32 or bfloat16) on the CPU -> x's shape and dtype, each row
// normalized (`rms_rows`); rows split between threads only for a prefill's many
torch::Tensor fixed_rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0) && x.scalar_type() == w.scalar_type() &&
              x.device().is_cpu() && w.device().is_cpu(), "fixed_rms_norm: x (..., E) and w (E,) of one dtype on the CPU");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t E = w.size(0), M = E ? x.numel() / E : 0;
  auto y = torch::empty_like(x);
  auto rows = [&](auto* xp, auto* wp, auto* yp) {
    auto f = [&](int64_t first, int64_t last) { rms_rows(xp, wp, yp, E, float(eps), first, last); };
    if (M >= 64) shared_for(M, f);
    else f(0, M);
  };
  on_dtype(x, "fixed_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rows(x.data_ptr<T>(), w.data_ptr<T>(), y.data_ptr<T>());
  });
  return y;
}

// exp(x) on 8 lanes for x <= 0 (a softmax weight): Cephes' expf, x = n ln2 + r with
// |r| <= ln2/2, e^r by a degree-6 polynomial in Horner form (one FMA a coefficient), times 2^n by
// the exponent bits; below -87.3 exactly 0. The same instructions on every CPU kind with AVX2.
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};  // Horner's, highest degree first
static inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.33654f);
  __m256 zero = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// the lanes of acc[0..7] each added as `finish` adds a dot product's lanes,
// ((0+1)+(2+3))+((4+5)+(6+7)): the 8 sums, one a lane, in one register (hadd pairs neighbours
// within each 128-bit half; the halves' sums are added last)
static inline __m256 hsum8x8(const __m256* acc) {
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// s[j] = q·k_j for keys j0..j0+7, D a multiple of 8: lane l of key j's sum takes d = 8c + l, c in
// order (one FMA each), the lanes then added as `finish` adds them
template <typename TQ, typename TK>
static inline __m256 dots8(const TQ* q, const TK* k, int64_t k_row, int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv = load8(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k + j * k_row + d), acc[j]);
  }
  return hsum8x8(acc);
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(at::BFloat16* p, __m256 v) {  // round to nearest even, as torch rounds
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) p[i] = at::BFloat16(f[i]);
}

// The additive mask's value for a key a row may not see (model.py MASKED, as float32)
constexpr float MASKED = -1e30f;

// out[r][d .. d + 8 DC) = (sum over live keys j, in order, of p[r][j] v_j) / l[r], one FMA a key
// and lane; with sum_l, first adds l[r] += p[r][j] over the same keys in the same order (so l is
// complete before any division: the division waits for the loop)
template <int R, int DC, typename TV, typename TO>
static inline void pv_chunks(const float* p, const TV* v, int64_t v_row, int64_t S, const uint8_t* live, int64_t d,
                             bool sum_l, float* l, TO* const* out) {
  __m256 o[R][DC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) o[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < S / 8; ++g) {
    if (!live[g]) continue;
    for (int64_t j = 8 * g; j < 8 * g + 8; ++j) {
      __m256 vj[DC];
      for (int c = 0; c < DC; ++c) vj[c] = load8(v + j * v_row + d + 8 * c);
      for (int r = 0; r < R; ++r) {
        const __m256 pr = _mm256_set1_ps(p[r * S + j]);
        for (int c = 0; c < DC; ++c) o[r][c] = _mm256_fmadd_ps(pr, vj[c], o[r][c]);
        if (sum_l) l[r] += p[r * S + j];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) store8(out[r] + d + 8 * c, _mm256_div_ps(o[r][c], _mm256_set1_ps(l[r])));
}

// One (query rows, key block) pair of `unit_blocks`: R rows of q (D values each) against S
// keys. Per row: s_j = q·k_j * scale + mask_j (`dots8`); m = max_j s_j; p_j = exp(s_j - m);
// l = sum of p_j and o = sum of p_j v_j, both over j in order (o on D lanes, one FMA a key);
// out = o / l, lse = m + log(l). Each row's operations are its own, whatever the rows beside it.
// Work whose result is known is skipped, the bits unchanged: a group of 8 keys the row may not
// see at all scores MASKED exactly (s_j = q·k_j * scale + MASKED rounds to MASKED while
// |q·k_j * scale| < 1e22), and keys whose p_j is 0 for every row add exactly nothing to l and o.
template <int R, typename TQ, typename TK, typename TV, typename TO>
static void attend_rows(const TQ* const* q, const TK* k, const TV* v, int64_t k_row, int64_t v_row,
                        const float* const* mask, int64_t S, int64_t D, float scale, TO* const* out, float* lse,
                        float* p, uint8_t* live) {  // scratch: p (R, S), live (S / 8)
  const __m256 sc = _mm256_set1_ps(scale), masked = _mm256_set1_ps(MASKED), zero = _mm256_setzero_ps();
  for (int64_t g = 0; g < S / 8; ++g) live[g] = 0;
  for (int r = 0; r < R; ++r) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < S; j += 8) {
      __m256 mk = _mm256_loadu_ps(mask[r] + j);
      __m256 s = _mm256_movemask_ps(_mm256_cmp_ps(mk, masked, _CMP_EQ_OQ)) == 0xFF ? masked :
                 _mm256_add_ps(_mm256_mul_ps(dots8(q[r], k + j * k_row, k_row, D), sc), mk);
      _mm256_storeu_ps(p + r * S + j, s);
      mx = _mm256_max_ps(mx, s);
    }
    const float m = hmax8(mx);
    lse[r] = m;
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t j = 0; j < S; j += 8) {
      __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + r * S + j), mv));
      _mm256_storeu_ps(p + r * S + j, e);
      live[j / 8] |= _mm256_movemask_ps(_mm256_cmp_ps(e, zero, _CMP_NEQ_UQ)) != 0;
    }
  }
  float l[R];
  for (int r = 0; r < R; ++r) l[r] = 0.0f;
  // o on D lanes, DC chunks of 8 at once: R * DC chains of FMAs side by side (one chain a row
  // would wait on its own FMA's latency every key); l's chains ride along in the first pass
  constexpr int DC = R >= 3 ? 2 : 8 / R;
  int64_t d = 0;
  for (; d + 8 * DC <= D; d += 8 * DC) pv_chunks<R, DC>(p, v, v_row, S, live, d, d == 0, l, out);
  for (; d < D; d += 8) pv_chunks<R, 1>(p, v, v_row, S, live, d, d == 0, l, out);
  for (int r = 0; r < R; ++r) lse[r] += std::log(l[r]);
}

// rows n of src (n, D), row stride `stride`, as float32 into dst (n, D) contiguous: exact
template <typename T>
static void widen_rows(const T* src, int64_t stride, int64_t n, int64_t D, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + i * D + d, load8(src + i * stride + d));
}

// AVX-512F (`use_avx512`): `attend_rows` with the same operations per lane on 16 lanes, so the
// same bits. Scores: keys in pairs, key 2P's chunk of 8 values in lanes 0-7 and key 2P + 1's in
// 8-15 (`key_pairs` lays a block out so), each lane its chain of FMAs over d = 8c + lane, then
// `hsum8x8` on the halves; R rows at once share the keys' loads. Values: 16 lanes of d a register.
#pragma GCC push_options
#pragma GCC target("avx512f")
static inline __m512 exp_nonpositive16(__m512 x) {  // `exp_nonpositive` on 16 lanes
  const __m512 low = _mm512_set1_ps(-87.33654f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
  x = _mm512_max_ps(x, low);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(_mm512_knot(zero), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename T>
static inline void store16(T* p, __m512 v) {
  store8(p, _mm512_castps512_ps256(v));
  store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// keys 0..S-1 of src (row stride `stride`) as float32 pairs into dst: pair P, chunk c at
// dst + (P D / 8 + c) 16, key 2P's values 8c..8c+7 then key 2P + 1's (S even)
template <typename T>
static void key_pairs(const T* src, int64_t stride, int64_t S, int64_t D, float* dst) {
  for (int64_t j = 0; j < S; ++j)
    for (int64_t c = 0; c < D / 8; ++c)
      _mm256_storeu_ps(dst + ((j / 2) * (D / 8) + c) * 16 + (j % 2) * 8, load8(src + j * stride + 8 * c));
}

// `dots8` of R rows (float32, D values) against keys 8g..8g+7 of key_pairs' kp: s[r]
template <int R>
static inline void dots8_rows(const float* const* q, const float* kp, int64_t g, int64_t D, __m256* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  const float* base = kp + g * 4 * D * 2;
  for (int64_t c = 0; c < D / 8; ++c) {
    __m512 kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = _mm512_loadu_ps(base + (i * (D / 8) + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = twice8(q[r] + 8 * c);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 a[8];
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = _mm512_castps512_ps256(acc[r][i]);
      a[2 * i + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][i]), 1));
    }
    s[r] = hsum8x8(a);
  }
}

// `pv_chunks` on DC chunks of 16 lanes
template <int R, int DC, typename TV, typename TO>
static inline void pv_chunks16(const float* p, const TV* v, int64_t v_row, int64_t S, const uint8_t* live, int64_t d,
                               bool sum_l, float* l, TO* const* out) {
  __m512 o[R][DC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < S / 8; ++g) {
    if (!live[g]) continue;
    for (int64_t j = 8 * g; j < 8 * g + 8; ++j) {
      __m512 vj[DC];
      for (int c = 0; c < DC; ++c) vj[c] = load16(v + j * v_row + d + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 pr = _mm512_set1_ps(p[r * S + j]);
        for (int c = 0; c < DC; ++c) o[r][c] = _mm512_fmadd_ps(pr, vj[c], o[r][c]);
        if (sum_l) l[r] += p[r * S + j];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) store16(out[r] + d + 16 * c, _mm512_div_ps(o[r][c], _mm512_set1_ps(l[r])));
}

// `attend_rows` on AVX-512: q R rows widened to float32, the block's keys as `key_pairs`
template <int R, typename TV, typename TO>
static void attend_rows16(const float* const* q, const float* kp, const TV* v, int64_t v_row,
                          const float* const* mask, int64_t S, int64_t D, float scale, TO* const* out, float* lse,
                          float* p, uint8_t* live) {
  const __m256 sc = _mm256_set1_ps(scale), masked = _mm256_set1_ps(MASKED), zero = _mm256_setzero_ps();
  __m256 mx[R];
  for (int r = 0; r < R; ++r) mx[r] = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < S / 8; ++g) {
    live[g] = 0;
    __m256 mk[R], dot[R];
    bool hidden[R], any = false;
    for (int r = 0; r < R; ++r) {
      mk[r] = _mm256_loadu_ps(mask[r] + 8 * g);
      hidden[r] = _mm256_movemask_ps(_mm256_cmp_ps(mk[r], masked, _CMP_EQ_OQ)) == 0xFF;
      any = any || !hidden[r];
    }
    if (any) dots8_rows<R>(q, kp, g, D, dot);
    for (int r = 0; r < R; ++r) {
      __m256 s = hidden[r] ? masked : _mm256_add_ps(_mm256_mul_ps(dot[r], sc), mk[r]);
      _mm256_storeu_ps(p + r * S + 8 * g, s);
      mx[r] = _mm256_max_ps(mx[r], s);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float m = hmax8(mx[r]);
    lse[r] = m;
    int64_t j = 0;
    for (; j + 16 <= S; j += 16) {
      __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(p + r * S + j), _mm512_set1_ps(m)));
      _mm512_storeu_ps(p + r * S + j, e);
      const __mmask16 nonzero = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      live[j / 8] |= (nonzero & 0xFF) != 0;
      live[j / 8 + 1] |= (nonzero >> 8) != 0;
    }
    for (; j < S; j += 8) {
      __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + r * S + j), _mm256_set1_ps(m)));
      _mm256_storeu_ps(p + r * S + j, e);
      live[j / 8] |= _mm256_movemask_ps(_mm256_cmp_ps(e, zero, _CMP_NEQ_UQ)) != 0;
    }
  }
  float l[R];
  for (int r = 0; r < R; ++r) l[r] = 0.0f;
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_chunks16<R, 4>(p, v, v_row, S, live, d, d == 0, l, out);
  for (; d + 16 <= D; d += 16) pv_chunks16<R, 1>(p, v, v_row, S, live, d, d == 0, l, out);
  for (; d < D; d += 8) pv_chunks<R, 1>(p, v, v_row, S, live, d, d == 0, l, out);
  for (int r = 0; r < R; ++r) lse[r] += std::log(l[r]);
}

#pragma GCC pop_options

// f(std::integral_constant<int, R>{}) for a tile of R = 1..4 rows: the count as a template argument
template <typename F>
static void by_rows(int R, F&& f) {
  switch (R) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// Attention's block kernel (model.py `block_outputs`). q (N, H, D): N H query rows, row i = q[i / H, i % H]; k, v (B, Hkv, W, D);
// mask (B, nb, M, KB) float32 (0 or MASKED), W >= nb * KB; unit_q (B * Hkv, M) int64, rows of q.
// Unit u = (b, h), its rows m, block j: attend_rows of q[unit_q[u, m]] over keys j KB .. (j + 1) KB - 1
// of k[b, h], v[b, h] under mask[b, j, m] -> out (B * Hkv, nb, M, D) in q's dtype, lse (B * Hkv, nb, M)
// float32. Pairs (u, j) go to threads whole, their rows 4 at a time; bfloat16 keys (and values, for
// more than one tile of rows) are widened to float32 once a pair, which changes no value.
std::vector<torch::Tensor> unit_blocks(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                                       torch::Tensor unit_q, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && mask.dim() == 4 && unit_q.dim() == 2,
              "unit_blocks: q (N, H, D), k and v (B, Hkv, W, D), mask (B, nb, M, KB), unit_q (B*Hkv, M)");
  const int64_t D = q.size(2), H = q.size(1), B = k.size(0), Hkv = k.size(1), nb = mask.size(1), M = mask.size(2), S = mask.size(3);
  TORCH_CHECK(k.size(3) == D && mask.size(0) == B && k.size(2) >= nb * S && unit_q.size(0) == B * Hkv &&
              unit_q.size(1) == M && D % 8 == 0 && S % 8 == 0 && S > 0 && q.stride(2) == 1 && k.stride(3) == 1 &&
              v.stride(3) == 1 && mask.stride(3) == 1 && mask.scalar_type() == torch::kFloat &&
              unit_q.scalar_type() == torch::kLong && unit_q.is_contiguous() && q.scalar_type() == k.scalar_type() &&
              k.scalar_type() == v.scalar_type() && q.device().is_cpu() && k.device().is_cpu() &&
              mask.device().is_cpu() && unit_q.device().is_cpu(),
              "unit_blocks: D and KB multiples of 8, W >= nb*KB, last dims contiguous, mask float32, unit_q int64, "
              "one dtype, on the CPU");
  auto out = torch::empty({B * Hkv, nb, M, D}, q.options());
  auto lse = torch::empty({B * Hkv, nb, M}, q.options().dtype(torch::kFloat));
  const int64_t* rows = unit_q.data_ptr<int64_t>();
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T = std::remove_pointer_t<decltype(qp)>;
    constexpr bool widen = std::is_same_v<T, at::BFloat16>;
    const float* mp = mask.data_ptr<float>();
    float* lp = lse.data_ptr<float>();
    shared_for(B * Hkv * nb, [&](int64_t first, int64_t last) {
      const bool wide = avx512_on;  // AVX-512: every block's keys as key_pairs, q rows widened
      std::vector<float> scratch(4 * S), kw(widen || wide ? S * D : 0), vw(widen ? S * D : 0), qw(wide ? 4 * D : 0);
      std::vector<uint8_t> live(S / 8);
      const bool widen_v = widen && M > 4;
      for (int64_t pair = first; pair < last; ++pair) {
        const int64_t u = pair / nb, j = pair % nb, b = u / Hkv, h = u % Hkv;
        const T* kb = kp + b * k.stride(0) + h * k.stride(1) + j * S * k.stride(2);
        const T* vb = vp + b * v.stride(0) + h * v.stride(1) + j * S * v.stride(2);
        if (wide) key_pairs(kb, k.stride(2), S, D, kw.data());
        else if (widen) widen_rows(kb, k.stride(2), S, D, kw.data());
        if (widen_v) widen_rows(vb, v.stride(2), S, D, vw.data());
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
          const int R = int(std::min<int64_t>(4, M - r0));
          const T* qr[4];
          const float* qf[4];
          T* orow[4];
          const float* mr[4];
          for (int r = 0; r < R; ++r) {
            const int64_t row = rows[u * M + r0 + r];
            qr[r] = qp + row / H * q.stride(0) + row % H * q.stride(1);
            orow[r] = op + ((u * nb + j) * M + r0 + r) * D;
            mr[r] = mp + b * mask.stride(0) + j * mask.stride(1) + (r0 + r) * mask.stride(2);
            qf[r] = wide ? qw.data() + r * D : nullptr;
            if (wide) widen_rows(qr[r], 0, 1, D, qw.data() + r * D);
          }
          float* ls = lp + (u * nb + j) * M + r0;
          auto tile = [&](auto* vt, int64_t v_row) {  // the block's values as stored or widened
            by_rows(R, [&](auto n) {
              constexpr int N = decltype(n)::value;
              const float sc = float(scale);
              if (wide) attend_rows16<N>(qf, kw.data(), vt, v_row, mr, S, D, sc, orow, ls, scratch.data(), live.data());
              else if constexpr (widen) attend_rows<N>(qr, kw.data(), vt, D, v_row, mr, S, D, sc, orow, ls, scratch.data(), live.data());
              else attend_rows<N>(qr, kb, vt, k.stride(2), v_row, mr, S, D, sc, orow, ls, scratch.data(), live.data());
            });
          };
          if (widen_v) tile(vw.data(), D);
          else tile(vb, v.stride(2));
        }
      }
    });
  };
  on_dtype(q, "unit_blocks", [&](auto tag) {
    using T = decltype(tag);
    run(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), out.data_ptr<T>());
  });
  return {out, lse};
}

// FlashAttention's blockwise softmax combine (model.py `attention`) of each unit row's nb blocks:
// out (U, nb, M, D) in q's dtype and lse (U, nb, M) float32 (`unit_blocks`), unit_out (U, M) int64
// -> y (n_out, D) in out's dtype, y[unit_out[u, m]] = sum_j w_j out_j / sum_j w_j, w_j =
// exp(lse_j - max_j lse_j) (`exp_nonpositive`), both sums a pairwise tree over block positions
// ((0 + 1) + (2 + 3)) + ..., blocks past nb counting as zeros, so a row's bits do not depend on
// nb past its last visible block (whose weight is exactly 0); unit_out -1 (a padding row): not
// written. One block: w = 1 exactly, y = out.
torch::Tensor combine_units(torch::Tensor out, torch::Tensor lse, torch::Tensor unit_out, int64_t n_out) {
  TORCH_CHECK(out.dim() == 4 && out.is_contiguous() && lse.dim() == 3 && lse.is_contiguous() &&
              lse.scalar_type() == torch::kFloat && lse.size(0) == out.size(0) && lse.size(1) == out.size(1) &&
              lse.size(2) == out.size(2) && unit_out.dim() == 2 && unit_out.is_contiguous() &&
              unit_out.scalar_type() == torch::kLong && unit_out.size(0) == out.size(0) &&
              unit_out.size(1) == out.size(2) && out.size(3) % 8 == 0 && out.device().is_cpu(),
              "combine_units: out (U, nb, M, D) contiguous, D a multiple of 8, lse (U, nb, M) float32, unit_out (U, M) int64");
  const int64_t U = out.size(0), nb = out.size(1), M = out.size(2), D = out.size(3);
  TORCH_CHECK(unit_out.numel() == 0 || unit_out.max().item<int64_t>() < n_out, "combine_units: unit_out past n_out");
  int64_t P = 1;
  while (P < nb) P *= 2;
  auto y = torch::empty({n_out, D}, out.options());
  const int64_t* dst = unit_out.data_ptr<int64_t>();
  const float* lp = lse.data_ptr<float>();
  auto run = [&](auto* op, auto* yp) {
    shared_for(U * M, [&](int64_t first, int64_t last) {
      std::vector<float> w(P + 8), den(P);
      std::vector<__m256> x(P);
      for (int64_t row = first; row < last; ++row) {
        const int64_t u = row / M, m = row % M, to = dst[row];
        if (to < 0) continue;
        float mx = -INFINITY;
        for (int64_t j = 0; j < nb; ++j) mx = std::max(mx, lp[(u * nb + j) * M + m]);
        for (int64_t j = 0; j < nb; j += 8) {
          alignas(32) float diff[8];
          for (int i = 0; i < 8; ++i) diff[i] = j + i < nb ? lp[(u * nb + j + i) * M + m] - mx : 0.0f;
          _mm256_storeu_ps(w.data() + j, exp_nonpositive(_mm256_load_ps(diff)));
        }
        for (int64_t j = 0; j < P; ++j) den[j] = j < nb ? w[j] : 0.0f;
        for (int64_t s = 1; s < P; s *= 2)
          for (int64_t i = 0; i < P; i += 2 * s) den[i] += den[i + s];
        for (int64_t d = 0; d < D; d += 8) {
          for (int64_t j = 0; j < P; ++j)
            x[j] = j < nb ? _mm256_mul_ps(load8(op + ((u * nb + j) * M + m) * D + d), _mm256_set1_ps(w[j]))
                          : _mm256_setzero_ps();
          for (int64_t s = 1; s < P; s *= 2)
            for (int64_t i = 0; i < P; i += 2 * s) x[i] = _mm256_add_ps(x[i], x[i + s]);
          store8(yp + to * D + d, _mm256_div_ps(x[0], _mm256_set1_ps(den[0])));
        }
      }
    });
  };
  on_dtype(out, "combine_units", [&](auto tag) {
    using T = decltype(tag);
    run(out.data_ptr<T>(), y.data_ptr<T>());
  });
  return y;
}

// keys and values (Hkv, C, D) of one slot and layer, k and v (T, Hkv, D) (last dims contiguous),
// columns (T,) int64: keys[h][columns[t]] = k[t][h] and values likewise, a plain copy (the two
// index_put_ calls it replaces, in one call)
void kv_write(torch::Tensor keys, torch::Tensor values, torch::Tensor k, torch::Tensor v, torch::Tensor columns) {
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && k.dim() == 3 && k.sizes() == v.sizes() &&
              k.size(1) == keys.size(0) && k.size(2) == keys.size(2) && columns.dim() == 1 &&
              columns.size(0) == k.size(0) && columns.scalar_type() == torch::kLong && columns.device().is_cpu() &&
              keys.scalar_type() == k.scalar_type() && values.scalar_type() == v.scalar_type() &&
              keys.stride(2) == 1 && values.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
              keys.device().is_cpu() && k.device().is_cpu(),
              "kv_write: keys, values (Hkv, C, D), k, v (T, Hkv, D) of their dtype, columns (T,) int64, on the CPU");
  const int64_t T = k.size(0), H = k.size(1), C = keys.size(1), bytes = k.size(2) * k.element_size();
  columns = columns.contiguous();  // held: a temporary's data would be freed at the statement's end
  const int64_t* col = columns.data_ptr<int64_t>();
  auto* kd = static_cast<char*>(keys.data_ptr());
  auto* vd = static_cast<char*>(values.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t e = k.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(col[t] >= 0 && col[t] < C, "kv_write: column ", col[t], " outside [0, ", C, ")");
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(kd + (h * keys.stride(0) + col[t] * keys.stride(1)) * e, ks + (t * k.stride(0) + h * k.stride(1)) * e, bytes);
      std::memcpy(vd + (h * values.stride(0) + col[t] * values.stride(1)) * e, vs + (t * v.stride(0) + h * v.stride(1)) * e, bytes);
    }
  }
}

// qkv (M, S, D) (S >= heads), cos and signed sin (M, D), one dtype on the CPU -> the first `heads`
// heads of each row rotated, (M, heads, D): y[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin[d], each
// product and the sum rounded to the dtype as the three elementwise torch ops that it replaces
// (`x * cos + x.roll(D/2, -1) * sin`) round them, so the bits are theirs
torch::Tensor fixed_rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) &&
              cos.size(1) == qkv.size(2) && qkv.size(2) % 2 == 0 && heads >= 0 && heads <= qkv.size(1) &&
              qkv.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type() && qkv.device().is_cpu(),
              "fixed_rope: qkv (M, S, D), cos and sin (M, D), D even, heads <= S, one dtype on the CPU");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t M = qkv.size(0), S = qkv.size(1), D = qkv.size(2), half = D / 2;
  auto y = torch::empty({M, heads, D}, qkv.options());
  auto rotate = [&](auto* x, auto* c, auto* s, auto* o) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (m * S + h) * D;
        const T* cr = c + m * D;
        const T* sr = s + m * D;
        T* yr = o + (m * heads + h) * D;
        for (int64_t d = 0; d < D; ++d)
          yr[d] = T(widen(T(widen(xr[d]) * widen(cr[d]))) + widen(T(widen(xr[(d + half) % D]) * widen(sr[d]))));
      }
  };
  on_dtype(qkv, "fixed_rope", [&](auto tag) {
    using T = decltype(tag);
    rotate(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), y.data_ptr<T>());
  });
  return y;
}

// Run the AVX-512 code or not (it runs only where the CPU has it); returns whether it now runs.
// The bits are the same either way: tests compare the two.
bool use_avx512(bool on) {
  avx512_on = on && cpu_has_avx512();
  return avx512_on;
}

// Run bfloat16 weights laid out for AMX (`model.amx_rows`) on its tiles where the CPU and OS offer
// them, and have `model.pack_weight` lay them out so; returns whether that is now on.
bool use_amx(bool on) {
  amx_on = on && amx_offered;
  return amx_on;
}

// Gumbel-max candidates (gpu_worker/sampling/coupling.py `gumbel_argmax`): for each row of probs
// (R, N) float32 and its stream key (R,) int64, the m tokens with the least exponential-race key
// (1 - u) / p, u = (top 53 bits of splitmix64(key ^ token_ids[v]) + 0.5) / 2^53, in ascending
// order of key (the same double operations as the torch code, so the same keys); tokens with
// p <= 0 never enter. Returns (keys (R, m) float64, inf where a row has fewer than m tokens with
// mass, ids (R, m) int64, 0 there). coupling.py scores these in torch and checks that no other
// token can win, so the draw does not depend on this function's rounding.
static inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static std::tuple<torch::Tensor, torch::Tensor> gumbel_candidates(torch::Tensor probs, torch::Tensor keys,
                                                                  torch::Tensor token_ids, int64_t m) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.is_contiguous(), "probs: (R, N) float32");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == torch::kInt64 && keys.size(0) == probs.size(0), "keys: (R,) int64");
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.scalar_type() == torch::kInt64 && token_ids.size(0) == probs.size(1)
              && token_ids.is_contiguous(), "token_ids: (N,) int64");
  TORCH_CHECK(m >= 1, "m >= 1");
  const int64_t R = probs.size(0), N = probs.size(1);
  auto out_keys = torch::full({R, m}, INFINITY, torch::kFloat64);
  auto out_ids = torch::zeros({R, m}, torch::kInt64);
  const float* p = probs.data_ptr<float>();
  const uint64_t* key = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  const uint64_t* ids = reinterpret_cast<const uint64_t*>(token_ids.data_ptr<int64_t>());
  double* ok = out_keys.data_ptr<double>();
  int64_t* oi = out_ids.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* pr = p + r * N;
      double* best = ok + r * m;  // ascending; best[m - 1] the bar a token must pass
      int64_t* at = oi + r * m;
      for (int64_t v = 0; v < N; ++v) {
        if (!(pr[v] > 0.0f)) continue;
        const double u = (double(splitmix64(key[r] ^ ids[v]) >> 11) + 0.5) * 0x1p-53;
        const double race = (1.0 - u) / double(pr[v]);
        if (!(race < best[m - 1])) continue;
        int64_t j = m - 1;  // insertion, keeping equal keys in token order
        for (; j > 0 && best[j - 1] > race; --j) { best[j] = best[j - 1]; at[j] = at[j - 1]; }
        best[j] = race; at[j] = v;
      }
    }
  });
  return {out_keys, out_ids};
}

// int_kernel.cpp: GGUF blocks by integer dot products
std::string use_int_isa(const std::string& name);
torch::Tensor int_pack(torch::Tensor blocks, int64_t kind);
torch::Tensor int_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t N,
                         c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> residual);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_amx", &use_amx, "bfloat16 weights in AMX tiles where the CPU has them; returns whether it is on");
  m.def("amx", &amx_runs, "whether bfloat16 weights go to AMX tiles (`use_amx`)");
  m.def("use_avx512", &use_avx512, "run the AVX-512 code where the CPU has it; returns whether it runs");
  // without the GIL, as torch's own ops: a service's event loop keeps running beside a forward
  m.def("fixed_linear", &fixed_linear, "residual + (x @ w^T + b), one fixed order per output",
        py::call_guard<py::gil_scoped_release>());
  m.def("fixed_rms_norm", &fixed_rms_norm, "x / sqrt(mean(x^2) + eps) * w per row, one fixed order per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("unit_blocks", &unit_blocks, "each unit row's softmax(q k^T * scale + mask) v and log-sum-exp per key block, one fixed order per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("combine_units", &combine_units, "each unit row's key blocks combined by their log-sum-exps, in a fixed tree",
        py::call_guard<py::gil_scoped_release>());
  m.def("kv_write", &kv_write, "a row's new keys and values copied into its slot's columns");
  m.def("fixed_rope", &fixed_rope, "the first heads of qkv rotated by RoPE's cos and signed sin, torch's bits",
        py::call_guard<py::gil_scoped_release>());
  m.def("gumbel_candidates", &gumbel_candidates, "each row's m tokens of least (1 - u) / p, Gumbel-max's candidates",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear", &quant_linear, "residual + (x @ dequant(blocks)^T + b), fixed_linear's order",
        py::call_guard<py::gil_scoped_release>());
  m.def("use_int_isa", &use_int_isa, "int_linear's ISA: best, vnni, avx2 or scalar; returns the one in use");
  m.def("int_pack", &int_pack, "GGUF rows of blocks in int_linear's layout (groups of 16 rows)");
  m.def("int_linear", &int_linear, "residual + (x @ W^T + b) by int8 activation blocks and integer dot products",
        py::call_guard<py::gil_scoped_release>());
}
