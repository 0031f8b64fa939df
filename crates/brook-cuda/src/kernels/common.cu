// brook's CUDA kernels, compiled at run time by NVRTC for the device found. The source is
// this file and then matvec.cu, tensor.cu, tensor_n.cu, experts_tc.cu, matmul.cu, routing.cu,
// mixers.cu and delta.cu, joined in that order (`gpu::SOURCE`).
//
// Activations are f32 throughout. Weights stay in the checkpoint's own bytes: MLX affine
// quantization (`bits` 2..8, little-endian bit packing across u32 words, per-group scale and
// bias, w = s·q + b) or plain floats. A `Mat` describes one weight matrix; for routed experts
// its addresses are offsets inside an expert slot and `base` (from the per-layer slot table)
// is added, so one kernel serves dense weights, resident experts and streamed ones.
//
// No headers: bf16 and f16 are widened by bit operations and PTX, so NVRTC needs no include
// path.

typedef unsigned int u32;
typedef unsigned long long u64;

#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (Hopper and later): the host may start a kernel while the
// one before it is still running. Every kernel calls PDL_SYNC() before it reads anything an
// earlier kernel wrote or writes anything (and on every path before it returns, so that its
// completion implies its predecessor's): the wait returns once the previous kernel has
// finished and its writes are visible; the trigger then lets the next kernel launch. Work
// that depends on nothing earlier (loading weights) may come before it. On older GPUs, and
// when the host launches without the attribute, both are no-ops.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define PDL_SYNC()                                                \
    do {                                                          \
        asm volatile("griddepcontrol.wait;" ::: "memory");        \
        asm volatile("griddepcontrol.launch_dependents;" :::);    \
    } while (0)
// The trigger alone, for a kernel that waits on flags instead (`wait_ready`).
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" :::)
#else
#define PDL_SYNC() \
    do {           \
    } while (0)
#define PDL_TRIGGER() \
    do {              \
    } while (0)
#endif

// Weight bytes are read once a step and stream through L2 (a layer's 20-30 MB against 50 MB
// of L2 on an H100): loaded with an evict-first policy, they leave in place what is read
// again (the kernels' own code, activations, states, caches, scales of the next launch).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
__device__ __forceinline__ u64 stream_policy() {
    u64 p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ uint2 ld_stream(const uint2* a) {
    uint2 v;
    asm volatile("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(a), "l"(stream_policy()));
    return v;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* a) {
    uint4 v;
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(a), "l"(stream_policy()));
    return v;
}
__device__ __forceinline__ u32 ld_stream(const u32* a) {
    u32 v;
    asm volatile("ld.global.nc.L2::cache_hint.u32 %0, [%1], %2;"
                 : "=r"(v)
                 : "l"(a), "l"(stream_policy()));
    return v;
}
// A float of a state this kernel also writes (so not through the read-only path), and its
// store, both evict-first: a DeltaNet layer's states are read and written once a token.
__device__ __forceinline__ float ld_state(const float* a) {
    float v;
    asm volatile("ld.global.L2::cache_hint.f32 %0, [%1], %2;" : "=f"(v) : "l"(a), "l"(stream_policy()));
    return v;
}
__device__ __forceinline__ void st_state(float* a, float v) {
    asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(a), "f"(v), "l"(stream_policy())
                 : "memory");
}
#else
template <typename T>
__device__ __forceinline__ T ld_stream(const T* a) {
    return __ldg(a);
}
__device__ __forceinline__ float ld_state(const float* a) { return *a; }
__device__ __forceinline__ void st_state(float* a, float v) { *a = v; }
#endif

// Flags a kernel counts up while a later one runs beside it (the mapped experts' gather and
// the products that read what it copied, routing.cu `gather_ready`): the producer's threads
// fence their writes, meet at a barrier, and one adds 1; a consumer waits until the count
// reaches `need`, with acquire semantics, before it reads what was copied (through its SM's
// L1, which holds no line of those slots: it is invalidated when a kernel starts, and no
// block reads a slot before its flag) or the table the producer wrote (through L2,
// `__ldcg`). Thread 0 of the block waits, the rest at the barrier.
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
    v = *(const volatile u32*)p;
    __threadfence();
#endif
    return v;
}

__device__ __forceinline__ void spin_ready(const u32* f, u32 need) {
    while (ld_acquire(f) < need) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
        __nanosleep(64);
#endif
    }
}

__device__ __forceinline__ void wait_ready(const u32* f, u32 need) {
    if (threadIdx.x == 0) spin_ready(f, need);
    __syncthreads();
}

// One warp's wait (lane 0 spins).
__device__ __forceinline__ void wait_ready_warp(const u32* f, u32 need) {
    if ((threadIdx.x & 31) == 0) spin_ready(f, need);
    __syncwarp();
}

struct Mat {
    u64 w, s, b;        // weight words or floats; scales; biases
    int rows, cols;
    int bits;           // 0: float weights
    int group;
    int wtype;          // float weights: 0 f32, 1 bf16, 2 f16
    int stype;          // scales and biases: 0 f32, 1 bf16, 2 f16
};

__device__ __forceinline__ float f16f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float ldf(u64 p, int type, long long i) {
    if (type == 1) return __uint_as_float(((u32)((const unsigned short*)p)[i]) << 16);
    if (type == 2) return f16f(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}

// Scales and biases, which no kernel writes: through the read-only path.
__device__ __forceinline__ float ldsb(u64 p, int type, long long i) {
    if (type == 1) return __uint_as_float(((u32)__ldg((const unsigned short*)p + i)) << 16);
    if (type == 2) return f16f(__ldg((const unsigned short*)p + i));
    return __ldg((const float*)p + i);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
__device__ __forceinline__ float softplusf_(float x) {
    return x > 20.0f ? x : fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

// Element (r, c) of a matrix, dequantized.
__device__ __forceinline__ float wat(const Mat& m, u64 base, int r, int c) {
    if (m.bits == 0) return ldf(base + m.w, m.wtype, (long long)r * m.cols + c);
    long long wpr = (long long)m.cols * m.bits / 32;
    const u32* row = (const u32*)(base + m.w) + r * wpr;
    long long bit = (long long)c * m.bits;
    int word = (int)(bit >> 5), sh = (int)(bit & 31);
    u32 v = row[word] >> sh;
    if (sh + m.bits > 32) v |= row[word + 1] << (32 - sh);
    v &= (1u << m.bits) - 1u;
    long long gi = (long long)r * (m.cols / m.group) + c / m.group;
    return fmaf(ldf(base + m.s, m.stype, gi), (float)v, ldf(base + m.b, m.stype, gi));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Code j (0..3) of the bytes of `w` as an exact float: the byte goes into the low mantissa
// bits of 2^23 by one byte permute and 2^23 is subtracted (an integer-to-float conversion
// runs at a fraction of the FMA rate).
__device__ __forceinline__ float code(u32 w, int j) {
    return __uint_as_float(__byte_perm(w, 0x4Bu, 0x4550u + j)) - 8388608.0f;
}

// Σ q·x over the 8 four-bit codes of one word (x in a, b) and over the 4 eight-bit ones.
__device__ __forceinline__ float word_dot4(u32 t, float4 a, float4 b) {
    u32 lo = t & 0x0F0F0F0Fu, hi = (t >> 4) & 0x0F0F0F0Fu;
    float q = code(lo, 0) * a.x;
    q = fmaf(code(hi, 0), a.y, q);
    q = fmaf(code(lo, 1), a.z, q);
    q = fmaf(code(hi, 1), a.w, q);
    q = fmaf(code(lo, 2), b.x, q);
    q = fmaf(code(hi, 2), b.y, q);
    q = fmaf(code(lo, 3), b.z, q);
    return fmaf(code(hi, 3), b.w, q);
}

__device__ __forceinline__ float word_dot8(u32 t, float4 a) {
    float q = code(t, 0) * a.x;
    q = fmaf(code(t, 1), a.y, q);
    q = fmaf(code(t, 2), a.z, q);
    return fmaf(code(t, 3), a.w, q);
}
