// One-pass CPU kernels for the selection hot path (loaded with ctypes by native.py; no Python or
// torch headers, so it compiles in about a second). Every kernel gives exactly what the pure
// numpy/torch path gives: element-wise IEEE float operations one at a time in the oracle's order
// (built with -ffp-contract=off, so no fused multiply-add), |x| >= t compared in x's dtype, NaN
// never passing a threshold.
//
//   ge          indices (ascending) of |x| >= t
//   add_ge      r <- r + g, then the indices of |r| >= t               (error feedback, one pass)
//   dgc_ge      DGC's u/v update, then the indices of |v| >= t          (one pass)
//   topk_small  the k largest |x|, ties toward the lower index (small tensors: a copy, nth_element)
//
// The scans write at most `cap` indices and return how many passed (more than cap: the caller
// knows the list is incomplete).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

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

// mode 0: v <- v + g;  mode 1: u <- u*m + g, v <- v + u;  mode 2 (Nesterov): u <- u*m + g,
// v <- v + (g + u*m)
template <typename T>
int64_t dgc_ge(const T* __restrict g, T* __restrict u, T* __restrict v, int64_t n, T m, int mode, T t,
               int64_t* __restrict idx, int64_t cap) {
  int64_t c = 0;
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
    if (any) c = append(v, lo, hi, t, idx, c, cap);
  }
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
int64_t hvdc_dgc_ge_f32(const float* g, float* u, float* v, int64_t n, float m, int mode, float t,
                        int64_t* idx, int64_t cap) {
  return dgc_ge<float>(g, u, v, n, m, mode, t, idx, cap);
}
int64_t hvdc_dgc_ge_f64(const double* g, double* u, double* v, int64_t n, double m, int mode, double t,
                        int64_t* idx, int64_t cap) {
  return dgc_ge<double>(g, u, v, n, m, mode, t, idx, cap);
}
int64_t hvdc_topk_small_f32(const float* x, int64_t n, int64_t k, int64_t* out, float* work) {
  return topk_small<float>(x, n, k, out, work);
}
int64_t hvdc_topk_small_f64(const double* x, int64_t n, int64_t k, int64_t* out, double* work) {
  return topk_small<double>(x, n, k, out, work);
}
int hvdc_abi_version() { return 1; }

}  // extern "C"
