// One decoded token of a Gated DeltaNet block in one launch, for one sequence or several
// (one token each): the conv with SiLU, the q and k norms and the gates, the delta rule and
// the gated norm, which the general path (any number of tokens) runs as four kernels
// (mixers.cu conv_silu, delta_prep, delta_rule_*, gated_norm). The arithmetic is theirs,
// operation for operation, so the bits are the same (a GPU test holds the two paths to it).
//
// Block (key head kh, 1, sequence z) owns kh's q and k channels and its R = nv/nk value
// heads' channels: every conv channel a block reads, it alone writes, so the conv state needs
// no other block. Thread r·dv + j owns column j of value head kh·R + r: DK floats of the
// state in registers, loaded before the wait (as delta_rule_* does; the state and the conv
// state were last written by this layer's launch of the sequence's previous token, or copied
// in before the step, and so was the table `seqs`).
//
// Inputs: the token's stacked projections [qkv (cd); z (nv·dv); b (nv); a (nv)] at `in`, the
// z, b and a parts `zo`, `bo`, `ao` floats in, sequence z's row `xs` floats after the one
// before. Output y [z][nv·dv]. With `seqs` non-null, sequence z's conv state and state are
// seqs[2z] and seqs[2z + 1]; otherwise `cst` and `state`.
template <int DK>
__device__ void delta_step_impl(const float* __restrict__ in, int xs, int zo, int bo, int ao,
                                float* __restrict__ cst, float* __restrict__ state,
                                const float* __restrict__ wt, const float* __restrict__ A_log,
                                const float* __restrict__ dt_bias, const float* __restrict__ nw,
                                float* __restrict__ y, int cd, int KK, int nk, int nv, int dv,
                                float eps, const u64* __restrict__ seqs) {
    // Shared: q [DK], k [DK], v then the rule's outputs [R·dv], β [R], g [R], 1/rms [R].
    extern __shared__ float sm[];
    int R = nv / nk, kh = blockIdx.x, z = blockIdx.z;
    int tid = threadIdx.x, n = blockDim.x, lane = tid & 31, w = tid >> 5;
    int r = tid / dv, j = tid - r * dv, h = kh * R + r;
    if (seqs) {
        cst = (float*)seqs[2 * z];
        state = (float*)seqs[2 * z + 1];
    }
    in += (long long)z * xs;
    y += (long long)z * nv * dv;
    float* qs = sm;
    float* ks = sm + DK;
    float* vs = ks + DK;
    float* bs = vs + R * dv;
    float* gs = bs + R;
    float* inv_s = gs + R;
    float* st = state + (long long)h * DK * dv + j;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; i++) s[i] = ld_state(st + i * dv);
    PDL_SYNC();

    // conv_silu (one token): channel c's window is the K-1 state rows, then the input.
    int key_dim = nk * DK, sK = KK - 1;
    for (int cl = tid; cl < 2 * DK + R * dv; cl += n) {
        int c = cl < DK       ? kh * DK + cl
                : cl < 2 * DK ? key_dim + kh * DK + (cl - DK)
                              : 2 * key_dim + kh * R * dv + (cl - 2 * DK);
        float acc = 0.0f;
        for (int m = 0; m < KK; m++) {
            float v = m < sK ? cst[(long long)m * cd + c] : in[c];
            acc += wt[c * KK + m] * v;
        }
        sm[cl] = siluf_(acc);
        for (int q = 0; q < sK; q++)
            cst[(long long)q * cd + c] = q + 1 < sK ? cst[(long long)(q + 1) * cd + c] : in[c];
    }
    __syncthreads();

    // delta_prep: q = rms_norm(q)·dk⁻¹, k = rms_norm(k)·dk^-½ (ε = 1e-6/dk); β, g per head.
    float inv_scale = 1.0f / sqrtf((float)DK);
    float keps = 1e-6f / (float)DK;
    for (int hh = w; hh < 2; hh += n >> 5) {
        float* v = sm + hh * DK;
        float ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss = fmaf(v[i], v[i], ss);
        ss = warp_sum(ss);
        float scale = hh == 0 ? inv_scale * inv_scale : inv_scale;
        float inv = 1.0f / sqrtf(ss / (float)DK + keps) * scale;
        for (int i = lane; i < DK; i += 32) v[i] *= inv;
    }
    for (int i = tid; i < R; i += n) {
        int hv = kh * R + i;
        bs[i] = sigmoidf_(in[bo + hv]);
        gs[i] = -expf(A_log[hv]) * softplusf_(in[ao + hv] + dt_bias[hv]);
    }
    __syncthreads();

    // delta_rule_DK: decay, the delta update, the output; the state goes back.
    float alpha = expf(gs[r]), bt = bs[r];
    float v = vs[r * dv + j];
    float u = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; i++) {
        s[i] *= alpha;
        u = fmaf(s[i], ks[i], u);
    }
    float delta = bt * (v - u);
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; i++) {
        s[i] = fmaf(ks[i], delta, s[i]);
        out = fmaf(s[i], qs[i], out);
    }
#pragma unroll
    for (int i = 0; i < DK; i++) st_state(st + i * dv, s[i]);
    vs[r * dv + j] = out;  // only this thread read that v
    __syncthreads();

    // gated_norm: y = rms_norm(o; nw) · silu(z), a warp's sum per head.
    for (int rr = w; rr < R; rr += n >> 5) {
        const float* oh = vs + rr * dv;
        float ss = 0.0f;
        for (int i = lane; i < dv; i += 32) ss = fmaf(oh[i], oh[i], ss);
        float inv = 1.0f / sqrtf(warp_sum(ss) / (float)dv + eps);
        if (lane == 0) inv_s[rr] = inv;
    }
    __syncthreads();
    y[h * dv + j] = vs[r * dv + j] * inv_s[r] * nw[j] * siluf_(in[zo + h * dv + j]);
}

// At most 32768 state floats a block: 256 threads at DK = 128 (the Qwen3.5/3.6 and
// Qwen3-Next shapes: R = 2, dv = 128), so each keeps its column in registers.
#define DELTA_STEP(NAME, DK)                                                                    \
    extern "C" __global__ void __launch_bounds__(32768 / DK)                                    \
        NAME(const float* in, int xs, int zo, int bo, int ao, float* cst, float* state,         \
             const float* wt, const float* A_log, const float* dt_bias, const float* nw,        \
             float* y, int cd, int KK, int nk, int nv, int dv, float eps, const u64* seqs) {    \
        delta_step_impl<DK>(in, xs, zo, bo, ao, cst, state, wt, A_log, dt_bias, nw, y, cd, KK, \
                            nk, nv, dv, eps, seqs);                                             \
    }
DELTA_STEP(delta_step_32, 32)
DELTA_STEP(delta_step_64, 64)
DELTA_STEP(delta_step_128, 128)
