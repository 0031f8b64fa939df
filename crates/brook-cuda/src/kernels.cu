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

// One row of W times x, summed over the warp (every lane returns the total). The 4- and
// 8-bit paths issue all of a lane's weight, scale and bias loads for up to U words before
// using any, so a row costs one memory round trip instead of one per word.
#define U 8
__device__ float row_dot(const Mat& m, u64 base, int r, const float* __restrict__ x) {
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
                float q = 0.0f, sx = 0.0f;
                if (m.bits == 4) {
                    const float4* xp = (const float4*)(x + 8 * w);
                    float4 a = __ldg(xp), b = __ldg(xp + 1);
                    u32 t = v[u];
                    q = fmaf((float)(t & 15u), a.x, q);
                    q = fmaf((float)((t >> 4) & 15u), a.y, q);
                    q = fmaf((float)((t >> 8) & 15u), a.z, q);
                    q = fmaf((float)((t >> 12) & 15u), a.w, q);
                    q = fmaf((float)((t >> 16) & 15u), b.x, q);
                    q = fmaf((float)((t >> 20) & 15u), b.y, q);
                    q = fmaf((float)((t >> 24) & 15u), b.z, q);
                    q = fmaf((float)(t >> 28), b.w, q);
                    sx = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
                } else {
                    float4 a = __ldg((const float4*)x + w);
                    u32 t = v[u];
                    q = fmaf((float)(t & 255u), a.x, q);
                    q = fmaf((float)((t >> 8) & 255u), a.y, q);
                    q = fmaf((float)((t >> 16) & 255u), a.z, q);
                    q = fmaf((float)(t >> 24), a.w, q);
                    sx = (a.x + a.y) + (a.z + a.w);
                }
                acc = fmaf(sc[u], q, acc);
                acc = fmaf(bi[u], sx, acc);
            }
        }
    } else {
        for (int c = lane; c < m.cols; c += 32) acc = fmaf(wat(m, base, r, c), x[c], acc);
    }
    return warp_sum(acc);
}

// y[v, r] = W[r] · x[v / xdiv] for the rows of m1 then m2 (m2.rows may be 0), one warp per
// row, vector v = blockIdx.y. With `sel`, vector v uses expert sel[v] of the slot table `tab`
// (skipped when that expert has no slot); otherwise the addresses are absolute.
extern "C" __global__ void qmv(Mat m1, Mat m2, const u64* __restrict__ tab,
                               const int* __restrict__ sel, int xdiv,
                               const float* __restrict__ x, float* __restrict__ y) {
    int rows = m1.rows + m2.rows;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    int v = blockIdx.y;
    u64 base = 0;
    if (sel) {
        base = tab[sel[v]];
        if (base == 0) return;
    }
    const float* xv = x + (long long)(v / xdiv) * m1.cols;
    float d = r < m1.rows ? row_dot(m1, base, r, xv) : row_dot(m2, base, r - m1.rows, xv);
    if ((threadIdx.x & 31) == 0) y[(long long)v * rows + r] = d;
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
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * I) return;
    long long n = idx / I, i = idx % I;
    h[idx] = siluf_(gu[n * 2 * I + i]) * gu[n * 2 * I + I + i];
}

// out[t, :] = embedding row tokens[t].
extern "C" __global__ void embed(Mat m, const int* __restrict__ tokens, float* __restrict__ out) {
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
extern "C" __global__ void topk(const float* __restrict__ logits, int E, int K, int norm,
                                int* __restrict__ sel, float* __restrict__ wts) {
    extern __shared__ float p[];   // [E]
    __shared__ int ids[32];
    __shared__ float ws[32];
    int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * E;
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
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[sel[i]], 1);
}

extern "C" __global__ void moe_offsets(const int* __restrict__ counts, int E, int* __restrict__ offs,
                                       int* __restrict__ fill) {
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
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = sel[i];
    pairs[offs[e] + atomicAdd(&fill[e], 1)] = i;
}

// out[t, j] = Σ_k wts[t,k] · y[t·K + k, j] (in expert-id order) + sigmoid(sg[t]) · shared[t, j].
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ wts,
                                       const float* __restrict__ shared, const float* __restrict__ sg,
                                       float* __restrict__ out, int T, int K, int H) {
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
