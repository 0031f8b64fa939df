// The routed and shared experts' kernels on the tensor cores (part of brook's CUDA source;
// see common.cu, and tensor.cu, whose helpers and TC_DISPATCH these use): gate/up with SwiGLU,
// and down with the router's weights, for one token or several.

#if __CUDA_ARCH__ >= 800
// qmv_swiglu's tensor-core form: vector v < nsel is routed expert sel[v] (slot table tab;
// skipped when it has no slot), vector nsel (when the grid has it) the shared expert (gate
// sg, up su); h[j] = silu(gate[j]·x)·(up[j]·x) into y[v, ·] and ys. A tile is gate rows
// j..j+7 (as rows g) and the same up rows (as rows g + 8), so each lane t = 0 ends with both
// factors of its h[j]. Rows a multiple of 8; dynamic shared memory as qmv_tc's.
template <int ST, int G>
__device__ __forceinline__ void swiglu_tc_rows(const Mat& Gt, const Mat& Up, u64 base,
                                               int split, bool pre, bool flags,
                                               const float* __restrict__ x,
                                               float* __restrict__ h, uint4* tcs) {
    int K = Gt.cols, nch = K >> 7, tiles = Gt.rows >> 3;
    uint4* fr = tcs;
    float* sx = (float*)(tcs + nch * TC_CHUNK_U4);
    float* part = sx + (K >> 6);
    int g = (threadIdx.x & 31) >> 2;
    auto rows_of = [&](int tile, TcRow (&row)[2]) {
        row[0] = tc_row<ST, G>(Gt, base, tile * 8 + g);
        row[1] = tc_row<ST, G>(Up, base, tile * 8 + g);
    };
    TcLoads<ST, G> f;
    // The first loads go out before the activations are staged; the shared expert's
    // (`pre`) even before the wait, which this call then makes, as its weights depend on
    // no earlier kernel (a routed expert's slot is known only after the caller's wait).
    // With `flags` (the gather beside it) it does not wait: its input was written before the
    // gather started, and the gather's end is not awaited.
    bool issued = tc_first<ST, G>(tiles, split, nch, f, rows_of);
    if (pre) {
        if (flags)
            PDL_TRIGGER();
        else
            PDL_SYNC();
    }
    tc_stage(x, 0, 1, K, fr, sx);
    __syncthreads();
    tc_tiles<ST, G>(tiles, split, nch, fr, sx, part, f, issued, rows_of,
                    [&](int tile, const float (&o)[2]) { h[tile * 8 + g] = siluf_(o[0]) * o[1]; });
}

// R: beside gather_ready (one token), waiting on its flags `ready` (swiglu_tc_ready) instead of
// on the kernel before.
template <int ST, int G, bool R>
__device__ void swiglu_tc_body(const Mat& gm, const Mat& um, const u64* __restrict__ tab,
                               const int* __restrict__ sel, int nsel, int per, const Mat& sg,
                               const Mat& su, int split, const float* __restrict__ x,
                               float* __restrict__ y, float* __restrict__ ys,
                               const u32* __restrict__ ready, int need, uint4* tcs) {
    // `per` vectors a token (its nsel routed experts, then the shared one where present).
    int v = token_vector(per, nsel, gm.cols, gm.rows, sg.rows, sel, x, y, ys);
    if (v < nsel) {
        u64 base;
        if (R) {
            // One token beside gather_ready: the table and every copied expert's gate and
            // up bytes are in place once ready[0] counts `need`.
            PDL_TRIGGER();
            wait_ready(ready, (u32)need);
            base = __ldcg(tab + __ldcg(sel + v));
        } else {
            PDL_SYNC();
            base = tab[sel[v]];
        }
        if (base == 0) return;
        swiglu_tc_rows<ST, G>(gm, um, base, split, false, R, x, y + (long long)v * gm.rows,
                              tcs);
    } else {
        swiglu_tc_rows<ST, G>(sg, su, 0, split, true, R, x, ys, tcs);
    }
}

// Rows r + g and r + g + 8 of `m` at `base` into `row`, their first chunks issued into f
// (down_tc's tile of one expert).
template <int ST, int G>
__device__ __forceinline__ void tc_issue_tile(const Mat& m, u64 base, int r, int g,
                                              TcRow (&row)[2], TcLoads<ST, G>& f) {
    row[0] = tc_row<ST, G>(m, base, r + g);
    row[1] = tc_row<ST, G>(m, base, r + g + 8);
    tc_issue<ST, G>(row, 0, f);
}

// moe_down's tensor-core form: out[r] = Σ_k wts[k]·(down of expert sel[k] · h_k)[r] +
// sigmoid(sg)·(sdown · h_s)[r]. A block takes tiles of 16 rows (blockIdx.x, then every
// gridDim.x-th: several when many tokens share the launch, so each block stages its token's
// inputs once for more rows); its warp w takes vectors w, w + nw, … of the K routed ones
// and then the shared one (vector K), weights each tile's result, and the block sums the
// warps' partial sums in warp order. Dynamic shared memory: the K routed inputs' and the
// shared input's fragments and sums (ops.rs `tc_down_smem`), then 16 floats per warp. At
// most 12 warps (the register budget of one block per SM).
template <int ST, int G, bool R>
__device__ void down_tc_body(const Mat& down, const u64* __restrict__ tab,
                             const int* __restrict__ sel, const float* __restrict__ wts, int K,
                             const Mat& sdown, const float* __restrict__ sg, int sgs,
                             const float* __restrict__ h, const float* __restrict__ hsh,
                             float* __restrict__ out, const u32* __restrict__ ready, int need,
                             uint4* tcs) {
    int I = down.cols, IS = sdown.cols, nch = I >> 7, snch = IS >> 7;
    // Token blockIdx.y: its selection, weights, gate (sgs floats apart), inputs and output
    // follow the previous token's.
    int tok = blockIdx.y;
    sel += (long long)tok * K;
    wts += (long long)tok * K;
    sg += (long long)tok * sgs;
    h += (long long)tok * K * I;
    hsh += (long long)tok * IS;
    out += (long long)tok * down.rows;
    uint4* fr = tcs;
    uint4* sfr = fr + K * nch * TC_CHUNK_U4;
    float* sx = (float*)(sfr + snch * TC_CHUNK_U4);
    float* ssx = sx + K * (I >> 6);
    float* part = ssx + (IS >> 6);
    int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int r0 = blockIdx.x * 16;
    TcLoads<ST, G> f;
    TcRow row[2];
    // The shared expert's loads need no earlier kernel: issued first where it is the warp's
    // first vector.
    if (warp == K) {
        tc_issue_tile<ST, G>(sdown, 0, r0, g, row, f);
    }
    PDL_SYNC();
    // A routed first vector's slot is known now: its loads go out before the staging. With
    // R (one token beside gather_ready, down_tc_ready), the routed experts' down bytes are in
    // place once ready[0] counts `need`: their warps wait after the staging, the shared one
    // goes on.
    u64 first = 0;
    if (!R && warp < K) {
        first = tab[sel[warp]];
        if (first != 0) tc_issue_tile<ST, G>(down, first, r0, g, row, f);
    }
    tc_stage(h, I, K, I, fr, sx);
    tc_stage(hsh, 0, 1, IS, sfr, ssx);
    __syncthreads();
    if (R && warp < K) {
        wait_ready_warp(ready, (u32)need);
        first = __ldcg(tab + __ldcg(sel + warp));
        if (first != 0) tc_issue_tile<ST, G>(down, first, r0, g, row, f);
    }
    for (bool issued = true; r0 < down.rows; r0 += gridDim.x * 16) {
        float acc[2] = {0.0f, 0.0f};
        for (int e = warp; e <= K; e += nw) {
            // Routed vector e < K (its slot; none: no output) or the shared one (e = K).
            bool routed = e < K;
            if (R && routed && e != warp) wait_ready_warp(ready, (u32)need);
            u64 base = 0;
            if (routed && e == warp)
                base = first;
            else if (routed)
                base = R ? __ldcg(tab + __ldcg(sel + e)) : tab[sel[e]];
            if (routed && base == 0) continue;
            if (!(issued && e == warp)) {   // else its loads are out already
                tc_issue_tile<ST, G>(routed ? down : sdown, base, r0, g, row, f);
            }
            float o[2];
            if (routed)
                tc_rows<ST, G>(row, 0, nch, f, fr + e * nch * TC_CHUNK_U4, sx + e * (I >> 6), o);
            else
                tc_rows<ST, G>(row, 0, snch, f, sfr, ssx, o);
            float w = routed ? (R ? __ldcg(wts + e) : wts[e]) : sigmoidf_(R ? __ldcg(sg) : sg[0]);
            acc[0] = fmaf(w, o[0], acc[0]);
            acc[1] = fmaf(w, o[1], acc[1]);
        }
        // The next tile's first vector (the same expert) goes out now, while this tile's
        // partial sums meet: f is free.
        int next = r0 + gridDim.x * 16;
        issued = next < down.rows && (warp == K || first != 0);
        if (issued) tc_issue_tile<ST, G>(warp == K ? sdown : down, first, next, g, row, f);
        if ((lane & 3) == 0) {
            part[warp * 16 + g] = acc[0];
            part[warp * 16 + g + 8] = acc[1];
        }
        __syncthreads();
        if (threadIdx.x < 16) {
            float s = 0.0f;
            for (int w = 0; w < nw; w++) s += part[w * 16 + threadIdx.x];
            out[r0 + threadIdx.x] = s;
        }
        __syncthreads();   // part is written again for the next tile
    }
}
#endif

// The expert kernels, and their forms beside gather_ready (`_ready`: R), which take the same
// arguments: one definition each, R a constant of the kernel.
#define SWIGLU_TC_KERNEL(NAME, READY)                                                           \
    extern "C" __global__ void __launch_bounds__(128, 4)                                        \
        NAME(Mat gm, Mat um, const u64* __restrict__ tab, const int* __restrict__ sel, int nsel, \
             int per, Mat sg, Mat su, int split, const float* __restrict__ x,                   \
             float* __restrict__ y, float* __restrict__ ys, const u32* __restrict__ ready,      \
             int need) {                                                                        \
        constexpr bool R = READY;                                                               \
        TC_DISPATCH(gm, SWIGLU_TC);                                                             \
    }
#define SWIGLU_TC(ST, G) \
    swiglu_tc_body<ST, G, R>(gm, um, tab, sel, nsel, per, sg, su, split, x, y, ys, ready, need, tcs)
SWIGLU_TC_KERNEL(swiglu_tc, false)
SWIGLU_TC_KERNEL(swiglu_tc_ready, true)

#define DOWN_TC_KERNEL(NAME, READY)                                                             \
    extern "C" __global__ void __launch_bounds__(384)                                           \
        NAME(Mat down, const u64* __restrict__ tab, const int* __restrict__ sel,                \
             const float* __restrict__ wts, int K, Mat sdown, const float* __restrict__ sg,     \
             int sgs, const float* __restrict__ h, const float* __restrict__ hsh,               \
             float* __restrict__ out, const u32* __restrict__ ready, int need) {                \
        constexpr bool R = READY;                                                               \
        TC_DISPATCH(down, DOWN_TC);                                                             \
    }
#define DOWN_TC(ST, G) \
    down_tc_body<ST, G, R>(down, tab, sel, wts, K, sdown, sg, sgs, h, hsh, out, ready, need, tcs)
DOWN_TC_KERNEL(down_tc, false)
DOWN_TC_KERNEL(down_tc_ready, true)
