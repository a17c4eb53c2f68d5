// Hand-written kernels for tests, examples and the strided fallbacks.
// Compiled by kernels/build.rs into one fatbin (sm_80, sm_90 SASS + compute_90 PTX).
// Every kernel is extern "C" so its name is what kernels/src/lib.rs looks up.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// The same mixer as kernels::reference::splitmix64.
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Byte i of the pattern is byte (i % 8) of splitmix64(seed + i / 8).
__device__ __forceinline__ void fill_words(u8* p, u64 len, u64 seed) {
    u64 words = (len + 7) / 8;
    for (u64 w = blockIdx.x * (u64)blockDim.x + threadIdx.x; w < words; w += (u64)gridDim.x * blockDim.x) {
        u64 value = splitmix64(seed + w);
        u64 base = w * 8;
        if (base + 8 <= len && ((unsigned long)(p + base) & 7) == 0) {
            *(u64*)(p + base) = value;  // little-endian: byte k is bits 8k..8k+7
        } else {
            for (u64 k = 0; k < 8 && base + k < len; k++) p[base + k] = (u8)(value >> (8 * k));
        }
    }
}

extern "C" __global__ void fill_pattern(u8* p, u64 len, u64 seed) { fill_words(p, len, seed); }

// Waits `ns` nanoseconds of GPU time, then writes the pattern: work whose result is late.
extern "C" __global__ void spin_then_fill(u8* p, u64 len, u64 seed, u64 ns) {
    u64 start = global_timer_ns();
    while (global_timer_ns() - start < ns) {
    }
    __syncthreads();
    fill_words(p, len, seed);
}

// Adds `words` 64-bit words into *out: a consumer's read of a tensor that costs only its memory
// traffic. 16-byte loads where the words allow, and one atomic per block: with one per warp, the
// 8,192 warps of a 5 MB read queued on a single address and took longer than the read itself.
extern "C" __global__ void sum_words(const u64* p, u64 words, u64* out) {
    u64 sum = 0;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (((unsigned long)p & 15) == 0) {
        const ulonglong2* pairs = (const ulonglong2*)p;
        for (u64 i = first; i < words / 2; i += stride) {
            ulonglong2 v = pairs[i];
            sum += v.x + v.y;
        }
        if (first == 0 && words % 2 == 1) sum += p[words - 1];
    } else {
        for (u64 i = first; i < words; i += stride) sum += p[i];
    }
    __shared__ u64 warp_sums[32];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        sum = threadIdx.x < (blockDim.x + 31) / 32 ? warp_sums[threadIdx.x] : 0;
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
        if (threadIdx.x == 0) atomicAdd(out, sum);
    }
}

// Position-sensitive sum: out += sum over i of splitmix64(i * 256 + byte[i]) (mod 2^64).
// Addition commutes, so the result does not depend on scheduling. *out must start at 0.
extern "C" __global__ void checksum(const u8* p, u64 len, u64* out) {
    u64 sum = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
        sum += splitmix64((i << 8) | p[i]);
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, sum);
}

// A strided view of up to 8 dimensions; strides in elements, may be negative. Matches
// kernels::StridedLayout.
struct StridedLayout {
    u64 shape[8];
    i64 strides[8];
    u32 ndim;
    u32 elem_size;
    u64 numel;
};

__device__ __forceinline__ i64 strided_offset(const StridedLayout& l, u64 linear) {
    i64 offset = 0;
    for (int d = (int)l.ndim - 1; d >= 0; d--) {
        u64 index = linear % l.shape[d];
        linear /= l.shape[d];
        offset += (i64)index * l.strides[d];
    }
    return offset;
}

template <typename T>
__device__ __forceinline__ void copy_elements(const u8* src, u8* dst, const StridedLayout& l, bool pack) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < l.numel; i += (u64)gridDim.x * blockDim.x) {
        i64 s = strided_offset(l, i);
        if (pack) ((T*)dst)[i] = ((const T*)src)[s];
        else ((T*)dst)[s] = ((const T*)src)[i];
    }
}

__device__ __forceinline__ void strided_copy(const u8* src, u8* dst, const StridedLayout& l, bool pack) {
    switch (l.elem_size) {
        case 1: copy_elements<u8>(src, dst, l, pack); break;
        case 2: copy_elements<u16>(src, dst, l, pack); break;
        case 4: copy_elements<u32>(src, dst, l, pack); break;
        case 8: copy_elements<u64>(src, dst, l, pack); break;
    }
}

// dst (contiguous) <- src (strided view whose element 0 is at src).
extern "C" __global__ void pack_strided(const u8* src, u8* dst, StridedLayout layout) {
    strided_copy(src, dst, layout, true);
}

// dst (strided view whose element 0 is at dst) <- src (contiguous).
extern "C" __global__ void unpack_strided(const u8* src, u8* dst, StridedLayout layout) {
    strided_copy(src, dst, layout, false);
}

// C[m x n] = A[m x k] * B[k x n], row-major float32, 16x16 shared-memory tiles.
extern "C" __global__ void matmul_f32(const float* a, const float* b, float* c, u32 m, u32 n, u32 k) {
    __shared__ float ta[16][16];
    __shared__ float tb[16][16];
    u32 row = blockIdx.y * 16 + threadIdx.y;
    u32 col = blockIdx.x * 16 + threadIdx.x;
    float acc = 0.0f;
    for (u32 t = 0; t < k; t += 16) {
        ta[threadIdx.y][threadIdx.x] = (row < m && t + threadIdx.x < k) ? a[(u64)row * k + t + threadIdx.x] : 0.0f;
        tb[threadIdx.y][threadIdx.x] = (col < n && t + threadIdx.y < k) ? b[(u64)(t + threadIdx.y) * n + col] : 0.0f;
        __syncthreads();
        for (u32 i = 0; i < 16; i++) acc += ta[threadIdx.y][i] * tb[i][threadIdx.x];
        __syncthreads();
    }
    if (row < m && col < n) c[(u64)row * n + col] = acc;
}
