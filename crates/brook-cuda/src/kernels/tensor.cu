// One-token matrix kernels on the tensor cores (part of brook's CUDA source; see common.cu),
// for 4-bit matrices with bf16 or f16 scales in groups of 64 (MLX's default) or 128 and a
// width that is a multiple of 512 (TCU chunks of 128). Ampere and later; the host checks
// (ops.rs `tc_fits`).
//
// Exact integer products of rounded activations; only the f32 sums round beyond that:
// - each 64 activations of a vector share a power of two m (|x| < 2^23·m for all of them),
//   and x = m·X with X = x / m rounded to an integer, |X| <= 2^23 (Split24 as in the CPU's VNNI
//   kernels, here within one f32 ulp of the block's largest value), as four signed bytes;
// - a code q ∈ [0, 15] is an unsigned byte, so one m16n8k32 integer mma multiplies 16 rows ×
//   32 codes by the four digit rows in columns 0..3 of B (4..7: zero, or a second vector)
//   and sums them exactly in 32-bit integers;
// - w = s·q + b, so a row's product is Σ_groups s·m·Σq·X + b·Σx, the sums of x per 64
//   columns taken once per block, and the digit sums meet in f32 (one rounding per lane).
// The win is the decoding: a word of eight codes becomes the two byte registers of an mma's
// A by two masks and a shift (0.4 instructions a code; the bf16 form this replaced took 1.5,
// which left the many-token kernels issue-bound: docs/BENCH.md), and an mma takes 32 codes.
//
// Layout. A row's codes are taken 128 columns (16 words, a "chunk") at a time; lane
// (g = lane / 4, t = lane % 4) of a warp reads words h·8 + 2t and h·8 + 2t + 1 (h = 0, 1:
// the chunk's two halves, each inside one group) of rows g and g + 8 of its 16-row tile.
// Word W's codes n = 0..7 are columns 8W + n (nibble n). The mma for (h, i) (word i of
// the lane's two) takes A = {W & 0x0F0F0F0F (codes 0, 2, 4, 6) of rows g, g + 8, then
// (W >> 4) & 0x0F0F0F0F (codes 1, 3, 5, 7) of rows g, g + 8}, so B must hold, for lane
// (p, t), digit p of x at columns 8W + 2j and 8W + 2j + 1 (j = 0..3): `tc_stage` writes
// exactly those bytes, as uint2 at [chunk][q = 2h + i][digit p][t].

#define TCU 4                       // chunks a warp loads before it computes them
#define TC_CHUNK_U4 33              // uint4 a chunk of B: 4 q × 4 digits × 4 t uint2, m_0, m_1

#if __CUDA_ARCH__ >= 800
// d += A·B over 32 codes: A the 16 × 32 unsigned codes (a0, a1: rows g and g + 8 at k =
// 4t..4t+3; a2, a3: at k = 16 + 4t..), B 32 × 8 signed digits (b0: k = 4t.., b1: k = 16 +
// 4t.., column g), exact integer sums.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A lane's sum of its two digit columns (t even: digits 0 and 1, t odd: 2 and 3) over a
// half chunk, in units of its power of two `unit` (digit_unit): 256·hi + lo is exact in 32
// bits (|hi|, |lo| <= 64·15·128 < 2^17) and rounds once on conversion, so this is the
// rounded sum of the two columns' exact values; the scalings are by powers of two, exact.
__device__ __forceinline__ float digit_pair(int hi, int lo, float unit) {
    return (float)(hi * 256 + lo) * unit;
}

// The weight of a lane's digit pair for a block whose power of two is m: 2^16·m for the top
// pair (digits 0 and 1), m for the low one.
__device__ __forceinline__ float digit_unit(float m, bool top) {
    return top ? m * 65536.0f : m;
}

#define NIB 0x0F0F0F0Fu

// Vectors x_v (v < n, each K floats, K % 128 == 0, x_v = x + v·xstride) as B fragments in
// fr (TC_CHUNK_U4 uint4 per chunk, vector after vector) and their sums per 64 columns in
// sx, by the whole block. No barrier: the caller adds one after its last stage.
// Each 64 columns of a vector (a chunk's half h) share a power of two m_h = 2^(e − 23), e the
// exponent with every |x| < 2^e there: x = m_h·X with X = rint(x / m_h), |X| <= 2^23 (within
// one f32 ulp of the block's largest |x|; 2^(e − 24) would give half), as four signed bytes
// (digits 0..3 of weight 2^24, 2^16, 2^8, 1, each in −128..127). A chunk holds, as uint2, for
// q = 2h + i, digit n and lane t: the digit of the values 8W + 2j (first word, byte j) and
// 8W + 2j + 1 (second word) of word W = 8h + 2t + i, then m_0 and m_1 (uint4 32).
__device__ void tc_stage(const float* __restrict__ x, long long xstride, int n, int K, uint4* fr,
                         float* sx) {
    // Item (v, c, q, t) takes the 8 values of word 8h + 2t + i (q = 2h + i) of chunk c; the 8
    // items of one half (c, h) are 8 consecutive threads, which meet by shuffles for the
    // half's largest |x| and its sum (8 values a lane in order, then lanes xor 1, 2, 4).
    // Every thread takes the same number of turns (the shuffles need the whole warp).
    int per = K >> 3, nch = K >> 7, items = n * per;
    for (int it0 = 0; it0 < items; it0 += blockDim.x) {
        int it = it0 + threadIdx.x;
        bool ok = it < items;   // the same for the eight lanes of a half (items % 8 == 0)
        if (!ok) it = 0;
        int v = it / per, i = it - v * per;
        int c = i >> 4, q = (i >> 2) & 3, t = i & 3;
        int word = (q >> 1) * 8 + 2 * t + (q & 1);
        const float* xp = x + v * xstride + c * 128 + word * 8;
        float e[8];
        if ((((u64)xp) & 15) == 0) {
            float4 a = *(const float4*)xp, b = *(const float4*)(xp + 4);
            e[0] = a.x; e[1] = a.y; e[2] = a.z; e[3] = a.w;
            e[4] = b.x; e[5] = b.y; e[6] = b.z; e[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) e[j] = xp[j];
        }
        float mx = 0.0f, sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            mx = fmaxf(mx, fabsf(e[j]));
            sum += e[j];
        }
        // The eight lanes of a half: the same it >> 3.
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        int ex;
        frexpf(mx, &ex);        // mx < 2^ex; 0 for mx = 0
        ex = max(ex, -100);     // 2^(23 − ex) stays a normal float
        uint4* cb = fr + (long long)(v * nch + c) * TC_CHUNK_U4;
        if (!ok) continue;
        if ((it & 7) == 0) {
            ((float*)(cb + 32))[q >> 1] = ldexpf(1.0f, ex - 23);
            sx[v * (K >> 6) + c * 2 + (q >> 1)] = sum;
        }
        float inv = ldexpf(1.0f, 23 - ex);
        // The balanced digits of X = rint(x / m) (|X| <= 2^23; the low three in −128..127)
        // are the bytes of (X + 0x808080) ^ 0x808080: adding 128 at each low byte makes every
        // digit + 128 a byte (its carries are the digits' borrows), the xor takes the 128 off
        // again, and the top byte is what is left, the top digit (−1..1). Byte 3 − d is
        // digit d.
        u32 wd[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            wd[j] = ((u32)__float2int_rn(e[j] * inv) + 0x808080u) ^ 0x808080u;
        // Digit d of value 2b + k is byte b of dg[d][k]: a 4 × 4 byte transpose per k.
        u32 dg[4][2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            u32 lo01 = __byte_perm(wd[k], wd[2 + k], 0x5140);       // bytes 0, 1 of both
            u32 hi01 = __byte_perm(wd[k], wd[2 + k], 0x7362);       // bytes 2, 3
            u32 lo23 = __byte_perm(wd[4 + k], wd[6 + k], 0x5140);
            u32 hi23 = __byte_perm(wd[4 + k], wd[6 + k], 0x7362);
            dg[3][k] = __byte_perm(lo01, lo23, 0x5410);
            dg[2][k] = __byte_perm(lo01, lo23, 0x7632);
            dg[1][k] = __byte_perm(hi01, hi23, 0x5410);
            dg[0][k] = __byte_perm(hi01, hi23, 0x7632);
        }
        uint2* o = (uint2*)cb + q * 16 + t;
#pragma unroll
        for (int d = 0; d < 4; d++) o[d * 4] = make_uint2(dg[d][0], dg[d][1]);
    }
}

// One row of a tile: its words and the scales and biases of its groups.
struct TcRow {
    const u32* w;
    u64 s, b;
};

template <int ST, int G>
__device__ __forceinline__ TcRow tc_row(const Mat& m, u64 base, long long r) {
    TcRow o;
    long long g0 = r * (m.cols / G) * 2;
    o.w = (const u32*)(base + m.w) + r * (m.cols >> 3);
    o.s = base + m.s + g0;
    o.b = base + m.b + g0;
    return o;
}

// TCU = 4 chunks of a lane's two rows (k = 0: row g, 1: row g + 8): the words, and the
// scales and biases of the chunks' groups (every lane loads them: tensor_n.cu's lanes
// t = 2, 3 use them as t = 0, 1 do; the same words for the whole quad), 16-bit
// values two to a word: with G = 64 word u holds chunk u's two halves, with G = 128 word
// u / 2 holds chunks u and u + 1 (one load of 16 or 8 bytes per row each).
template <int ST, int G>
struct TcLoads {
    uint2 w[TCU][2][2];
    u32 s[2][4], b[2][4];
};

template <int ST, int G>
__device__ __forceinline__ void tc_issue(const TcRow (&row)[2], int c0, TcLoads<ST, G>& f) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const TcRow& r = row[k];
#pragma unroll
        for (int u = 0; u < TCU; u++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                f.w[u][h][k] = ld_stream((const uint2*)(r.w + (c0 + u) * 16 + h * 8 + 2 * t));
        if (G == 64) {
            uint4 sv = ld_stream((const uint4*)(r.s + c0 * 4));
            uint4 bv = ld_stream((const uint4*)(r.b + c0 * 4));
            f.s[k][0] = sv.x; f.s[k][1] = sv.y; f.s[k][2] = sv.z; f.s[k][3] = sv.w;
            f.b[k][0] = bv.x; f.b[k][1] = bv.y; f.b[k][2] = bv.z; f.b[k][3] = bv.w;
        } else {
            uint2 sv = ld_stream((const uint2*)(r.s + c0 * 2));
            uint2 bv = ld_stream((const uint2*)(r.b + c0 * 2));
            f.s[k][0] = sv.x; f.s[k][1] = sv.y; f.s[k][2] = 0u; f.s[k][3] = 0u;
            f.b[k][0] = bv.x; f.b[k][1] = bv.y; f.b[k][2] = 0u; f.b[k][3] = 0u;
        }
    }
}

// The 16-bit value in the high (hi) or low half of w, as a float.
template <int ST>
__device__ __forceinline__ float tc_word_half(u32 w, int hi) {
    if (ST == 1) return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
    return f16f((unsigned short)(hi ? (w >> 16) : (w & 0xffffu)));
}

// The 16-bit value of chunk u, half h from words packed as tc_issue's, as a float.
template <int ST, int G>
__device__ __forceinline__ float tc_half(const u32 (&v)[4], int u, int h) {
    return tc_word_half<ST>(G == 64 ? v[u] : v[u >> 1], G == 64 ? h : (u & 1));
}

// The loaded chunks against the staged fragments fr and sums sx of one vector, into acc
// (k = 0: row g, 1: row g + 8; lanes t = 0 and 1 each hold part of the total). Unrolled,
// so every loaded word is a register by a constant index: the form that kept the code
// small (a loop not unrolled, the words moved down a chunk an iteration) spent about as
// many moves as products, and was 5 % slower for one sequence, 8 % for sixteen
// (docs/BENCH.md). The caller then issues the next loads into f.
template <int ST, int G>
__device__ __forceinline__ void tc_consume(const TcLoads<ST, G>& f, const uint4* fr,
                                           const float* sx, int c0, float (&acc)[2]) {
    int lane = threadIdx.x & 31, t = lane & 3, p = lane >> 2;
#pragma unroll
    for (int u = 0; u < TCU; u++) {
        int c = c0 + u;
        const uint2* cb = (const uint2*)(fr + c * TC_CHUNK_U4);
        const float* m = (const float*)(fr + c * TC_CHUNK_U4 + 32);
        float s0[2], s1[2], b0[2], b1[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            s0[h] = tc_half<ST, G>(f.s[0], u, h);
            s1[h] = tc_half<ST, G>(f.s[1], u, h);
            b0[h] = tc_half<ST, G>(f.b[0], u, h);
            b1[h] = tc_half<ST, G>(f.b[1], u, h);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int d[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 2; i++) {
                // Column p: digit p of the vector (p >= 4: zero).
                uint2 bq = p < 4 ? cb[(2 * h + i) * 16 + p * 4 + t] : make_uint2(0u, 0u);
                u32 wl = i ? f.w[u][h][0].y : f.w[u][h][0].x;
                u32 wh = i ? f.w[u][h][1].y : f.w[u][h][1].x;
                mma_u8s8(d, wl & NIB, wh & NIB, (wl >> 4) & NIB, (wh >> 4) & NIB, bq.x, bq.y);
            }
            // Lane t holds columns 2t, 2t + 1: digits 0 and 1 at t = 0, 2 and 3 at t = 1.
            float unit = digit_unit(m[h], t == 0);
            float lo = digit_pair(d[0], d[1], unit);
            float hi = digit_pair(d[2], d[3], unit);
            acc[0] = fmaf(s0[h], lo, acc[0]);
            acc[1] = fmaf(s1[h], hi, acc[1]);
            if (t == 0) {
                float sxv = sx[c * 2 + h];
                acc[0] = fmaf(b0[h], sxv, acc[0]);
                acc[1] = fmaf(b1[h], sxv, acc[1]);
            }
        }
    }
}

// Rows lo (g) and hi (g + 8) of a tile over chunks [cb, ce) times one staged vector, `f`
// holding chunk cb's loads already issued; every lane with t = 0 returns both totals.
template <int ST, int G>
__device__ __forceinline__ void tc_rows(const TcRow (&row)[2], int cb, int ce,
                                        TcLoads<ST, G>& f, const uint4* fr, const float* sx,
                                        float (&out)[2]) {
    float acc[2] = {0.0f, 0.0f};
    for (int c0 = cb; c0 < ce; c0 += TCU) {
        if (c0 > cb) tc_issue<ST, G>(row, c0, f);
        tc_consume(f, fr, sx, c0, acc);
    }
    out[0] = acc[0] + __shfl_xor_sync(0xffffffffu, acc[0], 1);
    out[1] = acc[1] + __shfl_xor_sync(0xffffffffu, acc[1], 1);
}

// Row r of the stack m0..m3 (every matrix's rows a multiple of 16).
template <int ST, int G>
__device__ __forceinline__ TcRow tc_stack_row(const Mat& m0, const Mat& m1, const Mat& m2,
                                              const Mat& m3, int r) {
    int l;
    int i = locate(m0, m1, m2, r, l);
    return tc_row<ST, G>(pick(m0, m1, m2, m3, i), 0, l);
}

// The first loads of a warp's next tile (when it has one), issued as soon as its last tile's
// loads are consumed: into the same registers, now free, so they are in flight while that
// tile's partial sums meet and are stored. Whether there was one.
template <int ST, int G, typename RowsOf>
__device__ __forceinline__ bool tc_next(int tile, int tiles, int cb, TcLoads<ST, G>& f,
                                        RowsOf rows_of) {
    if (tile >= tiles) return false;
    TcRow row[2];
    rows_of(tile, row);
    tc_issue<ST, G>(row, cb, f);
    return true;
}

// The tiles of one staged vector, `split` warps to a tile: warp w of a block takes tile
// w / split of the block's step and chunks [slice·nch/split, (slice + 1)·nch/split) of it
// (slice = w % split), the blocks striding over the tiles; the slices' partial sums meet
// in `part` (two buffers of 16 floats per warp, alternating, so one barrier a step
// suffices) and slice 0 adds them in order. rows_of(tile, row) names a tile's rows;
// out(tile, o) takes its totals (lanes with t = 0). `issued`: the warp's first tile's first
// chunks are already in f (each next tile's are issued by tc_next). Every warp of the block
// runs the same number of steps.
template <int ST, int G, typename RowsOf, typename Out>
__device__ __forceinline__ void tc_tiles(int tiles, int split, int nch, const uint4* fr,
                                         const float* sx, float* part, TcLoads<ST, G>& f,
                                         bool issued, RowsOf rows_of, Out out) {
    int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int per = nw / split, tl = warp / split, slice = warp % split;
    int cs = nch / split, cb = slice * cs;
    TcRow row[2];
    int step = 0;
    for (int t0 = blockIdx.x * per; t0 < tiles; t0 += gridDim.x * per, step++) {
        int tile = t0 + tl;
        float o[2] = {0.0f, 0.0f};
        if (tile < tiles) {
            rows_of(tile, row);
            if (!issued) tc_issue<ST, G>(row, cb, f);
            tc_rows<ST, G>(row, cb, cb + cs, f, fr, sx, o);
        }
        issued = tc_next<ST, G>(tile + gridDim.x * per, tiles, cb, f, rows_of);
        if (split == 1) {
            if (tile < tiles && (lane & 3) == 0) out(tile, o);
            continue;
        }
        float* p = part + (step & 1) * nw * 16;
        if ((lane & 3) == 0) {
            p[warp * 16 + g] = o[0];
            p[warp * 16 + g + 8] = o[1];
        }
        __syncthreads();
        if (slice == 0 && tile < tiles && (lane & 3) == 0) {
            float sum[2] = {0.0f, 0.0f};
            for (int i = 0; i < split; i++) {
                sum[0] += p[(warp + i) * 16 + g];
                sum[1] += p[(warp + i) * 16 + g + 8];
            }
            out(tile, sum);
        }
    }
}

// The first tile of this warp under tc_tiles' assignment, issued into f before the wait
// (weights depend on no earlier kernel); whether there was one.
template <int ST, int G, typename RowsOf>
__device__ __forceinline__ bool tc_first(int tiles, int split, int nch, TcLoads<ST, G>& f,
                                         RowsOf rows_of) {
    int nw = blockDim.x >> 5, warp = threadIdx.x >> 5;
    int tile = blockIdx.x * (nw / split) + warp / split;
    return tc_next<ST, G>(tile, tiles, (warp % split) * (nch / split), f, rows_of);
}

// y[v, r] = W[r]·x[v / xdiv] over the rows of m0..m3 stacked, on the tensor cores, in tiles
// of 16 rows (tc_tiles). ST: the scales' type, bf16 (1) or f16 (2); G: the group size;
// every matrix's the same. Dynamic shared memory: ops.rs `tc_smem`.
template <int ST, int G>
__device__ void qmv_tc_body(const Mat& m0, const Mat& m1, const Mat& m2, const Mat& m3,
                            int xdiv, int split, const float* __restrict__ x,
                            float* __restrict__ y, uint4* tcs) {
    int K = m0.cols, nch = K >> 7;
    uint4* fr = tcs;
    float* sx = (float*)(tcs + nch * TC_CHUNK_U4);
    float* part = sx + (K >> 6);
    int rows = m0.rows + m1.rows + m2.rows + m3.rows, tiles = rows >> 4;
    int g = (threadIdx.x & 31) >> 2, v = blockIdx.y;
    auto rows_of = [&](int tile, TcRow (&row)[2]) {
        row[0] = tc_stack_row<ST, G>(m0, m1, m2, m3, tile * 16 + g);
        row[1] = tc_stack_row<ST, G>(m0, m1, m2, m3, tile * 16 + g + 8);
    };
    TcLoads<ST, G> f;
    bool issued = tc_first<ST, G>(tiles, split, nch, f, rows_of);
    PDL_SYNC();
    tc_stage(x + (long long)(v / xdiv) * K, 0, 1, K, fr, sx);
    __syncthreads();
    float* yv = y + (long long)v * rows;
    tc_tiles<ST, G>(tiles, split, nch, fr, sx, part, f, issued, rows_of,
                    [&](int tile, const float (&o)[2]) {
                        yv[tile * 16 + g] = o[0];
                        yv[tile * 16 + g + 8] = o[1];
                    });
}

#endif

// The kernels, one body per scale type. Before Ampere they are empty (never launched).
#if __CUDA_ARCH__ >= 800
#define TC_DISPATCH(M, CALL)                         \
    do {                                             \
        extern __shared__ uint4 tcs[];               \
        if ((M).stype == 1 && (M).group == 64)       \
            CALL(1, 64);                             \
        else if ((M).stype == 1)                     \
            CALL(1, 128);                            \
        else if ((M).group == 64)                    \
            CALL(2, 64);                             \
        else                                         \
            CALL(2, 128);                            \
    } while (0)
#else
#define TC_DISPATCH(M, CALL) \
    do {                         \
    } while (0)
#endif

extern "C" __global__ void __launch_bounds__(256, 2)
    qmv_tc(Mat m0, Mat m1, Mat m2, Mat m3, int xdiv, int split, const float* __restrict__ x,
           float* __restrict__ y) {
#define QMV_TC(ST, G) qmv_tc_body<ST, G>(m0, m1, m2, m3, xdiv, split, x, y, tcs)
    TC_DISPATCH(m0, QMV_TC);
}
