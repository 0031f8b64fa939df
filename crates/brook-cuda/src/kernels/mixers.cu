// The mixers: Gated DeltaNet (conv, prep, the delta rule token by token and chunk by chunk,
// gated norm) and gated attention.

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
