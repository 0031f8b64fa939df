// One-token matrix kernels (part of brook's CUDA source; see common.cu): activations staged
// in shared memory, the dense and stacked products, the experts' SwiGLU and down projections.

// The matrix-vector kernels read the activations from shared memory, staged once per block
// in a padded layout: element i lives at pad(i), four floats of padding after every 32, so
// the 16-byte reads of eight lanes that each start 32 (or 16) elements apart hit distinct
// banks. (Read straight from global memory, those strided reads made the kernels L1-bound.)
__device__ __forceinline__ int pad(int i) { return i + ((i >> 5) << 2); }

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
                v[u] = ok ? ld_stream(row + w) : 0u;
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
        uint4 t = ld_stream((const uint4*)p);
        v[0] = t.x; v[1] = t.y; v[2 % VW] = t.z; v[3 % VW] = t.w;
    } else {
        uint2 t = ld_stream((const uint2*)p);
        v[0] = t.x; v[1 % VW] = t.y;
    }
}

// Unit u (VW words) of row r of a fast-form matrix at `base`, with its group's scale and bias
// (ush: log2 of units per group; gpr: groups per row).
template <int VW>
__device__ __forceinline__ void load_group_unit(const Mat& m, u64 base, long long r, int u,
                                                int words, int ush, int gpr, u32 (&v)[VW],
                                                float& sc, float& bi) {
    load_unit<VW>((const u32*)(base + m.w) + r * words + (long long)u * VW, v);
    long long gi = r * gpr + (u >> ush);
    sc = ldsb(base + m.s, m.stype, gi);
    bi = ldsb(base + m.b, m.stype, gi);
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
#pragma unroll
    for (int i = 0; i < N; i++) {
        int u = u0 + lane + 32 * i;
        bool ok = u < units;
#pragma unroll
        for (int r = 0; r < R; r++) {
            long long row = r0 + r;
            if (ok) {
                load_group_unit<4>(m, base, row, u, words, ush, gpr, f.v[i][r], f.sc[i][r],
                                   f.bi[i][r]);
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
// rows' weights are requested before PDL_SYNC: they depend on no earlier kernel. A one-row
// step loads four units a lane in a round (NU two for four rows), so a row of up to 128
// units (2048 codes at 8 bits: a router) needs no second round after the wait; the units
// are summed in the same order either way.
template <int R>
__device__ void stacked(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3, u64 base,
                        int rows, const float* __restrict__ x, float* xs, float* __restrict__ y,
                        int xblock, int xblocks) {
    constexpr int N = R == 1 ? 4 : NU;
    int nw = blockDim.x >> 5;
    int stride = xblocks * nw * R;
    int r0 = (xblock * nw + (threadIdx.x >> 5)) * R;
    bool lead = (threadIdx.x & 31) == 0;
    Round<R, N> f;
    Mat m;
    int l = 0;
    bool ok = whole<R>(m0, m1, m2, m3, base, r0, rows, m, l);
    if (ok) issue<R, N>(m, base, l, 0, f);
    PDL_SYNC();
    stage(x, xs, m0.cols);
    while (r0 < rows) {
        if (ok) {
            float d[R];
            rows_fast<R, N>(m, base, l, f, xs, d);
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
        if (ok) issue<R, N>(m, base, l, 0, f);
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
// Dynamic shared memory: m0.cols activations padded (ops.rs `padded_bytes`).
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
// times x[0] into ys. Dynamic shared memory as qmv's.
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

// The vector of block row blockIdx.y in a launch of `per` vectors a token (the SwiGLU
// kernels'): moves the pointers to its token's selection (nsel ids), input (cols floats),
// routed outputs (nsel · rows) and shared output (srows), each after the previous token's,
// and returns the vector's index within its token.
__device__ __forceinline__ int token_vector(int per, int nsel, int cols, int rows, int srows,
                                            const int* __restrict__& sel,
                                            const float* __restrict__& x,
                                            float* __restrict__& y, float* __restrict__& ys) {
    int tok = blockIdx.y / per;
    sel += (long long)tok * nsel;
    x += (long long)tok * cols;
    y += (long long)tok * nsel * rows;
    ys += (long long)tok * srows;
    return blockIdx.y - tok * per;
}

// qmv_sel's SwiGLU form for one token (or several: see `per`): vector v < nsel is routed expert sel[v], vector nsel
// (when the grid has it) the shared expert; h[v, j] = silu(gate[j]·x) · (up[j]·x) for the
// gate rows g (sg for the shared one) and up rows u (su), into y[v, ·] and ys.
extern "C" __global__ void __launch_bounds__(256, 3) qmv_swiglu(Mat g, Mat u, const u64* __restrict__ tab,
                                                             const int* __restrict__ sel, int nsel,
                                                             int per, Mat sg, Mat su,
                                                             const float* __restrict__ x,
                                                             float* __restrict__ y,
                                                             float* __restrict__ ys) {
    extern __shared__ float xs[];
    int v = token_vector(per, nsel, g.cols, g.rows, sg.rows, sel, x, y, ys);
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
            load_group_unit<VW>(down, base, r, u, words, ush, gpr, v[kk][0], sc[kk], bi[kk]);
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
                                                           int sgs, const float* __restrict__ h,
                                                           const float* __restrict__ hsh,
                                                           float* __restrict__ out) {
    extern __shared__ float hs[];   // padded: [K·I] routed, then [IS] shared
    const int VW = 2;
    int I = down.cols, IS = sdown.cols, H = down.rows;
    // Token blockIdx.y, as down_tc's.
    int tok = blockIdx.y;
    sel += (long long)tok * K;
    wts += (long long)tok * K;
    sg += (long long)tok * sgs;
    h += (long long)tok * K * I;
    hsh += (long long)tok * IS;
    out += (long long)tok * H;
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool on = r < H;
    // The shared expert's first units: its weights depend on no earlier kernel.
    int swords = (IS * sdown.bits) >> 5, sunits = swords / VW;
    int sush = __ffs(((sdown.group * sdown.bits) >> 5) / VW) - 1, sgpr = IS / sdown.group;
    u32 sv[1][VW] = {{0u, 0u}};
    float ssc = 0.0f, sbi = 0.0f;
    if (on && lane < sunits)
        load_group_unit<VW>(sdown, 0, r, lane, swords, sush, sgpr, sv[0], ssc, sbi);
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
        if (u0 > 0) load_group_unit<VW>(sdown, 0, r, u, swords, sush, sgpr, sv[0], ssc, sbi);
        float d[1] = {sacc};
        const float s1[1] = {ssc}, b1[1] = {sbi};
        unit_dot<VW, 1>(sv, sfour, hs + pad(K * I + u * svpu), s1, b1, d);
        sacc = d[0];
    }
    float total = warp_sum(acc) + sigmoidf_(sg[0]) * warp_sum(sacc);
    if (lane == 0) out[r] = total;
}
