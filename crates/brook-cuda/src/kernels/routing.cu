// Routing: softmax and top-k, the grouping of (token, expert) pairs for prefill, the combine.

// Router: softmax over E logits per token, top K (ties to the lower id), renormalised if
// asked, then ordered by expert id so sums run in the CPU path's order. One warp per token:
// no block barriers between the K rounds.
#define TOPK_REGS 16
extern "C" __global__ void topk(const float* __restrict__ logits, int E, int K, int norm,
                                int* __restrict__ sel, float* __restrict__ wts) {
    PDL_SYNC();
    extern __shared__ float p[];   // [E], for E > 32·TOPK_REGS
    __shared__ int ids[32];
    __shared__ float ws[32];
    int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * E;
    if (E <= 32 * TOPK_REGS) {
        // Every lane keeps its E/32 probabilities in registers.
        float v[TOPK_REGS];
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < TOPK_REGS; j++) {
            int i = lane + 32 * j;
            v[j] = i < E ? l[i] : -INFINITY;
            mx = fmaxf(mx, v[j]);
        }
        mx = warp_max(mx);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < TOPK_REGS; j++) {
            int i = lane + 32 * j;
            v[j] = i < E ? expf(v[j] - mx) : 0.0f;
            s += v[j];
        }
        s = warp_sum(s);
#pragma unroll
        for (int j = 0; j < TOPK_REGS; j++) v[j] = lane + 32 * j < E ? v[j] / s : -1.0f;
        for (int k = 0; k < K; k++) {
            float best = -1.0f;
            int bidx = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < TOPK_REGS; j++)
                if (v[j] > best) { best = v[j]; bidx = lane + 32 * j; }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, best, o);
                int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
                if (ov > best || (ov == best && oi < bidx)) { best = ov; bidx = oi; }
            }
#pragma unroll
            for (int j = 0; j < TOPK_REGS; j++)
                if (lane + 32 * j == bidx) v[j] = -2.0f;
            if (lane == 0) {
                ids[k] = bidx;
                ws[k] = best;
            }
        }
    } else {
        float mx = -INFINITY;
        for (int i = lane; i < E; i += 32) {
            float v = l[i];
            p[i] = v;
            mx = fmaxf(mx, v);
        }
        mx = warp_max(mx);
        float s = 0.0f;
        for (int i = lane; i < E; i += 32) {
            float e = expf(p[i] - mx);
            p[i] = e;
            s += e;
        }
        s = warp_sum(s);
        for (int i = lane; i < E; i += 32) p[i] = p[i] / s;
        __syncwarp();
        for (int k = 0; k < K; k++) {
            float best = -1.0f;
            int bidx = 0x7fffffff;
            for (int i = lane; i < E; i += 32) {
                float v = p[i];
                if (v > best) { best = v; bidx = i; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, best, o);
                int oi = __shfl_xor_sync(0xffffffffu, bidx, o);
                if (ov > best || (ov == best && oi < bidx)) { best = ov; bidx = oi; }
            }
            if (lane == 0) {
                ids[k] = bidx;
                ws[k] = best;
                p[bidx] = -2.0f;
            }
            __syncwarp();
        }
    }
    __syncwarp();
    if (lane == 0) {
        if (norm) {
            float sum = 0.0f;
            for (int k = 0; k < K; k++) sum += ws[k];
            for (int k = 0; k < K; k++) ws[k] = ws[k] / sum;
        }
        for (int a = 1; a < K; a++) {
            int id = ids[a];
            float wv = ws[a];
            int b = a - 1;
            while (b >= 0 && ids[b] > id) { ids[b + 1] = ids[b]; ws[b + 1] = ws[b]; b--; }
            ids[b + 1] = id;
            ws[b + 1] = wv;
        }
        for (int k = 0; k < K; k++) {
            sel[t * K + k] = ids[k];
            wts[t * K + k] = ws[k];
        }
    }
}

// Grouping of (token, k) pairs by expert for the grouped prefill kernels.
extern "C" __global__ void moe_count(const int* __restrict__ sel, int n, int* __restrict__ counts) {
    PDL_SYNC();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[sel[i]], 1);
}

extern "C" __global__ void moe_offsets(const int* __restrict__ counts, int E, int* __restrict__ offs,
                                       int* __restrict__ fill) {
    PDL_SYNC();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E; e++) {
            offs[e] = acc;
            fill[e] = 0;
            acc += counts[e];
        }
    }
}

extern "C" __global__ void moe_fill(const int* __restrict__ sel, int n, const int* __restrict__ offs,
                                    int* __restrict__ fill, int* __restrict__ pairs) {
    PDL_SYNC();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = sel[i];
    pairs[offs[e] + atomicAdd(&fill[e], 1)] = i;
}

// out[t, j] = Σ_k wts[t,k] · y[t·K + k, j] (in expert-id order) + sigmoid(sg[t]) · shared[t, j].
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ wts,
                                       const float* __restrict__ shared, const float* __restrict__ sg,
                                       float* __restrict__ out, int T, int K, int H) {
    PDL_SYNC();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H) return;
    int t = (int)(idx / H), j = (int)(idx % H);
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += wts[t * K + k] * y[((long long)t * K + k) * H + j];
    out[idx] = acc + sigmoidf_(sg[t]) * shared[idx];
}
