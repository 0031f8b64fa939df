// The experts of a step of several sequences, grouped (part of brook's CUDA source; see
// common.cu, and tensor.cu and tensor_n.cu, whose helpers these use): each routed expert
// that two tokens picked, and the shared expert of every two tokens, is decoded once for
// both, two vectors to an mma as in tensor_n.cu. Every vector's arithmetic is the one-token
// kernels' (experts_tc.cu), operation for operation, and the down projections' weighted sum
// is down_tc's, in its order, so each token keeps the bits it gets alone.
//
// The groups: pick p = t·K + j is token t's j-th expert. The picks of one expert are taken
// in pick order, the r-th and (r + 1)-th (r even) sharing a group; the shared expert's
// groups are tokens (0, 1), (2, 3), …, the first S = ⌈n / 2⌉ rows of a grouped launch's
// grid (their weights need nothing earlier, so they load before the wait), the routed
// groups after them, in the pick order of their first pick. The grid has room for every
// pick alone; the rows past the step's count end at once.

// groups[i] = {expert, first pick, second pick or −1, 0} for the routed groups of n·K picks
// `sel`, count[0] their number. One block of 1024 threads; dynamic shared memory: two ints a
// pick (grouped.rs `GROUP_PICKS` bounds the picks).
extern "C" __global__ void __launch_bounds__(1024)
    moe_groups(const int* __restrict__ sel, int nk, int4* __restrict__ groups,
               int* __restrict__ count) {
    extern __shared__ int picks_sm[];
    int* ss = picks_sm;
    int* starts = picks_sm + nk;
    __shared__ int base[32];
    PDL_SYNC();
    for (int p = threadIdx.x; p < nk; p += blockDim.x) ss[p] = sel[p];
    __syncthreads();
    // A pick starts a group when an even number of earlier picks chose its expert.
    for (int p = threadIdx.x; p < nk; p += blockDim.x) {
        int e = ss[p], r = 0;
        for (int q = 0; q < p; q++) r += ss[q] == e;
        starts[p] = (r & 1) == 0;
    }
    __syncthreads();
    // Each lane of warp 0 counts the starts of its run of picks; the runs' offsets by a scan.
    if (threadIdx.x < 32) {
        int lane = threadIdx.x, run = (nk + 31) / 32, b = lane * run, e = min(nk, b + run);
        int c = 0;
        for (int p = b; p < e; p++) c += starts[p];
        int incl = c;
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        base[lane] = incl - c;
        if (lane == 31) count[0] = incl;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        int lane = threadIdx.x, run = (nk + 31) / 32, b = lane * run, e = min(nk, b + run);
        int i = base[lane];
        for (int p = b; p < e; p++) {
            if (!starts[p]) continue;
            int partner = -1;
            for (int q = p + 1; q < nk; q++)
                if (ss[q] == ss[p]) {
                    partner = q;
                    break;
                }
            groups[i++] = make_int4(ss[p], p, partner, 0);
        }
    }
}

// The tokens' combination of their experts' down outputs, as down_tc sums it: warp w of a
// down_tc block (nw of them) weighs its vectors e = w, w + nw, … (routed e < K, whose slot
// must exist; the shared one e = K) into one sum, and the warps' sums meet in warp order.
// ey[p, ·]: pick p's output; so[t, ·]: token t's shared output.
extern "C" __global__ void down_combine(const float* __restrict__ ey, const float* __restrict__ so,
                                        const u64* __restrict__ tab, const int* __restrict__ sel,
                                        const float* __restrict__ wts,
                                        const float* __restrict__ sg, int sgs, int K, int nw,
                                        int n, int rows, float* __restrict__ out) {
    PDL_SYNC();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * rows) return;
    int t = (int)(idx / rows), r = (int)(idx - (long long)t * rows);
    float s = 0.0f;
    for (int w = 0; w < nw; w++) {
        float acc = 0.0f;
        for (int e = w; e <= K; e += nw) {
            float v, wt;
            if (e < K) {
                long long p = (long long)t * K + e;
                if (tab[sel[p]] == 0) continue;
                v = ey[p * rows + r];
                wt = wts[p];
            } else {
                v = so[(long long)t * rows + r];
                wt = sigmoidf_(sg[(long long)t * sgs]);
            }
            acc = fmaf(wt, v, acc);
        }
        s += acc;
    }
    out[idx] = s;
}

#if __CUDA_ARCH__ >= 800
// What a block of a grouped launch takes: its group's expert (base 0 for the shared one,
// whose matrices have addresses of their own), its first and second item (the shared
// expert's: tokens; a routed expert's: picks; the second is the first again where the group
// has only one), and how many (0: nothing to do). A routed group is read from the step's groups,
// so this waits first for them; the shared ones wait in the caller, after their first loads.
struct Group {
    bool shared;
    u64 base;
    int nv, a, b;
};

__device__ __forceinline__ Group group_of(int n, const u64* __restrict__ tab,
                                          const int4* __restrict__ groups,
                                          const int* __restrict__ count) {
    Group gr;
    int S = (n + 1) >> 1, gy = blockIdx.y;
    gr.shared = gy < S;
    gr.base = 0;
    if (gr.shared) {
        gr.a = 2 * gy;
        gr.nv = gr.a + 1 < n ? 2 : 1;
        gr.b = gr.a + gr.nv - 1;
        return gr;
    }
    PDL_SYNC();
    gr.nv = 0;
    int i = gy - S;
    if (i >= count[0]) return gr;
    int4 g = groups[i];
    gr.base = tab[g.x];
    if (gr.base == 0) return gr;
    gr.a = g.y;
    gr.nv = g.z >= 0 ? 2 : 1;
    gr.b = g.z >= 0 ? g.z : g.y;
    return gr;
}

// One group's gate/up rows Gt, Up (the shared expert's, or a routed one's at gr.base) with
// SwiGLU: item i's input is its token's row of x, its output row i of out. Called from two
// branches, so each binds its own kernel parameters (a reference chosen at run time made the
// compiler copy both matrices to the stack).
template <int ST, int G>
__device__ __forceinline__ void swiglu_tcg_rows(const Mat& Gt, const Mat& Up, const Group& gr,
                                                int ta, int tb, int split,
                                                const float* __restrict__ x,
                                                float* __restrict__ out, uint4* tcs) {
    int cols = Gt.cols, nch = cols >> 7, tiles = Gt.rows >> 3, g = (threadIdx.x & 31) >> 2;
    long long o0 = (long long)gr.a * Gt.rows, o1 = (long long)gr.b * Gt.rows;
    uint4* fr = tcs;
    float* sx = (float*)(tcs + 2 * nch * TC_CHUNK_U4);
    float* part = sx + 2 * (cols >> 6);
    u64 base = gr.base;
    auto rows_of = [&](int tile, TcRow (&row)[2]) {
        row[0] = tc_row<ST, G>(Gt, base, tile * 8 + g);
        row[1] = tc_row<ST, G>(Up, base, tile * 8 + g);
    };
    TcLoads<ST, G> f;
    bool issued = tc_first<ST, G>(tiles, split, nch, f, rows_of);
    if (gr.shared) PDL_SYNC();
    tc_stage(x + (long long)ta * cols, (long long)(tb - ta) * cols, gr.nv, cols, fr, sx);
    __syncthreads();
    tc_tiles_n<ST, G, 2>(tiles, split, nch, gr.nv, fr, sx, part, f, issued, rows_of,
                         [&](int tile, int v, const float (&o)[2]) {
                             out[(v ? o1 : o0) + tile * 8 + g] = siluf_(o[0]) * o[1];
                         });
}

// swiglu_tc_body for the groups of n tokens (`split` as the one-token launch's): h =
// silu(gate·x)·(up·x) of pick p into y[p, ·], of token t's shared expert into ys[t, ·].
// Dynamic shared memory: tc_smem for two vectors and two buffers of 2·4·16 floats.
template <int ST, int G>
__device__ void swiglu_tcg_body(const Mat& gm, const Mat& um, const u64* __restrict__ tab,
                                int K, int n, const Mat& sg, const Mat& su, int split,
                                const int4* __restrict__ groups, const int* __restrict__ count,
                                const float* __restrict__ x, float* __restrict__ y,
                                float* __restrict__ ys, uint4* tcs) {
    Group gr = group_of(n, tab, groups, count);
    if (gr.nv == 0) return;
    // Each item's input is its token's; its output row is the token's (shared) or the pick's.
    if (gr.shared)
        swiglu_tcg_rows<ST, G>(sg, su, gr, gr.a, gr.b, split, x, ys, tcs);
    else
        swiglu_tcg_rows<ST, G>(gm, um, gr, gr.a / K, gr.b / K, split, x, y, tcs);
}

// One group's down projection M: item i's input is row i of h, its output row i of out.
template <int ST, int G>
__device__ __forceinline__ void down_tcg_rows(const Mat& M, const Group& gr,
                                              const float* __restrict__ h,
                                              float* __restrict__ out, uint4* tcs) {
    int rows = M.rows, cols = M.cols, nch = cols >> 7, tiles = rows >> 4;
    int g = (threadIdx.x & 31) >> 2;
    uint4* fr = tcs;
    float* sx = (float*)(tcs + 2 * nch * TC_CHUNK_U4);
    u64 base = gr.base;
    auto rows_of = [&](int tile, TcRow (&row)[2]) {
        row[0] = tc_row<ST, G>(M, base, tile * 16 + g);
        row[1] = tc_row<ST, G>(M, base, tile * 16 + g + 8);
    };
    TcLoads<ST, G> f;
    bool issued = tc_first<ST, G>(tiles, 1, nch, f, rows_of);
    if (gr.shared) PDL_SYNC();
    tc_stage(h + (long long)gr.a * cols, (long long)(gr.b - gr.a) * cols, gr.nv, cols, fr, sx);
    __syncthreads();
    tc_tiles_n<ST, G, 2>(tiles, 1, nch, gr.nv, fr, sx, nullptr, f, issued, rows_of,
                         [&](int tile, int v, const float (&o)[2]) {
                             float* yv = out + (long long)(v ? gr.b : gr.a) * rows;
                             yv[tile * 16 + g] = o[0];
                             yv[tile * 16 + g + 8] = o[1];
                         });
}

// down_tc's products for the groups of n tokens, unweighted: pick p's down projection of
// h[p, ·] into ey[p, ·], token t's shared one of hs[t, ·] into so[t, ·] (down_combine then
// weighs and sums them). A warp takes a 16-row tile over every chunk, as down_tc's do.
// Dynamic shared memory: tc_smem for two vectors of the wider input.
template <int ST, int G>
__device__ void down_tcg_body(const Mat& down, const u64* __restrict__ tab, int n,
                              const Mat& sdown, const int4* __restrict__ groups,
                              const int* __restrict__ count, const float* __restrict__ h,
                              const float* __restrict__ hs, float* __restrict__ ey,
                              float* __restrict__ so, uint4* tcs) {
    Group gr = group_of(n, tab, groups, count);
    if (gr.nv == 0) return;
    if (gr.shared)
        down_tcg_rows<ST, G>(sdown, gr, hs, so, tcs);
    else
        down_tcg_rows<ST, G>(down, gr, h, ey, tcs);
}
#endif

extern "C" __global__ void __launch_bounds__(128, 3)
    swiglu_tcg(Mat gm, Mat um, const u64* __restrict__ tab, int K, int n, Mat sg, Mat su,
               int split, const int4* __restrict__ groups, const int* __restrict__ count,
               const float* __restrict__ x, float* __restrict__ y, float* __restrict__ ys) {
#define SWIGLU_TCG(ST, G) \
    swiglu_tcg_body<ST, G>(gm, um, tab, K, n, sg, su, split, groups, count, x, y, ys, tcs)
    TC_DISPATCH(gm, SWIGLU_TCG);
}

extern "C" __global__ void __launch_bounds__(128, 4)
    down_tcg(Mat down, const u64* __restrict__ tab, int n, Mat sdown,
             const int4* __restrict__ groups, const int* __restrict__ count,
             const float* __restrict__ h, const float* __restrict__ hs, float* __restrict__ ey,
             float* __restrict__ so) {
#define DOWN_TCG(ST, G) \
    down_tcg_body<ST, G>(down, tab, n, sdown, groups, count, h, hs, ey, so, tcs)
    TC_DISPATCH(down, DOWN_TCG);
}
