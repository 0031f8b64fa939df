// The tensor-core matrix kernels for several vectors at once (part of brook's CUDA source;
// see common.cu and tensor.cu, whose helpers these use): the steps of several sequences
// (batch.rs) read each weight tile once for up to QMV_TCN vectors, and give every vector the
// bits tensor.cu's one-vector kernels give it.

#if __CUDA_ARCH__ >= 800
// Two vectors share each mma: a vector takes four of B's eight columns (its four digit
// rows), so pair j puts vector 2j in columns 0..3 and vector 2j + 1 in columns 4..7. The
// mma's sums are exact integers, each column's independent of the others, so each vector's
// sums are those of tensor.cu's one-vector mma (its digits in columns 0..3, the rest zero).
// Lane t of a quad holds output columns 2t and 2t + 1: lanes t = 0, 1 hold vector 2j as
// tc_consume's t = 0, 1 do, lanes t = 2, 3 hold vector 2j + 1 the same way, and the same
// shuffle adds each pair of lanes. So a lane carries one accumulator per pair, for vector
// 2j + t / 2.

// tc_consume for NV vectors at once (NV / 2 pairs): each loaded chunk's codes are decoded
// once and multiplied by every pair's fragments (fr and sx hold the vectors one after
// another, nch chunks each). All NV are computed whether present or not (the caller stores
// only the present ones; the others read staging room that holds no vector): with no branch
// between them the pairs' chains of dependent mma interleave. Every vector's arithmetic is
// tc_consume's, operation for operation, so its results are bit for bit those of a launch
// for that vector alone.
template <int ST, int G, int NV>
__device__ __forceinline__ void tc_consume_n(const TcLoads<ST, G>& f, const uint4* fr,
                                             const float* sx, int nch, int c0,
                                             float (&acc)[NV / 2][2]) {
    int lane = threadIdx.x & 31, t = lane & 3, p = lane >> 2;
    // This lane's B column: digit p & 3 of vector 2j + p / 4.
    int digit = p & 3, side = p >> 2, mine = t >> 1;
    bool even = (t & 1) == 0;
#pragma unroll
    for (int u = 0; u < TCU; u++) {
        int c = c0 + u;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 wl = i ? f.w[u][h][0].y : f.w[u][h][0].x;
                u32 wh = i ? f.w[u][h][1].y : f.w[u][h][1].x;
                a[i][0] = wl & NIB;
                a[i][1] = wh & NIB;
                a[i][2] = (wl >> 4) & NIB;
                a[i][3] = (wh >> 4) & NIB;
            }
            float s0 = tc_half<ST, G>(f.s[0], u, h), s1 = tc_half<ST, G>(f.s[1], u, h);
            float b0 = tc_half<ST, G>(f.b[0], u, h), b1 = tc_half<ST, G>(f.b[1], u, h);
#pragma unroll
            for (int j = 0; j < NV / 2; j++) {
                const uint2* fv =
                    (const uint2*)(fr + ((long long)(2 * j + side) * nch + c) * TC_CHUNK_U4);
                int d[4] = {0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    uint2 bq = fv[(2 * h + i) * 16 + digit * 4 + t];
                    mma_u8s8(d, a[i][0], a[i][1], a[i][2], a[i][3], bq.x, bq.y);
                }
                float mh = ((const float*)(fr + ((long long)(2 * j + mine) * nch + c) *
                                                    TC_CHUNK_U4 + 32))[h];
                float unit = digit_unit(mh, even);
                float lo = digit_pair(d[0], d[1], unit);
                float hi = digit_pair(d[2], d[3], unit);
                acc[j][0] = fmaf(s0, lo, acc[j][0]);
                acc[j][1] = fmaf(s1, hi, acc[j][1]);
                if (even) {
                    float sxv = sx[(2 * j + mine) * (nch * 2) + c * 2 + h];
                    acc[j][0] = fmaf(b0, sxv, acc[j][0]);
                    acc[j][1] = fmaf(b1, sxv, acc[j][1]);
                }
            }
        }
    }
}

// tc_rows for NV vectors: a lane's totals for vector 2j + t / 2 in out[j] (lanes t = 0, 2).
template <int ST, int G, int NV>
__device__ __forceinline__ void tc_rows_n(const TcRow (&row)[2], int cb, int ce, int nch,
                                          TcLoads<ST, G>& f, const uint4* fr, const float* sx,
                                          float (&out)[NV / 2][2]) {
    float acc[NV / 2][2];
#pragma unroll
    for (int j = 0; j < NV / 2; j++) acc[j][0] = acc[j][1] = 0.0f;
    for (int c0 = cb; c0 < ce; c0 += TCU) {
        if (c0 > cb) tc_issue<ST, G>(row, c0, f);
        tc_consume_n<ST, G, NV>(f, fr, sx, nch, c0, acc);
    }
#pragma unroll
    for (int j = 0; j < NV / 2; j++) {
        out[j][0] = acc[j][0] + __shfl_xor_sync(0xffffffffu, acc[j][0], 1);
        out[j][1] = acc[j][1] + __shfl_xor_sync(0xffffffffu, acc[j][1], 1);
    }
}

// tc_tiles for NV vectors (n present), the same warps, slices and order of partial sums per
// vector; `part` holds two buffers of NV·nw·16 floats. out(tile, v, o) takes vector v's
// totals (from lanes t = 0 for even v, t = 2 for odd v).
template <int ST, int G, int NV, typename RowsOf, typename Out>
__device__ __forceinline__ void tc_tiles_n(int tiles, int split, int nch, int n, const uint4* fr,
                                           const float* sx, float* part, TcLoads<ST, G>& f,
                                           bool issued, RowsOf rows_of, Out out) {
    int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int per = nw / split, tl = warp / split, slice = warp % split;
    int cs = nch / split, cb = slice * cs;
    bool holds = (lane & 1) == 0;    // lanes t = 0, 2: a vector's totals
    int mine = (lane & 3) >> 1;      // which vector of each pair
    TcRow row[2];
    int step = 0;
    for (int t0 = blockIdx.x * per; t0 < tiles; t0 += gridDim.x * per, step++) {
        int tile = t0 + tl;
        float o[NV / 2][2];
#pragma unroll
        for (int j = 0; j < NV / 2; j++) o[j][0] = o[j][1] = 0.0f;
        if (tile < tiles) {
            rows_of(tile, row);
            if (!issued) tc_issue<ST, G>(row, cb, f);
            tc_rows_n<ST, G, NV>(row, cb, cb + cs, nch, f, fr, sx, o);
        }
        issued = tc_next<ST, G>(tile + gridDim.x * per, tiles, cb, f, rows_of);
        if (split == 1) {
            if (tile < tiles && holds)
#pragma unroll
                for (int j = 0; j < NV / 2; j++)
                    if (2 * j + mine < n) out(tile, 2 * j + mine, o[j]);
            continue;
        }
        float* p = part + (step & 1) * NV * nw * 16;
        if (holds) {
#pragma unroll
            for (int j = 0; j < NV / 2; j++) {
                int v = 2 * j + mine;
                p[(v * nw + warp) * 16 + g] = o[j][0];
                p[(v * nw + warp) * 16 + g + 8] = o[j][1];
            }
        }
        __syncthreads();
        if (slice == 0 && tile < tiles && holds) {
#pragma unroll
            for (int j = 0; j < NV / 2; j++) {
                int v = 2 * j + mine;
                if (v >= n) continue;
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

// The routed experts of a prefill chunk on the tensor cores (ops.rs `qmm` with `tc`; the tiled
// `qmm`'s grouped form): block (x, e) takes expert e's (token, pick) pairs pairs[offs[e] +
// j], j < counts[e], eight at a time (input x[pair / xdiv], output y[pair]: the rows of m0,
// then m1's, at the expert's slot tab[e]; an expert without one is skipped), each weight tile
// read once for the eight. Every expert takes the same operations whichever tier holds it,
// so a chunk's bits do not depend on the tiers. Dynamic shared memory as qmv_tcn8's.
template <int ST, int G>
__device__ void qmm_tcn_body(const Mat& m0, const Mat& m1, const u64* __restrict__ tab,
                             const int* __restrict__ counts, const int* __restrict__ offs,
                             const int* __restrict__ pairs, int xdiv, int split,
                             const float* __restrict__ x, float* __restrict__ y, uint4* tcs) {
    constexpr int NV = 8;
    int e = blockIdx.y;
    PDL_SYNC();
    int count = counts[e];
    u64 base = count > 0 ? tab[e] : 0;
    if (base == 0) return;
    const int* pl = pairs + offs[e];
    int K = m0.cols, nch = K >> 7;
    uint4* fr = tcs;
    float* sx = (float*)(tcs + NV * nch * TC_CHUNK_U4);
    float* part = sx + NV * (K >> 6);
    int rows = m0.rows + m1.rows, tiles = rows >> 4;
    int g = (threadIdx.x & 31) >> 2;
    // A tile lies inside m0 or inside m1 (each a multiple of 16 rows).
    auto rows_of = [&](int tile, TcRow (&row)[2]) {
        int r = tile * 16 + g;
        bool first = r < m0.rows;
        TcRow a0 = tc_row<ST, G>(m0, base, r), a1 = tc_row<ST, G>(m0, base, r + 8);
        TcRow b0 = tc_row<ST, G>(m1, base, r - m0.rows);
        TcRow b1 = tc_row<ST, G>(m1, base, r + 8 - m0.rows);
        row[0] = first ? a0 : b0;
        row[1] = first ? a1 : b1;
    };
    for (int v0 = 0; v0 < count; v0 += NV) {
        int n = min(NV, count - v0);
        TcLoads<ST, G> f;
        bool issued = tc_first<ST, G>(tiles, split, nch, f, rows_of);
        if (v0 > 0) __syncthreads();   // the last group's fragments and sums are read
        for (int j = 0; j < n; j++)
            tc_stage(x + (long long)(pl[v0 + j] / xdiv) * K, 0, 1, K,
                     fr + (long long)j * nch * TC_CHUNK_U4, sx + j * (K >> 6));
        __syncthreads();
        tc_tiles_n<ST, G, NV>(tiles, split, nch, n, fr, sx, part, f, issued, rows_of,
                              [&](int tile, int v, const float (&o)[2]) {
                                  float* yv = y + (long long)pl[v0 + v] * rows;
                                  yv[tile * 16 + g] = o[0];
                                  yv[tile * 16 + g + 8] = o[1];
                              });
    }
}

#endif

// qmv_tc for up to NV vectors a block (see qmv_tcn_body): qmv_tcn2, qmv_tcn4 and qmv_tcn8,
// the host taking the smallest that holds a step's vectors (eight a block beyond that).
#define QMV_TCN(NV)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                         \
        qmv_tcn##NV(Mat m0, Mat m1, Mat m2, Mat m3, int nvec, int split,                         \
                    const float* __restrict__ x, float* __restrict__ y) {                        \
        TC_DISPATCH(m0, QMV_TCN_##NV);                                                           \
    }
#define QMV_TCN_2(ST, G) qmv_tcn_body<ST, G, 2>(m0, m1, m2, m3, nvec, split, x, y, tcs)
#define QMV_TCN_4(ST, G) qmv_tcn_body<ST, G, 4>(m0, m1, m2, m3, nvec, split, x, y, tcs)
#define QMV_TCN_8(ST, G) qmv_tcn_body<ST, G, 8>(m0, m1, m2, m3, nvec, split, x, y, tcs)
QMV_TCN(2)
QMV_TCN(4)
QMV_TCN(8)

// qmm_tcn_body's kernel (the prefill's routed experts, eight pairs of an expert at a time).
extern "C" __global__ void __launch_bounds__(256, 1)
    qmm_tcn8(Mat m0, Mat m1, const u64* __restrict__ tab, const int* __restrict__ counts,
             const int* __restrict__ offs, const int* __restrict__ pairs, int xdiv, int split,
             const float* __restrict__ x, float* __restrict__ y) {
#define QMM_TCN(ST, G) \
    qmm_tcn_body<ST, G>(m0, m1, tab, counts, offs, pairs, xdiv, split, x, y, tcs)
    TC_DISPATCH(m0, QMM_TCN);
}
