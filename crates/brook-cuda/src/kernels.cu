// brook's CUDA kernels, compiled at run time by NVRTC for the device found.
//
// Activations are f32 throughout. Weights stay in the checkpoint's own bytes: MLX affine
// quantization (`bits` 2..8, little-endian bit packing across u32 words, per-group scale and
// bias, w = s·q + b) or plain floats. A `Mat` describes one weight matrix; for routed experts
// its addresses are offsets inside an expert slot and `base` (from the per-layer slot table)
// is added, so one kernel serves dense weights, resident experts and streamed ones.
//
// No headers: bf16 and f16 are widened by bit operations and PTX, so NVRTC needs no include
// path.

typedef unsigned int u32;
typedef unsigned long long u64;

#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (Hopper and later): the host may start a kernel while the
// one before it is still running. Every kernel calls PDL_SYNC() before it reads anything an
// earlier kernel wrote or writes anything (and on every path before it returns, so that its
// completion implies its predecessor's): the wait returns once the previous kernel has
// finished and its writes are visible; the trigger then lets the next kernel launch. Work
// that depends on nothing earlier (loading weights) may come before it. On older GPUs, and
// when the host launches without the attribute, both are no-ops.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define PDL_SYNC()                                                \
    do {                                                          \
        asm volatile("griddepcontrol.wait;" ::: "memory");        \
        asm volatile("griddepcontrol.launch_dependents;" :::);    \
    } while (0)
#else
#define PDL_SYNC() \
    do {           \
    } while (0)
#endif

struct Mat {
    u64 w, s, b;        // weight words or floats; scales; biases
    int rows, cols;
    int bits;           // 0: float weights
    int group;
    int wtype;          // float weights: 0 f32, 1 bf16, 2 f16
    int stype;          // scales and biases: 0 f32, 1 bf16, 2 f16
};

__device__ __forceinline__ float f16f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float ldf(u64 p, int type, long long i) {
    if (type == 1) return __uint_as_float(((u32)((const unsigned short*)p)[i]) << 16);
    if (type == 2) return f16f(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}

// Scales and biases, which no kernel writes: through the read-only path.
__device__ __forceinline__ float ldsb(u64 p, int type, long long i) {
    if (type == 1) return __uint_as_float(((u32)__ldg((const unsigned short*)p + i)) << 16);
    if (type == 2) return f16f(__ldg((const unsigned short*)p + i));
    return __ldg((const float*)p + i);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
__device__ __forceinline__ float softplusf_(float x) {
    return x > 20.0f ? x : fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

// Element (r, c) of a matrix, dequantized.
__device__ __forceinline__ float wat(const Mat& m, u64 base, int r, int c) {
    if (m.bits == 0) return ldf(base + m.w, m.wtype, (long long)r * m.cols + c);
    long long wpr = (long long)m.cols * m.bits / 32;
    const u32* row = (const u32*)(base + m.w) + r * wpr;
    long long bit = (long long)c * m.bits;
    int word = (int)(bit >> 5), sh = (int)(bit & 31);
    u32 v = row[word] >> sh;
    if (sh + m.bits > 32) v |= row[word + 1] << (32 - sh);
    v &= (1u << m.bits) - 1u;
    long long gi = (long long)r * (m.cols / m.group) + c / m.group;
    return fmaf(ldf(base + m.s, m.stype, gi), (float)v, ldf(base + m.b, m.stype, gi));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Code j (0..3) of the bytes of `w` as an exact float: the byte goes into the low mantissa
// bits of 2^23 by one byte permute and 2^23 is subtracted (an integer-to-float conversion
// runs at a fraction of the FMA rate).
__device__ __forceinline__ float code(u32 w, int j) {
    return __uint_as_float(__byte_perm(w, 0x4Bu, 0x4550u + j)) - 8388608.0f;
}

// Σ q·x over the 8 four-bit codes of one word (x in a, b) and over the 4 eight-bit ones.
__device__ __forceinline__ float word_dot4(u32 t, float4 a, float4 b) {
    u32 lo = t & 0x0F0F0F0Fu, hi = (t >> 4) & 0x0F0F0F0Fu;
    float q = code(lo, 0) * a.x;
    q = fmaf(code(hi, 0), a.y, q);
    q = fmaf(code(lo, 1), a.z, q);
    q = fmaf(code(hi, 1), a.w, q);
    q = fmaf(code(lo, 2), b.x, q);
    q = fmaf(code(hi, 2), b.y, q);
    q = fmaf(code(lo, 3), b.z, q);
    return fmaf(code(hi, 3), b.w, q);
}

__device__ __forceinline__ float word_dot8(u32 t, float4 a) {
    float q = code(t, 0) * a.x;
    q = fmaf(code(t, 1), a.y, q);
    q = fmaf(code(t, 2), a.z, q);
    return fmaf(code(t, 3), a.w, q);
}

// The matrix-vector kernels read the activations from shared memory, staged once per block
// in a padded layout: element i lives at pad(i), four floats of padding after every 32, so
// the 16-byte reads of eight lanes that each start 32 (or 16) elements apart hit distinct
// banks. (Read straight from global memory, those strided reads made the kernels L1-bound.)
__device__ __forceinline__ int pad(int i) { return i + ((i >> 5) << 2); }

// Floats of shared memory that `n` padded activations take.
__device__ __forceinline__ int padded(int n) { return pad(n) + 4; }

// x[0..n) into xs in the padded layout, by the whole block (then a barrier).
__device__ void stage(const float* __restrict__ x, float* xs, int n) {
    if ((n & 3) == 0 && (((u64)x) & 15) == 0) {
        for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4)
            *(float4*)(xs + pad(i)) = *(const float4*)(x + i);
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) xs[pad(i)] = x[i];
    }
    __syncthreads();
}

// One row of W times the staged x, summed over the warp (every lane returns the total): the
// generic path for the widths and shapes `fast` does not take.
#define U 8
__device__ __noinline__ float row_dot(const Mat& m, u64 base, int r, const float* xs) {
    int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if ((m.bits == 4 && (m.cols & 7) == 0) || (m.bits == 8 && (m.cols & 3) == 0)) {
        int per = 32 / m.bits;                       // values per word
        int words = m.cols / per, gw = m.group / per;
        const u32* row = (const u32*)(base + m.w) + (long long)r * words;
        long long g0 = (long long)r * (m.cols / m.group);
        u64 sp = base + m.s, bp = base + m.b;
        for (int w0 = 0; w0 < words; w0 += 32 * U) {
            u32 v[U];
            float sc[U], bi[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int w = w0 + lane + 32 * u;
                bool ok = w < words;
                v[u] = ok ? __ldg(row + w) : 0u;
                long long gi = g0 + (ok ? w / gw : 0);
                sc[u] = ok ? ldf(sp, m.stype, gi) : 0.0f;
                bi[u] = ok ? ldf(bp, m.stype, gi) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int w = w0 + lane + 32 * u;
                if (w >= words) break;
                float q, sx;
                if (m.bits == 4) {
                    const float* xp = xs + pad(8 * w);   // 8 values, never across a pad
                    float4 a = *(const float4*)xp, b = *(const float4*)(xp + 4);
                    q = word_dot4(v[u], a, b);
                    sx = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
                } else {
                    float4 a = *(const float4*)(xs + pad(4 * w));
                    q = word_dot8(v[u], a);
                    sx = (a.x + a.y) + (a.z + a.w);
                }
                acc = fmaf(sc[u], q, acc);
                acc = fmaf(bi[u], sx, acc);
            }
        }
    } else {
        for (int c = lane; c < m.cols; c += 32) acc = fmaf(wat(m, base, r, c), xs[pad(c)], acc);
    }
    return warp_sum(acc);
}

// The fast path: 4- or 8-bit codes, rows of whole VW-word units that never straddle a group,
// and units aligned for one VW·4-byte load.
template <int VW>
__device__ __forceinline__ bool fast(const Mat& m, u64 base) {
    return (m.bits == 4 || m.bits == 8) && ((m.cols * m.bits) % (32 * VW)) == 0 &&
           ((m.group * m.bits) % (32 * VW)) == 0 && (m.group & (m.group - 1)) == 0 &&
           ((base + m.w) % (4 * VW)) == 0;
}

template <int VW>
__device__ __forceinline__ void load_unit(const u32* p, u32 (&v)[VW]) {
    if (VW == 4) {
        uint4 t = __ldg((const uint4*)p);
        v[0] = t.x; v[1] = t.y; v[2 % VW] = t.z; v[3 % VW] = t.w;
    } else {
        uint2 t = __ldg((const uint2*)p);
        v[0] = t.x; v[1 % VW] = t.y;
    }
}

// One unit (VW words, one group) of R rows against the same staged activations xp (padded
// layout, the unit's values contiguous), added to acc[r] as scale·Σ code·x + bias·Σ x one
// word at a time (short partial sums keep the rounding near that of dequantizing first).
template <int VW, int R>
__device__ __forceinline__ void unit_dot(const u32 (&v)[R][VW], bool four, const float* xp,
                                         const float (&sc)[R], const float (&bi)[R],
                                         float (&acc)[R]) {
    const float4* x4 = (const float4*)xp;
#pragma unroll
    for (int w = 0; w < VW; w++) {
        float sx;
        float q[R];
        if (four) {
            float4 a = x4[2 * w], b = x4[2 * w + 1];
            sx = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
#pragma unroll
            for (int r = 0; r < R; r++) q[r] = word_dot4(v[r][w], a, b);
        } else {
            float4 a = x4[w];
            sx = (a.x + a.y) + (a.z + a.w);
#pragma unroll
            for (int r = 0; r < R; r++) q[r] = word_dot8(v[r][w], a);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] = fmaf(sc[r], q[r], acc[r]);
            acc[r] = fmaf(bi[r], sx, acc[r]);
        }
    }
}

// The loads of one round of R rows of a fast-form matrix: NU 16-byte units per lane (unit
// u0 + lane + 32·i) with their scales and biases.
#define NU 2
template <int R, int N = NU>
struct Round {
    u32 v[N][R][4];
    float sc[N][R], bi[N][R];
};

template <int R, int N = NU>
__device__ __forceinline__ void issue(const Mat& m, u64 base, int r0, int u0, Round<R, N>& f) {
    int lane = threadIdx.x & 31;
    int words = (m.cols * m.bits) >> 5, units = words >> 2;
    // Units per group: a power of two (fast() checks the group is one).
    int ush = __ffs(((m.group * m.bits) >> 5) >> 2) - 1, gpr = m.cols / m.group;
    const u32* W = (const u32*)(base + m.w);
#pragma unroll
    for (int i = 0; i < N; i++) {
        int u = u0 + lane + 32 * i;
        bool ok = u < units;
#pragma unroll
        for (int r = 0; r < R; r++) {
            long long row = r0 + r;
            if (ok) {
                load_unit<4>(W + row * words + (long long)u * 4, f.v[i][r]);
                long long gi = row * gpr + (u >> ush);
                f.sc[i][r] = ldsb(base + m.s, m.stype, gi);
                f.bi[i][r] = ldsb(base + m.b, m.stype, gi);
            } else {
#pragma unroll
                for (int w = 0; w < 4; w++) f.v[i][r][w] = 0u;
                f.sc[i][r] = 0.0f;
                f.bi[i][r] = 0.0f;
            }
        }
    }
}

template <int R, int N = NU>
__device__ __forceinline__ void consume(const Mat& m, int u0, const Round<R, N>& f,
                                        const float* xs, float (&acc)[R]) {
    int lane = threadIdx.x & 31;
    int units = (m.cols * m.bits) >> 7, vpu = 128 / m.bits;
#pragma unroll
    for (int i = 0; i < N; i++) {
        int u = u0 + lane + 32 * i;
        if (u >= units) break;
        unit_dot<4, R>(f.v[i], m.bits == 4, xs + pad(u * vpu), f.sc[i], f.bi[i], acc);
    }
}

// Rows r0..r0+R−1 of a fast-form m times the staged x; `f` holds the first round's loads
// already issued.
template <int R, int N = NU>
__device__ void rows_fast(const Mat& m, u64 base, int r0, Round<R, N>& f, const float* xs,
                          float (&out)[R]) {
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    int units = (m.cols * m.bits) >> 7;
    for (int u0 = 0; u0 < units; u0 += 32 * N) {
        if (u0 > 0) issue<R, N>(m, base, r0, u0, f);
        consume<R, N>(m, u0, f, xs, acc);
    }
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(acc[r]);
}

// One row of any matrix times the staged x: the rows a warp's step cannot take together
// (out of line, to keep the kernels' hot loops small).
__device__ __noinline__ float one_row(Mat m, u64 base, int r, const float* xs) {
    if (fast<4>(m, base)) {
        Round<1> g;
        float o[1];
        issue<1>(m, base, r, 0, g);
        rows_fast<1>(m, base, r, g, xs, o);
        return o[0];
    }
    return row_dot(m, base, r, xs);
}

// Which of up to four stacked matrices holds row r (0..3), and its row there. Selected by
// value, not by reference, so the kernel parameters stay out of local memory.
__device__ __forceinline__ int locate(const Mat& m0, const Mat& m1, const Mat& m2, int r,
                                      int& local) {
    if (r < m0.rows) { local = r; return 0; }
    r -= m0.rows;
    if (r < m1.rows) { local = r; return 1; }
    r -= m1.rows;
    if (r < m2.rows) { local = r; return 2; }
    local = r - m2.rows;
    return 3;
}

__device__ __forceinline__ Mat pick(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3,
                                    int i) {
    return i == 0 ? m0 : i == 1 ? m1 : i == 2 ? m2 : m3;
}

// Whether rows r0..r0+R−1 all lie in one fast-form matrix (then `m`, `l` say which and where).
template <int R>
__device__ __forceinline__ bool whole(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3,
                                      u64 base, int r0, int rows, Mat& m, int& l) {
    if (r0 + R > rows) return false;
    int l2;
    int i = locate(m0, m1, m2, r0, l);
    if (locate(m0, m1, m2, r0 + R - 1, l2) != i) return false;
    m = pick(m0, m1, m2, m3, i);
    return fast<4>(m, base);
}

// y[r] = W[r]·x for the rows of m0..m3 stacked (absent ones have 0 rows), the activations
// staged in xs by this call: each warp takes R rows at a time (4 for large matrices, where
// reading the activations once for four rows pays; 1 for small ones, to spread them over
// more warps), the block's warps and the grid's blocks striding over the rows. The first
// rows' weights are requested before PDL_SYNC: they depend on no earlier kernel.
template <int R>
__device__ void stacked(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3, u64 base,
                        int rows, const float* __restrict__ x, float* xs, float* __restrict__ y,
                        int xblock, int xblocks) {
    int nw = blockDim.x >> 5;
    int stride = xblocks * nw * R;
    int r0 = (xblock * nw + (threadIdx.x >> 5)) * R;
    bool lead = (threadIdx.x & 31) == 0;
    Round<R> f;
    Mat m;
    int l = 0;
    bool ok = whole<R>(m0, m1, m2, m3, base, r0, rows, m, l);
    if (ok) issue<R>(m, base, l, 0, f);
    PDL_SYNC();
    stage(x, xs, m0.cols);
    while (r0 < rows) {
        if (ok) {
            float d[R];
            rows_fast<R>(m, base, l, f, xs, d);
            if (lead)
#pragma unroll
                for (int r = 0; r < R; r++) y[r0 + r] = d[r];
        } else {
            for (int r = r0; r < min(r0 + R, rows); r++) {
                int lr;
                Mat mr = pick(m0, m1, m2, m3, locate(m0, m1, m2, r, lr));
                float d = one_row(mr, base, lr, xs);
                if (lead) y[r] = d;
            }
        }
        r0 += stride;
        ok = whole<R>(m0, m1, m2, m3, base, r0, rows, m, l);
        if (ok) issue<R>(m, base, l, 0, f);
    }
}

// h[j] = silu(gate[j]·x) · (up[j]·x) for the I rows of an expert's gate and up projections,
// the activations staged in xs by this call: each warp takes rows j, j + 1 of both at a time.
__device__ void swiglu_rows(const Mat& g, const Mat& u, u64 base, const float* __restrict__ x,
                            float* xs, float* __restrict__ h) {
    int nw = blockDim.x >> 5, I = g.rows;
    int stride = gridDim.x * nw * 2;
    int j0 = (blockIdx.x * nw + (threadIdx.x >> 5)) * 2;
    bool lead = (threadIdx.x & 31) == 0;
    bool both = fast<4>(g, base) && fast<4>(u, base);
    Round<2, 1> fg, fu;
    bool ok = both && j0 + 2 <= I;
    if (ok) {
        issue<2, 1>(g, base, j0, 0, fg);
        issue<2, 1>(u, base, j0, 0, fu);
    }
    PDL_SYNC();
    stage(x, xs, g.cols);
    while (j0 < I) {
        float dg[2] = {0.0f, 0.0f}, du[2] = {0.0f, 0.0f};
        if (ok) {
            rows_fast<2, 1>(g, base, j0, fg, xs, dg);
            rows_fast<2, 1>(u, base, j0, fu, xs, du);
        } else {
            for (int i = 0; i < 2 && j0 + i < I; i++) {
                dg[i] = one_row(g, base, j0 + i, xs);
                du[i] = one_row(u, base, j0 + i, xs);
            }
        }
        if (lead)
            for (int i = 0; i < 2 && j0 + i < I; i++) h[j0 + i] = siluf_(dg[i]) * du[i];
        j0 += stride;
        ok = both && j0 + 2 <= I;
        if (ok) {
            issue<2, 1>(g, base, j0, 0, fg);
            issue<2, 1>(u, base, j0, 0, fu);
        }
    }
}

// y[v, r] = W[r] · x[v / xdiv] over the rows of m0..m3 stacked, vector v = blockIdx.y:
// qmv4 takes 4 rows per warp step, qmv1 one (separate kernels, each with a small hot loop).
// Dynamic shared memory: padded(m0.cols) floats.
#define QMV(NAME, R)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2)                                      \
        NAME(Mat m0, Mat m1, Mat m2, Mat m3, int xdiv, const float* __restrict__ x,          \
             float* __restrict__ y) {                                                         \
        extern __shared__ float xs[];                                                         \
        int rows = m0.rows + m1.rows + m2.rows + m3.rows;                                     \
        int v = blockIdx.y;                                                                   \
        stacked<R>(m0, m1, m2, m3, 0, rows, x + (long long)(v / xdiv) * m0.cols, xs,          \
                   y + (long long)v * rows, blockIdx.x, gridDim.x);                           \
    }
QMV(qmv4, 4)
QMV(qmv1, 1)

// Routed experts for vectors v < nsel: expert sel[v] of the slot table `tab` (skipped when
// it has no slot), rows of m0 then m1 (offsets inside a slot) times x[v / xdiv] into
// y[v, ·]. Vector nsel, when the grid has it, is the shared expert: s0 then s1 (absolute)
// times x[0] into ys. Dynamic shared memory: padded(m0.cols) floats.
extern "C" __global__ void __launch_bounds__(256, 2) qmv_sel(Mat m0, Mat m1, const u64* __restrict__ tab,
                                                          const int* __restrict__ sel, int nsel,
                                                          int xdiv, Mat s0, Mat s1,
                                                          const float* __restrict__ x,
                                                          float* __restrict__ y,
                                                          float* __restrict__ ys) {
    extern __shared__ float xs[];
    int v = blockIdx.y;
    Mat none = m0;
    none.rows = 0;
    if (v < nsel) {
        PDL_SYNC();
        u64 base = tab[sel[v]];
        if (base == 0) return;
        int rows = m0.rows + m1.rows;
        stacked<1>(m0, m1, none, none, base, rows, x + (long long)(v / xdiv) * m0.cols, xs,
                   y + (long long)v * rows, blockIdx.x, gridDim.x);
    } else {
        stacked<1>(s0, s1, none, none, 0, s0.rows + s1.rows, x, xs, ys, blockIdx.x, gridDim.x);
    }
}

// qmv_sel's SwiGLU form for one token: vector v < nsel is routed expert sel[v], vector nsel
// (when the grid has it) the shared expert; h[v, j] = silu(gate[j]·x) · (up[j]·x) for the
// gate rows g (sg for the shared one) and up rows u (su), into y[v, ·] and ys.
extern "C" __global__ void __launch_bounds__(256, 3) qmv_swiglu(Mat g, Mat u, const u64* __restrict__ tab,
                                                             const int* __restrict__ sel, int nsel,
                                                             Mat sg, Mat su,
                                                             const float* __restrict__ x,
                                                             float* __restrict__ y,
                                                             float* __restrict__ ys) {
    extern __shared__ float xs[];
    int v = blockIdx.y;
    if (v < nsel) {
        PDL_SYNC();
        u64 base = tab[sel[v]];
        if (base == 0) return;
        swiglu_rows(g, u, base, x, xs, y + (long long)v * g.rows);
    } else {
        swiglu_rows(sg, su, 0, x, xs, ys);
    }
}

#define KB 8
// Loads of up to KB experts' unit u0 + lane of row r of their down projections (the slot of
// expert k in lane k of `mybase`).
template <int VW>
__device__ __forceinline__ void down_batch(const Mat& down, u64 mybase, int K, int r, bool on,
                                           int u0, int k0, int words, int units, int ush, int gpr,
                                           u32 (&v)[KB][1][VW], float (&sc)[KB], float (&bi)[KB]) {
    int u = u0 + (threadIdx.x & 31);
    bool ok = on && u < units;
#pragma unroll
    for (int kk = 0; kk < KB; kk++) {
        u64 base = __shfl_sync(0xffffffffu, mybase, (k0 + kk) & 31);
        if (ok && k0 + kk < K && base != 0) {
            load_unit<VW>((const u32*)(base + down.w) + (long long)r * words + u * VW, v[kk][0]);
            long long gi = (long long)r * gpr + (u >> ush);
            sc[kk] = ldsb(base + down.s, down.stype, gi);
            bi[kk] = ldsb(base + down.b, down.stype, gi);
        } else {
#pragma unroll
            for (int w = 0; w < VW; w++) v[kk][0][w] = 0u;
            sc[kk] = bi[kk] = 0.0f;
        }
    }
}

// One token's expert outputs and their combination, in one launch: out[r] = Σ_k wts[k] ·
// (down of expert sel[k] · h_k)[r] + sigmoid(sg) · (sdown · h_s)[r], with h_k the routed
// experts' silu(gate)·up ([K][I]) and h_s the shared expert's ([IS]). One warp per row; a
// lane issues the loads of up to 8 experts before using any, and the shared expert's before
// PDL_SYNC. The host checks that both downs have the fast form for 8-byte units and that
// the activations fit in shared memory.
extern "C" __global__ void __launch_bounds__(256) moe_down(Mat down, const u64* __restrict__ tab,
                                                           const int* __restrict__ sel,
                                                           const float* __restrict__ wts, int K,
                                                           Mat sdown, const float* __restrict__ sg,
                                                           const float* __restrict__ h,
                                                           const float* __restrict__ hsh,
                                                           float* __restrict__ out) {
    extern __shared__ float hs[];   // padded: [K·I] routed, then [IS] shared
    const int VW = 2;
    int I = down.cols, IS = sdown.cols, H = down.rows;
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool on = r < H;
    // The shared expert's first units: its weights depend on no earlier kernel.
    int swords = (IS * sdown.bits) >> 5, sunits = swords / VW;
    int sush = __ffs(((sdown.group * sdown.bits) >> 5) / VW) - 1, sgpr = IS / sdown.group;
    const u32* SW = (const u32*)sdown.w;
    u32 sv[1][VW] = {{0u, 0u}};
    float ssc = 0.0f, sbi = 0.0f;
    if (on && lane < sunits) {
        load_unit<VW>(SW + (long long)r * swords + lane * VW, sv[0]);
        long long gi = (long long)r * sgpr + (lane >> sush);
        ssc = ldsb(sdown.s, sdown.stype, gi);
        sbi = ldsb(sdown.b, sdown.stype, gi);
    }
    PDL_SYNC();
    // Lane k keeps expert k's slot and weight (K ≤ 32, checked by the host).
    u64 mybase = lane < K ? tab[sel[lane]] : 0;
    float myw = lane < K ? wts[lane] : 0.0f;
    bool four = down.bits == 4;
    int words = (I * down.bits) >> 5, units = words / VW;
    int ush = __ffs(((down.group * down.bits) >> 5) / VW) - 1, gpr = I / down.group;
    int vpu = VW * 32 / down.bits;
    u32 v[KB][1][VW];
    float sc[KB], bi[KB];
    // The first batch of expert loads goes out before the activations are staged.
    down_batch<VW>(down, mybase, K, r, on, 0, 0, words, units, ush, gpr, v, sc, bi);
    for (int i = threadIdx.x; i < K * I; i += blockDim.x) hs[pad(i)] = h[i];
    for (int i = threadIdx.x; i < IS; i += blockDim.x) hs[pad(K * I + i)] = hsh[i];
    __syncthreads();
    if (!on) return;
    float acc = 0.0f;
    for (int u0 = 0; u0 < units; u0 += 32) {
        int u = u0 + lane;
        bool ok = u < units;
        for (int k0 = 0; k0 < K; k0 += KB) {
            if (u0 > 0 || k0 > 0)
                down_batch<VW>(down, mybase, K, r, on, u0, k0, words, units, ush, gpr, v, sc, bi);
#pragma unroll
            for (int kk = 0; kk < KB; kk++) {
                float w = __shfl_sync(0xffffffffu, myw, (k0 + kk) & 31);
                if (!ok || k0 + kk >= K) continue;
                float d[1] = {0.0f};
                const float s1[1] = {sc[kk]}, b1[1] = {bi[kk]};
                unit_dot<VW, 1>(v[kk], four, hs + pad((k0 + kk) * I + u * vpu), s1, b1, d);
                acc = fmaf(w, d[0], acc);
            }
        }
    }
    bool sfour = sdown.bits == 4;
    int svpu = VW * 32 / sdown.bits;
    float sacc = 0.0f;
    for (int u0 = 0; u0 < sunits; u0 += 32) {
        int u = u0 + lane;
        if (u >= sunits) continue;
        if (u0 > 0) {
            load_unit<VW>(SW + (long long)r * swords + u * VW, sv[0]);
            long long gi = (long long)r * sgpr + (u >> sush);
            ssc = ldsb(sdown.s, sdown.stype, gi);
            sbi = ldsb(sdown.b, sdown.stype, gi);
        }
        float d[1] = {sacc};
        const float s1[1] = {ssc}, b1[1] = {sbi};
        unit_dot<VW, 1>(sv, sfour, hs + pad(K * I + u * svpu), s1, b1, d);
        sacc = d[0];
    }
    float total = warp_sum(acc) + sigmoidf_(sg[0]) * warp_sum(sacc);
    if (lane == 0) out[r] = total;
}

// Tiled y[n, r] = W[r] · x[xrow(n)] for many vectors (prefill). 64 rows × 64 vectors per block,
// 256 threads each computing 4 × 4. Dense: vectors are tokens 0..T. Grouped (tab != 0): block z
// is expert e, its vectors are pairs[offs[e] .. offs[e] + counts[e]], x row pair / xdiv and
// y row pair.
#define BM 64
#define BN 64
#define BK 32
extern "C" __global__ void __launch_bounds__(256) qmm(Mat m1, Mat m2, const u64* __restrict__ tab,
                               const int* __restrict__ counts, const int* __restrict__ offs,
                               const int* __restrict__ pairs, int xdiv, int T,
                               const float* __restrict__ x, float* __restrict__ y) {
    PDL_SYNC();
    __shared__ float Ws[BK][BM + 1];
    __shared__ float Xs[BK][BN + 1];
    __shared__ int xr[BN], yr[BN];
    int rows = m1.rows + m2.rows, cols = m1.cols;
    int r0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    int count = T;
    u64 base = 0;
    const int* plist = 0;
    if (tab) {
        int e = blockIdx.z;
        count = counts[e];
        if (n0 >= count) return;
        base = tab[e];
        if (base == 0) return;
        plist = pairs + offs[e];
    } else if (n0 >= count) {
        return;
    }
    int tid = threadIdx.x;
    if (tid < BN) {
        int n = n0 + tid;
        int p = n < count ? (plist ? plist[n] : n) : -1;
        xr[tid] = p < 0 ? -1 : p / xdiv;
        yr[tid] = p;
    }
    __syncthreads();
    int tx = tid & 15, ty = tid >> 4;
    float acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < cols; k0 += BK) {
        for (int e = tid; e < BM * BK; e += 256) {
            int rr = e / BK, k = e % BK;
            int r = r0 + rr, c = k0 + k;
            float w = 0.0f;
            if (r < rows && c < cols)
                w = r < m1.rows ? wat(m1, base, r, c) : wat(m2, base, r - m1.rows, c);
            Ws[k][rr] = w;
        }
        for (int e = tid; e < BN * BK; e += 256) {
            int nn = e / BK, k = e % BK;
            int c = k0 + k, row = xr[nn];
            Xs[k][nn] = (row >= 0 && c < cols) ? x[(long long)row * cols + c] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < BK; k++) {
            float a[4], b[4];
            for (int i = 0; i < 4; i++) a[i] = Ws[k][tx + 16 * i];
            for (int j = 0; j < 4; j++) b[j] = Xs[k][ty + 16 * j];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int j = 0; j < 4; j++) {
        int p = yr[ty + 16 * j];
        if (p < 0) continue;
        for (int i = 0; i < 4; i++) {
            int r = r0 + tx + 16 * i;
            if (r < rows) y[(long long)p * rows + r] = acc[i][j];
        }
    }
}

// h[n, i] = silu(gu[n, i]) · gu[n, I + i] for n < N.
extern "C" __global__ void swiglu(const float* __restrict__ gu, float* __restrict__ h, int N, int I) {
    PDL_SYNC();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * I) return;
    long long n = idx / I, i = idx % I;
    h[idx] = siluf_(gu[n * 2 * I + i]) * gu[n * 2 * I + I + i];
}

// out[t, :] = embedding row tokens[t].
extern "C" __global__ void embed(Mat m, const int* __restrict__ tokens, float* __restrict__ out) {
    PDL_SYNC();
    int t = blockIdx.x, row = tokens[t];
    for (int c = threadIdx.x; c < m.cols; c += blockDim.x)
        out[(long long)t * m.cols + c] = wat(m, 0, row, c);
}

__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += red[i];
    return t;
}

// With d: x += d. Then out = rms_norm(x) · w, one block per row.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ d,
                                        const float* __restrict__ w, float* __restrict__ out,
                                        int H, float eps) {
    PDL_SYNC();
    __shared__ float red[32];
    long long off = (long long)blockIdx.x * H;
    float ss = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float v = x[off + i];
        if (d) {
            v += d[off + i];
            x[off + i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)H + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[off + i] = x[off + i] * inv * w[i];
}

// Router: softmax over E logits per token, top K (ties to the lower id), renormalised if
// asked, then ordered by expert id so sums run in the CPU path's order. One warp per token:
// no block barriers between the K rounds.
#define TOPK_REGS 16
extern "C" __global__ void topk(const float* __restrict__ logits, int E, int K, int norm,
                                int* __restrict__ sel, float* __restrict__ wts) {
    PDL_SYNC();
    extern __shared__ float p[];   // [E], for E > 32·TOPK_REGS
    __shared__ int ids[32];
    __shared__ float ws[32];
    int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * E;
    if (E <= 32 * TOPK_REGS) {
        // Every lane keeps its E/32 probabilities in registers.
        float v[TOPK_REGS];
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < TOPK_REGS; j++) {
            int i = lane + 32 * j;
            v[j] = i < E ? l[i] : -INFINITY;
            mx = fmaxf(mx, v[j]);
        }
        mx = warp_max(mx);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < TOPK_REGS; j++) {
            int i = lane + 32 * j;
            v[j] = i < E ? expf(v[j] - mx) : 0.0f;
            s += v[j];
        }
        s = warp_sum(s);
#pragma unroll
        for (int j = 0; j < TOPK_REGS; j++) v[j] = lane + 32 * j < E ? v[j] / s : -1.0f;
        for (int k = 0; k < K; k++) {
            float best = -1.0f;
            int bidx = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < TOPK_REGS; j++)
                if (v[j] > best) { best = v[j]; bidx = lane + 32 * j; }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, best, o);
                int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
                if (ov > best || (ov == best && oi < bidx)) { best = ov; bidx = oi; }
            }
#pragma unroll
            for (int j = 0; j < TOPK_REGS; j++)
                if (lane + 32 * j == bidx) v[j] = -2.0f;
            if (lane == 0) {
                ids[k] = bidx;
                ws[k] = best;
            }
        }
    } else {
        float mx = -INFINITY;
        for (int i = lane; i < E; i += 32) {
            float v = l[i];
            p[i] = v;
            mx = fmaxf(mx, v);
        }
        mx = warp_max(mx);
        float s = 0.0f;
        for (int i = lane; i < E; i += 32) {
            float e = expf(p[i] - mx);
            p[i] = e;
            s += e;
        }
        s = warp_sum(s);
        for (int i = lane; i < E; i += 32) p[i] = p[i] / s;
        __syncwarp();
        for (int k = 0; k < K; k++) {
            float best = -1.0f;
            int bidx = 0x7fffffff;
            for (int i = lane; i < E; i += 32) {
                float v = p[i];
                if (v > best) { best = v; bidx = i; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, best, o);
                int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
                if (ov > best || (ov == best && oi < bidx)) { best = ov; bidx = oi; }
            }
            if (lane == 0) {
                ids[k] = bidx;
                ws[k] = best;
                p[bidx] = -2.0f;
            }
            __syncwarp();
        }
    }
    __syncwarp();
    if (lane == 0) {
        if (norm) {
            float sum = 0.0f;
            for (int k = 0; k < K; k++) sum += ws[k];
            for (int k = 0; k < K; k++) ws[k] = ws[k] / sum;
        }
        for (int a = 1; a < K; a++) {
            int id = ids[a];
            float wv = ws[a];
            int b = a - 1;
            while (b >= 0 && ids[b] > id) { ids[b + 1] = ids[b]; ws[b + 1] = ws[b]; b--; }
            ids[b + 1] = id;
            ws[b + 1] = wv;
        }
        for (int k = 0; k < K; k++) {
            sel[t * K + k] = ids[k];
            wts[t * K + k] = ws[k];
        }
    }
}

// Grouping of (token, k) pairs by expert for the grouped prefill kernels.
extern "C" __global__ void moe_count(const int* __restrict__ sel, int n, int* __restrict__ counts) {
    PDL_SYNC();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[sel[i]], 1);
}

extern "C" __global__ void moe_offsets(const int* __restrict__ counts, int E, int* __restrict__ offs,
                                       int* __restrict__ fill) {
    PDL_SYNC();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E; e++) {
            offs[e] = acc;
            fill[e] = 0;
            acc += counts[e];
        }
    }
}

extern "C" __global__ void moe_fill(const int* __restrict__ sel, int n, const int* __restrict__ offs,
                                    int* __restrict__ fill, int* __restrict__ pairs) {
    PDL_SYNC();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = sel[i];
    pairs[offs[e] + atomicAdd(&fill[e], 1)] = i;
}

// out[t, j] = Σ_k wts[t,k] · y[t·K + k, j] (in expert-id order) + sigmoid(sg[t]) · shared[t, j].
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ wts,
                                       const float* __restrict__ shared, const float* __restrict__ sg,
                                       float* __restrict__ out, int T, int K, int H) {
    PDL_SYNC();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H) return;
    int t = (int)(idx / H), j = (int)(idx % H);
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += wts[t * K + k] * y[((long long)t * K + k) * H + j];
    out[idx] = acc + sigmoidf_(sg[t]) * shared[idx];
}

// Causal depthwise conv with SiLU over [state (K-1 rows); qkv (T rows)], then the state keeps
// the last K-1 rows. wt is the checkpoint's [cd, K]. One thread per channel.
extern "C" __global__ void conv_silu(const float* __restrict__ qkv, float* __restrict__ state,
                                     const float* __restrict__ wt, float* __restrict__ out,
                                     int T, int cd, int KK) {
    PDL_SYNC();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    int s = KK - 1;
    for (int t = 0; t < T; t++) {
        float acc = 0.0f;
        for (int m = 0; m < KK; m++) {
            int i = t + m;
            float v = i < s ? state[(long long)i * cd + c] : qkv[(long long)(i - s) * cd + c];
            acc += wt[c * KK + m] * v;
        }
        out[(long long)t * cd + c] = siluf_(acc);
    }
    for (int r = 0; r < s; r++) {
        int i = T + r;
        state[(long long)r * cd + c] = i < s ? state[(long long)i * cd + c] : qkv[(long long)(i - s) * cd + c];
    }
}

// q and k heads (inside the conv output, in place): q = rms_norm(q)·dk⁻¹, k = rms_norm(k)·dk^-½
// with ε = 1e-6/dk; β = sigmoid(b); g = −exp(A_log)·softplus(a + dt_bias). One block per token.
extern "C" __global__ void delta_prep(float* __restrict__ conv, const float* __restrict__ b,
                                      const float* __restrict__ a, const float* __restrict__ A_log,
                                      const float* __restrict__ dt_bias, float* __restrict__ beta,
                                      float* __restrict__ g, int cd, int nk, int nv, int dk) {
    PDL_SYNC();
    int t = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float inv_scale = 1.0f / sqrtf((float)dk);
    float eps = 1e-6f / (float)dk;
    for (int hh = w; hh < 2 * nk; hh += nw) {
        float* v = conv + (long long)t * cd + hh * dk;
        float ss = 0.0f;
        for (int i = lane; i < dk; i += 32) ss = fmaf(v[i], v[i], ss);
        ss = warp_sum(ss);
        float scale = hh < nk ? inv_scale * inv_scale : inv_scale;
        float inv = 1.0f / sqrtf(ss / (float)dk + eps) * scale;
        for (int i = lane; i < dk; i += 32) v[i] *= inv;
    }
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        int j = t * nv + i;
        beta[j] = sigmoidf_(b[j]);
        g[j] = -expf(A_log[i]) * softplusf_(a[j] + dt_bias[i]);
    }
}

// The gated delta rule token by token. Block (h, column group): each lane owns one value
// column j of head h's [dk, dv] state, kept in registers when DK > 0 (else in global memory).
template <int DK>
__device__ void delta_rule_impl(const float* __restrict__ conv, const float* __restrict__ g,
                                const float* __restrict__ beta, float* __restrict__ state,
                                float* __restrict__ o, int T, int cd, int nk, int nv, int dk, int dv) {
    PDL_SYNC();
    extern __shared__ float sm[];   // q[dk], k[dk]
    float* qs = sm;
    float* ks = sm + dk;
    int h = blockIdx.x, lane = threadIdx.x;
    int j = blockIdx.y * 32 + lane;
    int kh = h / (nv / nk), key_dim = nk * dk;
    bool on = j < dv;
    float* st = state + (long long)h * dk * dv;
    float s[DK > 0 ? DK : 1];
    if (DK > 0 && on)
        for (int i = 0; i < DK; i++) s[i] = st[i * dv + j];
    for (int t = 0; t < T; t++) {
        const float* row = conv + (long long)t * cd;
        for (int i = lane; i < dk; i += 32) {
            qs[i] = row[kh * dk + i];
            ks[i] = row[key_dim + kh * dk + i];
        }
        __syncwarp();
        float alpha = expf(g[t * nv + h]), bt = beta[t * nv + h];
        if (on) {
            float v = row[2 * key_dim + h * dv + j];
            float u = 0.0f;
            if (DK > 0) {
#pragma unroll
                for (int i = 0; i < (DK > 0 ? DK : 1); i++) {
                    s[i] *= alpha;
                    u = fmaf(s[i], ks[i], u);
                }
            } else {
                for (int i = 0; i < dk; i++) {
                    float x = st[i * dv + j] * alpha;
                    st[i * dv + j] = x;
                    u = fmaf(x, ks[i], u);
                }
            }
            float delta = bt * (v - u);
            float out = 0.0f;
            if (DK > 0) {
#pragma unroll
                for (int i = 0; i < (DK > 0 ? DK : 1); i++) {
                    s[i] = fmaf(ks[i], delta, s[i]);
                    out = fmaf(s[i], qs[i], out);
                }
            } else {
                for (int i = 0; i < dk; i++) {
                    float x = fmaf(ks[i], delta, st[i * dv + j]);
                    st[i * dv + j] = x;
                    out = fmaf(x, qs[i], out);
                }
            }
            o[((long long)t * nv + h) * dv + j] = out;
        }
        __syncwarp();
    }
    if (DK > 0 && on)
        for (int i = 0; i < DK; i++) st[i * dv + j] = s[i];
}

#define DELTA_RULE(NAME, DK)                                                                    \
    extern "C" __global__ void NAME(const float* conv, const float* g, const float* beta,      \
                                    float* state, float* o, int T, int cd, int nk, int nv,     \
                                    int dk, int dv) {                                          \
        delta_rule_impl<DK>(conv, g, beta, state, o, T, cd, nk, nv, dk, dv);                   \
    }
DELTA_RULE(delta_rule_32, 32)
DELTA_RULE(delta_rule_64, 64)
DELTA_RULE(delta_rule_128, 128)
DELTA_RULE(delta_rule_any, 0)

// y = rms_norm(o; w) · silu(z) per value head, one warp per (token, head).
extern "C" __global__ void gated_norm(const float* __restrict__ o, const float* __restrict__ z,
                                      const float* __restrict__ w, float* __restrict__ y,
                                      int rows, int dv, float eps) {
    PDL_SYNC();
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* oh = o + (long long)r * dv;
    float ss = 0.0f;
    for (int i = lane; i < dv; i += 32) ss = fmaf(oh[i], oh[i], ss);
    float inv = 1.0f / sqrtf(warp_sum(ss) / (float)dv + eps);
    for (int i = lane; i < dv; i += 32)
        y[(long long)r * dv + i] = oh[i] * inv * w[i] * siluf_(z[(long long)r * dv + i]);
}

// Attention inputs: q = rope(rms_norm(q)), gate split off, k = rope(rms_norm(k)) and v written
// into the caches at positions meta[0] + t. Block (t, head): heads nq.. are kv heads. 64
// threads; the head is staged in shared memory for the rotation.
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const double* __restrict__ inv_freq,
                                     const int* __restrict__ meta, float* __restrict__ q,
                                     float* __restrict__ gate, float* __restrict__ kc,
                                     float* __restrict__ vc, int nq, int nkv, int hd, int rd,
                                     int gated, float eps) {
    PDL_SYNC();
    extern __shared__ float buf[];   // [hd]
    __shared__ float red[32];
    int t = blockIdx.x, head = blockIdx.y, tid = threadIdx.x;
    int pos = meta[0] + t;
    bool isq = head < nq;
    int per = gated ? 2 * hd : hd;
    const float* src = isq ? qg + ((long long)t * nq + head) * per
                           : k + ((long long)t * nkv + (head - nq)) * hd;
    const float* wn = isq ? qn : kn;
    float ss = 0.0f;
    for (int i = tid; i < hd; i += blockDim.x) ss = fmaf(src[i], src[i], ss);
    float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)hd + eps);
    for (int i = tid; i < hd; i += blockDim.x) buf[i] = src[i] * inv * wn[i];
    __syncthreads();
    int half = rd / 2;
    float* dst = isq ? q + ((long long)t * nq + head) * hd
                     : kc + ((long long)pos * nkv + (head - nq)) * hd;
    for (int i = tid; i < hd; i += blockDim.x) {
        float val = buf[i];
        if (i < rd) {
            int j = i < half ? i : i - half;
            double ang = (double)pos * inv_freq[j];
            float sn = (float)sin(ang), cs = (float)cos(ang);
            val = i < half ? buf[j] * cs - buf[j + half] * sn : buf[j + half] * cs + buf[j] * sn;
        }
        dst[i] = val;
    }
    if (isq && gated)
        for (int i = tid; i < hd; i += blockDim.x)
            gate[((long long)t * nq + head) * hd + i] = src[hd + i];
    if (!isq)
        for (int i = tid; i < hd; i += blockDim.x)
            vc[((long long)pos * nkv + (head - nq)) * hd + i] = v[((long long)t * nkv + (head - nq)) * hd + i];
}

// Causal attention with GQA over the cache, online softmax in tiles of blockDim positions;
// output multiplied by sigmoid(gate). Block (t, head), 128 threads, hd ≤ 512.
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ gate,
                                     const float* __restrict__ kc, const float* __restrict__ vc,
                                     const int* __restrict__ meta, float* __restrict__ out,
                                     int nq, int nkv, int hd, int gated, float scale) {
    PDL_SYNC();
    extern __shared__ float sh[];   // q[hd], p[blockDim]
    __shared__ float red[32];
    float* qs = sh;
    float* ps = sh + hd;
    int t = blockIdx.x, head = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    int kvh = head / (nq / nkv);
    int visible = meta[0] + t + 1;
    for (int i = tid; i < hd; i += nt) qs[i] = q[((long long)t * nq + head) * hd + i];
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float m = -INFINITY, l = 0.0f;
    long long stride = (long long)nkv * hd;
    for (int base = 0; base < visible; base += nt) {
        int p = base + tid;
        float sc = -INFINITY;
        if (p < visible) {
            const float* kp = kc + p * stride + kvh * hd;
            float d = 0.0f;
            for (int i = 0; i < hd; i++) d = fmaf(qs[i], kp[i], d);
            sc = d * scale;
        }
        float mt = warp_max(sc);
        __syncthreads();
        if ((tid & 31) == 0) red[tid >> 5] = mt;
        __syncthreads();
        mt = -INFINITY;
        for (int i = 0; i < (nt >> 5); i++) mt = fmaxf(mt, red[i]);
        float mn = fmaxf(m, mt);
        float e = p < visible ? expf(sc - mn) : 0.0f;
        ps[tid] = e;
        float st = block_sum(e, red);
        float corr = expf(m - mn);
        l = l * corr + st;
        for (int i = 0; i < 4; i++) acc[i] *= corr;
        __syncthreads();
        int n = min(nt, visible - base);
        for (int pp = 0; pp < n; pp++) {
            const float* vp = vc + (long long)(base + pp) * stride + kvh * hd;
            float pr = ps[pp];
            for (int i = 0; i < 4; i++) {
                int d = tid + i * nt;
                if (d < hd) acc[i] = fmaf(pr, vp[d], acc[i]);
            }
        }
        m = mn;
        __syncthreads();
    }
    for (int i = 0; i < 4; i++) {
        int d = tid + i * nt;
        if (d >= hd) continue;
        long long at = ((long long)t * nq + head) * hd + d;
        float val = acc[i] / l;
        if (gated) val *= sigmoidf_(gate[at]);
        out[at] = val;
    }
}
