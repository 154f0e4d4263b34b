// Weight-only linear over group-quantized weights, dequantized in registers (CPU).
//
// y [M, n] = x [M, K] @ W.T, where W [n, K] is never materialised: weight (row r, column k) is
// q * scale + min of its group of `group` consecutive k. The weights are stored in panels of 16
// output rows, k-major inside a panel (layout and reference: ridgefill_runtime/ops/packed_linear.py):
//
//   data   bits 4: uint8 [P, K / 2, 16]  byte j of pair t holds row 16p + j at k = 2t (low nibble)
//                                        and k = 2t + 1 (high nibble), values 0..15
//          bits 8: int8  [P, K, 16]      (values -128..127)
//   scale  float16 or float32 [P, K / group, 16];  min: same, or empty (no offset)
//
// so one 16-byte load gives 16 output rows' weights at two k (4 bits) or one k (8 bits), one
// widening of the bytes serves both nibbles, and a tile of up to 16 input
// rows (AVX-512; 4-6 on AVX2, whose 8 rows and more read a chunk dequantized once: staged_panel_avx2)
// reuses each dequantized weight vector. In tiles of five rows and more (three and more on AVX2), the
// dequantized weight is computed exactly as the dequantized path computes it (q * scale rounded, then
// + min rounded; see kMinExact), so the two paths use the same weight values and differ only in
// summation order; smaller tiles (decode's small batches) scale each group's sum of q * x instead (see
// kRaw): the same error bound. Many-row calls (prefill chunks) take packed_dequantize_t and a float32
// BLAS GEMM instead (ops/packed_linear.py).
// Instruction set chosen at run time: AVX-512F, AVX2+FMA+F16C, or portable C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 16;

// The kernels' MIN parameter: how a weight's offset is added. The weight must come out as the
// dequantized path computes it, q * scale rounded, then + min rounded. With float16 scales the product
// is exact (at most 8 + 11 significant bits), so one FMA gives that same value in one instruction
// (the separate multiply and add cost ~20 % of the batch-1 weight sweep, benchmarks/packed_sweep.py);
// with float32 scales the product is rounded first.
constexpr int kNoMin = 0, kMinExact = 1, kMinRounded = 2;
// Not a weight format: the integers as floats, unscaled. The one- and two-row (AVX2) and one- to
// four-row (AVX-512) tiles sum q * x over a group and scale the sum once: y += scale * sum(q x) + min * sum(x).
// That is one multiply (or FMA) a k fewer; at batch 1 dequantizing is half of the vector work and the
// kernel was compute-bound even on weights in cache (benchmarks/packed_group_sum.txt). The products are
// then rounded as q * x, not as (q * scale + min) * x: the same error bound, not the same bits as the
// dequantized path (the tests compare both to float64).
constexpr int kRaw = 3;

struct Packed {
  const uint8_t* data;  // panel p starts at data + p * panel_bytes()
  const void* scale;
  const void* min;  // nullptr: no offset
  bool half_scale;
  int bits, group;
  int64_t K, n, panels;
  int64_t panel_bytes() const { return K * (bits == 4 ? 8 : 16); }
};

// Decode reads every weight once per step from DRAM, in runs of one panel (a few KB): the
// hardware prefetchers stop at each 4 KB page and ramp up again, so without this the kernel
// waited on memory at ~6 GB/s of the ~27 GB/s two cores can read (benchmarks/decode.md).
// Called at the start of each group: fetch that group's bytes kPrefetch ahead, and its scales.
// (always_inline: without it GCC 12 dropped every prefetch from the target("avx512f") callers.)
constexpr int64_t kPrefetch = 2048;

__attribute__((always_inline)) inline void prefetch_group(const Packed& w, const uint8_t* group_data, int64_t at) {
#if defined(__x86_64__)
  const int64_t bytes = w.group * (w.bits == 4 ? 8 : 16);
  const char* p = reinterpret_cast<const char*>(group_data) + kPrefetch;
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
  const int64_t scale_at = at * (w.half_scale ? 2 : 4) + kPrefetch / 8;
  _mm_prefetch(static_cast<const char*>(w.scale) + scale_at, _MM_HINT_T0);
  if (w.min) _mm_prefetch(static_cast<const char*>(w.min) + scale_at, _MM_HINT_T0);
#else
  (void)w, (void)group_data, (void)at;
#endif
}

// -- portable ----------------------------------------------------------------------------------

inline float scale_at(const void* p, bool half, int64_t i) {
  return half ? float(static_cast<const c10::Half*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline float q_at(const Packed& w, int64_t panel, int64_t k, int j) {
  const uint8_t* p = w.data + panel * w.panel_bytes();
  if (w.bits == 8) return float(static_cast<int8_t>(p[k * 16 + j]));
  return float((p[(k / 2) * 16 + j] >> (4 * (k & 1))) & 15);
}

// Row 16 * panel + j's weight at k: q * scale, then + min (no FMA in the baseline ISA).
inline float weight_at(const Packed& w, int64_t panel, int64_t k, int j) {
  const int64_t at = (panel * (w.K / w.group) + k / w.group) * kPanel + j;
  float v = q_at(w, panel, k, j) * scale_at(w.scale, w.half_scale, at);
  if (w.min) v += scale_at(w.min, w.half_scale, at);
  return v;
}

void panel_portable(const Packed& w, const float* x, const float*, const float*, int64_t M, int64_t panel, float* y) {
  float acc[kPanel];
  for (int64_t m = 0; m < M; ++m) {
    std::fill(acc, acc + kPanel, 0.f);
    for (int64_t k = 0; k < w.K; ++k) {
      const float xk = x[m * w.K + k];
      for (int j = 0; j < kPanel; ++j) acc[j] += weight_at(w, panel, k, j) * xk;
    }
    std::memcpy(y + m * kPanel, acc, sizeof acc);
  }
}

#if defined(__x86_64__)
// -- AVX2 + FMA + F16C: a panel is two 8-lane halves -------------------------------------------

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const void* p, bool half, int64_t i) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(p) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

// N rows' accumulators (16 lanes each: lo, hi) as nested named members. NOTE: GCC 12 wrote an array of
// vector accumulators back to the stack every k (12 stores a k at 6 rows, also fully unrolled); named
// members it keeps in registers.
template <int N>
struct RowsAvx2 {
  __m256 lo, hi;
  RowsAvx2<N - 1> rest;
};
template <>
struct RowsAvx2<0> {};

template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void zero_rows(RowsAvx2<N>& a) {
  if constexpr (N > 0) {
    a.lo = a.hi = _mm256_setzero_ps();
    zero_rows<N - 1>(a.rest);
  }
}

template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void load_rows(RowsAvx2<N>& a, const float* y) {
  if constexpr (N > 0) {
    a.lo = _mm256_loadu_ps(y), a.hi = _mm256_loadu_ps(y + 8);
    load_rows<N - 1>(a.rest, y + kPanel);
  }
}

template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void store_rows(const RowsAvx2<N>& a, float* y) {
  if constexpr (N > 0) {
    _mm256_storeu_ps(y, a.lo), _mm256_storeu_ps(y + 8, a.hi);
    store_rows<N - 1>(a.rest, y + kPanel);
  }
}

// One k's 16 weights (w0: rows 0-7 of the panel, w1: 8-15) times N rows of x (x: the first row's x at
// that k; rows K apart).
template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void fma_rows(RowsAvx2<N>& a, __m256 w0, __m256 w1,
                                                                             const float* x, int64_t K) {
  if constexpr (N > 0) {
    const __m256 xb = _mm256_broadcast_ss(x);
    a.lo = _mm256_fmadd_ps(w0, xb, a.lo), a.hi = _mm256_fmadd_ps(w1, xb, a.hi);
    fma_rows<N - 1>(a.rest, w0, w1, x + K, K);
  }
}

template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void add_rows(RowsAvx2<N>& a, const RowsAvx2<N>& b) {
  if constexpr (N > 0) {
    a.lo = _mm256_add_ps(a.lo, b.lo), a.hi = _mm256_add_ps(a.hi, b.hi);
    add_rows<N - 1>(a.rest, b.rest);
  }
}

// a += b * scale (rows 0-7 of the panel: s0, 8-15: s1)
template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void scale_add_rows(RowsAvx2<N>& a, const RowsAvx2<N>& b,
                                                                                   __m256 s0, __m256 s1) {
  if constexpr (N > 0) {
    a.lo = _mm256_fmadd_ps(b.lo, s0, a.lo), a.hi = _mm256_fmadd_ps(b.hi, s1, a.hi);
    scale_add_rows<N - 1>(a.rest, b.rest, s0, s1);
  }
}

// a += min * sum: row r's sum at sums[r * stride]
template <int N>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void min_add_rows(RowsAvx2<N>& a, __m256 z0, __m256 z1,
                                                                                 const float* sums, int64_t stride) {
  if constexpr (N > 0) {
    const __m256 sum = _mm256_set1_ps(*sums);
    a.lo = _mm256_fmadd_ps(z0, sum, a.lo), a.hi = _mm256_fmadd_ps(z1, sum, a.hi);
    min_add_rows<N - 1>(a.rest, z0, z1, sums + stride, stride);
  }
}

template <int MIN>
__attribute__((target("avx2,fma,f16c"))) inline __m256 dequant8(__m256i q, __m256 s, __m256 z) {
  const __m256 qf = _mm256_cvtepi32_ps(q);
  if (MIN == kRaw) return qf;
  if (MIN == kMinExact) return _mm256_fmadd_ps(qf, s, z);
  __m256 w = _mm256_mul_ps(qf, s);
  if (MIN == kNoMin) return w;
  __asm__("" : "+x"(w));  // an empty asm the product passes through: GCC cannot contract it into an FMA
  return _mm256_add_ps(w, z);
}

// One k's 16 8-bit weights of a panel, dequantized: rows 0-7 in w0, 8-15 in w1.
template <int MIN>
__attribute__((target("avx2,fma,f16c"))) inline void q8_avx2(const uint8_t* panel, int64_t k, __m256 s0, __m256 s1,
                                                             __m256 z0, __m256 z1, __m256& w0, __m256& w1) {
  // two 8-byte loads widened straight from memory: one shuffle-port op each (a 16-byte load, then a byte
  // shift for the upper half, took three, on the port the widenings need)
  const uint8_t* b = panel + k * 16;
  w0 = dequant8<MIN>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))), s0, z0);
  w1 = dequant8<MIN>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8))), s1, z1);
}

template <int BITS, int MIN, int MR>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Packed& w, const float* x, const float* xs, int64_t panel,
                                                        float* y) {
  // With one or two rows, one accumulator set is a chain of dependent FMAs, k after k: even and odd k go to
  // two sets there, as in tile_avx512 (four rows already give eight independent chains). Measured under the
  // AVX2 cap on an AVX-512 Xeon, this alone changed little; q8_avx2's two 8-byte loads gave 8-10 % at batch 1.
  constexpr bool kSplit = MR <= 2;
  constexpr bool kGroupSum = MR <= 4;  // see kRaw
  constexpr bool kGroupSplit = MR == 1;  // two rows already give four chains (and 16 registers hold no more)
  constexpr int DQ = kGroupSum ? kRaw : MIN;
  RowsAvx2<MR> total, odd;  // odd: k + 1's chains where kSplit, else unused
  zero_rows<MR>(total);
  if (kSplit && !kGroupSum) zero_rows<MR>(odd);
  const int64_t groups = w.K / w.group;
  const uint8_t* base = w.data + panel * w.panel_bytes();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (panel * groups + g) * kPanel, k0 = g * w.group, k1 = k0 + w.group;
    prefetch_group(w, base + k0 * (BITS == 4 ? 8 : 16), at);
    const __m256 s0 = load8(w.scale, w.half_scale, at), s1 = load8(w.scale, w.half_scale, at + 8);
    __m256 z0 = _mm256_setzero_ps(), z1 = z0;
    if (MIN) z0 = load8(w.min, w.half_scale, at), z1 = load8(w.min, w.half_scale, at + 8);
    RowsAvx2<MR> group_even, group_odd;  // kGroupSum: this group's unscaled sums (even, odd k)
    if constexpr (kGroupSum) zero_rows<MR>(group_even);
    if constexpr (kGroupSplit) zero_rows<MR>(group_odd);
    RowsAvx2<MR>& even = kGroupSum ? group_even : total;
    RowsAvx2<MR>& second = kGroupSum ? (kGroupSplit ? group_odd : group_even) : kSplit ? odd : total;
    if (BITS == 4) {
      for (int64_t k = k0; k < k1; k += 2) {  // a pair of k per 16 bytes
        const uint8_t* b = base + (k / 2) * 16;
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
        fma_rows<MR>(even, dequant8<DQ>(_mm256_and_si256(b0, low4), s0, z0),
                     dequant8<DQ>(_mm256_and_si256(b1, low4), s1, z1), x + k, w.K);
        fma_rows<MR>(second, dequant8<DQ>(_mm256_srli_epi32(b0, 4), s0, z0),
                     dequant8<DQ>(_mm256_srli_epi32(b1, 4), s1, z1), x + k + 1, w.K);
      }
    } else {
      int64_t k = k0;
      __m256 w0, w1;
      for (; k + 2 <= k1; k += 2) {
        q8_avx2<DQ>(base, k, s0, s1, z0, z1, w0, w1);
        fma_rows<MR>(even, w0, w1, x + k, w.K);
        q8_avx2<DQ>(base, k + 1, s0, s1, z0, z1, w0, w1);
        fma_rows<MR>(second, w0, w1, x + k + 1, w.K);
      }
      if (k < k1) {  // an odd group's last k
        q8_avx2<DQ>(base, k, s0, s1, z0, z1, w0, w1);
        fma_rows<MR>(even, w0, w1, x + k, w.K);
      }
    }
    if constexpr (kGroupSum) {
      if constexpr (kGroupSplit) add_rows<MR>(group_even, group_odd);
      scale_add_rows<MR>(total, group_even, s0, s1);
      if constexpr (MIN != kNoMin) min_add_rows<MR>(total, z0, z1, xs + g, groups);  // + min * sum(x) over the group
    }
  }
  if (kSplit && !kGroupSum) add_rows<MR>(total, odd);
  store_rows<MR>(total, y);
}

// -- AVX2, many rows: dequantize a panel's chunk of k once, then every row tile reads it from L1 ----------
// tile_avx2 dequantizes each weight again for every tile of 4-6 rows: at 16 rows (three tiles) the
// dequantizing took 18 vector ops against 32 FMAs a k. Here a chunk of kStageK k of the panel is
// dequantized once into a float32 buffer (16 KB: L1) by the same arithmetic (the same values), and each
// tile then loads its two vectors a k from there (load ports, not the FMA ports). The accumulators go to
// y between chunks, unrounded, and each row still sums k in order: the results are bitwise those of
// tile_avx2 for tiles of 3 rows and more.
constexpr int64_t kStageK = 256;
constexpr int64_t kStageMinRows = 8;  // below: tile_avx2 (the buffer's stores and loads would not pay)

// Weights of k in [k0, k1) (whole groups) of one panel, dequantized into buf [(k1 - k0), 16].
template <int BITS, int MIN>
__attribute__((target("avx2,fma,f16c"))) void stage_avx2(const Packed& w, int64_t panel, int64_t k0, int64_t k1,
                                                         float* buf) {
  const int64_t groups = w.K / w.group;
  const uint8_t* base = w.data + panel * w.panel_bytes();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t g = k0 / w.group; g < k1 / w.group; ++g) {
    const int64_t at = (panel * groups + g) * kPanel, g0 = g * w.group, g1 = g0 + w.group;
    prefetch_group(w, base + g0 * (BITS == 4 ? 8 : 16), at);
    const __m256 s0 = load8(w.scale, w.half_scale, at), s1 = load8(w.scale, w.half_scale, at + 8);
    __m256 z0 = _mm256_setzero_ps(), z1 = z0;
    if (MIN) z0 = load8(w.min, w.half_scale, at), z1 = load8(w.min, w.half_scale, at + 8);
    for (int64_t k = g0; k < g1; ++k) {
      float* out = buf + (k - k0) * kPanel;
      __m256 w0, w1;
      if (BITS == 4) {
        const uint8_t* b = base + (k / 2) * 16;
        __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
        __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
        if (k & 1) b0 = _mm256_srli_epi32(b0, 4), b1 = _mm256_srli_epi32(b1, 4);  // odd k: high nibbles
        w0 = dequant8<MIN>(_mm256_and_si256(b0, low4), s0, z0);
        w1 = dequant8<MIN>(_mm256_and_si256(b1, low4), s1, z1);
      } else {
        q8_avx2<MIN>(base, k, s0, s1, z0, z1, w0, w1);
      }
      _mm256_store_ps(out, w0);
      _mm256_store_ps(out + 8, w1);
    }
  }
}

// MR rows of x times the staged weights of k in [k0, k0 + kn), added to (or, first, written as) y [MR, 16].
template <int MR>
__attribute__((target("avx2,fma,f16c"))) void staged_rows_avx2(const float* buf, int64_t kn, const float* x,
                                                               int64_t K, int64_t k0, bool first, float* y) {
  if (first) std::memset(y, 0, MR * kPanel * sizeof(float));
  RowsAvx2<MR> acc;
  load_rows<MR>(acc, y);
  for (int64_t k = 0; k < kn; ++k)
    fma_rows<MR>(acc, _mm256_load_ps(buf + k * kPanel), _mm256_load_ps(buf + k * kPanel + 8), x + k0 + k, K);
  store_rows<MR>(acc, y);
}

// Tiles of 6 rows, the last one to three tiles of 3-5 (sizes of 3 and more keep tile_avx2's sums): 16 rows
// are 6 + 6 + 4, 20 are 6 + 6 + 4 + 4.
template <int BITS, int MIN>
void staged_panel_avx2(const Packed& w, const float* x, int64_t M, int64_t panel, float* y) {
  alignas(32) float buf[kStageK * kPanel];
  const int64_t chunk = kStageK / w.group * w.group;  // whole groups (w.group <= kStageK: panel_avx2)
  int64_t sixes = M / 6, rest = M % 6;
  if (rest == 1 || rest == 2) sixes -= 1, rest += 6;  // 7 = 4 + 3, 8 = 4 + 4
  for (int64_t k0 = 0; k0 < w.K; k0 += chunk) {
    const int64_t kn = std::min(chunk, w.K - k0);
    const bool first = k0 == 0;
    stage_avx2<BITS, MIN>(w, panel, k0, k0 + kn, buf);
    int64_t m = 0;
    for (int64_t t = 0; t < sixes; ++t, m += 6) staged_rows_avx2<6>(buf, kn, x + m * w.K, w.K, k0, first, y + m * kPanel);
    int64_t left = rest;
    if (left >= 7) staged_rows_avx2<4>(buf, kn, x + m * w.K, w.K, k0, first, y + m * kPanel), m += 4, left -= 4;
    switch (left) {
      case 5: staged_rows_avx2<5>(buf, kn, x + m * w.K, w.K, k0, first, y + m * kPanel); break;
      case 4: staged_rows_avx2<4>(buf, kn, x + m * w.K, w.K, k0, first, y + m * kPanel); break;
      case 3: staged_rows_avx2<3>(buf, kn, x + m * w.K, w.K, k0, first, y + m * kPanel); break;
      default: break;
    }
  }
}

template <int BITS, int MIN>
void panel_avx2(const Packed& w, const float* x, const float*, const float* xs, int64_t M, int64_t panel, float* y) {
  if (M >= kStageMinRows && w.group <= kStageK)
    return staged_panel_avx2<BITS, MIN>(w, x, M, panel, y);
  const int64_t groups = w.K / w.group;
  int64_t m = 0;
  // 8-bit weights: 6-row tiles (12 accumulators; the group's scales then live on the stack and come in as
  // memory operands): each weight vector serves 6 rows, and AVX2's one broadcast per 8-lane FMA, not the
  // FMA ports, is the limit there. 4-bit weights keep 4 rows (their two widened k need the registers).
  if constexpr (BITS == 8)
    for (; m + 6 <= M; m += 6) tile_avx2<BITS, MIN, 6>(w, x + m * w.K, xs + m * groups, panel, y + m * kPanel);
  for (; m + 4 <= M; m += 4) tile_avx2<BITS, MIN, 4>(w, x + m * w.K, xs + m * groups, panel, y + m * kPanel);
  switch (M - m) {
    case 3: tile_avx2<BITS, MIN, 3>(w, x + m * w.K, xs + m * groups, panel, y + m * kPanel); break;
    case 2: tile_avx2<BITS, MIN, 2>(w, x + m * w.K, xs + m * groups, panel, y + m * kPanel); break;
    case 1: tile_avx2<BITS, MIN, 1>(w, x + m * w.K, xs + m * groups, panel, y + m * kPanel); break;
    default: break;
  }
}

// -- AVX-512F: a panel is one 16-lane vector ---------------------------------------------------

__attribute__((target("avx512f"))) inline __m512 load16(const void* p, bool half, int64_t i) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const c10::Half*>(p) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

template <int MIN>
__attribute__((target("avx512f"))) inline __m512 dequant16(__m512i q, __m512 s, __m512 z) {
  const __m512 qf = _mm512_cvtepi32_ps(q);
  if (MIN == kRaw) return qf;
  if (MIN == kMinExact) return _mm512_fmadd_ps(qf, s, z);
  __m512 w = _mm512_mul_ps(qf, s);
  if (MIN == kNoMin) return w;
  __asm__("" : "+v"(w));  // as in dequant8
  return _mm512_add_ps(w, z);
}

// Weights at k (into the even-k accumulators) and k + 1 (odd) times MR rows of x.
template <int MR>
__attribute__((target("avx512f"))) inline void fma2(__m512 (&acc)[MR][2], __m512 w0, __m512 w1, const float* x,
                                                    int64_t K, int64_t k) {
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * K + k]), acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * K + k + 1]), acc[r][1]);
  }
}

template <int MIN>
__attribute__((target("avx512f"))) inline __m512 q8_at(const uint8_t* panel, int64_t k, __m512 s, __m512 z) {
  return dequant16<MIN>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * 16))), s, z);
}

template <int BITS, int MIN, int MR>
__attribute__((target("avx512f"))) void tile_avx512(const Packed& w, const float* x, const float* xs, int64_t panel,
                                                    float* y) {
  // Two accumulators a row, for even and odd k: with one or two rows a single chain of dependent
  // FMAs would wait on the FMA latency instead of the loads (-30 % at batch 1).
  constexpr bool kGroupSum = MR <= 4;  // see kRaw
  constexpr int DQ = kGroupSum ? kRaw : MIN;
  __m512 total[MR][2];
  for (int r = 0; r < MR; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  const int64_t groups = w.K / w.group;
  const uint8_t* base = w.data + panel * w.panel_bytes();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (panel * groups + g) * kPanel, k0 = g * w.group, k1 = k0 + w.group;
    prefetch_group(w, base + k0 * (BITS == 4 ? 8 : 16), at);
    const __m512 s = load16(w.scale, w.half_scale, at);
    const __m512 z = MIN ? load16(w.min, w.half_scale, at) : _mm512_setzero_ps();
    __m512 group[MR][2];  // kGroupSum: this group's unscaled sums (even, odd k)
    if constexpr (kGroupSum)
      for (int r = 0; r < MR; ++r) group[r][0] = group[r][1] = _mm512_setzero_ps();
    __m512(&acc)[MR][2] = kGroupSum ? group : total;
    if (BITS == 4) {
      for (int64_t k = k0; k < k1; k += 2) {  // a pair of k per 16 bytes
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (k / 2) * 16)));
        fma2<MR>(acc, dequant16<DQ>(_mm512_and_si512(b, _mm512_set1_epi32(15)), s, z),
                 dequant16<DQ>(_mm512_srli_epi32(b, 4), s, z), x, w.K, k);
      }
    } else {
      int64_t k = k0;
      for (; k + 2 <= k1; k += 2) fma2<MR>(acc, q8_at<DQ>(base, k, s, z), q8_at<DQ>(base, k + 1, s, z), x, w.K, k);
      if (k < k1) {  // an odd group's last k
        const __m512 wv = q8_at<DQ>(base, k, s, z);
        for (int r = 0; r < MR; ++r) acc[r][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * w.K + k]), acc[r][0]);
      }
    }
    if constexpr (kGroupSum)
      for (int r = 0; r < MR; ++r) {
        total[r][0] = _mm512_fmadd_ps(_mm512_add_ps(group[r][0], group[r][1]), s, total[r][0]);
        if constexpr (MIN != kNoMin)  // + min * sum(x) over the group
          total[r][1] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[r * groups + g]), total[r][1]);
      }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * kPanel, _mm512_add_ps(total[r][0], total[r][1]));
}

// Sixteen rows of x against one panel: one accumulator a row (sixteen independent FMA chains hide the
// latency that tile_avx512's even/odd pairs hide for few rows), so each dequantized weight vector
// serves 16 FMAs instead of 8. Dequantizing costs three vector ops a k (widen, convert, scale) on
// the two ports the FMAs use: 16 / 19 of their slots do useful work here against 8 / 11 in an
// 8-row tile, the batched-decode case (benchmarks/packed_sweep.py). x is read k-major (xt [K, 16],
// packed_linear_cpu transposes it once a call), so one k's 16 broadcasts come from one cache line.
// The weights at one k times that k's 16 x values (xk: 16 contiguous floats).
__attribute__((target("avx512f"))) inline void fma16(__m512 (&acc)[16], __m512 wv, const float* xk) {
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(xk[r]), acc[r]);
}

template <int BITS, int MIN>
__attribute__((target("avx512f"))) void tile16_avx512(const Packed& w, const float* xt, int64_t panel, float* y) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t groups = w.K / w.group;
  const uint8_t* base = w.data + panel * w.panel_bytes();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (panel * groups + g) * kPanel, k0 = g * w.group, k1 = k0 + w.group;
    prefetch_group(w, base + k0 * (BITS == 4 ? 8 : 16), at);
    const __m512 s = load16(w.scale, w.half_scale, at);
    const __m512 z = MIN ? load16(w.min, w.half_scale, at) : _mm512_setzero_ps();
    if (BITS == 4) {
      for (int64_t k = k0; k < k1; k += 2) {  // a pair of k per 16 bytes
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (k / 2) * 16)));
        fma16(acc, dequant16<MIN>(_mm512_and_si512(b, _mm512_set1_epi32(15)), s, z), xt + k * 16);
        fma16(acc, dequant16<MIN>(_mm512_srli_epi32(b, 4), s, z), xt + (k + 1) * 16);
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) fma16(acc, q8_at<MIN>(base, k, s, z), xt + k * 16);
    }
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + r * kPanel, acc[r]);
}

// -- AVX512-BF16: sixteen rows with bfloat16 products (gemm_dtype = bfloat16) ----------------------
// vdpbf16ps multiplies pairs of bfloat16 and adds both products into a float32 lane: one instruction
// does the work of two FMAs. A 32-bit weight lane j holds row j's weights at k and k + 1 (k in the low
// half), each rounded to nearest even from the float32 value the other kernels use; x comes as the same
// pairs (xp [K / 2, 16] 32-bit words: row r's x at k and k + 1), so one k pair's 16 broadcasts are one
// cache line. Sums stay float32.
//
// The weights are dequantized straight into that pair order: the bytes of rows 0-7 at k and k + 1 are
// interleaved before widening (one 128-bit unpack; the nibbles of a 4-bit byte already are row j's k
// and k + 1), so the float32 vector `lo` holds (row 0 k, row 0 k + 1, row 1 k, ..., row 7 k + 1) and
// `hi` the same for rows 8-15, with the scales repeated to match (once a group). vcvtne2ps2bf16 then
// lays lo's 16 values in bfloat16 elements 0-15 and hi's in 16-31: element 2j, 2j + 1 is row j at
// k, k + 1, the lane order vdpbf16ps wants, with no permute per pair (an earlier version dequantized in
// row order and permuted each pair, one more 512-bit op of ~9 against 16 dot products). Same values
// and the same sums in the same order as before.
template <int BITS>
__attribute__((target("avx512f,avx512bw"))) inline void pair_bytes(const uint8_t* base, int64_t k, __m128i& lo,
                                                                    __m128i& hi) {
  __m128i a, b;  // per row j (byte j): the value at k, at k + 1
  if (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (k / 2) * 16));
    a = _mm_and_si128(v, _mm_set1_epi8(15));
    b = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
  } else {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + k * 16));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (k + 1) * 16));
  }
  lo = _mm_unpacklo_epi8(a, b);  // rows 0-7: (k, k + 1) byte pairs
  hi = _mm_unpackhi_epi8(a, b);  // rows 8-15
}

template <int BITS>
__attribute__((target("avx512f,avx512bw"))) inline __m512i widen_bytes(__m128i v) {
  return BITS == 4 ? _mm512_cvtepu8_epi32(v) : _mm512_cvtepi8_epi32(v);  // 4 bits: 0..15; 8 bits: signed
}

template <int BITS, int MIN>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile16_bf16(const Packed& w, const uint32_t* xp,
                                                                          int64_t panel, float* y) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  // lane i of the pair-ordered vectors belongs to row i / 2 (lo) or 8 + i / 2 (hi)
  const __m512i rows_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i rows_hi = _mm512_add_epi32(rows_lo, _mm512_set1_epi32(8));
  const int64_t groups = w.K / w.group;
  const uint8_t* base = w.data + panel * w.panel_bytes();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (panel * groups + g) * kPanel, k0 = g * w.group, k1 = k0 + w.group;
    prefetch_group(w, base + k0 * (BITS == 4 ? 8 : 16), at);
    const __m512 s = load16(w.scale, w.half_scale, at);
    const __m512 z = MIN ? load16(w.min, w.half_scale, at) : _mm512_setzero_ps();
    const __m512 s_lo = _mm512_permutexvar_ps(rows_lo, s), s_hi = _mm512_permutexvar_ps(rows_hi, s);
    const __m512 z_lo = _mm512_permutexvar_ps(rows_lo, z), z_hi = _mm512_permutexvar_ps(rows_hi, z);
    for (int64_t k = k0; k < k1; k += 2) {  // groups hold an even number of k (packed_linear_bf16_cpu)
      __m128i lo, hi;
      pair_bytes<BITS>(base, k, lo, hi);
      // _mm512_cvtne2ps_pbh(a, b): bfloat16 elements 0-15 from b, 16-31 from a
      const __m512bh wv = _mm512_cvtne2ps_pbh(dequant16<MIN>(widen_bytes<BITS>(hi), s_hi, z_hi),
                                              dequant16<MIN>(widen_bytes<BITS>(lo), s_lo, z_lo));
      const uint32_t* xk = xp + (k / 2) * 16;
      for (int r = 0; r < 16; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(xk[r]))));
    }
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + r * kPanel, acc[r]);
}

template <int BITS, int MIN, int MR>
void rest_avx512(const Packed& w, const float* x, const float* xs, int64_t rows, int64_t panel, float* y) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile_avx512<BITS, MIN, MR>(w, x, xs, panel, y);
    return rest_avx512<BITS, MIN, MR - 1>(w, x, xs, rows, panel, y);
  }
}

template <int BITS, int MIN>
void panel_avx512(const Packed& w, const float* x, const float* xt, const float* xs, int64_t M, int64_t panel,
                  float* y) {
  const int64_t groups = w.K / w.group;
  int64_t m = 0;
  for (; m + 16 <= M; m += 16) tile16_avx512<BITS, MIN>(w, xt + m * w.K, panel, y + m * kPanel);
  for (; m + 8 <= M; m += 8) tile_avx512<BITS, MIN, 8>(w, x + m * w.K, xs + m * groups, panel, y + m * kPanel);
  rest_avx512<BITS, MIN, 7>(w, x + m * w.K, xs + m * groups, M - m, panel, y + m * kPanel);
}

// -- dispatch ----------------------------------------------------------------------------------

// (w, x [M, K], x k-major in 16-row blocks, x summed over each group [M, K / group] (w has a min), M, panel, y)
using PanelFn = void (*)(const Packed&, const float*, const float*, const float*, int64_t, int64_t, float*);

template <template <int, int> class Pick>
PanelFn by_format(int bits, int min) {
  if (bits == 4) return min == kNoMin ? Pick<4, kNoMin>::fn : min == kMinExact ? Pick<4, kMinExact>::fn : Pick<4, kMinRounded>::fn;
  return min == kNoMin ? Pick<8, kNoMin>::fn : min == kMinExact ? Pick<8, kMinExact>::fn : Pick<8, kMinRounded>::fn;
}
template <int B, int Z> struct Avx512 { static constexpr PanelFn fn = panel_avx512<B, Z>; };
template <int B, int Z> struct Avx2 { static constexpr PanelFn fn = panel_avx2<B, Z>; };

int min_kind(const Packed& w) { return !w.min ? kNoMin : w.half_scale ? kMinExact : kMinRounded; }

// Test knob: RIDGEFILL_PACKED_ISA=avx2 or =portable caps the instruction set (read once), so that the
// tests run every variant on an AVX-512 machine. 2: AVX-512, 1: AVX2, 0: portable.
int isa_cap() {
  const char* env = std::getenv("RIDGEFILL_PACKED_ISA");
  if (env == nullptr) return 2;
  if (std::strcmp(env, "avx2") == 0) return 1;
  if (std::strcmp(env, "portable") == 0) return 0;
  return 2;
}

PanelFn panel_kernel(const Packed& w) {
  static const int cap = isa_cap();
  static const bool avx512 = cap >= 2 && __builtin_cpu_supports("avx512f");
  static const bool avx2 = cap >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  if (avx512) return by_format<Avx512>(w.bits, min_kind(w));
  if (avx2) return by_format<Avx2>(w.bits, min_kind(w));
  return panel_portable;
}

using Bf16Fn = void (*)(const Packed&, const uint32_t*, int64_t, float*);

// The bfloat16 16-row tile for w, or nullptr where the CPU lacks AVX512-BF16 (or the ISA is capped
// below AVX-512) or a group holds an odd number of k (a k pair would straddle two scales): the
// caller then runs the float32 tiles.
Bf16Fn bf16_kernel(const Packed& w) {
  static const bool bf16 = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
  if (!bf16 || w.group % 2 != 0) return nullptr;
  const int min = min_kind(w);
  if (w.bits == 4)
    return min == kNoMin ? tile16_bf16<4, kNoMin> : min == kMinExact ? tile16_bf16<4, kMinExact> : tile16_bf16<4, kMinRounded>;
  return min == kNoMin ? tile16_bf16<8, kNoMin> : min == kMinExact ? tile16_bf16<8, kMinExact> : tile16_bf16<8, kMinRounded>;
}
#else
// (w, x [M, K], x k-major in 16-row blocks, x summed over each group [M, K / group] (w has a min), M, panel, y)
using PanelFn = void (*)(const Packed&, const float*, const float*, const float*, int64_t, int64_t, float*);
PanelFn panel_kernel(const Packed&) { return panel_portable; }
using Bf16Fn = void (*)(const Packed&, const uint32_t*, int64_t, float*);
Bf16Fn bf16_kernel(const Packed&) { return nullptr; }
#endif

Packed check_packed(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min, int64_t bits,
                    int64_t group, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "packed_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.dim() == 3, "packed_linear: data must be a contiguous CPU [P, K, bytes] tensor");
  TORCH_CHECK(data.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && data.size(2) == 16,
              "packed_linear: data must be uint8 [P, K / 2, 16] for 4 bits, int8 [P, K, 16] for 8 bits");
  const int64_t P = data.size(0), K = data.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(bits == 8 || group % 2 == 0, "packed_linear: 4-bit groups must hold an even number of k");
  TORCH_CHECK(group >= 1 && K % group == 0, "packed_linear: K=", K, " is not a multiple of group=", group);
  TORCH_CHECK(n > (P - 1) * kPanel && n <= P * kPanel, "packed_linear: n=", n, " does not fit ", P, " panels of 16 rows");
  TORCH_CHECK(scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat, "packed_linear: scale must be float16 or float32");
  TORCH_CHECK(scale.is_contiguous() && scale.sizes() == at::IntArrayRef({P, K / group, kPanel}),
              "packed_linear: scale must be a contiguous [P, K / group, 16] tensor");
  const bool has_min = min.numel() > 0;
  if (has_min)
    TORCH_CHECK(min.scalar_type() == scale.scalar_type() && min.is_contiguous() && min.sizes() == scale.sizes(),
                "packed_linear: min must match scale's dtype and shape, or be empty");
  return Packed{static_cast<const uint8_t*>(data.data_ptr()),
                scale.data_ptr(), has_min ? min.data_ptr() : nullptr, scale.scalar_type() == at::kHalf,
                int(bits), int(group), K, n, P};
}

// x's 16-row blocks [blocks * 16, K] float32 -> [blocks, K / 2, 16] words: (bf16(x[r, k]), bf16(x[r, k + 1]))
// with k in the low half, rounded to nearest even (ATen's float -> bfloat16 conversion, c10::BFloat16's), as
// tile16_bf16 reads them. ATen's vectorized conversion and a strided copy: a scalar loop over the elements took
// ~10 % of a [16, 2048] x [2048, 640] call.
at::Tensor bf16_pairs(const at::Tensor& x, int64_t blocks, int64_t K) {
  const at::Tensor words = x.narrow(0, 0, blocks * 16).to(at::kBFloat16).view(at::kInt);  // [blocks * 16, K / 2]
  return words.view({blocks, 16, K / 2}).transpose(1, 2).contiguous();  // [blocks, K / 2, 16]
}

// bf16: x's whole 16-row blocks multiply in bfloat16 (tile16_bf16) where the CPU has it; the rest
// of the rows, or all of them without AVX512-BF16, in float32.
at::Tensor linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                  int64_t bits, int64_t group, int64_t n, bool bf16) {
  const Packed w = check_packed(data, scale, min, bits, group, n);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == w.K,
              "packed_linear: x must be float32 [M, ", w.K, "], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return y;
  const PanelFn kernel = panel_kernel(w);
  const int64_t blocks = M / 16;
  const Bf16Fn tile_bf16 = bf16 && blocks > 0 ? bf16_kernel(w) : nullptr;
  const int64_t done = tile_bf16 ? blocks * 16 : 0;  // rows the bfloat16 tile takes
  const float* xp = xc.data_ptr<float>() + done * w.K;
  // the float32 16-row tile's input: x's whole blocks again, k-major ([M / 16, K, 16]);
  // the bfloat16 tile's: k pairs ([M / 16, K / 2, 16, 2] bfloat16, read as 32-bit words)
  // NOTE: none of them below 16 rows (decode's batch 1): five tensor ops, ~1.5 us of a ~20 us call
  at::Tensor xt, xb;
  if (blocks > 0 && tile_bf16) xb = bf16_pairs(xc, blocks, w.K);
  if (blocks > 0 && !tile_bf16) xt = xc.narrow(0, 0, blocks * 16).view({blocks, 16, w.K}).transpose(1, 2).contiguous();
  const float* xtp = xt.defined() ? xt.data_ptr<float>() : nullptr;
  // the group-sum tiles' min term: each row's x summed over each group, [M - done, K / group] (a loop:
  // ATen's sum cost ~4 us a call, a tenth of a batch-1 call on a small weight)
  const int64_t groups = w.K / w.group;
  std::vector<float> xs(w.min ? (M - done) * groups : 0);
  for (int64_t i = 0; i < int64_t(xs.size()); ++i) {
    const float* row = xp + (i / groups) * w.K + (i % groups) * w.group;
    float t = 0.f;
    for (int64_t k = 0; k < w.group; ++k) t += row[k];
    xs[i] = t;
  }
  const float* xsp = xs.data();
  const uint32_t* xbp = xb.defined() ? reinterpret_cast<const uint32_t*>(xb.data_ptr<int32_t>()) : nullptr;
  float* yp = y.data_ptr<float>();
  // NOTE: a panel's 16 outputs per row land in a small buffer first, so the last, partial panel
  // writes only its real rows and y needs no padding columns.
  at::parallel_for(0, w.panels, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> tile(M * kPanel);
    for (int64_t p = lo; p < hi; ++p) {
      for (int64_t b = 0; b * 16 < done; ++b) tile_bf16(w, xbp + b * (w.K / 2) * 16, p, tile.data() + b * 16 * kPanel);
      if (M > done) kernel(w, xp, xtp, xsp, M - done, p, tile.data() + done * kPanel);
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * n + p * kPanel, tile.data() + m * kPanel, cols * sizeof(float));
    }
  });
  return y;
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                             const at::Tensor& min, int64_t bits, int64_t group, int64_t n) {
  return linear(x, data, scale, min, bits, group, n, false);
}

at::Tensor packed_linear_bf16_cpu(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                                  const at::Tensor& min, int64_t bits, int64_t group, int64_t n) {
  return linear(x, data, scale, min, bits, group, n, true);
}

// -- dequantize (W.T) -----------------------------------------------------------------------------

// Panel p's 16 rows at every k -> wt[k, 16p .. 16p + 16): in W.T a panel's k-major bytes land as 16
// contiguous values, so the transposed layout is the cheap one to write (and x @ W.T needs no
// transpose). Out: float, or c10::BFloat16 (rounded to nearest even, as torch's .to(bfloat16) does)
// for a bfloat16 GEMM, which then reads half the bytes and needs no conversion pass.
template <typename Out>
void dequantize_panel_portable(const Packed& w, int64_t panel, Out* wt, int64_t ld) {
  for (int64_t k = 0; k < w.K; ++k) {
    for (int j = 0; j < kPanel; ++j) wt[k * ld + panel * kPanel + j] = Out(weight_at(w, panel, k, j));
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// Round to nearest even on the bits (finite values: dequantized weights are never NaN or inf).
__attribute__((target("avx512f"))) inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

template <int BITS, int MIN, typename Out>
__attribute__((target("avx512f"))) void dequantize_panel_avx512(const Packed& w, int64_t panel, Out* wt, int64_t ld) {
  const int64_t groups = w.K / w.group;
  const uint8_t* base = w.data + panel * w.panel_bytes();
  Out* out = wt + panel * kPanel;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (panel * groups + g) * kPanel;
    const __m512 s = load16(w.scale, w.half_scale, at);
    const __m512 z = MIN ? load16(w.min, w.half_scale, at) : _mm512_setzero_ps();
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += (BITS == 4 ? 2 : 1)) {
      if (BITS == 4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (k / 2) * 16)));
        store16(out + k * ld, dequant16<MIN>(_mm512_and_si512(b, _mm512_set1_epi32(15)), s, z));
        store16(out + (k + 1) * ld, dequant16<MIN>(_mm512_srli_epi32(b, 4), s, z));
      } else {
        store16(out + k * ld, q8_at<MIN>(base, k, s, z));
      }
    }
  }
}
#endif

template <typename Out>
using DequantFn = void (*)(const Packed&, int64_t, Out*, int64_t);

template <typename Out>
DequantFn<Out> dequantize_kernel(const Packed& w) {
#if defined(__x86_64__)
  static const bool avx512 = isa_cap() >= 2 && __builtin_cpu_supports("avx512f");
  if (avx512) {
    if (w.bits == 4)
      return w.min ? dequantize_panel_avx512<4, kMinRounded, Out> : dequantize_panel_avx512<4, kNoMin, Out>;
    return w.min ? dequantize_panel_avx512<8, kMinRounded, Out> : dequantize_panel_avx512<8, kNoMin, Out>;
  }
#endif
  return dequantize_panel_portable<Out>;
}

template <typename Out>
at::Tensor dequantize_t(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min, int64_t bits,
                        int64_t group, int64_t n, at::ScalarType dtype) {
  const Packed w = check_packed(data, scale, min, bits, group, n);
  const int64_t ld = w.panels * kPanel;
  at::Tensor wt = at::empty({w.K, ld}, data.options().dtype(dtype));
  const DequantFn<Out> kernel = dequantize_kernel<Out>(w);
  Out* out = wt.data_ptr<Out>();
  at::parallel_for(0, w.panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) kernel(w, p, out, ld);
  });
  // A slice's last panel (PackedWeight.rows) may hold real rows past n: the schema says zeros there.
  if (ld > n) wt.narrow(1, n, ld - n).zero_();
  return wt;
}

at::Tensor packed_dequantize_t_cpu(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                                   int64_t bits, int64_t group, int64_t n) {
  return dequantize_t<float>(data, scale, min, bits, group, n, at::kFloat);
}

at::Tensor packed_dequantize_t_bf16_cpu(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                                        int64_t bits, int64_t group, int64_t n) {
  return dequantize_t<c10::BFloat16>(data, scale, min, bits, group, n, at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_IMPL(ridgefill, CPU, m) {
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("packed_linear_bf16", &packed_linear_bf16_cpu);
  m.impl("packed_dequantize_t", &packed_dequantize_t_cpu);
  m.impl("packed_dequantize_t_bf16", &packed_dequantize_t_bf16_cpu);
}
