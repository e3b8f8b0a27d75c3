// What the CPU row kernels share: row addressing over any leading strides, widening a row of
// float16/bfloat16/float32/float64 into the accumulate type (float32, or float64 for float64) in a
// per-thread scratch row, narrowing it back, and an exp that the compiler can vectorize.
//
// The vector path is the stride-1 row: widening and narrowing are loops the compiler vectorizes
// (F16C instructions for float16, shifts for bfloat16), and the arithmetic runs on the widened row in
// `#pragma omp simd` loops. A row with another last-dim stride is gathered element by element
// (scalar) into the same scratch row, and everything after that is the vector path again. x is never
// copied as a whole: at most one row per thread is.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kernel_ladder_native::cpu {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Offsets of the rows of a (..., C) tensor: the leading dims, with those that one stride walks merged
// (a contiguous tensor's leading dims become one), so the common cases cost a multiply per row.
class RowIndexer {
 public:
  explicit RowIndexer(const at::Tensor& t) {
    const int64_t leading = t.dim() - 1;
    for (int64_t d = 0; d < leading; ++d) {
      const int64_t size = t.size(d), stride = t.stride(d);
      if (size == 1) continue;  // any stride: never stepped
      if (!sizes_.empty() && strides_.back() == stride * size) {
        sizes_.back() *= size;  // the previous dim steps over this one exactly: merge
        strides_.back() = stride;
      } else {
        sizes_.push_back(size);
        strides_.push_back(stride);
      }
    }
  }

  int64_t offset(int64_t row) const {
    if (sizes_.size() == 1) return row * strides_[0];
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      off += (row % sizes_[d]) * strides_[d];
      row /= sizes_[d];
    }
    return off;
  }

 private:
  std::vector<int64_t> sizes_, strides_;
};

// ---- widening and narrowing one row --------------------------------------------------------------

inline float to_acc(c10::Half v) { return static_cast<float>(v); }
inline float to_acc(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }

inline void widen_contiguous(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen_contiguous(const double* src, double* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(double)); }

inline void widen_contiguous(const c10::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the top half of a float32: a shift, which vectorizes.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[j]) << 16);
  }
}

inline void widen_contiguous(const c10::Half* src, float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= n; j += 8) {  // vcvtph2ps: 8 at a time
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
#endif
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

inline void narrow_contiguous(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void narrow_contiguous(const double* src, double* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(double)); }

inline void narrow_contiguous(const float* src, c10::BFloat16* dst, int64_t n) {
  // Round to nearest even on the bits (as c10::BFloat16 does), NaN kept a quiet NaN.
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t u = __builtin_bit_cast(uint32_t, src[j]);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[j] = (src[j] != src[j]) ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

inline void narrow_contiguous(const float* src, c10::Half* dst, int64_t n) {
  int64_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= n; j += 8) {  // vcvtps2ph, round to nearest even
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), h);
  }
#endif
  for (; j < n; ++j) dst[j] = static_cast<c10::Half>(src[j]);
}

// The row at `src` (n elements, `stride` apart) in the accumulate type: the row itself when it already
// is one (float32/float64, stride 1), else widened or gathered into `scratch`.
template <typename T>
inline const acc_t<T>* load_row(const T* src, int64_t n, int64_t stride, acc_t<T>* scratch) {
  if (stride == 1) {
    if constexpr (std::is_same_v<T, acc_t<T>>) {
      return src;
    } else {
      widen_contiguous(src, scratch, n);
      return scratch;
    }
  }
  for (int64_t j = 0; j < n; ++j) scratch[j] = to_acc(src[j * stride]);  // the scalar path
  return scratch;
}

// ---- exp -----------------------------------------------------------------------------------------

// e^z in float32 without a library call, so that `#pragma omp simd` loops around it vectorize (glibc's
// vector expf is only declared under -ffast-math). z = k ln2 + r with k = round(z / ln2) and
// |r| <= ln2 / 2, ln2 split in two parts so that k ln2 is exact (Cody & Waite); e^r by its Taylor
// series to degree 7 (truncation below 6e-9 relative, under float32's half ulp); 2^k built in the
// exponent bits in two factors, so that results down to the subnormals are right.
// NaN stays NaN, -inf gives 0, +inf gives inf.
inline float exp_simd(float z) {
  const float lo = -104.0f;  // e^-104 is below half the smallest subnormal: 0
  const float hi = 88.75f;   // e^88.75 is above float32's largest value: inf
  float zc = z < lo ? lo : z;
  zc = zc > hi ? hi : zc;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  const float t = zc * 1.44269504088896341f + shifter;
  const float k = t - shifter;
  const int32_t ki = static_cast<int32_t>(__builtin_bit_cast(uint32_t, t) - __builtin_bit_cast(uint32_t, shifter));
  float r = zc - k * 0.693359375f;  // ln2's leading bits: k * this is exact for |k| < 2^15
  r = r - k * -2.12194440e-4f;      // ln2's remainder
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t k1 = ki >> 1, k2 = ki - k1;  // each in [-75, 64]: both factors normal floats
  // (unsigned arithmetic: a NaN's k is garbage, and must not overflow; the result is NaN anyway)
  const float s1 = __builtin_bit_cast(float, (static_cast<uint32_t>(k1) + 127u) << 23);
  const float s2 = __builtin_bit_cast(float, (static_cast<uint32_t>(k2) + 127u) << 23);
  float result = (p * s1) * s2;
  result = z < lo ? 0.0f : result;
  result = z > hi ? std::numeric_limits<float>::infinity() : result;
  return result;
}

// float64 (the checking dtype) keeps the library's exp: exact to the last bit, not vectorized.
inline double exp_simd(double z) { return std::exp(z); }

// Rows per at::parallel_for task: enough elements that a task is worth a thread (tiny inputs stay on
// the calling thread), at least one row.
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace kernel_ladder_native::cpu
