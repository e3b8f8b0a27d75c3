// RMSNorm on the CPU, one rung per function: y[r, c] = x[r, c] / sqrt(mean_c(x[r, :]^2) + eps) * w[c].
//
// Every rung has the same signature (the exercise's): rows of `cols` floats, row r of x at
// x + r * x_row_stride and of y at y + r * y_row_stride (strides in elements: a row of a wider
// tensor, or a padded one), w of `cols` floats, fp32 accumulation. Built with
// -O3 -march=x86-64-v3 (AVX2 + FMA) and -fopenmp (the last rung's threads; the others use only
// `#pragma omp simd`, which -fopenmp-simd alone would enable too).
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KL_HAVE_AVX2 1
#endif

#include <cmath>
#include <cstdint>

// Rung 1, naive: two passes over each row, scalar. The sum of squares is a float reduction, which
// C++ evaluates in order: the compiler may not reassociate it into 8 partial sums (that changes the
// rounding), so it stays one add after another — GCC's report calls it vectorized, but only the
// squares are: each lane is then added in order, 8 dependent adds per vector. The second loop
// (no reduction) vectorizes, behind a run-time check that y does not overlap x or w.
extern "C" void rms_norm_naive(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                               int64_t x_row_stride, int64_t y_row_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
    const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];
  }
}

// Rung 2, vectorizable: the same two loops, each with `#pragma omp simd` — for the sum,
// `reduction(+ : sum)` is the permission the compiler lacked: keep partial sums per lane, add
// them at the end (a different rounding, as good: fp32 partial sums are, if anything, more
// accurate than one running sum). `__restrict__` says y overlaps neither x nor w, so no run-time
// overlap check and no scalar fallback copy. The vectorizer's report now says both loops are
// vectorized with 32-byte (8-float) vectors, the reduction among them.
extern "C" void rms_norm_simd(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                              int64_t rows, int64_t cols, int64_t x_row_stride, int64_t y_row_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict__ xr = x + r * x_row_stride;
    float* __restrict__ yr = y + r * y_row_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
    const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];
  }
}

#if KL_HAVE_AVX2
// The sum of a vector's 8 lanes: halves added pairwise (3 adds, not 7).
static inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row with AVX2 intrinsics (rungs 3 and 4).
static inline void rms_norm_row_avx2(const float* __restrict__ xr, const float* __restrict__ w,
                                     float* __restrict__ yr, int64_t cols, float eps) {
  // Two accumulators: an FMA takes 4 cycles and two can start per cycle, so one accumulator
  // (each FMA waiting for the last) would run at an eighth of the peak; two halve the wait.
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m256 a = _mm256_loadu_ps(xr + c), b = _mm256_loadu_ps(xr + c + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  if (c + 8 <= cols) {
    const __m256 a = _mm256_loadu_ps(xr + c);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    c += 8;
  }
  float sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
  for (; c < cols; ++c) sum += xr[c] * xr[c];  // the tail: cols % 8 elements, scalar
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
  const __m256 scale = _mm256_set1_ps(rstd);
  c = 0;
  for (; c + 8 <= cols; c += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + c), scale);
    _mm256_storeu_ps(yr + c, _mm256_mul_ps(v, _mm256_loadu_ps(w + c)));
  }
  for (; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];  // the tail again
}

#else
// Without AVX2 (another ISA, or an x86 before 2013) rung 3 does not exist, and rung 4 threads rung 2's row.
static inline void rms_norm_row_avx2(const float* __restrict__ xr, const float* __restrict__ w,
                                     float* __restrict__ yr, int64_t cols, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];
}
#endif

#if KL_HAVE_AVX2
// Rung 3, AVX2 intrinsics: what rung 2 asks the compiler for, written out — 8-wide FMAs into two
// accumulators, one horizontal sum per row, and the tail (cols % 8) done scalar, never loaded
// past the row's end (a full-width load there would read past the buffer).
extern "C" void rms_norm_avx2(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                              int64_t rows, int64_t cols, int64_t x_row_stride, int64_t y_row_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) rms_norm_row_avx2(x + r * x_row_stride, w, y + r * y_row_stride, cols, eps);
}
#endif

// Rung 4, threads: rung 3's rows shared among OpenMP threads (rows are independent; a static
// schedule gives each thread one contiguous band of rows, so no two threads write one cache line
// of y unless the row stride is under 16 floats). The thread count is OpenMP's
// (OMP_NUM_THREADS, or omp_set_num_threads).
extern "C" void rms_norm_threads(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                 int64_t rows, int64_t cols, int64_t x_row_stride, int64_t y_row_stride,
                                 float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rms_norm_row_avx2(x + r * x_row_stride, w, y + r * y_row_stride, cols, eps);
}
