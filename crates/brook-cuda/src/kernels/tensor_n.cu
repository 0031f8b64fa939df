// The tensor-core matrix kernels for several vectors at once (part of brook's CUDA source;
// see common.cu and tensor.cu, whose helpers these use): the steps of several sequences
// (batch.rs) read each weight tile once for up to QMV_TCN vectors, and give every vector the
// bits tensor.cu's one-vector kernels give it.

#if __CUDA_ARCH__ >= 800
// tc_consume for NV vectors at once (n ≤ NV of them present, the same n in the whole warp):
// each loaded chunk's codes are decoded once and multiplied by every vector's fragments (fr
// and sx hold the vectors one after another, nch chunks each). Every vector's arithmetic is
// tc_consume's, operation for operation, so its results are bit for bit those of a launch
// for that vector alone.
template <int ST, int G, int NV>
__device__ __forceinline__ void tc_consume_n(const TcLoads<ST, G>& f, const uint4* fr,
                                             const float* sx, int nch, int n, int c0,
                                             float (&acc)[NV][2]) {
    int lane = threadIdx.x & 31, t = lane & 3, p = lane >> 2;
#pragma unroll
    for (int u = 0; u < TCU; u++) {
        int c = c0 + u;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 a[2][8];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 wl = i ? f.w[u][h][0].y : f.w[u][h][0].x;
                u32 wh = i ? f.w[u][h][1].y : f.w[u][h][1].x;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    a[i][2 * j] = code_pair(wl, j);
                    a[i][2 * j + 1] = code_pair(wh, j);
                }
            }
            float s0 = tc_half<ST, G>(f.s[0], u, h), s1 = tc_half<ST, G>(f.s[1], u, h);
            float b0 = fmaf(8.0f, s0, tc_half<ST, G>(f.b[0], u, h));
            float b1 = fmaf(8.0f, s1, tc_half<ST, G>(f.b[1], u, h));
#pragma unroll
            for (int v = 0; v < NV; v++) {
                if (v >= n) break;
                const uint4* fv = fr + (long long)v * nch * TC_CHUNK_U4;
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    uint4 bq = p < 3 ? fv[c * TC_CHUNK_U4 + (2 * h + i) * 12 + p * 4 + t]
                                     : make_uint4(0u, 0u, 0u, 0u);
                    mma16816(d, a[i][0], a[i][1], a[i][2], a[i][3], bq.x, bq.y);
                    mma16816(d, a[i][4], a[i][5], a[i][6], a[i][7], bq.z, bq.w);
                }
                float lo = t == 0 ? d[0] + d[1] : d[0];
                float hi = t == 0 ? d[2] + d[3] : d[2];
                acc[v][0] = fmaf(s0, lo, acc[v][0]);
                acc[v][1] = fmaf(s1, hi, acc[v][1]);
                if (t == 0) {
                    float sxv = sx[v * (nch * 2) + c * 2 + h];
                    acc[v][0] = fmaf(b0, sxv, acc[v][0]);
                    acc[v][1] = fmaf(b1, sxv, acc[v][1]);
                }
            }
        }
    }
}

// tc_rows for NV vectors (n present).
template <int ST, int G, int NV>
__device__ __forceinline__ void tc_rows_n(const TcRow (&row)[2], int cb, int ce, int nch, int n,
                                          TcLoads<ST, G>& f, const uint4* fr, const float* sx,
                                          float (&out)[NV][2]) {
    float acc[NV][2];
#pragma unroll
    for (int v = 0; v < NV; v++) acc[v][0] = acc[v][1] = 0.0f;
    for (int c0 = cb; c0 < ce; c0 += TCU) {
        if (c0 > cb) tc_issue<ST, G>(row, c0, f);
        tc_consume_n<ST, G, NV>(f, fr, sx, nch, n, c0, acc);
    }
#pragma unroll
    for (int v = 0; v < NV; v++) {
        out[v][0] = acc[v][0] + __shfl_xor_sync(0xffffffffu, acc[v][0], 1);
        out[v][1] = acc[v][1] + __shfl_xor_sync(0xffffffffu, acc[v][1], 1);
    }
}

// tc_tiles for NV vectors (n present), the same warps, slices and order of partial sums per
// vector; `part` holds two buffers of NV·nw·16 floats. out(tile, v, o) takes vector v's totals.
template <int ST, int G, int NV, typename RowsOf, typename Out>
__device__ __forceinline__ void tc_tiles_n(int tiles, int split, int nch, int n, const uint4* fr,
                                           const float* sx, float* part, TcLoads<ST, G>& f,
                                           bool issued, RowsOf rows_of, Out out) {
    int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int per = nw / split, tl = warp / split, slice = warp % split;
    int cs = nch / split, cb = slice * cs;
    TcRow row[2];
    int step = 0;
    for (int t0 = blockIdx.x * per; t0 < tiles; t0 += gridDim.x * per, step++) {
        int tile = t0 + tl;
        float o[NV][2];
#pragma unroll
        for (int v = 0; v < NV; v++) o[v][0] = o[v][1] = 0.0f;
        if (tile < tiles) {
            rows_of(tile, row);
            if (!issued) tc_issue<ST, G>(row, cb, f);
            tc_rows_n<ST, G, NV>(row, cb, cb + cs, nch, n, f, fr, sx, o);
        }
        issued = false;
        if (split == 1) {
            if (tile < tiles && (lane & 3) == 0)
                for (int v = 0; v < n; v++) out(tile, v, o[v]);
            continue;
        }
        float* p = part + (step & 1) * NV * nw * 16;
        if ((lane & 3) == 0) {
#pragma unroll
            for (int v = 0; v < NV; v++) {
                p[(v * nw + warp) * 16 + g] = o[v][0];
                p[(v * nw + warp) * 16 + g + 8] = o[v][1];
            }
        }
        __syncthreads();
        if (slice == 0 && tile < tiles && (lane & 3) == 0) {
            for (int v = 0; v < n; v++) {
                float sum[2] = {0.0f, 0.0f};
                for (int i = 0; i < split; i++) {
                    sum[0] += p[(v * nw + warp + i) * 16 + g];
                    sum[1] += p[(v * nw + warp + i) * 16 + g + 8];
                }
                out(tile, v, sum);
            }
        }
    }
}

// qmv_tc_body for NV vectors a block: block y takes vectors NV·y .. (nvec of them in all,
// x[v] = x + v·K, xdiv 1), each weight tile read once for all of them. Each vector's outputs
// are bit for bit those of qmv_tc_body with the same split. Dynamic shared memory: ops.rs
// `tc_smem` for NV vectors and two buffers of NV·nw·16 floats.
template <int ST, int G, int NV>
__device__ void qmv_tcn_body(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3,
                             int nvec, int split, const float* __restrict__ x,
                             float* __restrict__ y, uint4* tcs) {
    int K = m0.cols, nch = K >> 7;
    int v0 = blockIdx.y * NV, n = min(NV, nvec - v0);
    uint4* fr = tcs;
    float* sx = (float*)(tcs + NV * nch * TC_CHUNK_U4);
    float* part = sx + NV * (K >> 6);
    int rows = m0.rows + m1.rows + m2.rows + m3.rows, tiles = rows >> 4;
    int g = (threadIdx.x & 31) >> 2;
    auto rows_of = [&](int tile, TcRow (&row)[2]) {
        row[0] = tc_stack_row<ST, G>(m0, m1, m2, m3, tile * 16 + g);
        row[1] = tc_stack_row<ST, G>(m0, m1, m2, m3, tile * 16 + g + 8);
    };
    TcLoads<ST, G> f;
    bool issued = tc_first<ST, G>(tiles, split, nch, f, rows_of);
    PDL_SYNC();
    tc_stage(x + (long long)v0 * K, K, n, K, fr, sx);
    __syncthreads();
    float* y0 = y + (long long)v0 * rows;
    tc_tiles_n<ST, G, NV>(tiles, split, nch, n, fr, sx, part, f, issued, rows_of,
                          [&](int tile, int v, const float (&o)[2]) {
                              float* yv = y0 + (long long)v * rows;
                              yv[tile * 16 + g] = o[0];
                              yv[tile * 16 + g + 8] = o[1];
                          });
}

#endif

// qmv_tc for up to QMV_TCN vectors a block (see qmv_tcn_body).
#define QMV_TCN 8
extern "C" __global__ void __launch_bounds__(256, 1)
    qmv_tcn(Mat m0, Mat m1, Mat m2, Mat m3, int nvec, int split, const float* __restrict__ x,
            float* __restrict__ y) {
#define QMV_TCN_(ST, G) qmv_tcn_body<ST, G, QMV_TCN>(m0, m1, m2, m3, nvec, split, x, y, tcs)
    TC_DISPATCH(m0, QMV_TCN_);
}
