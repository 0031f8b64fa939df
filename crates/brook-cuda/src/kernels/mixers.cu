// The mixers: Gated DeltaNet (conv, prep, the delta rule token by token, gated norm; the
// chunked rule is in delta.cu) and gated attention.

// Causal depthwise conv with SiLU over [state (K-1 rows); qkv (T rows)], then the state keeps
// the last K-1 rows. wt is the checkpoint's [cd, K]; qkv's rows are xs floats apart. One
// thread per channel.
//
// Several sequences in one launch (`seqs` non-null; this and the other mixer kernels): block
// z runs sequence z, whose state buffers seqs[2z], seqs[2z + 1] name (this kernel's is the
// first), on its token z of the inputs and outputs (one token each, T = 1).
extern "C" __global__ void conv_silu(const float* __restrict__ qkv, float* __restrict__ state,
                                     const float* __restrict__ wt, float* __restrict__ out,
                                     int T, int cd, int KK, int xs, const u64* __restrict__ seqs) {
    PDL_SYNC();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    if (seqs) {
        int z = blockIdx.z;
        state = (float*)seqs[2 * z];
        qkv += (long long)z * xs;
        out += (long long)z * cd;
    }
    int s = KK - 1;
    for (int t = 0; t < T; t++) {
        float acc = 0.0f;
        for (int m = 0; m < KK; m++) {
            int i = t + m;
            float v = i < s ? state[(long long)i * cd + c] : qkv[(long long)(i - s) * xs + c];
            acc += wt[c * KK + m] * v;
        }
        out[(long long)t * cd + c] = siluf_(acc);
    }
    for (int r = 0; r < s; r++) {
        int i = T + r;
        state[(long long)r * cd + c] = i < s ? state[(long long)i * cd + c] : qkv[(long long)(i - s) * xs + c];
    }
}

// The factor a q (q = true) or k head's values are multiplied by, from the sum of their
// squares ss: rms_norm with ε = 1e-6/dk, then dk⁻¹ for q and dk^-½ for k. delta_prep and
// the delta rule's own preparation (delta_rule_impl) both take it from here, so the two give
// the same bits.
__device__ __forceinline__ float head_scale(float ss, int dk, bool q) {
    float inv_scale = 1.0f / sqrtf((float)dk);
    float eps = 1e-6f / (float)dk;
    float scale = q ? inv_scale * inv_scale : inv_scale;
    return 1.0f / sqrtf(ss / (float)dk + eps) * scale;
}

// A value head's gates from its b and a inputs: β = sigmoid(b), g = −exp(A_log)·softplus(a +
// dt_bias) (shared by delta_prep and delta_rule_impl, as head_scale).
__device__ __forceinline__ void beta_g(float b, float a, float a_log, float dt_bias, float& beta,
                                       float& g) {
    beta = sigmoidf_(b);
    g = -expf(a_log) * softplusf_(a + dt_bias);
}

// q and k heads (inside the conv output, in place): q = rms_norm(q)·dk⁻¹, k = rms_norm(k)·dk^-½
// with ε = 1e-6/dk; β = sigmoid(b); g = −exp(A_log)·softplus(a + dt_bias). One block per token;
// b's and a's rows are bs floats apart. (A decoded token's rule does this itself: below.)
extern "C" __global__ void delta_prep(float* __restrict__ conv, const float* __restrict__ b,
                                      const float* __restrict__ a, const float* __restrict__ A_log,
                                      const float* __restrict__ dt_bias, float* __restrict__ beta,
                                      float* __restrict__ g, int cd, int nk, int nv, int dk, int bs) {
    PDL_SYNC();
    int t = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int hh = w; hh < 2 * nk; hh += nw) {
        float* v = conv + (long long)t * cd + hh * dk;
        float ss = 0.0f;
        for (int i = lane; i < dk; i += 32) ss = fmaf(v[i], v[i], ss);
        float inv = head_scale(warp_sum(ss), dk, hh < nk);
        for (int i = lane; i < dk; i += 32) v[i] *= inv;
    }
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        int j = t * nv + i, jb = t * bs + i;
        beta_g(b[jb], a[jb], A_log[i], dt_bias[i], beta[j], g[j]);
    }
}

// delta_prep's inputs for a rule that prepares its own token (`b` null: the conv output is
// prepared already and β and g are in the rule's arrays).
struct DeltaPrep {
    const float* b;         // [T, bs]: value head h's b at h
    const float* a;         // [T, bs]
    const float* a_log;     // [nv]
    const float* dt_bias;   // [nv]
    int bs;
};

// gated_norm's inputs for a rule that writes its token's normed output itself (`y` null:
// the rule writes o for a gated_norm launch after it).
struct GatedNorm {
    const float* z;         // [T, zs]: value head h's gate at h·dv
    const float* w;         // [dv]
    float* y;               // [T, nv, dv]
    float eps;
    int zs;
};

// gated_norm's factor for a head whose outputs' squares sum (in its order) to ss, and an
// output normed and gated by it: shared by gated_norm and delta_rule_impl, the same bits.
__device__ __forceinline__ float gated_inv(float ss, int dv, float eps) {
    return 1.0f / sqrtf(ss / (float)dv + eps);
}
__device__ __forceinline__ float gated_out(float o, float inv, float w, float z) {
    return o * inv * w * siluf_(z);
}

// Sum of x over the P lanes (P a power of two) that share a state column.
template <int P>
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
    for (int m = 1; m < P; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// The gated delta rule token by token. Block (h, column group): each value column j of head
// h's [dk, dv] state belongs to P neighbouring lanes, lane p of them holding rows p, p + P,
// p + 2P, ... in registers when DK > 0 (P = 1 only without: the state stays in global
// memory); the P lanes' partial sums meet by a butterfly of shuffles, which leaves every lane
// the same bits. A column group is the block's threads over P: 32 columns, or with `gn.y`
// set the whole head (dv rounded up to warps), whose outputs the block then norms and gates
// itself (gated_norm's work, the same bits) instead of writing o: one launch fewer.
// With `pr.b` set, the block prepares its token's q and k heads and head h's β and g itself
// (delta_prep's work, the same bits) as it loads them, which saves that launch: the conv
// output is read as the conv wrote it.
// With DK > 0 the state's loads go out before the wait: it was last written by this layer's
// launch for the sequence's previous tokens (or copied in before the step), never by a kernel
// that may still run, and so was the table `seqs` (copied at the step's start).
template <int DK, int P>
__device__ void delta_rule_impl(const float* __restrict__ conv, const float* __restrict__ g,
                                const float* __restrict__ beta, float* __restrict__ state,
                                float* __restrict__ o, int T, int cd, int nk, int nv, int dk, int dv,
                                const u64* __restrict__ seqs, DeltaPrep pr, GatedNorm gn) {
    if (DK == 0) PDL_SYNC();
    if (seqs) {
        int z = blockIdx.z;
        state = (float*)seqs[2 * z + 1];
        conv += (long long)z * cd;
        g += (long long)z * nv;
        beta += (long long)z * nv;
        o += (long long)z * nv * dv;
        if (pr.b) {
            pr.b += (long long)z * pr.bs;
            pr.a += (long long)z * pr.bs;
        }
        if (gn.y) {
            gn.z += (long long)z * gn.zs;
            gn.y += (long long)z * nv * dv;
        }
    }
    extern __shared__ float sm[];   // q[dk], k[dk], then with gn.y the head's outputs
    float* qs = sm;
    float* ks = sm + dk;
    float* os = sm + 2 * dk;
    constexpr int R = DK > 0 ? DK / P : 1;   // state rows a lane holds
    int h = blockIdx.x, lane = threadIdx.x & 31, p = threadIdx.x & (P - 1);
    int j = blockIdx.y * (blockDim.x / P) + threadIdx.x / P;
    int kh = h / (nv / nk), key_dim = nk * dk;
    bool on = j < dv;
    float* st = state + (long long)h * dk * dv;
    float s[R];
    if (DK > 0)
        for (int r = 0; r < R; r++) s[r] = on ? ld_state(st + (r * P + p) * dv + j) : 0.0f;
    if (DK > 0) PDL_SYNC();
    for (int t = 0; t < T; t++) {
        const float* row = conv + (long long)t * cd;
        float gt, bt;
        if (pr.b) {
            float sq = 0.0f, sk = 0.0f;
            for (int i = lane; i < dk; i += 32) {
                float qv = row[kh * dk + i], kv = row[key_dim + kh * dk + i];
                sq = fmaf(qv, qv, sq);
                sk = fmaf(kv, kv, sk);
            }
            float iq = head_scale(warp_sum(sq), dk, true);
            float ik = head_scale(warp_sum(sk), dk, false);
            // Every warp found the same factors; the block's threads share the writes.
            for (int i = threadIdx.x; i < dk; i += blockDim.x) {
                qs[i] = row[kh * dk + i] * iq;
                ks[i] = row[key_dim + kh * dk + i] * ik;
            }
            beta_g(pr.b[(long long)t * pr.bs + h], pr.a[(long long)t * pr.bs + h], pr.a_log[h],
                   pr.dt_bias[h], bt, gt);
        } else {
            for (int i = threadIdx.x; i < dk; i += blockDim.x) {
                qs[i] = row[kh * dk + i];
                ks[i] = row[key_dim + kh * dk + i];
            }
            gt = g[t * nv + h];
            bt = beta[t * nv + h];
        }
        // The norm's weight and gate, loaded while the rule computes.
        float wj = 0.0f, zj = 0.0f;
        if (gn.y && on) {
            wj = gn.w[j];
            zj = gn.z[(long long)t * gn.zs + h * dv + j];
        }
        __syncthreads();
        float alpha = expf(gt);
        float out = 0.0f;
        // With P > 1 every lane of a column takes part in its shuffles (an off column's
        // lanes hold zeros).
        if (on || P > 1) {
            float v = on ? row[2 * key_dim + h * dv + j] : 0.0f;
            float u = 0.0f;
            if (DK > 0) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    s[r] *= alpha;
                    u = fmaf(s[r], ks[r * P + p], u);
                }
            } else {
                for (int i = 0; i < dk; i++) {
                    float x = st[i * dv + j] * alpha;
                    st[i * dv + j] = x;
                    u = fmaf(x, ks[i], u);
                }
            }
            u = column_sum<P>(u);
            float delta = bt * (v - u);
            if (DK > 0) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    s[r] = fmaf(ks[r * P + p], delta, s[r]);
                    out = fmaf(s[r], qs[r * P + p], out);
                }
            } else {
                for (int i = 0; i < dk; i++) {
                    float x = fmaf(ks[i], delta, st[i * dv + j]);
                    st[i * dv + j] = x;
                    out = fmaf(x, qs[i], out);
                }
            }
            out = column_sum<P>(out);
            if (!gn.y && on && p == 0) o[((long long)t * nv + h) * dv + j] = out;
        }
        if (gn.y) {
            // gated_norm's sum: lane l adds columns l, l + 32, ... in order, then the warp's
            // lanes meet; every warp finds the same factor.
            if (on && p == 0) os[j] = out;
            __syncthreads();
            float ss = 0.0f;
            for (int i = lane; i < dv; i += 32) ss = fmaf(os[i], os[i], ss);
            float inv = gated_inv(warp_sum(ss), dv, gn.eps);
            if (on && p == 0)
                gn.y[((long long)t * nv + h) * dv + j] = gated_out(out, inv, wj, zj);
        }
        __syncthreads();
    }
    if (DK > 0 && on)
        for (int r = 0; r < R; r++) st_state(st + (r * P + p) * dv + j, s[r]);
}

#define DELTA_RULE(NAME, DK, P)                                                                 \
    extern "C" __global__ void NAME(const float* conv, const float* g, const float* beta,      \
                                    float* state, float* o, int T, int cd, int nk, int nv,     \
                                    int dk, int dv, const u64* seqs, DeltaPrep pr,             \
                                    GatedNorm gn) {                                            \
        delta_rule_impl<DK, P>(conv, g, beta, state, o, T, cd, nk, nv, dk, dv, seqs, pr, gn);  \
    }
DELTA_RULE(delta_rule_32, 32, 1)
DELTA_RULE(delta_rule_64, 64, 1)
DELTA_RULE(delta_rule_128, 128, 1)
DELTA_RULE(delta_rule_128_p2, 128, 2)
DELTA_RULE(delta_rule_128_p4, 128, 4)
DELTA_RULE(delta_rule_any, 0, 1)

// y = rms_norm(o; w) · silu(z) per value head, one warp per (token, head) row r = token·nv +
// head; z's tokens are zs floats apart.
extern "C" __global__ void gated_norm(const float* __restrict__ o, const float* __restrict__ z,
                                      const float* __restrict__ w, float* __restrict__ y,
                                      int rows, int dv, float eps, int nv, int zs) {
    PDL_SYNC();
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* oh = o + (long long)r * dv;
    z += (long long)(r / nv) * zs + (long long)(r % nv) * dv - (long long)r * dv;
    float ss = 0.0f;
    for (int i = lane; i < dv; i += 32) ss = fmaf(oh[i], oh[i], ss);
    float inv = gated_inv(warp_sum(ss), dv, eps);
    for (int i = lane; i < dv; i += 32)
        y[(long long)r * dv + i] = gated_out(oh[i], inv, w[i], z[(long long)r * dv + i]);
}

// Attention inputs: q = rope(rms_norm(q)), gate split off, k = rope(rms_norm(k)) and v written
// into the caches at positions meta[0] + t. Block (t, head): heads nq.. are kv heads. 64
// threads; the head is staged in shared memory for the rotation. With `seqs` (see conv_silu:
// the key and value caches), sequence z's position is meta[z] and its inputs start xs
// floats after the previous one's.
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const double* __restrict__ inv_freq,
                                     const int* __restrict__ meta, float* __restrict__ q,
                                     float* __restrict__ gate, float* __restrict__ kc,
                                     float* __restrict__ vc, int nq, int nkv, int hd, int rd,
                                     int gated, float eps, long long xs,
                                     const u64* __restrict__ seqs) {
    PDL_SYNC();
    if (seqs) {
        int z = blockIdx.z;
        kc = (float*)seqs[2 * z];
        vc = (float*)seqs[2 * z + 1];
        meta += z;
        qg += z * xs;
        k += z * xs;
        v += z * xs;
        q += (long long)z * nq * hd;
        gate += (long long)z * nq * hd;
    }
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

// Sequence z of a step of several (`seqs`: its key and value caches, `[z][2]`): its caches,
// its position in meta, and its rows (`rows` floats each) of the query, gate and output.
__device__ __forceinline__ void attn_seq(const u64* __restrict__ seqs, int z, int rows,
                                         const float* __restrict__& kc,
                                         const float* __restrict__& vc,
                                         const int* __restrict__& meta,
                                         const float* __restrict__& q,
                                         const float* __restrict__& gate,
                                         float* __restrict__& out) {
    kc = (const float*)seqs[2 * z];
    vc = (const float*)seqs[2 * z + 1];
    meta += z;
    long long off = (long long)z * rows;
    q += off;
    gate += off;
    out += off;
}

// One tile of n ≤ blockDim positions from `base` for a query staged in qs: the scores (a warp
// four positions at a time, its lanes along the head: coalesced rows of the cache), the
// online softmax's running max m and sum l, and acc[i] += p·v for dimension tid + i·blockDim.
// kb and vb point at the query's kv head in position 0's row; ps holds blockDim floats.
__device__ __forceinline__ void attend_tile(const float* qs, float* ps, float* red,
                                            const float* __restrict__ kb,
                                            const float* __restrict__ vb, long long stride,
                                            int hd, float scale, int base, int n, float& m,
                                            float& l, float (&acc)[4]) {
    int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    for (int j0 = warp * 4; j0 < n; j0 += nw * 4) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int i = lane; i < hd; i += 32) {
            float qv = qs[i];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (j0 + u < n) d[u] = fmaf(qv, kb[(long long)(base + j0 + u) * stride + i], d[u]);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float tot = warp_sum(d[u]);
            if (lane == 0 && j0 + u < n) ps[j0 + u] = tot * scale;
        }
    }
    __syncthreads();
    float sc = tid < n ? ps[tid] : -INFINITY;
    float mt = warp_max(sc);
    if (lane == 0) red[warp] = mt;
    __syncthreads();
    mt = -INFINITY;
    for (int i = 0; i < nw; i++) mt = fmaxf(mt, red[i]);
    float mn = fmaxf(m, mt);
    float e = tid < n ? expf(sc - mn) : 0.0f;
    __syncthreads();   // every thread has read red and ps
    ps[tid] = e;
    float st = block_sum(e, red);
    float corr = expf(m - mn);
    l = l * corr + st;
    for (int i = 0; i < 4; i++) acc[i] *= corr;
    __syncthreads();
#pragma unroll 4
    for (int pp = 0; pp < n; pp++) {
        const float* vp = vb + (long long)(base + pp) * stride;
        float pr = ps[pp];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int dd = tid + i * nt;
            if (dd < hd) acc[i] = fmaf(pr, vp[dd], acc[i]);
        }
    }
    m = mn;
    __syncthreads();
}

// A head's output at `at0` from this thread's dimensions tid + i·blockDim: acc / l, times
// sigmoid(gate) where the attention is gated.
__device__ __forceinline__ void attn_write(const float (&acc)[4], float l, int hd, int gated,
                                           long long at0, const float* __restrict__ gate,
                                           float* __restrict__ out) {
    for (int i = 0; i < 4; i++) {
        int d = threadIdx.x + i * blockDim.x;
        if (d >= hd) continue;
        float val = acc[i] / l;
        if (gated) val *= sigmoidf_(gate[at0 + d]);
        out[at0 + d] = val;
    }
}

// Causal attention with GQA over the cache, online softmax in tiles of blockDim positions;
// output multiplied by sigmoid(gate). Block (t, head), 128 threads, hd ≤ 512. With `seqs`
// as attn_prep's.
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ gate,
                                     const float* __restrict__ kc, const float* __restrict__ vc,
                                     const int* __restrict__ meta, float* __restrict__ out,
                                     int nq, int nkv, int hd, int gated, float scale,
                                     const u64* __restrict__ seqs) {
    PDL_SYNC();
    if (seqs) attn_seq(seqs, blockIdx.z, nq * hd, kc, vc, meta, q, gate, out);
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
    for (int base = 0; base < visible; base += nt)
        attend_tile(qs, ps, red, kc + kvh * hd, vc + kvh * hd, stride, hd, scale, base,
                    min(nt, visible - base), m, l, acc);
    attn_write(acc, l, hd, gated, ((long long)t * nq + head) * hd, gate, out);
}

// Decode attention split over the positions (flash decoding), for steps of one token a
// sequence: `attention` gives one block a head and walks every position in it, so its time
// grew with the context (a block per head, 16 of the H200's 132 SMs). Block (s, head, z)
// takes split s of sequence z's visible positions: splits of `len` positions, the visible
// ones over gridDim.x rounded up to 32, so how a sequence's positions are split depends on
// its position alone, never on the grid's other sequences (batch.rs keeps each sequence's
// bits). Each block leaves its running max, sum and unnormalised output in `part`
// ([z][head][split][hd + 2]); the last of a head's blocks to finish (its `count`, which it
// resets) merges the splits in order and writes the gated output. 128 threads, hd ≤ 512;
// `seqs` as attention's.
extern "C" __global__ void attention_dec(const float* __restrict__ q, const float* __restrict__ gate,
                                         const float* __restrict__ kc, const float* __restrict__ vc,
                                         const int* __restrict__ meta, float* __restrict__ out,
                                         int nq, int nkv, int hd, int gated, float scale,
                                         const u64* __restrict__ seqs, float* __restrict__ part,
                                         unsigned* __restrict__ count) {
    PDL_SYNC();
    int z = blockIdx.z, head = blockIdx.y, s = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    if (seqs) attn_seq(seqs, z, nq * hd, kc, vc, meta, q, gate, out);
    int visible = meta[0] + 1;
    int len = ((visible + gridDim.x - 1) / gridDim.x + 31) & ~31;
    int active = (visible + len - 1) / len;
    if (s >= active) return;
    extern __shared__ float sh[];   // q[hd], p[blockDim]
    __shared__ float red[32];
    __shared__ int last;
    float* qs = sh;
    float* ps = sh + hd;
    int kvh = head / (nq / nkv);
    for (int i = tid; i < hd; i += nt) qs[i] = q[(long long)head * hd + i];
    __syncthreads();
    long long stride = (long long)nkv * hd;
    const float* kb = kc + kvh * hd;
    const float* vb = vc + kvh * hd;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float m = -INFINITY, l = 0.0f;
    int p1 = min(visible, (s + 1) * len);
    for (int base = s * len; base < p1; base += nt)
        attend_tile(qs, ps, red, kb, vb, stride, hd, scale, base, min(nt, p1 - base), m, l, acc);
    int pid = z * nq + head;
    float* mine = part + ((long long)pid * gridDim.x + s) * (hd + 2);
    if (tid == 0) {
        mine[0] = m;
        mine[1] = l;
    }
    for (int i = 0; i < 4; i++) {
        int d = tid + i * nt;
        if (d < hd) mine[2 + d] = acc[i];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&count[pid], 1u) == (unsigned)(active - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* all = part + (long long)pid * gridDim.x * (hd + 2);
    float mx = -INFINITY;
    for (int j = 0; j < active; j++) mx = fmaxf(mx, __ldcg(all + (long long)j * (hd + 2)));
    float sum = 0.0f, o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < active; j++) {
        const float* pj = all + (long long)j * (hd + 2);
        float w = expf(__ldcg(pj) - mx);
        sum = fmaf(__ldcg(pj + 1), w, sum);
        for (int i = 0; i < 4; i++) {
            int d = tid + i * nt;
            if (d < hd) o[i] = fmaf(__ldcg(pj + 2 + d), w, o[i]);
        }
    }
    attn_write(o, sum, hd, gated, (long long)head * hd, gate, out);
    if (tid == 0) count[pid] = 0u;
}
