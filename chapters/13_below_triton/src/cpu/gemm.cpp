// C = A · B on the CPU, one rung per function. Row-major with leading dimensions: A is M × K with
// element (i, k) at a[i * lda + k], B is K × N at b[k * ldb + j], C is M × N at c[i * ldc + j]
// (lda >= K, ldb >= N, ldc >= N: a block of a larger matrix, or padded rows). C is overwritten.
// fp32 throughout. Built with -O3 -march=x86-64-v3 (AVX2 + FMA) -fopenmp (the last rung's threads).
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KL_HAVE_AVX2 1
#endif

#include <algorithm>
#include <cstdint>

// Rung 1, naive ijk: one dot product per element of C. The inner loop walks a column of B —
// stride ldb floats, a new cache line per multiply-add, each line used for one float of its 16 —
// and carries one running sum (a dependent chain of FMAs, not vectorized: a float reduction).
extern "C" void gemm_naive(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K, int64_t lda,
                           int64_t ldb, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += a[i * lda + k] * b[k * ldb + j];
      c[i * ldc + j] = sum;
    }
}

// Rung 2, loop order ikj: the same multiply-adds, the two inner loops swapped. The inner loop now
// walks a row of B and a row of C with stride 1 — every float of each cache line used — and has
// no reduction (C's row is updated element by element), so it vectorizes 8-wide. But for each row
// of A it still streams all of B (K × N floats): once B outgrows the L1 (and then the L2) cache,
// each row of C reloads B from the next level down.
extern "C" void gemm_ikj(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c, int64_t M,
                         int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    float* __restrict__ ci = c + i * ldc;
    for (int64_t j = 0; j < N; ++j) ci[j] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float aik = a[i * lda + k];
      const float* __restrict__ bk = b + k * ldb;
      for (int64_t j = 0; j < N; ++j) ci[j] += aik * bk[j];
    }
  }
}

// Tile sizes of rungs 3-5, from the caches of a common laptop core (32-48 KiB L1d, 1-2 MiB L2):
// - a KC × NC tile of B (32 × 128 floats = 16 KiB) is reused by every row of an MC-row band of A;
//   at half of a 32 KiB L1 it stays there beside the rows of A and C in use. Its rows are 128
//   floats long: the inner loop runs 16 vectors of 8 per row of A, enough to pay for its set-up
//   (at 64 columns, 8 vectors, the loop's overhead shows);
// - the band's MC × KC tile of A (128 × 32 floats = 16 KiB) and MC × NC tile of C (128 × 128 floats
//   = 64 KiB) stay in L2, and so does all of B's KC-row panel for the next tiles.
// So each element of B comes from L1 MC times per load from beyond it, not once per row of A.
constexpr int64_t MC = 128, KC = 32, NC = 128;

// Rung 3, cache-blocked: ikj inside tiles. The loops over tiles (i0, j0, k0) pick a tile of C,
// and the tiles of A and B that update it; inside, the ikj loops of rung 2 (vectorized the
// same way), now over data that fits the caches.
extern "C" void gemm_blocked(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                             int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;
  for (int64_t i0 = 0; i0 < M; i0 += MC)
    for (int64_t k0 = 0; k0 < K; k0 += KC)
      for (int64_t j0 = 0; j0 < N; j0 += NC) {
        const int64_t i1 = std::min(i0 + MC, M), k1 = std::min(k0 + KC, K), j1 = std::min(j0 + NC, N);
        for (int64_t i = i0; i < i1; ++i) {
          float* __restrict__ ci = c + i * ldc;
          for (int64_t k = k0; k < k1; ++k) {
            const float aik = a[i * lda + k];
            const float* __restrict__ bk = b + k * ldb;
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) ci[j] += aik * bk[j];
          }
        }
      }
}

// The register-blocked micro-kernel: a 6 × 16 block of C (12 AVX2 registers of 8 floats) kept in
// registers over k in [k0, k1). Per k: two loads of B's row (16 floats), six broadcasts of A's
// column, twelve FMAs — 12 FMAs for 8 loads/broadcasts, where ikj's inner loop did one FMA per
// load of B and a load and a store of C. Sixteen registers in all: 12 accumulators, 2 of B, 1 of A.
constexpr int64_t MR = 6, NR = 16;

#if KL_HAVE_AVX2
static inline void micro_6x16(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                              int64_t k0, int64_t k1, int64_t lda, int64_t ldb, int64_t ldc) {
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm256_loadu_ps(c + r * ldc);
    acc[r][1] = _mm256_loadu_ps(c + r * ldc + 8);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}
#else
// Without AVX2 the same 6 x 16 register block, left to the compiler's vectorizer (another ISA's width).
static inline void micro_6x16(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                              int64_t k0, int64_t k1, int64_t lda, int64_t ldb, int64_t ldc) {
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = c[r * ldc + j];
  for (int64_t k = k0; k < k1; ++k)
    for (int r = 0; r < MR; ++r) {
      const float ar = a[r * lda + k];
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[r][j] += ar * b[k * ldb + j];
    }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = acc[r][j];
}
#endif

// The edges: a block of fewer than 6 rows or 16 columns (M, N not multiples of the micro-tile),
// done like rung 3's inner loops. Never touches a column or row past the matrix.
static inline void edge_block(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                              int64_t rows, int64_t cols, int64_t k0, int64_t k1, int64_t lda, int64_t ldb,
                              int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = k0; k < k1; ++k) {
      const float ark = a[r * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] += ark * b[k * ldb + j];
    }
}

// One MC-row band of C: its tiles, and in each the 6 × 16 micro-kernel (rungs 4 and 5).
static void gemm_band(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                      int64_t i0, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  const int64_t i1 = std::min(i0 + MC, M);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(k0 + KC, K);
    for (int64_t j0 = 0; j0 < N; j0 += NC) {
      const int64_t j1 = std::min(j0 + NC, N);
      for (int64_t j = j0; j < j1; j += NR)    // a 16-column strip of B's tile (KC × 16: 2 KiB, in L1)
        for (int64_t i = i0; i < i1; i += MR) {  // ... reused by every 6-row strip of the band
          const int64_t rows = std::min(MR, i1 - i), cols = std::min(NR, j1 - j);
          if (rows == MR && cols == NR)
            micro_6x16(a + i * lda, b + j, c + i * ldc + j, k0, k1, lda, ldb, ldc);
          else
            edge_block(a + i * lda, b + j, c + i * ldc + j, rows, cols, k0, k1, lda, ldb, ldc);
        }
    }
  }
}

// Rung 4, SIMD micro-kernel: rung 3's tiles, each computed 6 × 16 at a time in registers.
extern "C" void gemm_simd(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c, int64_t M,
                          int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  for (int64_t i0 = 0; i0 < M; i0 += MC) gemm_band(a, b, c, i0, M, N, K, lda, ldb, ldc);
}

// Rung 5, threads: rung 4's MC-row bands of C shared among OpenMP threads — each band is written
// by one thread only (no two threads write one element, and no locks), and each reads all of B
// (shared, read-only: in the L2 of each core, or the shared L3). Dynamic schedule: bands are few
// (M / 128), and an edge band is cheaper than the others.
extern "C" void gemm_threads(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                             int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  const int64_t bands = (M + MC - 1) / MC;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t band = 0; band < bands; ++band) gemm_band(a, b, c, band * MC, M, N, K, lda, ldb, ldc);
}
