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
//   add_ge_to, dgc_pass_to, sk_update_sketch_to: the same, the state read from one buffer and
//               written to another (a caller whose state is immutable, as TensorFlow's variables
//               seen from numpy; the same traffic as in place)
//   take_and_zero  the sent values gathered, v (and u) zeroed there
//   topk_small  the k largest |x|, ties toward the lower index (small tensors: a copy, nth_element)
//   q_encode    a quantizer's payload (scales, packed codes) and its error-feedback residual
//   q_decode_sum  the sum over ranks of the decoded payloads, times the average's scale
//   q1c_encode / q1c_decode_sum  1-bit SGD with a (pos, neg) pair per column
//   sk_update_sketch  the sketch's momentum and error update and its count sketch (one pass)
//   sk_estimates_abs  |estimate| of every entry from a summed sketch (lower median over rows)
//   sk_estimates_abs_at  |estimate| of a strided sample of entries
//   sk_estimates_ge  the entries with |estimate| >= t and their |estimate| (a row bitmask rules out
//               the rest without reading the table)
//
// The scans write at most `cap` indices and return how many passed (more than cap: the caller
// knows the list is incomplete).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>
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

// SEP: r <- rin + g into r (rin another buffer), else in place (rin unused).
template <typename T, bool SEP = false>
int64_t add_ge(const T* __restrict g, T* __restrict r, int64_t n, T t, int64_t* __restrict idx,
               int64_t cap, const T* __restrict rin = nullptr) {
  int64_t c = 0;
  for (int64_t lo = 0; lo < n; lo += B) {
    const int64_t hi = std::min(n, lo + B);
    int any = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const T a = g[i] + (SEP ? rin[i] : r[i]);
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
// SEP: u and v read from uin / vin and written to u / v (other buffers), else in place.
template <typename T, bool SEP = false>
int64_t dgc_pass(const T* __restrict g, T* __restrict u, T* __restrict v, int64_t n, T m, int mode,
                 int64_t offset, int64_t stride, T* __restrict sample, T t0, int64_t* __restrict idx,
                 T* __restrict mags, int64_t cap, T* __restrict work, T* t_out,
                 const T* __restrict uin = nullptr, const T* __restrict vin = nullptr) {
  int64_t c = 0, next = offset, ns = 0;
  T t = t0;
  bool collecting = cap > 0;  // cap 0: no list (the caller scans v); t0 = inf would still pass infs
  for (int64_t lo = 0; lo < n; lo += B) {
    const int64_t hi = std::min(n, lo + B);
    int any = 0;
    if (mode == 0) {
      for (int64_t i = lo; i < hi; ++i) {
        const T a = (SEP ? vin[i] : v[i]) + g[i];
        v[i] = a;
        any |= (mag(a) >= t);
      }
    } else if (mode == 1) {
      for (int64_t i = lo; i < hi; ++i) {
        T un = (SEP ? uin[i] : u[i]) * m;
        un = un + g[i];
        u[i] = un;
        const T a = (SEP ? vin[i] : v[i]) + un;
        v[i] = a;
        any |= (mag(a) >= t);
      }
    } else {
      for (int64_t i = lo; i < hi; ++i) {
        T un = (SEP ? uin[i] : u[i]) * m;
        un = un + g[i];
        u[i] = un;
        T s = un * m;
        s = g[i] + s;
        const T a = (SEP ? vin[i] : v[i]) + s;
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

// -- quantizers: one-pass encode and decode + sum ------------------------------------------------
// The payload is hvdcompress.reference.quantizers' buffer: float32 scales (per segment: a bucket of
// a member, or the member), then the codes packed ``bits`` per entry (hvdcompress.packing's
// little-endian bit stream). Segments tile the flat tensor in order (seg_n: their lengths).
//
// Encode reads x (and the residual r) once per segment for its reduction (mean |a|, the means
// of the two signs, max |a|, the squared norm: sums in float64, each accumulator in order, as
// the oracle's float64 sums which it then rounds to float32 once), and once more to emit the
// codes, staged CB at a time in L1 and packed from there, and to write the residual
// r <- a - decoded (a = x + r; in place, or read from one buffer and written to another). A short
// segment (a bucket) is still in cache the second time. The stochastic rounding's uniforms are
// hvdcompress.rng's, computed inline from the entry's index. Decode + sum unpacks each rank's
// codes block by block into L1, adds the ranks' decoded values in rank order into an L1
// accumulator and writes each output entry once.
// Every float operation is the oracle's, one at a time, in its order (no FMA: -ffp-contract=off).
namespace quant {

#if defined(__GNUC__)
#define HVDC_INLINE inline __attribute__((always_inline))
#define HVDC_NOINLINE __attribute__((noinline))
#else
#define HVDC_INLINE inline
#define HVDC_NOINLINE
#endif

enum Kind { SIGN = 0, EFSIGN = 1, ONEBIT = 2, TERN = 3, QSGD = 4 };
constexpr int64_t CB = 2048;  // codes staged per block (a multiple of 8: blocks start on a byte)

// x if keep else +0.0, by masking the bits (a select the vectorizer keeps branch-free).
HVDC_INLINE double masked(double x, bool keep) {
  uint64_t b;
  std::memcpy(&b, &x, 8);
  b &= uint64_t(0) - uint64_t(keep);
  std::memcpy(&x, &b, 8);
  return x;
}
HVDC_INLINE float masked(float x, bool keep) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b &= uint32_t(0) - uint32_t(keep);
  std::memcpy(&x, &b, 4);
  return x;
}

// c ? x : y by masking the bits: exact (signed zeros, NaN) and free of branches, which the
// random signs and roundings would mispredict half the time where the loop is not vectorized.
HVDC_INLINE float select(bool c, float x, float y) {
  uint32_t bx, by;
  std::memcpy(&bx, &x, 4);
  std::memcpy(&by, &y, 4);
  const uint32_t m = uint32_t(0) - uint32_t(c);
  bx = (bx & m) | (by & ~m);
  std::memcpy(&x, &bx, 4);
  return x;
}

HVDC_INLINE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

// hvdcompress.rng.uniform's entry i of the stream whose constant is base.
HVDC_INLINE float uniform_at(uint32_t base, int64_t i) {
  const uint32_t h = mix32(uint32_t(i) * 0x61C88647u + base);
  return float(int32_t(h >> 8)) * 5.9604644775390625e-08f;  // 2**-24 (h >> 8 < 2**24: exact)
}

// The uniforms of entries i0 .. i0 + m - 1 (m <= CB), in a loop of their own (it vectorizes).
HVDC_INLINE void uniforms(uint32_t base, int64_t i0, int64_t m, float* __restrict u) {
  for (int64_t t = 0; t < m; ++t) u[t] = uniform_at(base, i0 + t);
}

inline int bits_for(int kind, int levels) {
  if (kind <= ONEBIT) return 1;
  if (kind == TERN) return 2;
  int b = 0;
  for (uint32_t v = uint32_t(2 * levels); v; v >>= 1) ++b;  // ceil(log2(2s + 1))
  return b < 1 ? 1 : b;
}

inline int scales_per_segment(int kind) { return kind == SIGN ? 0 : (kind == ONEBIT ? 2 : 1); }

inline int64_t packed_size(int64_t n, int bits) { return (n * bits + 7) / 8; }

// m codes (each < 2**bits) -> packed bytes; c holds 8 zero codes past m (the last group's padding).
HVDC_NOINLINE void pack(const uint8_t* __restrict c, int64_t m, int bits, uint8_t* __restrict out) {
  const int64_t nbytes = packed_size(m, bits), full = m / 8;
  if (bits == 1) {
    int64_t j = 0;
#if defined(__SSE2__)
    for (; j + 2 <= full; j += 2) {  // 16 codes: bit 0 of each byte to bit 7, then movemask
      const __m128i v = _mm_slli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 8 * j)), 7);
      const uint32_t bitsv = uint32_t(_mm_movemask_epi8(v));
      out[j] = uint8_t(bitsv);
      out[j + 1] = uint8_t(bitsv >> 8);
    }
#endif
    for (; j < nbytes; ++j) {
      const uint8_t* g = c + 8 * j;
      out[j] = uint8_t(g[0] | (g[1] << 1) | (g[2] << 2) | (g[3] << 3) | (g[4] << 4) | (g[5] << 5) | (g[6] << 6) |
                       (g[7] << 7));
    }
    return;
  }
  if (bits == 2) {
    for (int64_t j = 0; j < nbytes; ++j) {
      const uint8_t* g = c + 4 * j;
      out[j] = uint8_t(g[0] | (g[1] << 2) | (g[2] << 4) | (g[3] << 6));
    }
    return;
  }
  if (bits == 4) {
    for (int64_t j = 0; j < nbytes; ++j) out[j] = uint8_t(c[2 * j] | (c[2 * j + 1] << 4));
    return;
  }
  if (bits == 8) {
    std::memcpy(out, c, size_t(m));
    return;
  }
  for (int64_t g = 0; g < full; ++g) {  // 3, 5, 6, 7 bits: 8 codes make `bits` bytes
    uint64_t w = 0;
    for (int k = 0; k < 8; ++k) w |= uint64_t(c[8 * g + k]) << (bits * k);
    for (int b = 0; b < bits; ++b) out[g * bits + b] = uint8_t(w >> (8 * b));
  }
  if (m % 8) {
    uint64_t w = 0;
    for (int k = 0; k < 8; ++k) w |= uint64_t(c[8 * full + k]) << (bits * k);
    for (int64_t b = full * bits; b < nbytes; ++b) out[b] = uint8_t(w >> (8 * (b - full * bits)));
  }
}

// A byte's eight bits as eight bytes of 0 or 1 (bit k in byte k of the little-endian word).
struct Spread {
  uint64_t v[256];
  constexpr Spread() : v() {
    for (int b = 0; b < 256; ++b) {
      uint64_t w = 0;
      for (int k = 0; k < 8; ++k) w |= uint64_t((b >> k) & 1) << (8 * k);
      v[b] = w;
    }
  }
};
constexpr Spread SPREAD{};

// The m codes from code index lo (a multiple of 8) of a stream of `avail` bytes -> c[0..m).
HVDC_NOINLINE void unpack(const uint8_t* __restrict in, int64_t lo, int64_t m, int bits, int64_t avail,
                        uint8_t* __restrict c) {
  const uint8_t* src = in + lo / 8 * bits;
  const int64_t nbytes = packed_size(m, bits);
  const uint8_t mask = uint8_t((1 << bits) - 1);
  if (bits == 1) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (int64_t j = 0; j < nbytes; ++j) std::memcpy(c + 8 * j, &SPREAD.v[src[j]], 8);
#else
    for (int64_t j = 0; j < nbytes; ++j) {
      const uint8_t b = src[j];
      for (int k = 0; k < 8; ++k) c[8 * j + k] = (b >> k) & 1;
    }
#endif
    return;
  }
  if (bits == 2) {
    for (int64_t j = 0; j < nbytes; ++j) {
      const uint8_t b = src[j];
      for (int k = 0; k < 4; ++k) c[4 * j + k] = (b >> (2 * k)) & 3;
    }
    return;
  }
  if (bits == 4) {
    for (int64_t j = 0; j < nbytes; ++j) {
      c[2 * j] = src[j] & 15;
      c[2 * j + 1] = src[j] >> 4;
    }
    return;
  }
  if (bits == 8) {
    std::memcpy(c, src, size_t(m));
    return;
  }
  const int64_t groups = (m + 7) / 8, left = avail - lo / 8 * bits;
  for (int64_t g = 0; g < groups; ++g) {
    uint64_t w = 0;
    for (int b = 0; b < bits; ++b) {
      const int64_t at = g * bits + b;
      w |= uint64_t(at < left ? src[at] : 0) << (8 * b);
    }
    for (int k = 0; k < 8; ++k) c[8 * g + k] = uint8_t(w >> (bits * k)) & mask;
  }
}

// Where a is read from and the residual goes. RM 0: a = x, no residual; 1: a = x, r <- a - d;
// 2: a = x + r, r <- a - d in place (one pointer, so the vectorizer sees the same entry read and
// written, not two arrays that might overlap); 3: a = x + ri, r <- a - d into another buffer (a
// caller whose residual is immutable, as a TensorFlow variable's value seen from numpy).
template <int RM>
struct Src {
  static constexpr bool ADDS = RM >= 2;  // a = x + r
  const float* x;
  float* r;
  const float* ri = nullptr;  // RM 3: the residual read
  HVDC_INLINE const float* rin() const { return RM == 3 ? ri : r; }
  HVDC_INLINE float a(int64_t i) const { return RM == 2 ? x[i] + r[i] : (RM == 3 ? x[i] + ri[i] : x[i]); }
  HVDC_INLINE void keep(int64_t i, float a, float d) const {
    if (RM) r[i] = a - d;
  }
};

struct SignEnc {
  template <class S> HVDC_INLINE void begin(const S&, int64_t, int64_t, int64_t, float*) {}
  template <class S> HVDC_INLINE void run(const S& s, int64_t i0, int64_t m, uint8_t* __restrict c) {
    for (int64_t t = 0; t < m; ++t) c[t] = s.a(i0 + t) >= 0.0f;
  }
};

struct EFSignEnc {
  float sc = 0;
  template <class S> HVDC_INLINE void begin(const S& s, int64_t j, int64_t off, int64_t len, float* scales) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = off;
    const int64_t end = off + len;
    for (; i + 8 <= end; i += 8)
      for (int k = 0; k < 8; ++k) acc[k] += double(std::fabs(s.a(i + k)));
    for (; i < end; ++i) acc[0] += double(std::fabs(s.a(i)));
    const double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    sc = float(sum / double(len));
    scales[j] = sc;
  }
  template <class S> HVDC_INLINE void run(const S& s, int64_t i0, int64_t m, uint8_t* __restrict c) {
    const float p = sc, q = -sc;
    for (int64_t t = 0; t < m; ++t) {
      const float a = s.a(i0 + t);
      const bool b = a >= 0.0f;
      c[t] = b;
      s.keep(i0 + t, a, b ? p : q);
    }
  }
};

struct OneBitEnc {
  float pos = 0, neg = 0;
  template <class S> HVDC_INLINE void begin(const S& s, int64_t j, int64_t off, int64_t len, float* scales) {
    double ps[4] = {0, 0, 0, 0}, ns[4] = {0, 0, 0, 0}, pc[4] = {0, 0, 0, 0};
    int64_t i = off;
    const int64_t end = off + len;
    for (; i + 4 <= end; i += 4)
      for (int k = 0; k < 4; ++k) {
        const float a = s.a(i + k);
        const bool b = a >= 0.0f;
        ps[k] += masked(double(a), b);
        ns[k] += masked(double(a), !b);
        pc[k] += masked(1.0, b);
      }
    for (; i < end; ++i) {
      const float a = s.a(i);
      const bool b = a >= 0.0f;
      ps[0] += masked(double(a), b);
      ns[0] += masked(double(a), !b);
      pc[0] += masked(1.0, b);
    }
    const double psum = (ps[0] + ps[1]) + (ps[2] + ps[3]), nsum = (ns[0] + ns[1]) + (ns[2] + ns[3]);
    const double pn = (pc[0] + pc[1]) + (pc[2] + pc[3]), nn = double(len) - pn;  // exact counts
    pos = pn > 0 ? float(psum / pn) : 0.0f;
    neg = nn > 0 ? float(nsum / nn) : 0.0f;
    scales[2 * j] = pos;
    scales[2 * j + 1] = neg;
  }
  template <class S> HVDC_INLINE void run(const S& s, int64_t i0, int64_t m, uint8_t* __restrict c) {
    const float p = pos, q = neg;
    for (int64_t t = 0; t < m; ++t) {
      const float a = s.a(i0 + t);
      const bool b = a >= 0.0f;
      c[t] = b;
      s.keep(i0 + t, a, select(b, p, q));
    }
  }
};

struct TernEnc {
  uint32_t base;
  float sc = 0;
  explicit TernEnc(uint32_t b) : base(b) {}
  template <class S> HVDC_INLINE void begin(const S& s, int64_t j, int64_t off, int64_t len, float* scales) {
    float mx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int nan = 0;
    int64_t i = off;
    const int64_t end = off + len;
    for (; i + 8 <= end; i += 8)
      for (int k = 0; k < 8; ++k) {
        const float v = std::fabs(s.a(i + k));
        nan |= (v != v);
        mx[k] = v > mx[k] ? v : mx[k];
      }
    for (; i < end; ++i) {
      const float v = std::fabs(s.a(i));
      nan |= (v != v);
      mx[0] = v > mx[0] ? v : mx[0];
    }
    float m = mx[0];
    for (int k = 1; k < 8; ++k) m = mx[k] > m ? mx[k] : m;
    sc = nan ? std::numeric_limits<float>::quiet_NaN() : m;  // max propagates NaN, as numpy's
    scales[j] = sc;
  }
  template <class S> HVDC_INLINE void run(const S& s, int64_t i0, int64_t m, uint8_t* __restrict c) {
    const float p = sc, q = -sc;
    if (sc > 0.0f) {
      alignas(64) float u[CB];
      uniforms(base, i0, m, u);
      for (int64_t t = 0; t < m; ++t) {
        const float a = s.a(i0 + t);
        const bool keep = u[t] < std::fabs(a) / p;
        const bool pos = a >= 0.0f;
        c[t] = uint8_t(int(keep) * (2 - int(pos)));  // 0, 1 (+s) or 2 (-s)
        s.keep(i0 + t, a, select(keep, select(pos, p, q), 0.0f));
      }
    } else {  // no scale (0 or NaN): every probability is 0
      for (int64_t t = 0; t < m; ++t) {
        c[t] = 0;
        s.keep(i0 + t, s.a(i0 + t), 0.0f);
      }
    }
  }
};

struct QsgdEnc {
  uint32_t base;
  float S, inv;  // levels, float32(1 / levels)
  float f = 0, w = 0;
  QsgdEnc(uint32_t b, int levels) : base(b), S(float(levels)), inv(float(1.0 / double(levels))) {}
  template <class Src_> HVDC_INLINE void begin(const Src_& s, int64_t j, int64_t off, int64_t len, float* scales) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = off;
    const int64_t end = off + len;
    for (; i + 8 <= end; i += 8)
      for (int k = 0; k < 8; ++k) {
        const double a = double(s.a(i + k));
        acc[k] += a * a;
      }
    for (; i < end; ++i) {
      const double a = double(s.a(i));
      acc[0] += a * a;
    }
    const double sq = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float v = float(std::sqrt(sq));
    f = v > 0.0f ? S / v : 0.0f;
    w = v * inv;
    scales[j] = v;
  }
  template <class Src_> HVDC_INLINE void run(const Src_& s, int64_t i0, int64_t m, uint8_t* __restrict c) {
    const float ff = f, ww = w, SS = S;
    alignas(64) float u[CB];
    uniforms(base, i0, m, u);
    for (int64_t t = 0; t < m; ++t) {
      const float a = s.a(i0 + t);
      const float r = std::fabs(a) * ff;
      const float low = std::floor(r);
      float lvl = low + (u[t] < (r - low) ? 1.0f : 0.0f);
      lvl = lvl > SS ? SS : lvl;  // the min with s (NaN stays NaN, as numpy's minimum)
      const float sg = a >= 0.0f ? lvl : -lvl;
      c[t] = uint8_t(int32_t(sg + SS));
      // the decoded value (code - s) * w: code - s is sg exactly (an integer in [-s, s]); a NaN
      // converts to code 0 (x86's conversion, as numpy's), i.e. -s
      s.keep(i0 + t, a, select(sg != sg, -SS, sg) * ww);
    }
  }
};

template <class Enc, int RM>
HVDC_INLINE void encode_all(Enc& enc, const Src<RM>& s, const int64_t* seg_n, int64_t nseg, int bits, float* scales,
                uint8_t* packed) {
  alignas(64) uint8_t c[CB + 16];
  int64_t fill = 0, first = 0, off = 0;  // codes staged; index of the first staged code
  for (int64_t j = 0; j < nseg; ++j) {
    const int64_t end = off + seg_n[j];
    enc.begin(s, j, off, seg_n[j], scales);
    for (int64_t i = off; i < end;) {
      const int64_t m = std::min(end - i, CB - fill);
      enc.run(s, i, m, c + fill);
      fill += m;
      i += m;
      if (fill == CB) {
        pack(c, CB, bits, packed + first / 8 * bits);
        first += CB;
        fill = 0;
      }
    }
    off = end;
  }
  if (fill) {
    std::memset(c + fill, 0, 16);
    pack(c, fill, bits, packed + first / 8 * bits);
  }
}

template <class Enc>
HVDC_INLINE void encode_rm(Enc& enc, const float* x, const float* rin, float* rout, const int64_t* seg_n, int64_t nseg,
               int bits, float* scales, uint8_t* packed) {
  if (rout == nullptr) {
    encode_all(enc, Src<0>{x, nullptr}, seg_n, nseg, bits, scales, packed);
  } else if (rin == nullptr) {
    encode_all(enc, Src<1>{x, rout}, seg_n, nseg, bits, scales, packed);
  } else if (rin == rout) {
    encode_all(enc, Src<2>{x, rout}, seg_n, nseg, bits, scales, packed);
  } else {
    encode_all(enc, Src<3>{x, rout, rin}, seg_n, nseg, bits, scales, packed);
  }
}

// Decoders: the value of each code of a segment, written (first rank) or added (rank order).
struct EFSignDec {
  template <bool First> HVDC_INLINE static void apply(const float* sc, int64_t j, const uint8_t* __restrict c,
                                                      float* __restrict acc, int64_t m, float) {
    const float p = sc[j], q = -sc[j];
    for (int64_t t = 0; t < m; ++t) {
      const float v = c[t] ? p : q;
      acc[t] = First ? v : acc[t] + v;
    }
  }
};
struct OneBitDec {
  template <bool First> HVDC_INLINE static void apply(const float* sc, int64_t j, const uint8_t* __restrict c,
                                                      float* __restrict acc, int64_t m, float) {
    const float p = sc[2 * j], q = sc[2 * j + 1];
    for (int64_t t = 0; t < m; ++t) {
      const float v = c[t] ? p : q;
      acc[t] = First ? v : acc[t] + v;
    }
  }
};
struct TernDec {
  template <bool First> HVDC_INLINE static void apply(const float* sc, int64_t j, const uint8_t* __restrict c,
                                                      float* __restrict acc, int64_t m, float) {
    const float p = sc[j], q = -sc[j];
    for (int64_t t = 0; t < m; ++t) {
      const float v = c[t] == 1 ? p : (c[t] == 2 ? q : 0.0f);
      acc[t] = First ? v : acc[t] + v;
    }
  }
};
struct QsgdDec {  // sc holds w = v * float32(1/s) per segment (computed once per rank)
  template <bool First> HVDC_INLINE static void apply(const float* sc, int64_t j, const uint8_t* __restrict c,
                                                      float* __restrict acc, int64_t m, float S) {
    const float w = sc[j];
    for (int64_t t = 0; t < m; ++t) {
      const float v = (float(c[t]) - S) * w;
      acc[t] = First ? v : acc[t] + v;
    }
  }
};

template <class Dec>
HVDC_INLINE void decode_all(const uint8_t* buf, int64_t part, int64_t world, int64_t n, const int64_t* seg_n, int64_t nseg,
                int bits, int nsc, float S, float scale, float* out) {
  const int64_t head = 4 * nseg * nsc, avail = part - head;
  std::vector<float> sc(size_t(world * nseg * nsc));
  for (int64_t w = 0; w < world; ++w) {
    float* d = sc.data() + w * nseg * nsc;
    std::memcpy(d, buf + w * part, size_t(head));
    if (S > 0.0f) {
      const float inv = float(1.0 / double(S));
      for (int64_t j = 0; j < nseg; ++j) d[j] = d[j] * inv;
    }
  }
  std::vector<int64_t> start(size_t(nseg + 1), 0);
  for (int64_t j = 0; j < nseg; ++j) start[j + 1] = start[j] + seg_n[j];
  alignas(64) float acc[CB];
  alignas(64) uint8_t c[CB + 16];
  int64_t j0 = 0;  // the segment holding the block's first entry
  for (int64_t lo = 0; lo < n; lo += CB) {
    const int64_t m = std::min(n - lo, CB);
    while (start[j0 + 1] <= lo) ++j0;
    for (int64_t w = 0; w < world; ++w) {
      unpack(buf + w * part + head, lo, m, bits, avail, c);
      const float* s = sc.data() + w * nseg * nsc;
      for (int64_t i = lo, j = j0; i < lo + m; ++j) {
        const int64_t e = std::min(lo + m, start[j + 1]);
        if (w == 0)
          Dec::template apply<true>(s, j, c + (i - lo), acc + (i - lo), e - i, S);
        else
          Dec::template apply<false>(s, j, c + (i - lo), acc + (i - lo), e - i, S);
        i = e;
      }
    }
    if (scale != 1.0f) {
      for (int64_t t = 0; t < m; ++t) out[lo + t] = acc[t] * scale;
    } else {
      std::memcpy(out + lo, acc, size_t(m) * 4);
    }
  }
}

// signSGD's majority vote: sign(sum over ranks of +-1) * world, times scale.
HVDC_INLINE void decode_vote(const uint8_t* buf, int64_t part, int64_t world, int64_t n, float scale, float* out) {
  alignas(64) int32_t cnt[CB];
  alignas(64) uint8_t c[CB + 16];
  const float W = float(world);
  for (int64_t lo = 0; lo < n; lo += CB) {
    const int64_t m = std::min(n - lo, CB);
    for (int64_t t = 0; t < m; ++t) cnt[t] = 0;
    for (int64_t w = 0; w < world; ++w) {
      unpack(buf + w * part, lo, m, 1, part, c);
      for (int64_t t = 0; t < m; ++t) cnt[t] += c[t];
    }
    for (int64_t t = 0; t < m; ++t) {
      const int64_t v = 2 * int64_t(cnt[t]) - world;
      float r = float((v > 0) - (v < 0)) * W;
      out[lo + t] = scale != 1.0f ? r * scale : r;
    }
  }
}

HVDC_INLINE int64_t encode(int kind, const float* x, const float* rin, float* rout, int64_t n, const int64_t* seg_n,
               int64_t nseg, int levels, uint32_t base, uint8_t* out, int64_t out_bytes) {
  int64_t total = 0;
  for (int64_t j = 0; j < nseg; ++j) {
    if (seg_n[j] <= 0) return -1;
    total += seg_n[j];
  }
  const int bits = bits_for(kind, levels);
  const int nsc = scales_per_segment(kind);
  if (total != n || out_bytes != 4 * nseg * nsc + packed_size(n, bits) || (kind == QSGD && levels < 1) ||
      (rin != nullptr && rout == nullptr))  // a residual read is a residual written
    return -1;
  std::vector<float> scales(size_t(nseg * nsc) + 1);
  uint8_t* packed = out + 4 * nseg * nsc;
  switch (kind) {
    case SIGN: {
      SignEnc e;
      encode_rm(e, x, rin, rout, seg_n, nseg, bits, scales.data(), packed);
      break;
    }
    case EFSIGN: {
      EFSignEnc e;
      encode_rm(e, x, rin, rout, seg_n, nseg, bits, scales.data(), packed);
      break;
    }
    case ONEBIT: {
      OneBitEnc e;
      encode_rm(e, x, rin, rout, seg_n, nseg, bits, scales.data(), packed);
      break;
    }
    case TERN: {
      TernEnc e(base);
      encode_rm(e, x, rin, rout, seg_n, nseg, bits, scales.data(), packed);
      break;
    }
    case QSGD: {
      QsgdEnc e(base, levels);
      encode_rm(e, x, rin, rout, seg_n, nseg, bits, scales.data(), packed);
      break;
    }
    default:
      return -1;
  }
  std::memcpy(out, scales.data(), size_t(4 * nseg * nsc));
  return 0;
}

HVDC_INLINE int64_t decode_sum(int kind, const uint8_t* buf, int64_t part, int64_t world, int64_t n, const int64_t* seg_n,
                   int64_t nseg, int levels, float scale, float* out) {
  int64_t total = 0;
  for (int64_t j = 0; j < nseg; ++j) {
    if (seg_n[j] <= 0) return -1;
    total += seg_n[j];
  }
  const int bits = bits_for(kind, levels);
  const int nsc = scales_per_segment(kind);
  if (total != n || world < 1 || part != 4 * nseg * nsc + packed_size(n, bits) || (kind == QSGD && levels < 1))
    return -1;
  switch (kind) {
    case SIGN:
      decode_vote(buf, part, world, n, scale, out);
      break;
    case EFSIGN:
      decode_all<EFSignDec>(buf, part, world, n, seg_n, nseg, bits, nsc, 0.0f, scale, out);
      break;
    case ONEBIT:
      decode_all<OneBitDec>(buf, part, world, n, seg_n, nseg, bits, nsc, 0.0f, scale, out);
      break;
    case TERN:
      decode_all<TernDec>(buf, part, world, n, seg_n, nseg, bits, nsc, 0.0f, scale, out);
      break;
    case QSGD:
      decode_all<QsgdDec>(buf, part, world, n, seg_n, nseg, bits, nsc, float(levels), scale, out);
      break;
    default:
      return -1;
  }
  return 0;
}


// 1-bit SGD per column (Seide et al.): members given as (rows, cols) pairs tiling [0, n) in order,
// each viewed row-major as (rows, cols); payload [float32 (pos, neg) per column | packed signs].
// The column sums follow numpy's float64 reductions in the oracle (``encode_columns``), which start
// from 0: a matrix (cols > 1) adds its rows one after another into each column; a single column
// is one 1-D sum, which numpy does in buffer chunks of 8192 entries, each summed pairwise (8 lanes
// up to 128 entries, halves above), the chunks added in order to 0. The entries >= 0 and the others
// are summed apart (the other part's lanes get +0.0, as numpy's where), each as numpy adds.
//
// Encode is two reads of a = x + r: the sums (lanes that vectorize, counts exact in doubles),
// then the signs and the residual r <- a - (pos or neg of the entry's column), staged CB codes at
// a time and packed. Decode + sum unpacks each rank's codes block by block and adds the ranks'
// values in rank order in an L1 accumulator. Both run over a member's rows a stretch of columns
// at a time (the column values deinterleaved, so the loops vectorize), a single column with its
// two values held in registers.

constexpr int64_t NP_BUF = 8192;  // numpy's default buffer size (the chunk of a 1-D reduction)

#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"  // the vector helpers are inlined: no ABI crosses a call
// Eight lanes as two vectors of four doubles (GCC/clang vector extensions: element-wise IEEE
// operations, lowered to whatever width the target has).
typedef float v4f __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
typedef long long v4l __attribute__((vector_size(32)));

template <class S>
HVDC_INLINE v4d load4d(const S& s, int64_t i) {
  v4f a;
  std::memcpy(&a, s.x + i, 16);
  if (S::ADDS) {
    v4f r;
    std::memcpy(&r, s.rin() + i, 16);
    a = a + r;
  }
  return __builtin_convertvector(a, v4d);
}

struct Lanes {
  v4d p0, p1, q0, q1, c0, c1;
  HVDC_INLINE static void parts(const v4d& d, v4d& p, v4d& q, v4d& c, bool first) {
    const v4l m = d >= 0.0;  // all ones where a >= 0 (false for NaN)
    const v4d one = {1.0, 1.0, 1.0, 1.0};
    const v4d pp = (v4d)((v4l)d & m), qq = (v4d)((v4l)d & ~m), cc = (v4d)((v4l)one & m);
    if (first) {
      p = pp;
      q = qq;
      c = cc;
    } else {
      p += pp;
      q += qq;
      c += cc;
    }
  }
  template <class S> HVDC_INLINE void set(const S& s, int64_t i) {
    parts(load4d(s, i), p0, q0, c0, true);
    parts(load4d(s, i + 4), p1, q1, c1, true);
  }
  template <class S> HVDC_INLINE void add(const S& s, int64_t i) {
    parts(load4d(s, i), p0, q0, c0, false);
    parts(load4d(s, i + 4), p1, q1, c1, false);
  }
  HVDC_INLINE static void store(const v4d& lo, const v4d& hi, double* r) {
    std::memcpy(r, &lo, 32);
    std::memcpy(r + 4, &hi, 32);
  }
  HVDC_INLINE void out(double* p, double* q, double* c) const {
    store(p0, p1, p);
    store(q0, q1, q);
    store(c0, c1, c);
  }
};
#else
struct Lanes {  // the same eight lanes, one entry at a time
  double p[8], q[8], c[8];
  template <class S> HVDC_INLINE void set(const S& s, int64_t i) {
    for (int k = 0; k < 8; ++k) {
      const float a = s.a(i + k);
      const bool b = a >= 0.0f;
      p[k] = masked(double(a), b);
      q[k] = masked(double(a), !b);
      c[k] = masked(1.0, b);
    }
  }
  template <class S> HVDC_INLINE void add(const S& s, int64_t i) {
    for (int k = 0; k < 8; ++k) {
      const float a = s.a(i + k);
      const bool b = a >= 0.0f;
      p[k] += masked(double(a), b);
      q[k] += masked(double(a), !b);
      c[k] += masked(1.0, b);
    }
  }
  HVDC_INLINE void out(double* pp, double* qq, double* cc) const {
    for (int k = 0; k < 8; ++k) {
      pp[k] = p[k];
      qq[k] = q[k];
      cc[k] = c[k];
    }
  }
};
#endif

HVDC_INLINE double tree8(const double* r) { return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])); }

// numpy's pairwise sum splits n > 128 entries at n / 2 rounded down to a multiple of 8 and adds
// the halves' sums; a leaf of 8 .. 128 entries is summed in eight lanes (started from the first
// eight entries) added as a tree, then the rest one by one; a leaf under 8 entries from 0. The
// leaves are summed in a loop of their own (inlined into the entry point, so it gets the CPU's
// vector width), the tree over their sums is added afterwards.
constexpr int MAX_LEAVES = 256;  // a chunk of NP_BUF entries has at most 128 leaves

inline void pairwise_leaves(int64_t n, int64_t* len, int& count) {
  if (n <= 128) {
    len[count++] = n;
    return;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  pairwise_leaves(n2, len, count);
  pairwise_leaves(n - n2, len, count);
}

inline double pairwise_combine(int64_t n, const double* leaf, int& at) {
  if (n <= 128) return leaf[at++];
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  const double a = pairwise_combine(n2, leaf, at);
  return a + pairwise_combine(n - n2, leaf, at);
}

// One leaf's sums of the masked parts of a[off, off + n), n <= 128; pn counts the entries >= 0.
template <class S>
HVDC_INLINE void leaf_pn(const S& s, int64_t off, int64_t n, double& ps, double& ns, double& pn) {
  if (n < 8) {
    double p = 0.0, q = 0.0;
    for (int64_t i = off; i < off + n; ++i) {
      const float a = s.a(i);
      const bool b = a >= 0.0f;
      p += masked(double(a), b);
      q += masked(double(a), !b);
      pn += b;
    }
    ps = p;
    ns = q;
    return;
  }
  Lanes ln;  // the lanes start from the first eight entries, as numpy's
  ln.set(s, off);
  const int64_t whole = n - (n % 8);
  int64_t i = 8;
  for (; i < whole; i += 8) ln.add(s, off + i);
  alignas(64) double p[8], q[8], c[8];
  ln.out(p, q, c);
  double rp = tree8(p), rq = tree8(q);
  pn += tree8(c);  // an exact count
  for (; i < n; ++i) {
    const float a = s.a(off + i);
    const bool b = a >= 0.0f;
    rp += masked(double(a), b);
    rq += masked(double(a), !b);
    pn += b;
  }
  ps = rp;
  ns = rq;
}

// numpy's pairwise sums of the masked parts of a[off, off + n), n <= NP_BUF.
template <class S>
HVDC_INLINE void pairwise_pn(const S& s, int64_t off, int64_t n, double& ps, double& ns, double& pn) {
  int64_t len[MAX_LEAVES];
  double lp[MAX_LEAVES], lq[MAX_LEAVES];
  int count = 0;
  pairwise_leaves(n, len, count);
  for (int l = 0; l < count; ++l) {
    leaf_pn(s, off, len[l], lp[l], lq[l], pn);
    off += len[l];
  }
  int at = 0;
  ps = pairwise_combine(n, lp, at);
  at = 0;
  ns = pairwise_combine(n, lq, at);
}

HVDC_INLINE float mean_or_zero(double sum, double count) { return count > 0 ? float(sum / count) : 0.0f; }

// The (pos, neg) values of every column of one member at off, into P[0 .. cols) and Q[0 .. cols).
// work holds 3 * cols doubles.
template <class S>
HVDC_INLINE void column_means(const S& s, int64_t off, int64_t rows, int64_t cols, double* work, float* P, float* Q) {
  if (cols == 1) {
    double ps = 0.0, ns = 0.0, pn = 0.0;
    for (int64_t lo = 0; lo < rows; lo += NP_BUF) {
      const int64_t m = std::min(rows - lo, NP_BUF);
      double p, q;
      pairwise_pn(s, off + lo, m, p, q, pn);
      ps += p;
      ns += q;
    }
    P[0] = mean_or_zero(ps, pn);
    Q[0] = mean_or_zero(ns, double(rows) - pn);
    return;
  }
  double* __restrict ps = work;
  double* __restrict ns = work + cols;
  double* __restrict pc = work + 2 * cols;
  for (int64_t j = 0; j < cols; ++j) {
    ps[j] = 0.0;
    ns[j] = 0.0;
    pc[j] = 0.0;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = off + r * cols;
    for (int64_t j = 0; j < cols; ++j) {
      const float a = s.a(base + j);
      const bool b = a >= 0.0f;
      const double d = double(a);
      ps[j] += masked(d, b);
      ns[j] += masked(d, !b);
      pc[j] += masked(1.0, b);
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    P[j] = mean_or_zero(ps[j], pc[j]);
    Q[j] = mean_or_zero(ns[j], double(rows) - pc[j]);
  }
}

// Signs and residual of entries i .. i + m - 1 of a member (the first in column j): a stretch of
// columns at a time, or a single column's two values throughout.
template <class S>
HVDC_INLINE void emit_cols(const S& s, int64_t i, int64_t m, int64_t j, int64_t cols, const float* P, const float* Q,
                           uint8_t* __restrict c) {
  if (cols == 1) {
    const float p = P[0], q = Q[0];
    for (int64_t t = 0; t < m; ++t) {
      const float a = s.a(i + t);
      const bool b = a >= 0.0f;
      c[t] = b;
      s.keep(i + t, a, select(b, p, q));
    }
    return;
  }
  for (int64_t t = 0; t < m;) {
    const int64_t len = std::min(m - t, cols - j);
    const float* __restrict pp = P + j;
    const float* __restrict qq = Q + j;
    const int64_t at = i + t;
    uint8_t* __restrict cc = c + t;
    for (int64_t u = 0; u < len; ++u) {
      const float a = s.a(at + u);
      const bool b = a >= 0.0f;
      cc[u] = b;
      s.keep(at + u, a, select(b, pp[u], qq[u]));
    }
    t += len;
    j += len;
    if (j == cols) j = 0;
  }
}

template <int RM>
HVDC_INLINE void encode_cols_rm(const Src<RM>& s, const int64_t* dims, int64_t nm, float* scales, uint8_t* packed) {
  int64_t widest = 1;
  for (int64_t k = 0; k < nm; ++k) widest = std::max(widest, dims[2 * k + 1]);
  std::vector<double> work(size_t(3 * widest));
  std::vector<float> pq(size_t(2 * widest));
  float* P = pq.data();
  float* Q = P + widest;
  alignas(64) uint8_t c[CB + 16];
  int64_t fill = 0, first = 0, off = 0;
  float* sc = scales;
  for (int64_t k = 0; k < nm; ++k) {
    const int64_t rows = dims[2 * k], cols = dims[2 * k + 1], end = off + rows * cols;
    column_means(s, off, rows, cols, work.data(), P, Q);  // first read: the column values
    for (int64_t j = 0; j < cols; ++j) {
      sc[2 * j] = P[j];
      sc[2 * j + 1] = Q[j];
    }
    for (int64_t i = off; i < end;) {  // second read: signs and residual
      const int64_t m = std::min(end - i, CB - fill);
      emit_cols(s, i, m, cols == 1 ? 0 : (i - off) % cols, cols, P, Q, c + fill);
      fill += m;
      i += m;
      if (fill == CB) {
        pack(c, CB, 1, packed + first / 8);
        first += CB;
        fill = 0;
      }
    }
    sc += 2 * cols;
    off = end;
  }
  if (fill) {
    std::memset(c + fill, 0, 16);
    pack(c, fill, 1, packed + first / 8);
  }
}

// Checks the (rows, cols) pairs tile [0, n); the number of columns, or -1.
inline int64_t count_columns(const int64_t* dims, int64_t nm, int64_t n) {
  int64_t total = 0, ncols = 0;
  for (int64_t k = 0; k < nm; ++k) {
    if (dims[2 * k] <= 0 || dims[2 * k + 1] <= 0) return -1;
    total += dims[2 * k] * dims[2 * k + 1];
    ncols += dims[2 * k + 1];
  }
  return total == n ? ncols : -1;
}

HVDC_INLINE int64_t encode_cols(const float* x, const float* rin, float* rout, int64_t n, const int64_t* dims,
                                int64_t nm, uint8_t* out, int64_t out_bytes) {
  const int64_t ncols = count_columns(dims, nm, n);
  if (ncols < 0 || out_bytes != 8 * ncols + packed_size(n, 1) || (rin != nullptr && rout == nullptr)) return -1;
  std::vector<float> scales(size_t(2 * ncols) + 1);
  uint8_t* packed = out + 8 * ncols;
  if (rout == nullptr) {
    encode_cols_rm(Src<0>{x, nullptr}, dims, nm, scales.data(), packed);
  } else if (rin == nullptr) {
    encode_cols_rm(Src<1>{x, rout}, dims, nm, scales.data(), packed);
  } else if (rin == rout) {
    encode_cols_rm(Src<2>{x, rout}, dims, nm, scales.data(), packed);
  } else {
    encode_cols_rm(Src<3>{x, rout, rin}, dims, nm, scales.data(), packed);
  }
  std::memcpy(out, scales.data(), size_t(8 * ncols));
  return 0;
}

// Adds (First: writes) the values of codes c[0 .. m) of a member, the first in column j.
template <bool First>
HVDC_INLINE void decode_cols(const uint8_t* __restrict c, int64_t m, int64_t j, int64_t cols, const float* P,
                             const float* Q, float* __restrict acc) {
  if (cols == 1) {
    const float p = P[0], q = Q[0];
    for (int64_t t = 0; t < m; ++t) {
      const float v = select(c[t] != 0, p, q);
      acc[t] = First ? v : acc[t] + v;
    }
    return;
  }
  for (int64_t t = 0; t < m;) {
    const int64_t len = std::min(m - t, cols - j);
    const float* __restrict pp = P + j;
    const float* __restrict qq = Q + j;
    const uint8_t* __restrict cc = c + t;
    float* __restrict aa = acc + t;
    for (int64_t u = 0; u < len; ++u) {
      const float v = select(cc[u] != 0, pp[u], qq[u]);
      aa[u] = First ? v : aa[u] + v;
    }
    t += len;
    j += len;
    if (j == cols) j = 0;
  }
}

// Sum over ranks (in rank order) of every entry's column value for its bit, times scale.
HVDC_INLINE int64_t decode_sum_cols(const uint8_t* buf, int64_t part, int64_t world, int64_t n, const int64_t* dims,
                                    int64_t nm, float scale, float* out) {
  const int64_t ncols = count_columns(dims, nm, n);
  if (ncols < 0 || world < 1 || part != 8 * ncols + packed_size(n, 1)) return -1;
  const int64_t head = 8 * ncols, avail = part - head;
  // the column values of every rank, deinterleaved: rank w's P at pq[2 w ncols], Q ncols later
  std::vector<float> pq(size_t(world * 2 * ncols) + 1);
  for (int64_t w = 0; w < world; ++w) {
    float pair[2];
    for (int64_t j = 0; j < ncols; ++j) {
      std::memcpy(pair, buf + w * part + 8 * j, 8);
      pq[size_t(w * 2 * ncols + j)] = pair[0];
      pq[size_t(w * 2 * ncols + ncols + j)] = pair[1];
    }
  }
  std::vector<int64_t> start(size_t(nm + 1), 0), col0(size_t(nm + 1), 0);
  for (int64_t k = 0; k < nm; ++k) {
    start[k + 1] = start[k] + dims[2 * k] * dims[2 * k + 1];
    col0[k + 1] = col0[k] + dims[2 * k + 1];
  }
  alignas(64) float acc[CB];
  alignas(64) uint8_t c[CB + 16];
  int64_t k0 = 0;  // the member holding the block's first entry
  for (int64_t lo = 0; lo < n; lo += CB) {
    const int64_t m = std::min(n - lo, CB);
    while (start[k0 + 1] <= lo) ++k0;
    for (int64_t w = 0; w < world; ++w) {
      unpack(buf + w * part + head, lo, m, 1, avail, c);
      const float* P = pq.data() + w * 2 * ncols;
      for (int64_t i = lo, k = k0; i < lo + m; ++k) {
        const int64_t e = std::min(lo + m, start[k + 1]), cols = dims[2 * k + 1];
        const int64_t j = cols == 1 ? 0 : (i - start[k]) % cols;
        if (w == 0)
          decode_cols<true>(c + (i - lo), e - i, j, cols, P + col0[k], P + ncols + col0[k], acc + (i - lo));
        else
          decode_cols<false>(c + (i - lo), e - i, j, cols, P + col0[k], P + ncols + col0[k], acc + (i - lo));
        i = e;
      }
    }
    if (scale != 1.0f) {
      for (int64_t t = 0; t < m; ++t) out[lo + t] = acc[t] * scale;
    } else {
      std::memcpy(out + lo, acc, size_t(m) * 4);
    }
  }
  return 0;
}

}  // namespace quant

// -- count sketch (Sketched-SGD): the update and sketch in one pass, the estimates in another ------
// hvdcompress.reference.sketch and hvdcompress.hashing define every operation: the hashes are
// computed from the index and the rows' short tables (hashing.tables, passed in: simple tabulation
// over two 16-bit halves, then one multiply-shift into a signed cell y in [0, 2c)); the sketch adds v into each row's 2c signed cells in ascending index
// order (np.add.at's order) and folds them, S[j, b] = cell[2b] - cell[2b + 1]; the estimate of
// entry i is the lower median over rows of (y even ? S[j, y >> 1] : -S[j, y >> 1]), in the order of
// np.sort (NaN last). All float operations are float32, one at a time (no FMA).
namespace sketch {

constexpr uint32_t C3 = 0x2545F491u;
constexpr int64_t BLOCK = 65536;  // entries per HIGH value
constexpr int64_t SB = 512;       // entries hashed per sub-block (their cells stay in L1)
constexpr int64_t CH = 4096;      // entries per chunk (a divisor of BLOCK): rows x CH floats in L2

// The rows' hash tables (hashing.tables, as uint32): LOW row-major, min(n, BLOCK) per row; HIGH
// ceil(n / BLOCK) per row.
struct Tables {
  int64_t n_low, n_high;
  const uint32_t* low;
  const uint32_t* high;
  Tables(const uint32_t* lo, const uint32_t* hi, int64_t n)
      : n_low(std::min(n, BLOCK)), n_high((n + BLOCK - 1) / BLOCK), low(lo), high(hi) {}
};

// y = (((HIGH ^ LOW[t]) * C3) mod 2**32 * 2c) >> 32 for the m entries from t0 of a block.
// 2c <= 2**31 fits 32 bits, so the product is a 32 x 32 -> 64-bit multiply (it vectorizes).
HVDC_INLINE void cells(const uint32_t* __restrict low, uint32_t high, int64_t t0, int64_t m, uint64_t two_c,
                       uint32_t* __restrict y) {
  const uint32_t c2 = uint32_t(two_c);
  for (int64_t t = 0; t < m; ++t) {
    const uint32_t z = (high ^ low[t0 + t]) * C3;
    y[t] = uint32_t((uint64_t(z) * uint64_t(c2)) >> 32);
  }
}

// A buffer kept by the calling thread between calls (its pages are faulted in once, not at every
// exchange); grown to the largest size asked for. Holds no data between calls.
HVDC_INLINE float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) {
    buf = std::vector<float>();  // the old pages go back first
    buf.resize(n);
  }
  return buf.data();
}

// Signed cells of the rows sketched together in one sweep over v: a row's 2c cells are the
// sketch's only random-access data, and cells of all rows at once (20 MB at 25M entries) leave the
// cache, so rows are swept in groups whose cells stay in it: the first group's sweep is fused with
// the u/v update, each later one reads the new v again (a sequential read, cheaper than random
// accesses that miss the cache).
constexpr int64_t GROUP_CELLS = int64_t(1) << 18;  // 1 MB of cells

// u <- u*m + g and v <- v + u, then v into the rows' signed cells, folded into table (rows x cols).
// SEP: u and v read from uin / vin and written to u / v (other buffers), else in place.
template <bool SEP>
HVDC_INLINE int64_t update_sketch(const float* g, float* u, float* v, int64_t n, float mom, const uint32_t* low,
                                  const uint32_t* high, int rows, int64_t cols, float* table,
                                  const float* uin = nullptr, const float* vin = nullptr) {
  if (n < 1 || rows < 1 || rows > 32 || cols < 1 || cols > (int64_t(1) << 30)) return -1;
  const Tables tb(low, high, n);
  const int64_t two_c = 2 * cols;
  const int group = int(std::max<int64_t>(1, std::min<int64_t>(rows, GROUP_CELLS / two_c)));
  float* signed_cells = scratch(size_t(group * two_c));
  alignas(64) uint32_t y[SB];
  for (int j0 = 0; j0 < rows; j0 += group) {
    const int j1 = std::min(rows, j0 + group);
    std::memset(signed_cells, 0, size_t((j1 - j0) * two_c) * sizeof(float));
    for (int64_t i0 = 0; i0 < n; i0 += CH) {  // a chunk inside one block: its v stays in cache
      const int64_t m_chunk = std::min(n - i0, CH), b = i0 / BLOCK, t_chunk = i0 - b * BLOCK;
      float* __restrict vv = v + i0;
      if (j0 == 0) {
        float* __restrict uu = u + i0;
        const float* __restrict gg = g + i0;
        if (SEP) {
          const float* __restrict ui = uin + i0;
          const float* __restrict vi = vin + i0;
          for (int64_t t = 0; t < m_chunk; ++t) {
            const float nu = ui[t] * mom + gg[t];
            uu[t] = nu;
            vv[t] = vi[t] + nu;
          }
        } else {
          for (int64_t t = 0; t < m_chunk; ++t) {
            const float nu = uu[t] * mom + gg[t];
            uu[t] = nu;
            vv[t] = vv[t] + nu;
          }
        }
      }
      if (j0 > 0)  // v read again: the next chunk fetched without keeping it in the outer caches
        for (int64_t t = 0; t < m_chunk; t += 16) __builtin_prefetch(vv + CH + t, 0, 0);
      for (int j = j0; j < j1; ++j) {  // a row at a time: one row's cells in cache
        const uint32_t* low = tb.low + j * tb.n_low;
        const uint32_t high = tb.high[size_t(j * tb.n_high + b)];
        float* __restrict cell = signed_cells + (j - j0) * two_c;
        for (int64_t t0 = 0; t0 < m_chunk; t0 += SB) {
          const int64_t m = std::min(m_chunk - t0, SB);
          cells(low, high, t_chunk + t0, m, uint64_t(two_c), y);
          const float* __restrict x = vv + t0;
          for (int64_t t = 0; t < m; ++t) cell[y[t]] += x[t];  // index order within every cell
        }
      }
    }
    for (int j = j0; j < j1; ++j) {
      const float* s = signed_cells + (j - j0) * two_c;
      float* out = table + j * cols;
      for (int64_t c = 0; c < cols; ++c) out[c] = s[2 * c] - s[2 * c + 1];
    }
  }
  return 0;
}

// np.sort's order (NaN last) as a compare-exchange that keeps both values: lo <- the smaller.
HVDC_INLINE void cmpx(float& lo, float& hi) {
  const float a = lo, b = hi;
  const bool keep = b != b || a <= b;
  lo = keep ? a : b;
  hi = keep ? b : a;
}

// The lower median (element (r-1)//2 in np.sort's order) of every column of w (rows x m, row
// stride CH), in place; written to out. r = 3 and r = 5: selection networks; else odd-even
// transposition sort.
HVDC_INLINE void lower_median(float* w, int rows, int64_t m, float* __restrict out) {
  if (rows == 1) {
    for (int64_t t = 0; t < m; ++t) out[t] = w[t];
    return;
  }
  if (rows == 3) {
    float* __restrict a = w;
    float* __restrict b = w + CH;
    float* __restrict c = w + 2 * CH;
    for (int64_t t = 0; t < m; ++t) {
      float x = a[t], y = b[t], z = c[t];
      cmpx(x, y);  // x = min(a, b), y = max(a, b)
      cmpx(y, z);  // y = min(max(a, b), c)
      cmpx(x, y);  // y = max(min(a, b), min(max(a, b), c))
      out[t] = y;
    }
    return;
  }
  if (rows == 5) {
    float* __restrict a = w;
    float* __restrict b = w + CH;
    float* __restrict c = w + 2 * CH;
    float* __restrict d = w + 3 * CH;
    float* __restrict e = w + 4 * CH;
    for (int64_t t = 0; t < m; ++t) {
      float p = a[t], q = b[t], r = c[t], s = d[t], x = e[t];
      cmpx(p, q);  // p = min(a, b), q = max(a, b)
      cmpx(r, s);  // r = min(c, d), s = max(c, d)
      cmpx(r, p);  // p = f, the larger of the minima
      cmpx(q, s);  // q = g, the smaller of the maxima
      cmpx(x, p);  // x = min(e, f), p = max(e, f)
      cmpx(p, q);  // p = min(max(e, f), g)
      cmpx(x, p);  // p = the median of (e, f, g)
      out[t] = p;
    }
    return;
  }
  for (int pass = 0; pass < rows; ++pass)
    for (int i = pass % 2; i < rows - 1; i += 2) {
      float* __restrict a = w + i * CH;
      float* __restrict b = w + (i + 1) * CH;
      for (int64_t t = 0; t < m; ++t) cmpx(a[t], b[t]);
    }
  const float* med = w + ((rows - 1) / 2) * CH;
  for (int64_t t = 0; t < m; ++t) out[t] = med[t];
}

// est_abs[i] = |lower median over rows of s_j(i) * table[j, h_j(i)]| for i < n.
HVDC_INLINE int64_t estimates_abs(const float* table, int64_t n, const uint32_t* low, const uint32_t* high,
                                  int rows, int64_t cols, float* est_abs) {
  if (n < 1 || rows < 1 || rows > 32 || cols < 1 || cols > (int64_t(1) << 30)) return -1;
  const Tables tb(low, high, n);
  const int64_t two_c = 2 * cols;
  alignas(64) uint32_t y[SB];
  std::vector<float> w(size_t(rows * CH));
  alignas(64) float med[CH];
  for (int64_t i0 = 0; i0 < n; i0 += CH) {
    const int64_t m_chunk = std::min(n - i0, CH), b = i0 / BLOCK, t_chunk = i0 - b * BLOCK;
    for (int j = 0; j < rows; ++j) {  // a row at a time: one row of the table in cache
      const uint32_t* low = tb.low + j * tb.n_low;
      const uint32_t high = tb.high[size_t(j * tb.n_high + b)];
      const float* s = table + j * cols;
      for (int64_t t0 = 0; t0 < m_chunk; t0 += SB) {
        const int64_t m = std::min(m_chunk - t0, SB);
        cells(low, high, t_chunk + t0, m, uint64_t(two_c), y);
        float* __restrict wj = w.data() + j * CH + t0;
        for (int64_t t = 0; t < m; ++t) {
          const float x = s[y[t] >> 1];
          wj[t] = (y[t] & 1) ? -x : x;
        }
      }
    }
    lower_median(w.data(), rows, m_chunk, med);
    float* __restrict out = est_abs + i0;
    for (int64_t t = 0; t < m_chunk; ++t) out[t] = std::fabs(med[t]);
  }
  return 0;
}

// |lower median over rows of s_j(i) * table[j, h_j(i)]| of one entry, the hashes from the tables
// (the same operations as cells() and lower_median(): sorted by compare-exchanges in np.sort's
// order, NaN last).
HVDC_INLINE float estimate_abs_at(const float* table, const Tables& tb, int rows, int64_t cols, int64_t i) {
  float w[32];
  const uint64_t c2 = uint64_t(uint32_t(2 * cols));
  const int64_t b = i / BLOCK, t = i - b * BLOCK;
  for (int j = 0; j < rows; ++j) {
    const uint32_t z = (tb.high[size_t(j * tb.n_high + b)] ^ tb.low[size_t(j * tb.n_low + t)]) * C3;
    const uint32_t y = uint32_t((uint64_t(z) * c2) >> 32);
    const float x = table[j * cols + (y >> 1)];
    w[j] = (y & 1) ? -x : x;
  }
  for (int a = 1; a < rows; ++a)
    for (int c = a; c > 0; --c) cmpx(w[c - 1], w[c]);
  return std::fabs(w[(rows - 1) / 2]);
}

// Requests the table cells of entry i (they do not stay in cache), so that the reads of several
// entries overlap.
HVDC_INLINE void prefetch_cells(const float* table, const Tables& tb, int rows, int64_t cols, int64_t i) {
  const uint64_t c2 = uint64_t(uint32_t(2 * cols));
  const int64_t b = i / BLOCK, t = i - b * BLOCK;
  for (int j = 0; j < rows; ++j) {
    const uint32_t z = (tb.high[size_t(j * tb.n_high + b)] ^ tb.low[size_t(j * tb.n_low + t)]) * C3;
    __builtin_prefetch(table + j * cols + ((uint64_t(z) * c2) >> 33));
  }
}

// |estimate| of the m entries start, start + stride, ... (a sample to set a threshold from).
HVDC_INLINE int64_t estimates_abs_at(const float* table, int64_t n, const uint32_t* low, const uint32_t* high,
                                     int rows, int64_t cols, int64_t start, int64_t stride, int64_t m,
                                     float* out) {
  if (n < 1 || rows < 1 || rows > 32 || cols < 1 || cols > (int64_t(1) << 30) || start < 0 || stride < 1 ||
      m < 0 || (m > 0 && start + (m - 1) * stride >= n))
    return -1;
  const Tables tb(low, high, n);
  constexpr int64_t AHEAD = 64;  // entries whose cells are requested before the first is read
  for (int64_t s0 = 0; s0 < m; s0 += AHEAD) {
    const int64_t s1 = std::min(m, s0 + AHEAD);
    for (int64_t s = s0; s < s1; ++s) prefetch_cells(table, tb, rows, cols, start + s * stride);
    for (int64_t s = s0; s < s1; ++s) out[s] = estimate_abs_at(table, tb, rows, cols, start + s * stride);
  }
  return 0;
}

// cnt[e] += (signed cell y_e >= t) + ((signed cell y_e <= -t) << 16) for the m entries from t0 of
// a block, y_e the row's hash (cells()), from the row's bitmask bj (bit y: signed cell y >= t; the
// bit of y ^ 1 says whether cell y is <= -t).
HVDC_INLINE void count_bits(const uint32_t* __restrict low, uint32_t high, int64_t t0, int64_t m, uint64_t two_c,
                            const uint32_t* __restrict bj, uint32_t* __restrict cnt) {
  alignas(64) uint32_t y[SB];
  for (int64_t s = 0; s < m; s += SB) {
    const int64_t ms = std::min(m - s, SB);
    cells(low, high, t0 + s, ms, two_c, y);
    uint32_t* __restrict cc = cnt + s;
    for (int64_t e = 0; e < ms; ++e) {
      const uint32_t cell = y[e];
      const uint32_t w = bj[cell >> 5];
      cc[e] += ((w >> (cell & 31)) & 1) | (((w >> ((cell ^ 1) & 31)) & 1) << 16);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <immintrin.h>
#define HVDC_SK_GATHER 1
// count_bits with AVX2: the hash and the bit test of eight entries at once (a gather of their
// bitmask words).
__attribute__((target("avx2"))) void count_bits_avx2(const uint32_t* __restrict low, uint32_t high, int64_t t0,
                                                     int64_t m, uint64_t two_c, const uint32_t* __restrict bj,
                                                     uint32_t* __restrict cnt) {
  const __m256i hi = _mm256_set1_epi32(int(high)), c3 = _mm256_set1_epi32(int(C3));
  const __m256i c2 = _mm256_set1_epi32(int(uint32_t(two_c))), one = _mm256_set1_epi32(1);
  const __m256i m31 = _mm256_set1_epi32(31);
  int64_t e = 0;
  for (; e + 8 <= m; e += 8) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + t0 + e));
    const __m256i z = _mm256_mullo_epi32(_mm256_xor_si256(hi, lo), c3);
    const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(z, c2), 32);       // lanes 0, 2, ...
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(z, 32), c2);        // lanes 1, 3, ... (high half)
    const __m256i cell = _mm256_blend_epi32(even, odd, 0xAA);
    const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(bj), _mm256_srli_epi32(cell, 5), 4);
    const __m256i pos = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_and_si256(cell, m31)), one);
    const __m256i neg = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_and_si256(_mm256_xor_si256(cell, one), m31)), one);
    __m256i* c = reinterpret_cast<__m256i*>(cnt + e);
    _mm256_storeu_si256(c, _mm256_add_epi32(_mm256_loadu_si256(c), _mm256_or_si256(pos, _mm256_slli_epi32(neg, 16))));
  }
  if (e < m) count_bits(low, high, t0 + e, m - e, two_c, bj, cnt + e);
}
#endif

// Every entry with |estimate| >= t (t > 0), ascending, and its |estimate|: at most cap written, the
// number that pass returned (-2, nothing written: so many cells pass that computing every estimate
// is cheaper). The lower median is >= t only if r - (r-1)//2 of the entry's signed values
// s_j(i) * S[j, h_j(i)] are >= t or NaN (the median and the values sorted above it; NaN sorts last),
// and <= -t only if (r-1)//2 + 1 are <= -t (the median and the values below it); so a bitmask of
// the signed cells >= t or NaN (2c bits a row: it stays in cache where the table does not) counts
// both for every entry from the hashes alone (a NaN cell counted on both sides), and the estimate
// is computed for the few entries that may pass.
HVDC_INLINE int64_t estimates_ge(const float* table, int64_t n, const uint32_t* low, const uint32_t* high, int rows,
                                 int64_t cols, float t, int64_t* idx, float* mag, int64_t cap) {
  if (n < 1 || rows < 1 || rows > 32 || cols < 1 || cols > (int64_t(1) << 30) || !(t > 0.0f) || cap < 0) return -1;
  const Tables tb(low, high, n);
  const int64_t two_c = 2 * cols, words = (two_c + 31) / 32;
  std::vector<uint32_t> bits(size_t(rows * words), 0);
  int64_t set = 0;
  for (int j = 0; j < rows; ++j) {  // bit y: the signed cell y (S[y >> 1], negated where y is odd) >= t
    const float* s = table + j * cols;
    uint32_t* bj = bits.data() + j * words;
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int64_t mc = std::min<int64_t>(16, cols - c0);
      uint32_t word = 0;
      for (int64_t c = 0; c < mc; ++c) {
        const float x = s[c0 + c];
        const uint32_t nan = x != x, pos = (x >= t) | nan, neg = (-x >= t) | nan;
        word |= (pos | (neg << 1)) << (2 * c);
      }
      bj[c0 >> 4] = word;
      set += __builtin_popcount(word);
    }
  }
  if (4 * set > rows * two_c) return -2;  // a quarter of the cells pass: every estimate is cheaper
  // the lower median (element (r-1)//2) is >= t with the r - (r-1)//2 values from it up, <= -t with
  // the (r-1)//2 + 1 values up to it
  const uint32_t q_pos = uint32_t(rows - (rows - 1) / 2), q_neg = uint32_t((rows - 1) / 2 + 1);
#ifdef HVDC_SK_GATHER
  const bool avx2 = __builtin_cpu_supports("avx2");
#endif
  alignas(64) uint32_t cnt[CH];  // bits 0-7: rows whose signed value is >= t; bits 16-23: <= -t
  alignas(64) uint8_t may[CH + 8];
  alignas(64) int32_t live[CH];
  int64_t count = 0, spare_i = 0;
  float spare_m = 0.0f;
  for (int64_t i0 = 0; i0 < n; i0 += CH) {
    const int64_t m_chunk = std::min(n - i0, CH), b = i0 / BLOCK, t_chunk = i0 - b * BLOCK;
    std::memset(cnt, 0, sizeof(cnt));
    for (int j = 0; j < rows; ++j) {
      const uint32_t* lo = tb.low + j * tb.n_low;
      const uint32_t hi = tb.high[size_t(j * tb.n_high + b)];
      const uint32_t* bj = bits.data() + j * words;
#ifdef HVDC_SK_GATHER
      if (avx2)
        count_bits_avx2(lo, hi, t_chunk, m_chunk, uint64_t(two_c), bj, cnt);
      else
#endif
        count_bits(lo, hi, t_chunk, m_chunk, uint64_t(two_c), bj, cnt);
    }
    for (int64_t e = 0; e < m_chunk; ++e) may[e] = ((cnt[e] & 0xffff) >= q_pos) | ((cnt[e] >> 16) >= q_neg);
    std::memset(may + m_chunk, 0, 8);
    int64_t nl = 0;
    for (int64_t e0 = 0; e0 < m_chunk; e0 += 8) {  // almost every word of eight is zero
      uint64_t word;
      std::memcpy(&word, may + e0, 8);
      while (word) {
        live[nl++] = int32_t(e0 + (__builtin_ctzll(word) >> 3));
        word &= word - 1;
      }
    }
    for (int64_t s = 0; s < nl; ++s) prefetch_cells(table, tb, rows, cols, i0 + live[s]);
    for (int64_t s = 0; s < nl; ++s) {
      const int64_t i = i0 + live[s];
      const float a = estimate_abs_at(table, tb, rows, cols, i);
      const bool room = count < cap;  // no branch on a (a miss's value): the next entries' reads go on
      int64_t* pi = room ? idx + count : &spare_i;
      float* pm = room ? mag + count : &spare_m;
      *pi = i;
      *pm = a;
      count += a >= t;
    }
  }
  return count;
}

}  // namespace sketch

// The quantizer entry points are compiled twice, for AVX2 and for the baseline, and the loader
// picks one by the CPU (the same IEEE operations either way: only the speed differs).
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__clang__)
#define HVDC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVDC_CLONES
#endif

extern "C" {

HVDC_CLONES int64_t hvdc_q_encode(int kind, const float* x, const float* rin, float* rout, int64_t n,
                                  const int64_t* seg_n, int64_t nseg, int levels, uint32_t base, uint8_t* out,
                                  int64_t out_bytes) {
  return quant::encode(kind, x, rin, rout, n, seg_n, nseg, levels, base, out, out_bytes);
}
HVDC_CLONES int64_t hvdc_q_decode_sum(int kind, const uint8_t* buf, int64_t part, int64_t world, int64_t n,
                                      const int64_t* seg_n, int64_t nseg, int levels, float scale, float* out) {
  return quant::decode_sum(kind, buf, part, world, n, seg_n, nseg, levels, scale, out);
}

HVDC_CLONES int64_t hvdc_q1c_encode(const float* x, const float* rin, float* rout, int64_t n, const int64_t* dims,
                                    int64_t nm, uint8_t* out, int64_t out_bytes) {
  return quant::encode_cols(x, rin, rout, n, dims, nm, out, out_bytes);
}
HVDC_CLONES int64_t hvdc_q1c_decode_sum(const uint8_t* buf, int64_t part, int64_t world, int64_t n,
                                        const int64_t* dims, int64_t nm, float scale, float* out) {
  return quant::decode_sum_cols(buf, part, world, n, dims, nm, scale, out);
}
HVDC_CLONES int64_t hvdc_sk_update_sketch(const float* g, float* u, float* v, int64_t n, float m, const uint32_t* low,
                                          const uint32_t* high, int rows, int64_t cols, float* table) {
  return sketch::update_sketch<false>(g, u, v, n, m, low, high, rows, cols, table);
}
HVDC_CLONES int64_t hvdc_sk_update_sketch_to(const float* g, const float* uin, const float* vin, float* u, float* v,
                                             int64_t n, float m, const uint32_t* low, const uint32_t* high, int rows,
                                             int64_t cols, float* table) {
  if (uin == nullptr || vin == nullptr) return -1;
  return sketch::update_sketch<true>(g, u, v, n, m, low, high, rows, cols, table, uin, vin);
}
HVDC_CLONES int64_t hvdc_sk_estimates_abs(const float* table, int64_t n, const uint32_t* low, const uint32_t* high,
                                          int rows, int64_t cols, float* est_abs) {
  return sketch::estimates_abs(table, n, low, high, rows, cols, est_abs);
}
HVDC_CLONES int64_t hvdc_sk_estimates_abs_at(const float* table, int64_t n, const uint32_t* low, const uint32_t* high,
                                             int rows, int64_t cols, int64_t start, int64_t stride, int64_t m,
                                             float* out) {
  return sketch::estimates_abs_at(table, n, low, high, rows, cols, start, stride, m, out);
}
HVDC_CLONES int64_t hvdc_sk_estimates_ge(const float* table, int64_t n, const uint32_t* low, const uint32_t* high,
                                         int rows, int64_t cols, float t, int64_t* idx, float* mag, int64_t cap) {
  return sketch::estimates_ge(table, n, low, high, rows, cols, t, idx, mag, cap);
}
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
int64_t hvdc_add_ge_to_f32(const float* g, const float* rin, float* r, int64_t n, float t, int64_t* idx, int64_t cap) {
  return add_ge<float, true>(g, r, n, t, idx, cap, rin);
}
int64_t hvdc_add_ge_to_f64(const double* g, const double* rin, double* r, int64_t n, double t, int64_t* idx,
                           int64_t cap) {
  return add_ge<double, true>(g, r, n, t, idx, cap, rin);
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
int64_t hvdc_dgc_pass_to_f32(const float* g, const float* uin, const float* vin, float* u, float* v, int64_t n,
                             float m, int mode, int64_t offset, int64_t stride, float* sample, float t0, int64_t* idx,
                             float* mags, int64_t cap, float* work, float* t_out) {
  return dgc_pass<float, true>(g, u, v, n, m, mode, offset, stride, sample, t0, idx, mags, cap, work, t_out, uin,
                               vin);
}
int64_t hvdc_dgc_pass_to_f64(const double* g, const double* uin, const double* vin, double* u, double* v, int64_t n,
                             double m, int mode, int64_t offset, int64_t stride, double* sample, double t0,
                             int64_t* idx, double* mags, int64_t cap, double* work, double* t_out) {
  return dgc_pass<double, true>(g, u, v, n, m, mode, offset, stride, sample, t0, idx, mags, cap, work, t_out, uin,
                                vin);
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
int hvdc_abi_version() { return 7; }

}  // extern "C"
