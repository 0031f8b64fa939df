// Prefill's tiled matrix product, SwiGLU, the embedding and the residual RMS norm.

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

// With d: x += d. Then out = rms_norm(x) · w, one block per row. Rows of up to
// NORM_REGS · blockDim.x values stay in registers between the sum and the scaling, and
// their weights (which no kernel writes) are read before the wait.
#define NORM_REGS 8
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ d,
                                        const float* __restrict__ w, float* __restrict__ out,
                                        int H, float eps) {
    __shared__ float red[32];
    long long off = (long long)blockIdx.x * H;
    int n = blockDim.x;
    if (H <= NORM_REGS * n) {
        float v[NORM_REGS], wv[NORM_REGS];
#pragma unroll
        for (int j = 0; j < NORM_REGS; j++) {
            int i = threadIdx.x + j * n;
            wv[j] = i < H ? __ldg(w + i) : 0.0f;
        }
        PDL_SYNC();
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < NORM_REGS; j++) {
            int i = threadIdx.x + j * n;
            if (i < H) {
                v[j] = x[off + i];
                if (d) {
                    v[j] += d[off + i];
                    x[off + i] = v[j];
                }
                ss = fmaf(v[j], v[j], ss);
            }
        }
        float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)H + eps);
#pragma unroll
        for (int j = 0; j < NORM_REGS; j++) {
            int i = threadIdx.x + j * n;
            if (i < H) out[off + i] = v[j] * inv * wv[j];
        }
        return;
    }
    PDL_SYNC();
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += n) {
        float v = x[off + i];
        if (d) {
            v += d[off + i];
            x[off + i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += n) out[off + i] = x[off + i] * inv * w[i];
}
