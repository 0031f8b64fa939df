// Routing: softmax and top-k, the grouping of (token, expert) pairs for prefill, the combine.

// Router: softmax over E logits per token, top K (ties to the lower id), renormalised if
// asked, then ordered by expert id so sums run in the CPU path's order. One warp per token:
// no block barriers. A probability p ≥ 0 is ranked by the key bits(p) + 1, which orders as
// an unsigned integer like p does (0 marks taken or absent entries), so a round of the
// top-k is two warp reductions; lane k keeps the k-th pick.

// The largest key of the warp and, among the lanes holding it, the lowest index.
__device__ __forceinline__ void warp_argmax(u32 key, u32 idx, u32& top, u32& at) {
#if __CUDA_ARCH__ >= 800
    top = __reduce_max_sync(0xffffffffu, key);
    at = __reduce_min_sync(0xffffffffu, key == top ? idx : 0xffffffffu);
#else
    for (int o = 16; o > 0; o >>= 1) {
        u32 ok = __shfl_xor_sync(0xffffffffu, key, o), oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ok > key || (ok == key && oi < idx)) { key = ok; idx = oi; }
    }
    top = key;
    at = idx;
#endif
}

__device__ __forceinline__ u32 prob_key(float p) { return p >= 0.0f ? __float_as_uint(p) + 1u : 0u; }

// Lane k < K holds the k-th pick (id, probability): renormalise (summing in pick order, as
// the CPU does), order by id, write token t's row.
__device__ __forceinline__ void topk_write(int t, int K, int norm, int id, float w,
                                           int* __restrict__ sel, float* __restrict__ wts) {
    int lane = threadIdx.x & 31;
    if (norm) {
        float sum = 0.0f;
        for (int k = 0; k < K; k++) sum += __shfl_sync(0xffffffffu, w, k);
        w = w / sum;
    }
    int rank = 0;
    for (int k = 0; k < K; k++) rank += __shfl_sync(0xffffffffu, id, k) < id;
    if (lane < K) {
        sel[t * K + rank] = id;
        wts[t * K + rank] = w;
    }
}

// Every lane keeps its R = E/32 (rounded up) probabilities in registers.
template <int R>
__device__ __forceinline__ void topk_regs(const float* __restrict__ l, int t, int E, int K,
                                          int norm, int* __restrict__ sel,
                                          float* __restrict__ wts) {
    int lane = threadIdx.x;
    float v[R];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < R; j++) {
        int i = lane + 32 * j;
        v[j] = i < E ? l[i] : -INFINITY;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < R; j++) {
        int i = lane + 32 * j;
        v[j] = i < E ? expf(v[j] - mx) : 0.0f;
        s += v[j];
    }
    s = warp_sum(s);
    u32 key[R];
#pragma unroll
    for (int j = 0; j < R; j++) key[j] = lane + 32 * j < E ? prob_key(v[j] / s) : 0u;
    int my_id = 0;
    float my_w = 0.0f;
    for (int k = 0; k < K; k++) {
        u32 best = 0u, bidx = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < R; j++)
            if (key[j] > best) { best = key[j]; bidx = lane + 32 * j; }
        u32 top, at;
        warp_argmax(best, bidx, top, at);
#pragma unroll
        for (int j = 0; j < R; j++)
            if (lane + 32 * j == (int)at) key[j] = 0u;
        if (lane == k) {
            my_id = (int)at;
            my_w = __uint_as_float(top - 1u);
        }
    }
    topk_write(t, K, norm, my_id, my_w, sel, wts);
}

// The nzero words at `zero` set to 0 once the kernel before has finished: the flags of the
// gather that follows (`gather_ready`), whose last readers finished before that kernel.
__device__ __forceinline__ void zero_flags(u32* zero, int nzero) {
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < nzero; i += blockDim.x) zero[i] = 0u;
}

// Token t's logits start at t·ls.
extern "C" __global__ void topk(const float* __restrict__ logits, int E, int ls, int K, int norm,
                                int* __restrict__ sel, float* __restrict__ wts, u32* zero,
                                int nzero) {
    PDL_SYNC();
    zero_flags(zero, nzero);
    extern __shared__ float p[];   // [E], for E > 512
    int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * ls;
    if (E <= 256) return topk_regs<8>(l, t, E, K, norm, sel, wts);
    if (E <= 512) return topk_regs<16>(l, t, E, K, norm, sel, wts);
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
    int my_id = 0;
    float my_w = 0.0f;
    for (int k = 0; k < K; k++) {
        u32 best = 0u, bidx = 0xffffffffu;
        for (int i = lane; i < E; i += 32) {
            u32 key = prob_key(p[i]);
            if (key > best) { best = key; bidx = i; }
        }
        u32 top, at;
        warp_argmax(best, bidx, top, at);
        __syncwarp();
        if (lane == 0) p[at] = -2.0f;
        if (lane == k) {
            my_id = (int)at;
            my_w = __uint_as_float(top - 1u);
        }
        __syncwarp();
    }
    topk_write(t, K, norm, my_id, my_w, sel, wts);
}

// A replayed routing: token t uses the K experts given[t*K..] (a routing trace) instead of
// its top-k, weighted by the router's probabilities at those ids and renormalised as the
// top-k is. One warp per token.
extern "C" __global__ void topk_given(const float* __restrict__ logits, int E, int ls, int K,
                                      int norm, const int* __restrict__ given,
                                      int* __restrict__ sel, float* __restrict__ wts, u32* zero,
                                      int nzero) {
    PDL_SYNC();
    zero_flags(zero, nzero);
    int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long long)t * ls;
    float mx = -INFINITY;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, l[i]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (int i = lane; i < E; i += 32) s += expf(l[i] - mx);
    s = warp_sum(s);
    int id = lane < K ? given[t * K + lane] : 0;
    float w = lane < K ? expf(l[id] - mx) / s : 0.0f;
    topk_write(t, K, norm, id, w, sel, wts);
}

// Where pick j's expert comes from in a gather: its GPU slot (PICK_GPU), an earlier pick of
// the same expert (PICK_DUP, which copies it), guess i ≥ 0 of the `npref` a prefetch gathered,
// or a copy over PCIe (PICK_COPY).
#define PICK_GPU -1
#define PICK_DUP -2
#define PICK_COPY -3
__device__ __forceinline__ int pick_source(const u64* __restrict__ table, u64 lo, u64 hi,
                                           const int* __restrict__ sel, int j,
                                           const int* __restrict__ pref, int npref) {
    int e = sel[j];
    u64 src = table[e];
    if (src >= lo && src < hi) return PICK_GPU;
    for (int i = 0; i < j; i++)
        if (sel[i] == e) return PICK_DUP;
    for (int i = 0; i < npref; i++)
        if (pref[i] == e) return i;
    return PICK_COPY;
}

// 16-byte pieces [i, end) of s into d, `stride` apart a thread, four loads in flight at a
// time: streaming reads that keep PCIe busy, where the products' own scattered reads of host
// memory do not.
__device__ __forceinline__ void copy_pieces(const uint4* __restrict__ s, uint4* __restrict__ d,
                                            int i, int end, int stride) {
    for (; i + 3 * stride < end; i += 4 * stride) {
        uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], w = s[i + 3 * stride];
        d[i] = a;
        d[i + stride] = b;
        d[i + 2 * stride] = c;
        d[i + 3 * stride] = w;
    }
    for (; i < end; i += stride) d[i] = s[i];
}

// Experts in mapped host memory, gathered before the products read them: pick j (of n) whose
// table entry lies outside the GPU's slot arena [lo, hi) has its image copied over PCIe into
// slot j of `scratch` (by the first pick of that expert only; copy_pieces). step[e] then says
// where each picked expert is on the GPU; counts[e] counts the picks. A mapped expert among
// the `npref` guesses `pref` that an earlier launch of this kernel (a prefetch: its `copied`)
// gathered into `pref_scratch` is taken from there, not copied, and counted in pref_hits.
// A prefetch copies at most `cap` picks, the first ones to copy (its picks come in order of
// probability), counts only those it copies or finds on the GPU, and writes to copied[j]
// pick j's expert where it copied it, else -1 (with cap >= n every pick counts and copied
// may be null). Grid (parts, n).
extern "C" __global__ void gather_mapped(const u64* __restrict__ table, u64 lo, u64 hi,
                                         const int* __restrict__ sel, int n, u64 scratch,
                                         int slot_bytes, int img_bytes, u64* __restrict__ step,
                                         int* __restrict__ counts, const int* __restrict__ pref,
                                         u64 pref_scratch, int npref, int* __restrict__ pref_hits,
                                         int cap, int* __restrict__ copied) {
    PDL_SYNC();
    int j = blockIdx.y;
    int e = sel[j];
    bool lead = blockIdx.x == 0 && threadIdx.x == 0;
    int from = pick_source(table, lo, hi, sel, j, pref, npref);
    bool over = false;
    if (from == PICK_COPY && cap < n) {
        int rank = 0;
        for (int i = 0; i < j; i++)
            rank += pick_source(table, lo, hi, sel, i, pref, npref) == PICK_COPY;
        over = rank >= cap;
    }
    if (lead) {
        if (!over) atomicAdd(&counts[e], 1);
        if (copied) copied[j] = from == PICK_COPY && !over ? e : -1;
    }
    if (from == PICK_DUP || over) return;
    if (from >= 0) {
        if (lead) {
            step[e] = pref_scratch + (u64)from * slot_bytes;
            atomicAdd(pref_hits, 1);
        }
        return;
    }
    u64 src = table[e], dst = scratch + (u64)j * slot_bytes;
    if (lead) step[e] = from == PICK_GPU ? src : dst;
    if (from == PICK_GPU) return;
    copy_pieces((const uint4*)src, (uint4*)dst, blockIdx.x * blockDim.x + threadIdx.x,
                (img_bytes + 15) / 16, gridDim.x * blockDim.x);
}

// gather_mapped for a one-token step whose products run beside it (`ready`: two words the
// top-k zeroed): grid (P). The blocks copy every copied pick's gate and up bytes ([0, split))
// first, then their down bytes ([split, img)), each block a share of each pick with no
// barrier between picks (so the link never idles), and after each of the two phases every
// block counts 1 into ready[phase]. Block 0 writes step[e] (and counts and pref_hits as
// gather_mapped does) before its first count, so a product may read the table once ready[0]
// = P. The products wait on these counts instead of on this kernel's end (swiglu_tc,
// down_tc); this kernel's trigger comes when every block has started, so a waiting product
// never holds a place a block of this kernel needs.
extern "C" __global__ void gather_ready(const u64* __restrict__ table, u64 lo, u64 hi,
                                        const int* __restrict__ sel, int n, u64 scratch,
                                        int slot_bytes, int split, int img_bytes,
                                        u64* __restrict__ step, int* __restrict__ counts,
                                        const int* __restrict__ pref, u64 pref_scratch, int npref,
                                        int* __restrict__ pref_hits, u32* __restrict__ ready) {
    PDL_SYNC();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        for (int j = 0; j < n; j++) {
            int e = sel[j];
            atomicAdd(&counts[e], 1);
            int from = pick_source(table, lo, hi, sel, j, pref, npref);
            if (from >= 0) {
                step[e] = pref_scratch + (u64)from * slot_bytes;
                atomicAdd(pref_hits, 1);
            } else if (from != PICK_DUP) {
                step[e] = from == PICK_GPU ? table[e] : scratch + (u64)j * slot_bytes;
            }
        }
    }
    int stride = gridDim.x * blockDim.x;
    for (int r = 0; r < 2; r++) {
        int b0 = r == 0 ? 0 : split / 16, b1 = r == 0 ? split / 16 : (img_bytes + 15) / 16;
        for (int j = 0; j < n; j++) {
            if (pick_source(table, lo, hi, sel, j, pref, npref) != PICK_COPY) continue;
            copy_pieces((const uint4*)table[sel[j]], (uint4*)(scratch + (u64)j * slot_bytes),
                        b0 + blockIdx.x * blockDim.x + threadIdx.x, b1, stride);
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(&ready[r], 1u);
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

// out[t, j] = Σ_k wts[t,k] · y[t·K + k, j] (in expert-id order) + sigmoid(sg[t·sgs]) ·
// shared[t, j].
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ wts,
                                       const float* __restrict__ shared, const float* __restrict__ sg,
                                       float* __restrict__ out, int T, int K, int H, int sgs) {
    PDL_SYNC();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H) return;
    int t = (int)(idx / H), j = (int)(idx % H);
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += wts[t * K + k] * y[((long long)t * K + k) * H + j];
    out[idx] = acc + sigmoidf_(sg[(long long)t * sgs]) * shared[idx];
}

// The greedy pick of each row of logits (`Logits::Best`), as brook_core's `argmax` makes it:
// the largest value's index, NaN never, ties (-0 and +0 among them) to the lower index, 0
// when every value is NaN. A key orders (value, lower index) as one unsigned integer: the
// value's bits made monotone above, the index's complement below; 0 is "nothing yet" (no
// value that is not NaN maps there).
__device__ __forceinline__ u64 best_key(float x, u32 i) {
    u32 b = __float_as_uint(x);
    if (b == 0x80000000u) b = 0u;
    u32 m = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)m << 32) | (u64)(0xffffffffu - i);
}

__device__ __forceinline__ u64 block_max_u64(u64 k, u64* w) {
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(0xffffffffu, k, o);
        k = other > k ? other : k;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) w[warp] = k;
    __syncthreads();
    k = lane < warps ? w[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(0xffffffffu, k, o);
        k = other > k ? other : k;
    }
    return k;
}

// Grid (blocks, rows), row r's `v` logits at r·v. Each block keys its share of the row into
// part[r·blocks + b]; the row's last block to finish (a counter a row, which it resets for the
// next launch) reduces them and writes the index to out[r]. blockDim a multiple of 32.
extern "C" __global__ void best_rows(const float* __restrict__ logits, int v, u64* part,
                                     u32* count, u32* out) {
    PDL_SYNC();
    __shared__ u64 w[32];
    __shared__ int last;
    int row = blockIdx.y, nb = gridDim.x;
    const float* l = logits + (long long)row * v;
    int per = (v + nb - 1) / nb;
    int lo = blockIdx.x * per, hi = min(v, lo + per);
    u64 best = 0ull;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float x = l[i];
        bool nan = (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
        u64 k = nan ? 0ull : best_key(x, (u32)i);
        best = k > best ? k : best;
    }
    best = block_max_u64(best, w);
    if (threadIdx.x == 0) {
        part[(long long)row * nb + blockIdx.x] = best;
        __threadfence();
        last = atomicAdd(&count[row], 1u) == (u32)(nb - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = 0ull;
    for (int j = threadIdx.x; j < nb; j += blockDim.x) {
        u64 k = ((volatile u64*)part)[(long long)row * nb + j];
        best = k > best ? k : best;
    }
    __syncthreads();  // w is reused
    best = block_max_u64(best, w);
    if (threadIdx.x == 0) {
        out[row] = best ? 0xffffffffu - (u32)best : 0u;
        count[row] = 0u;
    }
}

// The most likely candidates of each row of logits (`Logits::Top`): the TOP_K largest by
// (value, lower index) as best_key orders them, NaN left out. First `top_blocks` keys each
// 64-value block of a row by its largest value (the key's upper word; 0 for a block of NaN).
// Then `top_rows`, one block a row: the TOP_K-th largest block key F is at most the TOP_K-th
// largest value's, so every value whose key reaches F, taken from the blocks whose largest
// does, holds the TOP_K largest; those are sorted and the first TOP_K written. Each row's
// output: TOP_K pairs (the value, a float whose bits are the index), then the pairs written,
// the values that reached F (0xffffffff when more than TOP_LIST did: nothing decided) and
// whether F took every value that is a number, each a float's bits.
#define TOP_K 64
#define TOP_LIST 4096
#define TOP_ROW (2 * TOP_K + 4)

extern "C" __global__ void top_blocks(const float* __restrict__ logits, int v, int nb,
                                      u32* __restrict__ bkey) {
    PDL_SYNC();
    int row = blockIdx.y, lane = threadIdx.x & 31;
    int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (b >= nb) return;
    const float* l = logits + (long long)row * v;
    u32 best = 0u;
    for (int j = lane; j < 64; j += 32) {
        int i = b * 64 + j;
        if (i < v) {
            float x = l[i];
            bool nan = (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
            u32 k = nan ? 0u : (u32)(best_key(x, (u32)i) >> 32);
            best = k > best ? k : best;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        u32 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if (lane == 0) bkey[(long long)row * nb + b] = best;
}

// Sorts s[0..n) (n a power of two) from largest to smallest, with every thread of the block.
template <typename T>
__device__ void bitonic_desc(T* s, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                int p = i ^ j;
                if (p > i) {
                    T a = s[i], c = s[p];
                    bool desc = (i & k) == 0;
                    if (desc ? (a < c) : (a > c)) {
                        s[i] = c;
                        s[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// One block a row; nb (blocks of 64 values a row) at most 2·TOP_LIST.
extern "C" __global__ void top_rows(const float* __restrict__ logits, int v, int nb,
                                    const u32* __restrict__ bkey, float* __restrict__ out) {
    PDL_SYNC();
    __shared__ u64 list[TOP_LIST];
    __shared__ u32 count;
    u32* keys = (u32*)list;
    int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const u32* bk = bkey + (long long)row * nb;
    const float* l = logits + (long long)row * v;
    float* o = out + (long long)row * TOP_ROW;
    int p = 1;
    while (p < nb) p <<= 1;
    for (int i = tid; i < p; i += blockDim.x) keys[i] = i < nb ? bk[i] : 0u;
    __syncthreads();
    bitonic_desc(keys, p);
    // Fewer than TOP_K blocks, or fewer holding a number: no floor, take every number.
    u32 f = nb >= TOP_K ? keys[TOP_K - 1] : 0u;
    bool every = f == 0u;
    if (every) f = 1u;
    __syncthreads();
    if (tid == 0) count = 0u;
    __syncthreads();
    for (int b = tid >> 5; b < nb; b += blockDim.x >> 5) {
        if (bk[b] < f) continue;
        for (int j = lane; j < 64; j += 32) {
            int i = b * 64 + j;
            if (i >= v) continue;
            float x = l[i];
            if ((__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u) continue;
            u64 k = best_key(x, (u32)i);
            if ((u32)(k >> 32) >= f) {
                u32 at = atomicAdd(&count, 1u);
                if (at < TOP_LIST) list[at] = k;
            }
        }
    }
    __syncthreads();
    u32 c = count;
    if (c > TOP_LIST) {
        if (tid == 0) {
            o[2 * TOP_K] = __uint_as_float(0u);
            o[2 * TOP_K + 1] = __uint_as_float(0xffffffffu);
            o[2 * TOP_K + 2] = __uint_as_float(0u);
        }
        return;
    }
    int q = 1;
    while (q < (int)c) q <<= 1;
    for (int i = (int)c + tid; i < q; i += blockDim.x) list[i] = 0ull;
    __syncthreads();
    bitonic_desc(list, q);
    int m = min((int)c, TOP_K);
    for (int j = tid; j < m; j += blockDim.x) {
        u64 k = list[j];
        u32 hi = (u32)(k >> 32);
        u32 bits = (hi & 0x80000000u) ? (hi & 0x7fffffffu) : ~hi;
        o[2 * j] = __uint_as_float(bits);
        o[2 * j + 1] = __uint_as_float(0xffffffffu - (u32)k);
    }
    if (tid == 0) {
        o[2 * TOP_K] = __uint_as_float((u32)m);
        o[2 * TOP_K + 1] = __uint_as_float(c);
        o[2 * TOP_K + 2] = __uint_as_float(every ? 1u : 0u);
    }
}
