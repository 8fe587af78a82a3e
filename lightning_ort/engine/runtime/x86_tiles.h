// Register tiles for lightning_ort's x86 kernels that read one layout and write another: a 16x16 float transpose
// in AVX-512 registers (a plain tensor's 16 channel rows of 16 positions turned into the 16 position vectors of
// ONNX Runtime's NCHWc layout, or the reverse), and its 8x8 form in AVX2 registers (ONNX Runtime's block there).

#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86_VECTORS 1
#else
#define X86_VECTORS 0
#endif

#if X86_VECTORS
namespace lightning_ort_kernels {

// r[i] becomes column i of the 16x16 matrix whose rows were r[0..15]: pairs of rows interleaved by floats, then
// by float pairs (each 128-bit lane then holds a 4x4 square transposed), then the lanes gathered across registers.
__attribute__((target("avx512f"))) inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512d p0 = _mm512_castps_pd(t[4 * g]), p1 = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d p2 = _mm512_castps_pd(t[4 * g + 2]), p3 = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(p0, p2));      // lane L: column 4L, rows 4g..4g+3
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p2));  // column 4L + 1
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(p1, p3));  // column 4L + 2
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(p1, p3));  // column 4L + 3
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 low01 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44);
    const __m512 high01 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    const __m512 low23 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    const __m512 high23 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(low01, low23, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(high01, high23, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
  }
}

// The 8x8 form of transpose_16x16: pairs of rows interleaved by floats, then by float pairs within 128-bit lanes,
// then the lanes of rows 0-3 and 4-7 joined.
__attribute__((target("avx2"))) inline void transpose_8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int g = 0; g < 2; ++g) {
    u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);          // lane L: column 4L, rows 4g..4g+3
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);      // column 4L + 1
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);  // column 4L + 2
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);  // column 4L + 3
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
    r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
  }
}

}  // namespace lightning_ort_kernels
#endif
