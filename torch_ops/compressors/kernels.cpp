// One-pass CPU kernels for the selection hot path (loaded with ctypes by native.py; no Python or
// torch headers, so it compiles in about a second). Every kernel gives exactly what the pure
// numpy/torch path gives: element-wise IEEE float operations one at a time in the oracle's order
// (built with -ffp-contract=off, so no fused multiply-add), |x| >= t compared in x's dtype, NaN
// never passing a threshold.
//
//   ge          indices (ascending) of |x| >= t
//   add_ge      r <- r + g, then the indices of |r| >= t               (error feedback, one pass)
//   dgc_sample  DGC's sample of |v| after the update, computed before the update runs
//   dgc_pass    DGC's u/v update, its sample of |v| and a self-tightening candidate list (one pass)
//   take_and_zero  the sent values gathered, v (and u) zeroed there
//   topk_small  the k largest |x|, ties toward the lower index (small tensors: a copy, nth_element)
//
// The scans write at most `cap` indices and return how many passed (more than cap: the caller
// knows the list is incomplete).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

template <typename T>
inline T mag(T x) { return std::fabs(x); }

// The scans run over blocks of B entries: a vectorizable loop computes each entry once (updating
// the state where the kernel does) and ORs the comparisons; only a block with a passing entry is
// read again (from L1) to append its indices.
constexpr int64_t B = 16;

template <typename T>
inline int64_t append(const T* __restrict x, int64_t lo, int64_t hi, T t, int64_t* __restrict idx,
                      int64_t c, int64_t cap) {
  if (c + (hi - lo) <= cap) {  // surely fits: a branch-free store
    for (int64_t i = lo; i < hi; ++i) {
      idx[c] = i;
      c += (mag(x[i]) >= t);
    }
    return c;
  }
  for (int64_t i = lo; i < hi; ++i) {
    if (mag(x[i]) >= t) {
      if (c < cap) idx[c] = i;
      ++c;
    }
  }
  return c;
}

template <typename T>
int64_t ge(const T* __restrict x, int64_t n, T t, int64_t* __restrict idx, int64_t cap) {
  int64_t c = 0;
  for (int64_t lo = 0; lo < n; lo += B) {
    const int64_t hi = std::min(n, lo + B);
    int any = 0;
    for (int64_t i = lo; i < hi; ++i) any |= (mag(x[i]) >= t);
    if (any) c = append(x, lo, hi, t, idx, c, cap);
  }
  return c;
}

template <typename T>
int64_t add_ge(const T* __restrict g, T* __restrict r, int64_t n, T t, int64_t* __restrict idx,
               int64_t cap) {
  int64_t c = 0;
  for (int64_t lo = 0; lo < n; lo += B) {
    const int64_t hi = std::min(n, lo + B);
    int any = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const T a = g[i] + r[i];
      r[i] = a;
      any |= (mag(a) >= t);
    }
    if (any) c = append(r, lo, hi, t, idx, c, cap);
  }
  return c;
}

// Bit i - lo set when |x_i| >= t, for lo <= i < hi <= lo + B (16): SSE2 compares and movemask where
// available (an ordered compare: NaN never passes), else one entry at a time.
template <typename T>
inline uint32_t block_bits(const T* x, int64_t lo, int64_t hi, T t) {
  uint32_t bits = 0;
  for (int64_t i = lo; i < hi; ++i) bits |= uint32_t(mag(x[i]) >= t) << (i - lo);
  return bits;
}
#if defined(__SSE2__)
template <>
inline uint32_t block_bits<float>(const float* x, int64_t lo, int64_t hi, float t) {
  if (hi - lo != 16) {
    uint32_t bits = 0;
    for (int64_t i = lo; i < hi; ++i) bits |= uint32_t(mag(x[i]) >= t) << (i - lo);
    return bits;
  }
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff)), tv = _mm_set1_ps(t);
  uint32_t bits = 0;
  for (int j = 0; j < 4; ++j) {
    const __m128 a = _mm_and_ps(_mm_loadu_ps(x + lo + 4 * j), abs_mask);
    bits |= uint32_t(_mm_movemask_ps(_mm_cmpge_ps(a, tv))) << (4 * j);
  }
  return bits;
}
template <>
inline uint32_t block_bits<double>(const double* x, int64_t lo, int64_t hi, double t) {
  if (hi - lo != 16) {
    uint32_t bits = 0;
    for (int64_t i = lo; i < hi; ++i) bits |= uint32_t(mag(x[i]) >= t) << (i - lo);
    return bits;
  }
  const __m128d abs_mask = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffLL)), tv = _mm_set1_pd(t);
  uint32_t bits = 0;
  for (int j = 0; j < 8; ++j) {
    const __m128d a = _mm_and_pd(_mm_loadu_pd(x + lo + 2 * j), abs_mask);
    bits |= uint32_t(_mm_movemask_pd(_mm_cmpge_pd(a, tv))) << (2 * j);
  }
  return bits;
}
#endif

// |v| after DGC's update at offset, offset + stride, ... (its sample), computed before the
// update runs, with the update's float operations in its order (u and v untouched): the rule's
// first threshold is then known before the pass. Returns how many were written.
template <typename T>
int64_t dgc_sample(const T* __restrict g, const T* __restrict u, const T* __restrict v, int64_t n, T m,
                   int mode, int64_t offset, int64_t stride, T* __restrict out) {
  int64_t c = 0;
  for (int64_t i = offset; i < n; i += stride) {
    T a;
    if (mode == 0) {
      a = v[i] + g[i];
    } else {
      T un = u[i] * m;
      un = un + g[i];
      if (mode == 1) {
        a = v[i] + un;
      } else {
        T s = un * m;
        s = g[i] + s;
        a = v[i] + s;
      }
    }
    out[c++] = mag(a);
  }
  return c;
}

// DGC's update in place (mode 0: v <- v + g;  mode 1: u <- u*m + g, v <- v + u;  mode 2,
// Nesterov: u <- u*m + g, v <- v + (g + u*m)), in one pass that also
//   * writes DGC's sample: |v| (new) at offset, offset + stride, ... into `sample`;
//   * collects candidates: the indices (ascending) and |v| of the entries with |v| >= t, into
//     idx / mags (at most cap, cap >= 4*B). t starts at t0; when the buffer would overflow, t is
//     raised to the (cap/2)-th largest |v| collected so far (just above it when ties would still
//     not leave room) and the buffer is cut to the entries >= t: those entries are final (the
//     pass is past them), so the list stays exactly {i : |v_i| >= t} for the final t, written
//     to *t_out. `work` holds cap entries (for nth_element).
// Returns how many candidates there are (<= cap), or -1 when no threshold can make room (the
// collected magnitudes are all equal to the largest one, e.g. all inf): the update and the sample
// are still complete, the caller scans v instead.
template <typename T>
int64_t dgc_pass(const T* __restrict g, T* __restrict u, T* __restrict v, int64_t n, T m, int mode,
                 int64_t offset, int64_t stride, T* __restrict sample, T t0, int64_t* __restrict idx,
                 T* __restrict mags, int64_t cap, T* __restrict work, T* t_out) {
  int64_t c = 0, next = offset, ns = 0;
  T t = t0;
  bool collecting = cap > 0;  // cap 0: no list (the caller scans v); t0 = inf would still pass infs
  for (int64_t lo = 0; lo < n; lo += B) {
    const int64_t hi = std::min(n, lo + B);
    int any = 0;
    if (mode == 0) {
      for (int64_t i = lo; i < hi; ++i) {
        const T a = v[i] + g[i];
        v[i] = a;
        any |= (mag(a) >= t);
      }
    } else if (mode == 1) {
      for (int64_t i = lo; i < hi; ++i) {
        T un = u[i] * m;
        un = un + g[i];
        u[i] = un;
        const T a = v[i] + un;
        v[i] = a;
        any |= (mag(a) >= t);
      }
    } else {
      for (int64_t i = lo; i < hi; ++i) {
        T un = u[i] * m;
        un = un + g[i];
        u[i] = un;
        T s = un * m;
        s = g[i] + s;
        const T a = v[i] + s;
        v[i] = a;
        any |= (mag(a) >= t);
      }
    }
    for (; next < hi; next += stride) sample[ns++] = mag(v[next]);
    if (!any || !collecting) continue;
    if (c + (hi - lo) > cap) {  // may not fit: raise t to keep at most about cap/2
      std::copy(mags, mags + c, work);
      const int64_t h = cap / 2;
      std::nth_element(work, work + (c - h), work + c);
      T nt = work[c - h];
      int64_t keep = 0;
      for (int64_t i = 0; i < c; ++i) keep += (mags[i] >= nt);
      if (keep + B > cap) nt = std::nextafter(nt, std::numeric_limits<T>::infinity());  // ties
      t = std::max(t, nt);
      int64_t j = 0;
      for (int64_t i = 0; i < c; ++i) {
        const T a = mags[i];
        idx[j] = idx[i];
        mags[j] = a;
        j += (a >= t);
      }
      c = j;
      if (c + (hi - lo) > cap) {  // t could not rise (every collected |v| is the maximum, e.g. inf)
        collecting = false;
        continue;
      }
    }
    uint32_t bits = block_bits(v, lo, hi, t);  // fits: the passing entries, one store each
    while (bits) {
      const int64_t i = lo + __builtin_ctz(bits);
      bits &= bits - 1;
      idx[c] = i;
      mags[c] = mag(v[i]);
      ++c;
    }
  }
  *t_out = t;
  return collecting ? c : -1;
}

// values[i] <- v[idx[i]]; v[idx[i]] <- 0; and u[idx[i]] <- 0 when u is given (momentum masking).
// Returns c, or -1 (nothing written) when an index is outside [0, n).
template <typename T>
int64_t take_and_zero(T* __restrict v, T* __restrict u, int64_t n, const int64_t* __restrict idx, int64_t c,
                      T* __restrict values) {
  int bad = 0;
  for (int64_t i = 0; i < c; ++i) bad |= (idx[i] < 0) | (idx[i] >= n);
  if (bad) return -1;
  for (int64_t i = 0; i < c; ++i) {
    const int64_t p = idx[i];
    values[i] = v[p];
    v[p] = 0;
  }
  if (u != nullptr)
    for (int64_t i = 0; i < c; ++i) u[idx[i]] = 0;
  return c;
}

// Writes the k largest |x| (ties toward the lower index) ascending into out; 0 < k < n.
// work holds n entries. Returns k, or -1 when x holds a NaN (left to the general path).
// The k-th largest w: for small k a min-heap of the k largest seen (most entries are rejected by
// one comparison with its top), else nth_element over a copy of |x|.
template <typename T>
int64_t topk_small(const T* x, int64_t n, int64_t k, int64_t* out, T* work) {
  T w;
  int64_t greater = 0;
  if (k * 64 <= n) {
    for (int64_t i = 0; i < k; ++i) {
      const T a = mag(x[i]);
      if (a != a) return -1;
      work[i] = a;
    }
    std::make_heap(work, work + k, std::greater<T>());
    for (int64_t i = k; i < n; ++i) {
      const T a = mag(x[i]);
      if (a > work[0]) {
        std::pop_heap(work, work + k, std::greater<T>());
        work[k - 1] = a;
        std::push_heap(work, work + k, std::greater<T>());
      } else if (a != a) {
        return -1;
      }
    }
    w = work[0];
    for (int64_t i = 1; i < k; ++i) greater += (work[i] > w);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T a = mag(x[i]);
      if (a != a) return -1;
      work[i] = a;
    }
    std::nth_element(work, work + (n - k), work + n);
    w = work[n - k];
    for (int64_t i = n - k + 1; i < n; ++i) greater += (work[i] > w);
  }
  int64_t ties = k - greater, c = 0;  // how many entries equal to w are taken, lowest index first
  for (int64_t i = 0; i < n && c < k; ++i) {
    const T a = mag(x[i]);
    if (a > w) {
      out[c++] = i;
    } else if (a == w && ties > 0) {
      out[c++] = i;
      --ties;
    }
  }
  return c;
}

}  // namespace

extern "C" {

int64_t hvdc_ge_f32(const float* x, int64_t n, float t, int64_t* idx, int64_t cap) {
  return ge<float>(x, n, t, idx, cap);
}
int64_t hvdc_ge_f64(const double* x, int64_t n, double t, int64_t* idx, int64_t cap) {
  return ge<double>(x, n, t, idx, cap);
}
int64_t hvdc_add_ge_f32(const float* g, float* r, int64_t n, float t, int64_t* idx, int64_t cap) {
  return add_ge<float>(g, r, n, t, idx, cap);
}
int64_t hvdc_add_ge_f64(const double* g, double* r, int64_t n, double t, int64_t* idx, int64_t cap) {
  return add_ge<double>(g, r, n, t, idx, cap);
}
int64_t hvdc_dgc_sample_f32(const float* g, const float* u, const float* v, int64_t n, float m, int mode,
                            int64_t offset, int64_t stride, float* out) {
  return dgc_sample<float>(g, u, v, n, m, mode, offset, stride, out);
}
int64_t hvdc_dgc_sample_f64(const double* g, const double* u, const double* v, int64_t n, double m, int mode,
                            int64_t offset, int64_t stride, double* out) {
  return dgc_sample<double>(g, u, v, n, m, mode, offset, stride, out);
}
int64_t hvdc_dgc_pass_f32(const float* g, float* u, float* v, int64_t n, float m, int mode, int64_t offset,
                          int64_t stride, float* sample, float t0, int64_t* idx, float* mags, int64_t cap,
                          float* work, float* t_out) {
  return dgc_pass<float>(g, u, v, n, m, mode, offset, stride, sample, t0, idx, mags, cap, work, t_out);
}
int64_t hvdc_dgc_pass_f64(const double* g, double* u, double* v, int64_t n, double m, int mode, int64_t offset,
                          int64_t stride, double* sample, double t0, int64_t* idx, double* mags, int64_t cap,
                          double* work, double* t_out) {
  return dgc_pass<double>(g, u, v, n, m, mode, offset, stride, sample, t0, idx, mags, cap, work, t_out);
}
int64_t hvdc_take_and_zero_f32(float* v, float* u, int64_t n, const int64_t* idx, int64_t c, float* values) {
  return take_and_zero<float>(v, u, n, idx, c, values);
}
int64_t hvdc_take_and_zero_f64(double* v, double* u, int64_t n, const int64_t* idx, int64_t c, double* values) {
  return take_and_zero<double>(v, u, n, idx, c, values);
}
int64_t hvdc_topk_small_f32(const float* x, int64_t n, int64_t k, int64_t* out, float* work) {
  return topk_small<float>(x, n, k, out, work);
}
int64_t hvdc_topk_small_f64(const double* x, int64_t n, int64_t k, int64_t* out, double* work) {
  return topk_small<double>(x, n, k, out, work);
}
int hvdc_abi_version() { return 2; }

}  // extern "C"
