// The chunked gated delta rule for prefill (part of brook's CUDA source; see common.cu).

// The gated delta rule a chunk at a time (prefill): brook_core's `delta_rule_chunked` on the
// GPU. Within a chunk of c ≤ DC_C tokens with entering state S₀ and cumulative log-decay γ
// (γᵢ = g₀ + … + gᵢ, L = c − 1 the last), the pseudo-values solve the unit lower-triangular
// system v'ᵢ = βᵢ(vᵢ − e^{γᵢ}S₀ᵀkᵢ) − Σ_{j<i} βᵢ(kᵢ·kⱼ)e^{γᵢ−γⱼ} v'ⱼ, the outputs are
// oᵢ = e^{γᵢ}S₀ᵀqᵢ + Σ_{j≤i} (qᵢ·kⱼ)e^{γᵢ−γⱼ} v'ⱼ, and the state leaves the chunk as
// e^{γ_L}S₀ + Σⱼ e^{γ_L−γⱼ} kⱼv'ⱼᵀ.
//
// Value columns never mix, so block (h, tile of DC_BV columns) runs every chunk of head h for
// its columns alone: DC_THREADS threads, the chunk's q and k rows, the state tile
// (transposed, [DC_BV][ks]), A and M ([DC_C][DC_A]) and the pseudo-values in shared memory
// (`delta::chunk_smem_bytes` in Rust mirrors the layout: 134 KiB at dk = 128, so one block
// an SM). k·k and q·k are recomputed by each tile of a head (4 at dv = 128): the price of
// one launch with no scratch, about two fifths of a block's FMAs. Rows c..DC_C of a ragged
// chunk are zero (β = 0, γ held at γ_L), so every product runs at full size without masks.
#define DC_C 64        // tokens per chunk (brook_core CHUNK)
#define DC_BV 32       // value columns per block
#define DC_THREADS 256
#define DC_A 65        // row stride of A and M: odd, so a warp's column reads miss no bank
#define DC_VP 36       // row stride of v': ≡ 4 (mod 32) keeps the solve's reads conflict-free

static_assert(DC_C == 64 && DC_BV == 32 && DC_THREADS == 256,
              "the thread layouts below assume 64 tokens, 32 columns, 256 threads");

// Pointers into the dynamic shared memory, in layout order (float4-aligned first).
struct DcSmem {
    float* q;     // [DC_C][ks] q rows of the chunk
    float* k;     // [DC_C][ks] k rows
    float* s;     // [DC_BV][ks] state tile, transposed: s[col·ks + i] = S[i, j0 + col]
    float* a;     // [DC_C][DC_A] βᵢ(kᵢ·kⱼ)e^{γᵢ−γⱼ} for j < i, else 0
    float* m;     // [DC_C][DC_A] (qᵢ·kⱼ)e^{γᵢ−γⱼ} for j ≤ i, else 0
    float* vp;    // [DC_C][DC_VP] v, then the right-hand sides, then v'
    float* vs;    // [DC_C][DC_VP] e^{γ_L−γⱼ} v'ⱼ
    float* gam;   // [DC_C] γ
    float* bet;   // [DC_C] β
    float* dl;    // [DC_C] e^{γ_L−γⱼ}, 0 past c
};

__device__ __forceinline__ DcSmem dc_smem(float* base, int ks) {
    DcSmem p;
    p.q = base;
    p.k = p.q + DC_C * ks;
    p.s = p.k + DC_C * ks;
    p.a = p.s + DC_BV * ks;
    p.m = p.a + DC_C * DC_A;
    p.vp = p.m + DC_C * DC_A;
    p.vs = p.vp + DC_C * DC_VP;
    p.gam = p.vs + DC_C * DC_VP;
    p.bet = p.gam + DC_C;
    p.dl = p.bet + DC_C;
    return p;
}

// V consecutive floats from shared memory (V = 4: one 16-byte load, p aligned).
template <int V>
__device__ __forceinline__ void ldv(float* d, const float* p) {
    if constexpr (V == 4) {
        float4 x = *reinterpret_cast<const float4*>(p);
        d[0] = x.x;
        d[1] = x.y;
        d[2] = x.z;
        d[3] = x.w;
    } else {
        for (int e = 0; e < V; e++) d[e] = p[e];
    }
}

template <int V>
__device__ __forceinline__ void stv(float* p, const float* d) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(d[0], d[1], d[2], d[3]);
    } else {
        for (int e = 0; e < V; e++) p[e] = d[e];
    }
}

// Rows [t0, t0 + c) of q, k, the tile of v, β and γ into shared memory, zero past c. q and
// k come 16 bytes a load where V = 4 and the rows are 16-byte aligned (cd % 4 == 0, as in
// the real models): a thread's 16 loads of a chunk at dk = 128 are all in flight at once,
// where one float a load would wait on memory four times as often. γ is an inclusive scan
// of g by the first warp, two entries a lane.
template <int V>
__device__ __forceinline__ void dc_load(const DcSmem& sh, const float* __restrict__ conv,
                                        const float* __restrict__ g, const float* __restrict__ beta,
                                        int t0, int c, int cd, int qoff, int koff, int voff,
                                        int dk, int ks, int nj, int nv, int h) {
    int tid = threadIdx.x;
    if (V == 4 && (cd & 3) == 0 && ((unsigned long long)conv & 15) == 0) {
        int w4 = dk / 4;
#pragma unroll 8
        for (int e = tid; e < DC_C * w4; e += DC_THREADS) {
            int i = e / w4, d = (e - i * w4) * 4;
            float4 qv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), kv = qv;
            if (i < c) {
                const float* row = conv + (long long)(t0 + i) * cd;
                qv = *reinterpret_cast<const float4*>(row + qoff + d);
                kv = *reinterpret_cast<const float4*>(row + koff + d);
            }
            *reinterpret_cast<float4*>(sh.q + i * ks + d) = qv;
            *reinterpret_cast<float4*>(sh.k + i * ks + d) = kv;
        }
    } else {
        for (int e = tid; e < DC_C * dk; e += DC_THREADS) {
            int i = e / dk, d = e - i * dk;
            float qv = 0.0f, kv = 0.0f;
            if (i < c) {
                const float* row = conv + (long long)(t0 + i) * cd;
                qv = row[qoff + d];
                kv = row[koff + d];
            }
            sh.q[i * ks + d] = qv;
            sh.k[i * ks + d] = kv;
        }
    }
    for (int e = tid; e < DC_C * DC_BV; e += DC_THREADS) {
        int i = e / DC_BV, col = e % DC_BV;
        sh.vp[i * DC_VP + col] =
            i < c && col < nj ? conv[(long long)(t0 + i) * cd + voff + col] : 0.0f;
    }
    if (tid < 32) {
        int i0 = tid, i1 = tid + 32;
        float lo = i0 < c ? g[(long long)(t0 + i0) * nv + h] : 0.0f;
        float hi = i1 < c ? g[(long long)(t0 + i1) * nv + h] : 0.0f;
        for (int sft = 1; sft < 32; sft <<= 1) {
            float x = __shfl_up_sync(0xffffffffu, lo, sft);
            float y = __shfl_up_sync(0xffffffffu, hi, sft);
            if (tid >= sft) {
                lo += x;
                hi += y;
            }
        }
        hi += __shfl_sync(0xffffffffu, lo, 31);
        sh.gam[i0] = lo;
        sh.gam[i1] = hi;
        sh.bet[i0] = i0 < c ? beta[(long long)(t0 + i0) * nv + h] : 0.0f;
        sh.bet[i1] = i1 < c ? beta[(long long)(t0 + i1) * nv + h] : 0.0f;
    }
}

// k·k and q·k over the chunk (the lower triangle of 16-row blocks), S₀ᵀk and S₀ᵀq for the
// tile, all as sums over the key dimension V at a time; then A, M, the right-hand sides
// βᵢ(vᵢ − e^{γᵢ}S₀ᵀkᵢ) into shared memory and e^{γᵢ}S₀ᵀqᵢ into oacc. Thread (ti, tj) owns
// rows ti + 16r and columns tj + 16s of every product.
template <int V>
__device__ __forceinline__ void dc_products(const DcSmem& sh, int dk, int ks, int c,
                                            float (&oacc)[4][2]) {
    int ti = threadIdx.x >> 4, tj = threadIdx.x & 15;
    float gk[4][4], gq[4][4], wk[4][2], wq[4][2];
#pragma unroll
    for (int r = 0; r < 4; r++) {
#pragma unroll
        for (int s = 0; s < 4; s++) gk[r][s] = gq[r][s] = 0.0f;
#pragma unroll
        for (int s = 0; s < 2; s++) wk[r][s] = wq[r][s] = 0.0f;
    }
#pragma unroll 2
    for (int d = 0; d < dk; d += V) {
        float kr[4][V], qr[4][V], kc[4][V], sv[2][V];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            ldv<V>(kr[r], sh.k + (ti + 16 * r) * ks + d);
            ldv<V>(qr[r], sh.q + (ti + 16 * r) * ks + d);
            ldv<V>(kc[r], sh.k + (tj + 16 * r) * ks + d);
        }
#pragma unroll
        for (int s = 0; s < 2; s++) ldv<V>(sv[s], sh.s + (tj + 16 * s) * ks + d);
#pragma unroll
        for (int e = 0; e < V; e++) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
#pragma unroll
                for (int s = 0; s <= r; s++) {
                    gk[r][s] = fmaf(kr[r][e], kc[s][e], gk[r][s]);
                    gq[r][s] = fmaf(qr[r][e], kc[s][e], gq[r][s]);
                }
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    wk[r][s] = fmaf(kr[r][e], sv[s][e], wk[r][s]);
                    wq[r][s] = fmaf(qr[r][e], sv[s][e], wq[r][s]);
                }
            }
        }
    }
    if (threadIdx.x < DC_C) {
        int j = threadIdx.x;
        sh.dl[j] = j < c ? expf(sh.gam[c - 1] - sh.gam[j]) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int i = ti + 16 * r;
        float gi = sh.gam[i], bi = sh.bet[i];
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int j = tj + 16 * s;
            float av = 0.0f, mv = 0.0f;
            if (s < r || (s == r && j <= i)) {
                float dec = expf(gi - sh.gam[j]);
                mv = gq[r][s] * dec;
                if (j < i) av = bi * gk[r][s] * dec;
            }
            sh.a[i * DC_A + j] = av;
            sh.m[i * DC_A + j] = mv;
        }
        float ei = expf(gi);
#pragma unroll
        for (int s = 0; s < 2; s++) {
            float* p = sh.vp + i * DC_VP + tj + 16 * s;
            *p = bi * (*p - ei * wk[r][s]);
            oacc[r][s] = ei * wq[r][s];
        }
    }
}

// v' = (I + A)⁻¹·rhs for the tile by right-looking substitution: warp w owns columns
// 4w..4w+3 and lane (part, col) rows part + 8m of one column in registers; step j takes the
// finished v'ⱼ from its owner by a shuffle and removes Aᵢⱼv'ⱼ from every row i. No block
// barrier inside: 64 dependent shuffles instead of 64 __syncthreads.
__device__ __forceinline__ void dc_solve(const DcSmem& sh, int c) {
    int lane = threadIdx.x & 31, part = lane >> 2, sub = lane & 3;
    int col = (threadIdx.x >> 5) * 4 + sub;
    float x[8];
#pragma unroll
    for (int m = 0; m < 8; m++) x[m] = sh.vp[(part + 8 * m) * DC_VP + col];
    const float* arow = sh.a + part * DC_A;
#pragma unroll
    for (int j = 0; j < DC_C - 1; j++) {
        if (j >= c - 1) break;   // rows past c are zero
        float vj = __shfl_sync(0xffffffffu, x[j >> 3], (j & 7) * 4 + sub);
#pragma unroll
        for (int m = j >> 3; m < 8; m++) x[m] = fmaf(-arow[8 * m * DC_A + j], vj, x[m]);
    }
#pragma unroll
    for (int m = 0; m < 8; m++) {
        int i = part + 8 * m;
        sh.vp[i * DC_VP + col] = x[m];
        sh.vs[i * DC_VP + col] = x[m] * sh.dl[i];
    }
}

// oᵢ = e^{γᵢ}S₀ᵀqᵢ + Σ_{j≤i} Mᵢⱼv'ⱼ for the rows and columns of thread (ti, tj), then out.
__device__ __forceinline__ void dc_output(const DcSmem& sh, float (&oacc)[4][2],
                                          float* __restrict__ o, int t0, int c, int nv, int dv,
                                          int h, int j0, int nj) {
    int ti = threadIdx.x >> 4, tj = threadIdx.x & 15;
#pragma unroll
    for (int jb = 0; jb < 4; jb++) {
        if (16 * jb >= c) break;
        for (int jj = 0; jj < 16; jj++) {
            int j = 16 * jb + jj;
            float v0 = sh.vp[j * DC_VP + tj], v1 = sh.vp[j * DC_VP + tj + 16];
#pragma unroll
            for (int r = jb; r < 4; r++) {
                float mv = sh.m[(ti + 16 * r) * DC_A + j];
                oacc[r][0] = fmaf(mv, v0, oacc[r][0]);
                oacc[r][1] = fmaf(mv, v1, oacc[r][1]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int i = ti + 16 * r;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            int col = tj + 16 * s;
            if (i < c && col < nj) o[((long long)(t0 + i) * nv + h) * dv + j0 + col] = oacc[r][s];
        }
    }
}

// S ← e^{γ_L}S + Σ_{j<c} kⱼ(e^{γ_L−γⱼ}v'ⱼ)ᵀ on the transposed tile. Thread (ti, tj) owns
// columns tj + 16s and key rows p·16V + V·ti + e; P passes of 16V rows stay in registers at
// once (all of them when DK is known).
template <int DK, int V>
__device__ __forceinline__ void dc_state(const DcSmem& sh, int dk, int ks, int c) {
    constexpr int P = DK > 0 ? (DK + 16 * V - 1) / (16 * V) : 1;
    int ti = threadIdx.x >> 4, tj = threadIdx.x & 15;
    float el = expf(sh.gam[c - 1]);
    for (int p0 = 0; p0 * 16 * V < dk; p0 += P) {
        float acc[P][2][V];
#pragma unroll
        for (int p = 0; p < P; p++) {
            int d = (p0 + p) * 16 * V + V * ti;
#pragma unroll
            for (int s = 0; s < 2; s++) {
                if (d < dk) ldv<V>(acc[p][s], sh.s + (tj + 16 * s) * ks + d);
#pragma unroll
                for (int e = 0; e < V; e++) acc[p][s][e] = d < dk ? acc[p][s][e] * el : 0.0f;
            }
        }
        for (int j = 0; j < c; j++) {
            float w0 = sh.vs[j * DC_VP + tj], w1 = sh.vs[j * DC_VP + tj + 16];
#pragma unroll
            for (int p = 0; p < P; p++) {
                int d = (p0 + p) * 16 * V + V * ti;
                if (d >= dk) continue;
                float kv[V];
                ldv<V>(kv, sh.k + j * ks + d);
#pragma unroll
                for (int e = 0; e < V; e++) {
                    acc[p][0][e] = fmaf(kv[e], w0, acc[p][0][e]);
                    acc[p][1][e] = fmaf(kv[e], w1, acc[p][1][e]);
                }
            }
        }
#pragma unroll
        for (int p = 0; p < P; p++) {
            int d = (p0 + p) * 16 * V + V * ti;
            if (d >= dk) continue;
#pragma unroll
            for (int s = 0; s < 2; s++) stv<V>(sh.s + (tj + 16 * s) * ks + d, acc[p][s]);
        }
    }
}

// DK > 0: dk = DK (a multiple of 4), rows read 16 bytes at a time with stride DK + 4 (rows 4
// banks apart, 16-byte aligned); DK = 0: any dk, one float at a time with an odd stride.
template <int DK>
__device__ void delta_chunk_impl(const float* __restrict__ conv, const float* __restrict__ g,
                                 const float* __restrict__ beta, float* __restrict__ state,
                                 float* __restrict__ o, int T, int cd, int nk, int nv, int dk_,
                                 int dv) {
    PDL_SYNC();
    constexpr int V = DK > 0 ? 4 : 1;
    const int dk = DK > 0 ? DK : dk_;
    const int ks = DK > 0 ? DK + 4 : (dk | 1);
    extern __shared__ __align__(16) float dcs[];
    DcSmem sh = dc_smem(dcs, ks);
    int h = blockIdx.x, j0 = blockIdx.y * DC_BV, tid = threadIdx.x;
    int kh = h / (nv / nk), key_dim = nk * dk;
    int nj = min(DC_BV, dv - j0);
    float* st = state + (long long)h * dk * dv + j0;
    for (int e = tid; e < dk * DC_BV; e += DC_THREADS) {
        int i = e / DC_BV, col = e % DC_BV;
        sh.s[col * ks + i] = col < nj ? st[(long long)i * dv + col] : 0.0f;
    }
    for (int t0 = 0; t0 < T; t0 += DC_C) {
        int c = min(DC_C, T - t0);
        dc_load<V>(sh, conv, g, beta, t0, c, cd, kh * dk, key_dim + kh * dk,
                2 * key_dim + h * dv + j0, dk, ks, nj, nv, h);
        __syncthreads();
        float oacc[4][2];
        dc_products<V>(sh, dk, ks, c, oacc);
        __syncthreads();
        dc_solve(sh, c);
        __syncthreads();
        dc_output(sh, oacc, o, t0, c, nv, dv, h, j0, nj);
        dc_state<DK, V>(sh, dk, ks, c);
        __syncthreads();
    }
    for (int e = tid; e < dk * DC_BV; e += DC_THREADS) {
        int i = e / DC_BV, col = e % DC_BV;
        if (col < nj) st[(long long)i * dv + col] = sh.s[col * ks + i];
    }
}

#define DELTA_CHUNK(NAME, DK)                                                                   \
    extern "C" __global__ void __launch_bounds__(DC_THREADS, 1)                                 \
        NAME(const float* conv, const float* g, const float* beta, float* state, float* o,     \
             int T, int cd, int nk, int nv, int dk, int dv) {                                   \
        delta_chunk_impl<DK>(conv, g, beta, state, o, T, cd, nk, nv, dk, dv);                   \
    }
DELTA_CHUNK(delta_chunk_32, 32)
DELTA_CHUNK(delta_chunk_64, 64)
DELTA_CHUNK(delta_chunk_128, 128)
DELTA_CHUNK(delta_chunk_any, 0)
