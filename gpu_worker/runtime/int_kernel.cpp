// y = residual + (x @ W^T + b) for W held as GGUF Q4_1 or Q8_0 blocks, by integer dot products:
// the arithmetic llama.cpp uses on these blocks (facts and formulas from ggml-cpu's x86 quants.c,
// no code taken), in one fixed order per output, so that a row's bits depend neither on the rows
// beside it nor on the ISA (`int_isa`: scalar, AVX2, AVX512-VNNI) nor on the threads.
//
// A row of x is quantized on its own, in blocks of 32 (`quantize_rows`: the same operations on
// every ISA, 8 lanes at a time beside the scalar reference; ggml's Q8_1 activation blocks, whose
// d and d * S ggml keeps in fp16 where ours stay float32):
//   amax = max |x_k|, dx = amax / 127, q_k = round-to-nearest-even(x_k * (127 / amax)) (0 where
//   amax is 0), in int8, and the block's sum S = sum q_k (int32), kept as dxs = dx * float(S).
// A weight block is (dw, mw, w_k) of Q4_1 (w_k in 0..15, weight dw * w_k + mw) or (dw, w_k) of Q8_0
// (w_k in -128..127, weight dw * w_k), dw and mw fp16 widened exactly. Its product with x's block:
//   i = sum_k w_k * q_k, exact in int32 in any order (so each ISA may sum as it likes);
//   s = (dw * dx) * float(i)            (Q8_0)
//   s = (dw * dx) * float(i) + mw * dxs  (Q4_1: sum_k mw * dx * q_k = mw * dxs)
// each * and + one float32 rounding (no FMA: the build's -ffp-contract=off), and an output is
//   acc = 0; acc = acc + s for blocks c = 0, 1, ... in order; then + b[n]; then residual + that.
// SIMD code puts 16 (VNNI) or 8 (AVX2) outputs in the lanes of a register, each lane that chain, so
// every ISA computes the same float32 operations on the same exact integers: the same bits.
//
// Weights are repacked once at load (`int_pack`) in groups of 16 rows of W: per group and block
// of 32 k, the 16 rows' dw (fp16), then Q4_1's 16 mw (fp16), then the quants as 4 (Q4_1: each byte
// two nibbles, k and k + 16) or 8 (Q8_0) vectors of 64 bytes, row r's 4 bytes of k = 4j..4j+3 at
// 4r: one VPDPBUSD multiplies 4 k of 16 rows by x's 4 values of that k broadcast. The bytes are the
// file's (a Q4_1 block is 20 bytes, a Q8_0 one 34), but for Q8_0's quants held as w + 128 (the top
// bit flipped: VPDPBUSD's unsigned operand, as Q4_1's nibbles are); rows past N are zero and never
// written.
//
// VNNI passes (`tile_vnni`): up to 8 rows of x at once against a group, its blocks in order; each
// block's 8 vectors of weights decoded once into registers and used by all the pass's rows (8
// VPDPBUSD a row), the rows' int32 sums and float32 accumulators in registers. So a weight byte
// read from memory feeds 8 rows, and a verify of k + 1 rows costs about ceil((k + 1) / 8) times
// the arithmetic of one pass, not k + 1 reads of the weights.
#include <torch/extension.h>
#include <immintrin.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "shared_for.h"

namespace {

constexpr int64_t QK = 32, G = 16;  // weights a block, rows of W a group
enum IntKind : int64_t { Q4_1 = 0, Q8_0 = 1 };
int64_t file_block_bytes(int64_t kind) { return kind == Q4_1 ? 20 : 34; }
int64_t group_block_bytes(int64_t kind) { return kind == Q4_1 ? G * 20 : G * 34; }
int64_t quant_offset(int64_t kind) { return kind == Q4_1 ? 4 * G : 2 * G; }  // after dw (and mw)

float half_to_float(const uint8_t* p) {  // exact
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// x's rows as int8 blocks: q (M, K) int8; dx, dxs and low = -128 * S (M, K / 32) (low: Q8_0's
// weights are held as w + 128, unsigned, so that a block's VPDPBUSD sums (w + 128) * q =
// i + 128 * S and starts from -128 * S instead of 0)
struct XQ {
  std::vector<int8_t> q;
  std::vector<float> dx, dxs;
  std::vector<int32_t> low;
  int64_t K;
};

// one block of 32 values of x (the reference: scalar, any block)
void quantize_block_scalar(const float* v, int8_t* q, float& dx, float& dxs, int32_t& low) {
  float amax = 0.0f;
  bool finite = true;
  for (int k = 0; k < QK; ++k) {
    const float a = std::fabs(v[k]);
    finite = finite && std::isfinite(a);
    amax = std::max(amax, a);
  }
  // a block holding an inf or a NaN: q = 0 and d NaN, so its outputs are NaN (no int8 of it);
  // one too small for 127 / amax to be finite: q = 0 (its products are below float32's range)
  const float r = 127.0f / amax;
  const float d = finite ? amax / 127.0f : NAN, id = finite && amax > 0.0f && std::isfinite(r) ? r : 0.0f;
  int32_t sum = 0;
  for (int k = 0; k < QK; ++k) {
    const int32_t qk = finite ? int32_t(std::nearbyint(v[k] * id)) : 0;
    q[k] = int8_t(qk);
    sum += qk;
  }
  dx = d;
  dxs = d * float(sum);
  low = -128 * sum;
}

// the same operations on 8 lanes (the build's AVX2): the max of |x| is exact in any order,
// v * id is one float32 rounding, VCVTPS2DQ rounds to nearest even as nearbyint does (the default
// MXCSR), and the int32 sum is exact; a block with an inf or a NaN takes the scalar code
void quantize_block_avx2(const float* v, int8_t* q, float& dx, float& dxs, int32_t& low) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), big = _mm256_set1_ps(FLT_MAX);
  __m256 x[4], amax8 = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 a = _mm256_and_ps(x[i], abs_mask);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));
    amax8 = _mm256_max_ps(amax8, a);
  }
  if (finite != 0xFF) return quantize_block_scalar(v, q, dx, dxs, low);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  const float r = 127.0f / amax;
  const __m256 id = _mm256_set1_ps(amax > 0.0f && std::isfinite(r) ? r : 0.0f);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], id));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // int32 -> int8 (exact: |q| <= 127), back in order across the 128-bit lanes the packs work in
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  dx = amax / 127.0f;
  dxs = dx * float(total);
  low = -128 * total;
}

XQ quantize_rows(const float* x, int64_t M, int64_t K, bool reference) {
  const int64_t blocks = M * K / QK;
  XQ out{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks),
         std::vector<int32_t>(blocks), K};
  for (int64_t b = 0; b < blocks; ++b)
    (reference ? quantize_block_scalar : quantize_block_avx2)(x + b * QK, out.q.data() + b * QK, out.dx[b],
                                                              out.dxs[b], out.low[b]);
  return out;
}

struct Out {
  const float* b; const float* residual; float* y;
  int64_t N;
};

// lanes acc[0..15] are outputs n0..n0+15 of row m: + b, residual + that, where n < N
void finish(const Out& o, const float* acc, int64_t m, int64_t n0) {
  for (int64_t l = 0; l < G && n0 + l < o.N; ++l) {
    float s = acc[l];
    if (o.b) s = s + o.b[n0 + l];
    if (o.residual) s = o.residual[m * o.N + n0 + l] + s;
    o.y[m * o.N + n0 + l] = s;
  }
}

// one block's s for its float operands (scalar: the reference every ISA's lanes reproduce)
inline float block_term(int64_t kind, float dw, float mw, float dx, float dxs, int32_t i) {
  float s = (dw * dx) * float(i);
  if (kind == Q4_1) s = s + mw * dxs;
  return s;
}

struct Packed {
  const uint8_t* p; int64_t kind, K, row_bytes;  // row_bytes: a group's bytes
  const uint8_t* at(int64_t g, int64_t c) const { return p + g * row_bytes + c * group_block_bytes(kind); }
};

// the weight of row r (0..15) of a group at k (0..31) of a block starting at blk
inline int32_t weight_at(int64_t kind, const uint8_t* blk, int r, int k) {
  const uint8_t* q = blk + quant_offset(kind);
  if (kind == Q8_0) return int32_t(q[(k / 4) * 64 + 4 * r + k % 4]) - 128;
  const int j = k % 16;
  const uint8_t byte = q[(j / 4) * 64 + 4 * r + j % 4];
  return k < 16 ? byte & 0x0F : byte >> 4;
}

void group_scalar(const Packed& w, const XQ& x, const Out& o, int64_t g, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    float acc[G] = {};
    for (int64_t c = 0; c < w.K / QK; ++c) {
      const uint8_t* blk = w.at(g, c);
      const int8_t* q = x.q.data() + m * w.K + c * QK;
      for (int r = 0; r < G; ++r) {
        int32_t i = 0;
        for (int k = 0; k < QK; ++k) i += weight_at(w.kind, blk, r, k) * int32_t(q[k]);
        const float mw = w.kind == Q4_1 ? half_to_float(blk + 2 * G + 2 * r) : 0.0f;
        acc[r] = acc[r] + block_term(w.kind, half_to_float(blk + 2 * r), mw, x.dx[m * w.K / QK + c],
                                     x.dxs[m * w.K / QK + c], i);
      }
    }
    finish(o, acc, m, g * G);
  }
}

// AVX2: each half of a group (8 rows, 32 bytes of each 64-byte vector) in turn; a block's integer
// sums by VPMADDUBSW (unsigned by signed byte pairs into int16, which saturates: the unsigned
// operand is at most 15 (Q4_1) or |w| <= 128 with x's sign moved onto it (Q8_0), so |pair| <=
// 2 * 128 * 127 < 32767) then VPMADDWD by ones into int32. Q4_1's pairs (|pair| <= 2 * 15 * 127)
// are summed over the block's 8 vectors in int16 first (|sum| <= 30480 < 32767: exact), so one
// VPMADDWD a block and row.
template <int64_t KIND, int MB>
void half_avx2(const Packed& w, const XQ& x, int64_t g, int h, int64_t m0, float* acc_out) {
  const int64_t K = w.K;
  const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(-128);
  __m256 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / QK; ++c) {
    const uint8_t* blk = w.at(g, c);
    const uint8_t* quants = blk + quant_offset(KIND) + 32 * h;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
    __m256 mw = _mm256_setzero_ps();
    __m256i u[8], sgn[8];  // unsigned operands; Q8_0: the weights whose signs x takes
    if (KIND == Q4_1) {
      mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * G + 16 * h)));
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 64 * j));
        u[j] = _mm256_and_si256(v, nib);
        u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        sgn[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 64 * j)), top);
        u[j] = _mm256_abs_epi8(sgn[j]);
      }
    }
    for (int r = 0; r < MB; ++r) {
      const int64_t m = m0 + r;
      const int8_t* q = x.q.data() + m * K + c * QK;
      __m256i i32;
      if (KIND == Q4_1) {
        __m256i i16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int j = 0; j < 8; ++j)
          i16[j % 2] = _mm256_add_epi16(i16[j % 2], _mm256_maddubs_epi16(u[j], _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * j))));
        i32 = _mm256_madd_epi16(_mm256_add_epi16(i16[0], i16[1]), ones);
      } else {
        i32 = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i xv = _mm256_sign_epi8(_mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * j)), sgn[j]);
          i32 = _mm256_add_epi32(i32, _mm256_madd_epi16(_mm256_maddubs_epi16(u[j], xv), ones));
        }
      }
      __m256 s = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x.dx[m * K / QK + c])), _mm256_cvtepi32_ps(i32));
      if (KIND == Q4_1) s = _mm256_add_ps(s, _mm256_mul_ps(mw, _mm256_set1_ps(x.dxs[m * K / QK + c])));
      acc[r] = _mm256_add_ps(acc[r], s);
    }
  }
  for (int r = 0; r < MB; ++r) _mm256_storeu_ps(acc_out + r * G + 8 * h, acc[r]);
}

template <int64_t KIND, int MB>
void tile_avx2(const Packed& w, const XQ& x, const Out& o, int64_t g, int64_t m0) {
  float acc[MB * G];
  half_avx2<KIND, MB>(w, x, g, 0, m0, acc);
  half_avx2<KIND, MB>(w, x, g, 1, m0, acc);
  for (int r = 0; r < MB; ++r) finish(o, acc + r * G, m0 + r, g * G);
}

template <int64_t KIND>
void group_avx2(const Packed& w, const XQ& x, const Out& o, int64_t g, int64_t m0, int64_t m1) {
  constexpr int MB = 4;
  int64_t m = m0;
  for (; m + MB <= m1; m += MB) tile_avx2<KIND, MB>(w, x, o, g, m);
  for (; m < m1; ++m) tile_avx2<KIND, 1>(w, x, o, g, m);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
// lanes of acc are outputs n0..n0+15 of row m: + b, residual + that, where n < N (finish's
// operations, 16 at a time)
inline void finish_vnni(const Out& o, __m512 acc, int64_t m, int64_t n0) {
  const __mmask16 k = n0 + G <= o.N ? __mmask16(0xFFFF) : __mmask16((1u << (o.N - n0)) - 1);
  if (o.b) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(k, o.b + n0));
  if (o.residual) acc = _mm512_add_ps(_mm512_maskz_loadu_ps(k, o.residual + m * o.N + n0), acc);
  _mm512_mask_storeu_ps(o.y + m * o.N + n0, k, acc);
}

// AVX512-VNNI: a group's 16 rows in a register's lanes; a block's integer sums by VPDPBUSD
// (unsigned by signed bytes, 4 products into each int32 lane, no saturation): the weights
// unsigned (Q4_1's nibbles; Q8_0's w + 128, its sum started at -128 * S) by x's int8 signed.
// PREFETCH: the group's blocks a few ahead are asked of memory (the first of several passes over
// a group, whose arithmetic would otherwise wait on them; one pass alone streams fast enough)
constexpr int64_t AHEAD = 8 * 16 * 20;  // bytes: 8 blocks of a Q4_1 group
template <int64_t KIND, int MB, bool PREFETCH = false>
void tile_vnni(const Packed& w, const XQ& x, const Out& o, int64_t g, int64_t m0) {
  const int64_t K = w.K, C = K / QK;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int8_t* xq = x.q.data() + m0 * K;
  const float* dx = x.dx.data() + m0 * C;
  const float* dxs = x.dxs.data() + m0 * C;
  const int32_t* low = x.low.data() + m0 * C;
  __m512 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* blk = w.at(g, c);
    const uint8_t* quants = blk + quant_offset(KIND);
    if (PREFETCH)
      for (int64_t l = 0; l < group_block_bytes(KIND); l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + l) + AHEAD, _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 mw = _mm512_setzero_ps();
    __m512i v[8];
    if (KIND == Q4_1) {
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * G)));
      for (int j = 0; j < 4; ++j) {
        const __m512i p = _mm512_loadu_si512(quants + 64 * j);
        v[j] = _mm512_and_si512(p, nib);
        v[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
      }
    } else {
      for (int j = 0; j < 8; ++j) v[j] = _mm512_loadu_si512(quants + 64 * j);
    }
    // the rows' integer sums as independent chains (a few rows: two a row, j even and odd), so
    // that VPDPBUSD's latency overlaps
    constexpr int CH = MB < 4 ? 2 : 1;
    __m512i i32[MB][CH];
    for (int r = 0; r < MB; ++r) {
      i32[r][0] = KIND == Q8_0 ? _mm512_set1_epi32(low[r * C + c]) : _mm512_setzero_si512();
      if (CH == 2) i32[r][CH - 1] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
#pragma GCC unroll 16
      for (int r = 0; r < MB; ++r) {
        // 4 values of x to every lane, by a broadcast load (not through a general register)
        const __m512i four = _mm512_broadcastd_epi32(_mm_loadu_si32(xq + r * K + c * QK + 4 * j));
        __m512i& sum = i32[r][j % CH];
        sum = _mm512_dpbusd_epi32(sum, v[j], four);
      }
#pragma GCC unroll 16
    for (int r = 0; r < MB; ++r) {
      const __m512i total = CH == 2 ? _mm512_add_epi32(i32[r][0], i32[r][CH - 1]) : i32[r][0];
      __m512 s = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[r * C + c])), _mm512_cvtepi32_ps(total));
      if (KIND == Q4_1) s = _mm512_add_ps(s, _mm512_mul_ps(mw, _mm512_set1_ps(dxs[r * C + c])));
      acc[r] = _mm512_add_ps(acc[r], s);
    }
  }
  for (int r = 0; r < MB; ++r) finish_vnni(o, acc[r], m0 + r, g * G);
}
#pragma GCC pop_options

// rows of x 8 at a time, then the rest (a decode step's one row, a verify's few, a prefill's
// many): which rows share a pass changes no output's operations
template <int64_t KIND, bool PREFETCH>
void pass_vnni(const Packed& w, const XQ& x, const Out& o, int64_t g, int64_t m, int64_t rows) {
  switch (rows) {
    case 8: return tile_vnni<KIND, 8, PREFETCH>(w, x, o, g, m);
    case 7: return tile_vnni<KIND, 7, PREFETCH>(w, x, o, g, m);
    case 6: return tile_vnni<KIND, 6, PREFETCH>(w, x, o, g, m);
    case 5: return tile_vnni<KIND, 5, PREFETCH>(w, x, o, g, m);
    case 4: return tile_vnni<KIND, 4, PREFETCH>(w, x, o, g, m);
    case 3: return tile_vnni<KIND, 3, PREFETCH>(w, x, o, g, m);
    case 2: return tile_vnni<KIND, 2, PREFETCH>(w, x, o, g, m);
    case 1: return tile_vnni<KIND, 1, PREFETCH>(w, x, o, g, m);
    default: return;
  }
}

template <int64_t KIND>
void group_vnni(const Packed& w, const XQ& x, const Out& o, int64_t g, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m += 8) {
    const int64_t rows = std::min<int64_t>(8, m1 - m);
    if (m == m0 && rows < m1 - m) pass_vnni<KIND, true>(w, x, o, g, m, rows);
    else pass_vnni<KIND, false>(w, x, o, g, m, rows);
  }
}

enum Isa : int { SCALAR = 0, AVX2 = 1, VNNI = 2 };
const char* ISA_NAMES[] = {"scalar", "avx2", "vnni"};
bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}
Isa best_isa() { return cpu_has_vnni() ? VNNI : AVX2; }  // the build needs AVX2 (linear_kernel.py)
Isa isa = best_isa();

// GGUF rows of blocks (N rows of C blocks of kind) -> the grouped layout (dst zeroed, see the top)
void pack_groups(const uint8_t* src, uint8_t* dst, int64_t N, int64_t C, int64_t kind) {
  const int64_t bytes = file_block_bytes(kind), gbb = group_block_bytes(kind);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / G, r = n % G;
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* in = src + n * C * bytes + c * bytes;
      uint8_t* blk = dst + g * C * gbb + c * gbb;
      std::memcpy(blk + 2 * r, in, 2);  // dw
      if (kind == Q4_1) std::memcpy(blk + 2 * G + 2 * r, in + 2, 2);  // mw
      const uint8_t* q = in + (kind == Q4_1 ? 4 : 2);
      uint8_t* quants = blk + quant_offset(kind);
      for (int j = 0; j < (kind == Q4_1 ? 4 : 8); ++j) std::memcpy(quants + 64 * j + 4 * r, q + 4 * j, 4);
      if (kind == Q8_0)
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) quants[64 * j + 4 * r + i] ^= 0x80;
    }
  }
}

// groups [first, last) of w for rows [0, M) of x on one ISA
void run_groups(Isa run, const Packed& w, const XQ& x, const Out& o, int64_t first, int64_t last, int64_t M) {
  for (int64_t g = first; g < last; ++g) {
    if (run == VNNI && w.kind == Q4_1) group_vnni<Q4_1>(w, x, o, g, 0, M);
    else if (run == VNNI) group_vnni<Q8_0>(w, x, o, g, 0, M);
    else if (run == AVX2 && w.kind == Q4_1) group_avx2<Q4_1>(w, x, o, g, 0, M);
    else if (run == AVX2) group_avx2<Q8_0>(w, x, o, g, 0, M);
    else group_scalar(w, x, o, g, 0, M);
  }
}

}  // namespace

// The ISA int_linear runs: "best" (VNNI where the CPU has it, else AVX2), "vnni", "avx2" or
// "scalar" (the reference); returns the one now in use (a refused "vnni" leaves it unchanged).
// The bits are the same on each: tests compare them.
std::string use_int_isa(const std::string& name) {
  if (name == "best") isa = best_isa();
  else if (name == "vnni") { if (cpu_has_vnni()) isa = VNNI; }
  else if (name == "avx2") isa = AVX2;
  else if (name == "scalar") isa = SCALAR;
  else TORCH_CHECK(false, "use_int_isa: best, vnni, avx2 or scalar, not ", name);
  return ISA_NAMES[isa];
}

// GGUF rows of blocks (N, K/32 * 20 or 34) uint8 of kind -> int_linear's layout
// (ceil(N / 16), K/32 * 16 * block bytes) uint8 (see the top of this file)
torch::Tensor int_pack(torch::Tensor blocks, int64_t kind) {
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0, "int_pack: kind 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.device().is_cpu() &&
              blocks.size(1) % file_block_bytes(kind) == 0, "int_pack: blocks (N, K/32 * block bytes) uint8 on the CPU");
  blocks = blocks.contiguous();
  const int64_t N = blocks.size(0), C = blocks.size(1) / file_block_bytes(kind), groups = (N + G - 1) / G;
  auto out = torch::zeros({groups, C * group_block_bytes(kind)}, blocks.options());
  pack_groups(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), N, C, kind);
  return out;
}

// x (M, K) float32, packed = int_pack(blocks of N rows, kind), b (N,) or None, residual (M, N) or
// None -> (M, N) float32 (see the top of this file)
torch::Tensor int_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t N,
                         c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0, "int_linear: kind 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && packed.dim() == 2 &&
              packed.scalar_type() == torch::kUInt8 && packed.device().is_cpu(),
              "int_linear: x (M, K) float32, packed (N/16, bytes) uint8, on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0 && packed.size(0) == (N + G - 1) / G && packed.size(1) == K / QK * group_block_bytes(kind),
              "int_linear: packed blocks of ", QK, " weights along K = ", K, " for N = ", N, " rows");
  x = x.contiguous();
  packed = packed.contiguous();
  torch::Tensor bias = b.has_value() ? b->contiguous() : torch::Tensor();
  torch::Tensor res = residual.has_value() ? residual->contiguous() : torch::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "int_linear: b (N,)");
  TORCH_CHECK(!res.defined() || (res.dim() == 2 && res.size(0) == M && res.size(1) == N &&
                                 res.scalar_type() == torch::kFloat), "int_linear: residual (M, N)");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const Isa run = isa;
  const XQ xq = quantize_rows(x.data_ptr<float>(), M, K, run == SCALAR);
  const Packed w{packed.data_ptr<uint8_t>(), kind, K, packed.size(1)};
  const Out o{bias.defined() ? bias.data_ptr<float>() : nullptr, res.defined() ? res.data_ptr<float>() : nullptr,
              y.data_ptr<float>(), N};
  shared_for(packed.size(0), [&](int64_t first, int64_t last) { run_groups(run, w, xq, o, first, last, M); });
  return y;
}
