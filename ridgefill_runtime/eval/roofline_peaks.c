/* This machine's two roofline peaks, measured the way the benchmarks' kernels could reach them.
 *
 *   fma   FLOP/s of independent fused multiply-adds on the widest vector the compiler targets
 *         (-march=native: 16 float lanes with AVX-512, 8 with AVX2), enough chains in flight to
 *         cover the FMA latency on every core;
 *   copy  bytes/s of a STREAM-style copy (b[i] = a[i]) over arrays far larger than the caches,
 *         counted as read + write (the write-allocate read is not counted, as STREAM does not).
 *
 * Usage: roofline_peaks THREADS  -> prints "fma_gflops <x>\ncopy_gbs <y>\nlanes <n>".
 * Built and run by benchmarks/roofline.py; each figure is the best of several repeats.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define CHAINS 12 /* >= FMA latency (4) x ports (2), with room */

typedef float vec __attribute__((vector_size(LANES * 4)));

static int ran; /* threads the FMA region actually ran on (OpenMP may give fewer than asked) */

static double fma_gflops(int threads, long iters) {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    float sink = 0;
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      if (omp_get_thread_num() == 0) ran = omp_get_num_threads();
      vec acc[CHAINS], a, b;
      for (int i = 0; i < LANES; ++i) a[i] = 1.0f + 1e-7f * i, b[i] = 0.999999f;
      for (int c = 0; c < CHAINS; ++c) acc[c] = a * (float)c;
      for (long it = 0; it < iters; ++it)
        for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * b + a; /* one FMA: contracted at -O3 */
      for (int c = 0; c < CHAINS; ++c)
        for (int i = 0; i < LANES; ++i) sink += acc[c][i];
    }
    double s = omp_get_wtime() - t0;
    double g = 2.0 * LANES * CHAINS * (double)iters * ran / s / 1e9;
    if (g > best) best = g;
    if (sink == 12345.f) puts(""); /* keeps the loop alive */
  }
  return best;
}

static double copy_gbs(int threads, size_t n) {
  float *a = aligned_alloc(64, n * 4), *b = aligned_alloc(64, n * 4);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t i = 0; i < n; ++i) a[i] = (float)i, b[i] = 0; /* first touch on the thread that copies */
  double best = 0;
  for (int rep = 0; rep < 6; ++rep) {
    double t0 = omp_get_wtime();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; ++i) b[i] = a[i];
    double s = omp_get_wtime() - t0;
    double g = 2.0 * n * 4 / s / 1e9;
    if (rep && g > best) best = g; /* rep 0 warms the pages */
  }
  if (b[n / 2] != (float)(n / 2)) puts("copy failed");
  free(a), free(b);
  return best;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  if (threads < 1) return 2;
  printf("fma_gflops %.2f\n", fma_gflops(threads, 100000000L));
  printf("copy_gbs %.2f\n", copy_gbs(threads, (size_t)64 << 20)); /* 2 x 256 MiB */
  printf("lanes %d\n", LANES);
  printf("threads_run %d\n", ran);
  return 0;
}
