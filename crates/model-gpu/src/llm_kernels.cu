// Kernels of the GPU forward pass (crates/model-gpu, docs/gpu-model.md).
//
// Compiled by NVRTC for the device's architecture with `-DBGS_DT=0|1|2` (f32, f16, bf16: the
// type of weights, the KV cache and GEMM inputs) and `-fmad=false` (no contraction of a
// multiply and an add, so the f32 maths matches the CPU oracle's operation by operation).
// The residual stream, norm weights, biases, GEMM outputs and every reduction are f32.
//
// Every reduction has a fixed order that depends only on the row being reduced (never on
// which other tokens share the step or on the bucket size): per-thread strided sums in index
// order, then a fixed shared-memory or butterfly tree. So a token's results are the same
// bits whatever else is in the batch (the GEMMs are cuBLAS's and are not covered by this).
//
// Layouts: activations are row-major `[token][feature]`. The KV cache is
// `[num_blocks][layers][k|v][kv_heads][block_size][head_dim]` in `wt`, like the CPU model's.
// Per-step inputs (written by the host before each replay):
//   tok[T]   token ids          pos[T]  positions        seq[T]  sequence index (0..items)
//   slot[T]  KV slot (block * block_size + offset), -1 = padding token (writes nothing)
//   rows[S]  token row of each sampled item              bt_off[items] offset into bt
//   bt[...]  the block tables of the step's sequences, packed back to back

#ifndef BGS_DT
#error "BGS_DT must be defined (0 = f32, 1 = f16, 2 = bf16)"
#endif

#if BGS_DT == 0
typedef float wt;
__device__ __forceinline__ float ld(wt v) { return v; }
__device__ __forceinline__ wt st(float f) { return f; }
#elif BGS_DT == 1
typedef unsigned short wt;
__device__ __forceinline__ float ld(wt v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ wt st(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#elif BGS_DT == 2
typedef unsigned short wt;
__device__ __forceinline__ float ld(wt v) { return __uint_as_float(((unsigned)v) << 16); }
// Round to nearest even, NaN stays a (quiet) NaN: the same rounding as the host's
// `half::bf16::from_f32`.
__device__ __forceinline__ wt st(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (wt)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (wt)(u >> 16);
}
#else
#error "BGS_DT must be 0, 1 or 2"
#endif

// 16 bytes of `wt` values, for vector loads of cache rows.
struct alignas(16) bgs_u4 {
    unsigned a, b, c, d;
};
#define BGS_PER16 (16 / (int)sizeof(wt))

// The BGS_PER16 values of `u` as f32, in memory order.
__device__ __forceinline__ void unpack16(const bgs_u4 u, float *o) {
#if BGS_DT == 0
    o[0] = __uint_as_float(u.a);
    o[1] = __uint_as_float(u.b);
    o[2] = __uint_as_float(u.c);
    o[3] = __uint_as_float(u.d);
#else
    const unsigned w[4] = {u.a, u.b, u.c, u.d};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        o[2 * i] = ld((wt)(w[i] & 0xffffu));
        o[2 * i + 1] = ld((wt)(w[i] >> 16));
    }
#endif
}

// q · k over `hd` dimensions, accumulated in dimension order (16-byte loads of k when the row
// is aligned and whole vectors cover it: the same sums in the same order either way).
__device__ __forceinline__ float dot_row(const float *q, const wt *k, int hd) {
    float dot = 0.0f;
    if (hd % BGS_PER16 == 0 && ((unsigned long long)k & 15ull) == 0) {
        const bgs_u4 *k4 = (const bgs_u4 *)k;
        for (int c = 0; c < hd / BGS_PER16; c++) {
            float e[BGS_PER16];
            unpack16(k4[c], e);
#pragma unroll
            for (int i = 0; i < BGS_PER16; i++) dot = dot + q[c * BGS_PER16 + i] * e[i];
        }
    } else {
        for (int d = 0; d < hd; d++) dot = dot + q[d] * ld(k[d]);
    }
    return dot;
}

#define BGS_NEG_INF (__int_as_float(0xff800000))
#define BGS_MAX_HEAD_DIM 128
// Most warps of one attention block (positions split across warps, see bgs_attention).
#define BGS_ATTN_MAX_WARPS 8
// Experiments only (BGS_LLM_KERNEL_DEFINES=BGS_ATTN_SCALAR=1): attention in the scalar form
// whatever the head size, to time both forms in one run.
#ifndef BGS_ATTN_SCALAR
#define BGS_ATTN_SCALAR 0
#endif
// The model's head size (`-DBGS_HEAD_DIM`, set by the host for the model it loads; 0 =
// unknown): attention's row-split form is compiled for it alone, so the kernel's register
// count is that form's (~70 at head_dim 64 in bf16 against ~90 with every form in one kernel:
// more blocks resident per SM). BGS_ATTN_LR = lanes per cache row, 0 = the scalar form.
#ifndef BGS_HEAD_DIM
#define BGS_HEAD_DIM 0
#endif
#if BGS_DT == 0
#define BGS_PER16_PP 4  // BGS_PER16 for the preprocessor, which knows no sizeof
#else
#define BGS_PER16_PP 8
#endif
#if !BGS_ATTN_SCALAR && BGS_HEAD_DIM % BGS_PER16_PP == 0 &&                                 \
    (BGS_HEAD_DIM / BGS_PER16_PP == 2 || BGS_HEAD_DIM / BGS_PER16_PP == 4 ||                 \
     BGS_HEAD_DIM / BGS_PER16_PP == 8 || BGS_HEAD_DIM / BGS_PER16_PP == 16)
#define BGS_ATTN_LR (BGS_HEAD_DIM / BGS_PER16_PP)
#else
#define BGS_ATTN_LR 0
#endif
// Rows of a group loaded at once by the row-split form (registers against memory latency:
// 4 keeps bf16 at head_dim 64 near 70 registers, 8 needs ~96).
#ifndef BGS_ATTN_CHUNK
#define BGS_ATTN_CHUNK 4
#endif
#define BGS_NORM_THREADS 256
#define BGS_ARGMAX_THREADS 1024

// Programmatic dependent launch (`GpuModelOptions::programmatic_launch`, sm_90 and later):
// with it the host launches each kernel with programmatic stream serialization, so a kernel
// may start while the one before it in the step drains. Every kernel therefore begins with
// BGS_PDL_BEGIN: `griddepcontrol.wait` blocks until the grid it depends on has completed and
// its memory is visible (so nothing is read early; a kernel launched without the attribute
// returns from it at once), then `griddepcontrol.launch_dependents` lets the next kernel be
// scheduled now rather than when this grid ends (BGS_PDL_EARLY=0: at its end). Waiting on the
// previous grid's completion chains every earlier kernel's completion too, since each of
// them waited in turn before doing anything.
#ifndef BGS_PDL_EARLY
#define BGS_PDL_EARLY 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if BGS_PDL_EARLY
#define BGS_PDL_BEGIN()                                                                    \
    do {                                                                                   \
        asm volatile("griddepcontrol.wait;" ::: "memory");                                 \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");                    \
    } while (0)
#else
#define BGS_PDL_BEGIN() asm volatile("griddepcontrol.wait;" ::: "memory")
#endif
#else
#define BGS_PDL_BEGIN() \
    do {                \
    } while (0)
#endif

// BGS_TIME_SKIP (a bit mask, 0 by default; set through BGS_LLM_KERNEL_DEFINES for
// `bgs-llm-gpu bench` only): a kernel whose bit is set waits on the previous grid and returns
// without computing anything, so a step's time with and without one kind of kernel shows what
// that kind costs inside the graph, where programmatic launches overlap each kernel's start
// with the previous one's end (what timing kernels one by one cannot show). The values are
// wrong with any bit set. Bits: 1 attention, 2 the folded QKV (+RoPE, KV write), 4 the folded
// o_proj (+add, norm), 8 the folded down_proj (+add, norm), 16 gate/up (+SiLU), 32 bgs_gemm_tc
// (the LM head in the folded form; every projection in the others), 64 the argmax.
#ifndef BGS_TIME_SKIP
#define BGS_TIME_SKIP 0
#endif
#define BGS_SKIP_IF(bits, pdl)                  \
    do {                                        \
        if (BGS_TIME_SKIP & (bits)) {           \
            if (pdl) BGS_PDL_BEGIN();           \
            return;                             \
        }                                       \
    } while (0)

// The block a kernel's body runs as. A launch of the kernel runs its body as the launched
// block (BGS_LAUNCH_BLK); the persistent kernel (bgs_persistent, below) runs the same bodies as
// the virtual blocks of each op of its table, so both compute the same bits. Bodies read their
// block's index and the grid from here, never from blockIdx / gridDim / blockDim.
struct bgs_blk {
    int x, y;   // the block's index in the op's grid
    int gx, gy; // the op's grid
    int nt;     // the op's threads per block (blockDim.x in a launch)
    int pt;     // threads actually running it: nt, except bgs_argmax in the persistent kernel
    bool pdl;   // a launch (wait on the previous grid where the body says, BGS_PDL_BEGIN)
};
#define BGS_LAUNCH_BLK                                                                     \
    bgs_blk {                                                                              \
        (int)blockIdx.x, (int)blockIdx.y, (int)gridDim.x, (int)gridDim.y, (int)blockDim.x, \
            (int)blockDim.x, true                                                          \
    }
// A barrier of the block's first n threads (a multiple of 32): the bodies that the persistent
// kernel runs with fewer threads than its own (attention) synchronize with it, since the other
// warps are not there. In a launch, n = blockDim.x: the same as __syncthreads.
__device__ __forceinline__ void bgs_bar(int n) {
    asm volatile("bar.sync 1, %0;" ::"r"(n) : "memory");
}

// x[t] = embed[tok[t]] (as f32).
__device__ __forceinline__ void embed_body(const bgs_blk &bk, const unsigned *tok,
                                           const wt *embed, float *x, int hidden) {
    const int t = bk.x;
    const wt *src = embed + (size_t)tok[t] * hidden;
    float *dst = x + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += bk.nt) dst[i] = ld(src[i]);
}
extern "C" __global__ void bgs_embed(const unsigned *tok, const wt *embed, float *x, int hidden) {
    BGS_PDL_BEGIN();
    embed_body(BGS_LAUNCH_BLK, tok, embed, x, hidden);
}

// Sum of `v` over the block's BGS_NORM_THREADS threads in a fixed tree (value i += value
// i + s for s = 128, 64, ..., 1); every thread gets it. The levels down to 32 go through
// shared memory, the last five through warp 0's shuffles (lane i adds lane i + s: the same
// pairs, so the same bits, with 3 barriers instead of 8).
__device__ __forceinline__ float block_sum(float v, float *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = BGS_NORM_THREADS / 2; s >= 32; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        float w = sh[threadIdx.x];
        for (int s = 16; s > 0; s >>= 1) w = w + __shfl_down_sync(0xffffffffu, w, s);
        if (threadIdx.x == 0) sh[0] = w;
    }
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

// The RMS norm's scale from a row's sum of squares, and one normed value in `wt`: shared by
// bgs_add_rmsnorm and the fused form's prologue (the same bits either way).
__device__ __forceinline__ float rms_inv(float sum_sq, int hidden, float eps) {
    const float mean = sum_sq / (float)hidden;
    return 1.0f / sqrtf(mean + eps);
}
__device__ __forceinline__ wt rms_scale(float w, float x, float inv) { return st(w * (x * inv)); }

// Rotate-half RoPE of the pair (x1, x2) at position p, frequency f: bgs_rope_kv's and the
// fused QKV epilogue's arithmetic.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float p, float f, float &r1,
                                            float &r2) {
    const float a = p * f;
    const float c = cosf(a), sn = sinf(a);
    r1 = x1 * c + (-x2) * sn;
    r2 = x2 * c + x1 * sn;
}

// silu(g) * u in `wt`: bgs_silu_mul's and the fused gate/up epilogue's arithmetic.
__device__ __forceinline__ wt silu_times(float g, float u) {
    const float s = g / (1.0f + expf(-g));
    return st(s * u);
}

// x[t] += delta[t] (when delta is not null), then out[t] = w * (x[t] / rms(x[t])), in `wt`.
// One block of BGS_NORM_THREADS threads per token.
__device__ __forceinline__ void add_rmsnorm_body(const bgs_blk &bk, float *x, const float *delta,
                                                 const float *w, wt *out, int hidden,
                                                 float eps) {
    __shared__ float sh[BGS_NORM_THREADS];
    const int t = bk.x;
    float *xr = x + (size_t)t * hidden;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += BGS_NORM_THREADS) {
        float v = xr[i];
        if (delta) {
            v = v + delta[(size_t)t * hidden + i];
            xr[i] = v;
        }
        acc = acc + v * v;
    }
    const float inv = rms_inv(block_sum(acc, sh), hidden, eps);
    wt *o = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += BGS_NORM_THREADS) o[i] = rms_scale(w[i], xr[i], inv);
}
extern "C" __global__ void bgs_add_rmsnorm(float *x, const float *delta, const float *w,
                                           wt *out, int hidden, float eps) {
    BGS_PDL_BEGIN();
    add_rmsnorm_body(BGS_LAUNCH_BLK, x, delta, w, out, hidden, eps);
}

// After the fused QKV GEMM: add the fused bias (when not null), rotate q and k ("rotate
// half", angle = pos * inv_freq[i]), write q back in place (f32) and k, v into the paged cache
// at slot[t] (nothing for a padding token, slot -1). One block per token.
//   qkv: [T][q_dim + 2 * kv_dim] f32, cache: this layer's base, block_stride in elements.
__device__ __forceinline__ void rope_kv_body(const bgs_blk &bk, float *qkv, const float *bias,
                                             const int *pos, const int *slot,
                                             const float *inv_freq, wt *cache, int num_heads,
                                             int num_kv_heads, int head_dim, int block_size,
                                             long long block_stride) {
    const int t = bk.x;
    const int half = head_dim / 2;
    const int qd = num_heads * head_dim, kvd = num_kv_heads * head_dim;
    float *row = qkv + (size_t)t * (qd + 2 * kvd);
    const float p = (float)pos[t];
    const int s = slot[t];
    wt *kc = 0;
    wt *vc = 0;
    if (s >= 0) {
        const long long blk = s / block_size, off = s % block_size;
        kc = cache + blk * block_stride + off * head_dim;
        vc = kc + (long long)num_kv_heads * block_size * head_dim;
    }
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int j = threadIdx.x; j < pairs; j += bk.nt) {
        const int h = j / half, i = j % half;
        // Heads 0..num_heads are q, the rest k (k starts right after q in the row).
        const int base = h * head_dim;
        float x1 = row[base + i], x2 = row[base + i + half];
        if (bias) {
            x1 = x1 + bias[base + i];
            x2 = x2 + bias[base + i + half];
        }
        float r1, r2;
        rope_rotate(x1, x2, p, inv_freq[i], r1, r2);
        if (h < num_heads) {
            row[base + i] = r1;
            row[base + i + half] = r2;
        } else if (kc) {
            const int kh = h - num_heads;
            wt *k = kc + (long long)kh * block_size * head_dim;
            k[i] = st(r1);
            k[i + half] = st(r2);
        }
    }
    if (vc) {
        for (int j = threadIdx.x; j < kvd; j += bk.nt) {
            float v = row[qd + kvd + j];
            if (bias) v = v + bias[qd + kvd + j];
            const int kh = j / head_dim, d = j % head_dim;
            vc[(long long)kh * block_size * head_dim + d] = st(v);
        }
    }
}
extern "C" __global__ void bgs_rope_kv(float *qkv, const float *bias, const int *pos,
                                       const int *slot, const float *inv_freq, wt *cache,
                                       int num_heads, int num_kv_heads, int head_dim,
                                       int block_size, long long block_stride) {
    BGS_PDL_BEGIN();
    rope_kv_body(BGS_LAUNCH_BLK, qkv, bias, pos, slot, inv_freq, cache, num_heads, num_kv_heads,
                 head_dim, block_size, block_stride);
}

// Butterfly sum over the warp: the same fixed tree for every lane, so every lane holds the
// same bits.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Butterfly max over the warp (every lane gets the same value).
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One warp's share of a token's attention, the scalar form (any head_dim): the warp takes the
// groups of 32 positions warp, warp + W, ...; lane j scores position p0 + j (a full dot product
// over the head, in dimension order), then every lane accumulates the group's values for its
// dimensions (l, l + 32, ...) in position order. Leaves the warp's accumulator in acc_out
// (head_dim floats) and its max and sum in m, l (every lane).
__device__ __forceinline__ void attention_scalar(int warps, const float *qs, const wt *cache,
                                                 const int *table,
                                                 int last, long long block_stride,
                                                 long long head_off, long long v_off,
                                                 int head_dim, int block_size, float scale,
                                                 float *acc_out, float &m_out, float &l_out) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[BGS_MAX_HEAD_DIM / 32];
#pragma unroll
    for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) acc[r] = 0.0f;
    float m = BGS_NEG_INF, l = 0.0f;
    for (int p0 = warp * 32; p0 <= last; p0 += 32 * warps) {
        const int p = p0 + lane;
        float sc = BGS_NEG_INF;
        // The cache block of this lane's position: for its key here and, shuffled, for every
        // lane's value read below (one table read per position, not one per value row).
        const int blk = p <= last ? table[p / block_size] : 0;
        if (p <= last) {
            const wt *k = cache + (long long)blk * block_stride + head_off +
                          (long long)(p % block_size) * head_dim;
            sc = dot_row(qs, k, head_dim) * scale;
        }
        const float mn = fmaxf(m, warp_max(sc));
        const float e = p <= last ? expf(sc - mn) : 0.0f;
        const float corr = expf(m - mn);  // exp(-inf) = 0 for the first group
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) acc[r] = acc[r] * corr;
        const int n = min(32, last - p0 + 1);
        for (int j = 0; j < n; j++) {
            const float w = __shfl_sync(0xffffffffu, e, j);
            const int bj = __shfl_sync(0xffffffffu, blk, j);
            const int pj = p0 + j;
            const wt *v = cache + (long long)bj * block_stride + head_off + v_off +
                          (long long)(pj % block_size) * head_dim;
#pragma unroll
            for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) {
                const int d = lane + 32 * r;
                if (d < head_dim) acc[r] = acc[r] + w * ld(v[d]);
            }
        }
        m = mn;
    }
#pragma unroll
    for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) {
        const int d = lane + 32 * r;
        if (d < head_dim) acc_out[d] = acc[r];
    }
    m_out = m;
    l_out = l;
}

// Rows c .. c + BGS_ATTN_CHUNK of the group at p0 in the row-split form (row i: position
// p0 + i * RP + sub), this lane's 16 bytes of each, from `base` (the head's keys or values in
// every cache block); each row's block id is shuffled from the lane that read it. Rows past
// `last` are left as they are (never used).
template <int LR>
__device__ __forceinline__ void load_rows(bgs_u4 *rows, const wt *base, int blk, int p0, int c,
                                          int sub, int part, int last, long long block_stride,
                                          int block_size, int head_dim) {
    constexpr int RP = 32 / LR;
#pragma unroll
    for (int i = c; i < c + BGS_ATTN_CHUNK && i < LR; i++) {
        const int pj = p0 + i * RP + sub;
        const int bj = __shfl_sync(0xffffffffu, blk, i * RP + sub);
        if (pj <= last)
            rows[i - c] = *(const bgs_u4 *)(base + (long long)bj * block_stride +
                                            (long long)(pj % block_size) * head_dim +
                                            part * BGS_PER16);
    }
}

// The same share in the row-split form, for head_dim = LR * BGS_PER16 (LR lanes per cache
// row, 2..16): a warp-wide 16-byte load covers RP = 32 / LR rows, so a group of 32 positions
// is LR independent loads per lane for its keys and LR for its values (the scalar form
// waits on 32 dependent value loads per group: at one token per step its attention was bound
// by that latency, 23 us per layer on the H200 at 128 positions).
//   Scores: in step i, the LR lanes of row sub = lane / LR take position p0 + i * RP + sub;
//   lane part = lane % LR multiplies BGS_PER16 dimensions in order and the row's LR partial
//   sums meet in an xor butterfly (offsets LR/2 .. 1); lane j then takes position p0 + j's
//   score from the row's first lane. Max, weights and sum as in the scalar form.
//   Values: lane (sub, part) accumulates, for its BGS_PER16 dimensions, rows sub, sub + RP,
//   ... of each group in position order; after the last group the RP rows' accumulators meet
//   in an xor butterfly (lane offsets 16 .. LR). Every split and tree depends only on the
//   positions and head_dim, never on the batch.
template <int LR>
__device__ __forceinline__ void attention_rows(int warps, const float *qs, const wt *cache,
                                               const int *table,
                                               int last, long long block_stride,
                                               long long head_off, long long v_off,
                                               int head_dim, int block_size, float scale,
                                               float *acc_out, float &m_out, float &l_out) {
    constexpr int RP = 32 / LR;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int sub = lane / LR, part = lane % LR;
    float q[BGS_PER16], acc[BGS_PER16];
#pragma unroll
    for (int k = 0; k < BGS_PER16; k++) {
        q[k] = qs[part * BGS_PER16 + k];
        acc[k] = 0.0f;
    }
    float m = BGS_NEG_INF, l = 0.0f;
    for (int p0 = warp * 32; p0 <= last; p0 += 32 * warps) {
        const int p = p0 + lane;
        const int blk = p <= last ? table[p / block_size] : 0;
        // The group's rows in chunks of BGS_ATTN_CHUNK: each chunk's loads first (independent:
        // one memory latency per chunk; a whole group at once needs ~100 registers a thread).
        bgs_u4 rows[BGS_ATTN_CHUNK];
        float sc = BGS_NEG_INF;
#pragma unroll
        for (int c = 0; c < LR; c += BGS_ATTN_CHUNK) {
            load_rows<LR>(rows, cache + head_off, blk, p0, c, sub, part, last, block_stride,
                          block_size, head_dim);
#pragma unroll
            for (int i = c; i < c + BGS_ATTN_CHUNK && i < LR; i++) {
                float dot = 0.0f;
                if (p0 + i * RP + sub <= last) {
                    float e[BGS_PER16];
                    unpack16(rows[i - c], e);
#pragma unroll
                    for (int k = 0; k < BGS_PER16; k++) dot = dot + q[k] * e[k];
                }
#pragma unroll
                for (int o = LR / 2; o > 0; o >>= 1)
                    dot = dot + __shfl_xor_sync(0xffffffffu, dot, o);
                const float s = __shfl_sync(0xffffffffu, dot, (lane % RP) * LR);
                if (lane / RP == i && p <= last) sc = s * scale;
            }
        }
        const float mn = fmaxf(m, warp_max(sc));
        const float e = p <= last ? expf(sc - mn) : 0.0f;
        const float corr = expf(m - mn);  // exp(-inf) = 0 for the first group
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int k = 0; k < BGS_PER16; k++) acc[k] = acc[k] * corr;
#pragma unroll
        for (int c = 0; c < LR; c += BGS_ATTN_CHUNK) {
            load_rows<LR>(rows, cache + head_off + v_off, blk, p0, c, sub, part, last,
                          block_stride, block_size, head_dim);
#pragma unroll
            for (int i = c; i < c + BGS_ATTN_CHUNK && i < LR; i++) {
                const float w = __shfl_sync(0xffffffffu, e, i * RP + sub);
                if (p0 + i * RP + sub <= last) {
                    float v[BGS_PER16];
                    unpack16(rows[i - c], v);
#pragma unroll
                    for (int k = 0; k < BGS_PER16; k++) acc[k] = acc[k] + w * v[k];
                }
            }
        }
        m = mn;
    }
#pragma unroll
    for (int o = 16; o >= LR; o >>= 1) {
#pragma unroll
        for (int k = 0; k < BGS_PER16; k++) acc[k] = acc[k] + __shfl_xor_sync(0xffffffffu, acc[k], o);
    }
    if (sub == 0) {
#pragma unroll
        for (int k = 0; k < BGS_PER16; k++) acc_out[part * BGS_PER16 + k] = acc[k];
    }
    m_out = m;
    l_out = l;
}

// Paged attention for decode and ragged prefill: one block of W warps (blockDim / 32, at most
// BGS_ATTN_MAX_WARPS) per (query head, token). The token attends to positions 0..=pos[t] of
// its own sequence through that sequence's block table (grouped-query: kv head = head /
// group), with an online softmax in f32 over groups of 32 positions, group g going to warp
// g % W (attention_rows when head_dim is 2..16 whole 16-byte vectors and the cache is
// 16-byte aligned, else attention_scalar: the choice depends only on the model). With W > 1
// the warps' states are combined in warp order at the end (W = 1 writes its own state). The
// split depends only on the positions and W, so a token's result is the same whatever else
// is in the batch; W only sets how many warps wait on memory at once.
// out: [T][num_heads * head_dim] in `wt`.
__device__ __forceinline__ void attention_body(const bgs_blk &bk, const float *qkv,
                                               const wt *cache, const int *pos, const int *seq,
                                               const int *bt_off, const int *bt, wt *out,
                                               int num_heads, int num_kv_heads, int head_dim,
                                               int block_size, long long block_stride,
                                               float scale) {
    __shared__ float qs[BGS_MAX_HEAD_DIM];
    __shared__ float part_acc[BGS_ATTN_MAX_WARPS][BGS_MAX_HEAD_DIM];
    __shared__ float part_m[BGS_ATTN_MAX_WARPS], part_l[BGS_ATTN_MAX_WARPS];
    const int head = bk.x, t = bk.y;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = bk.nt / 32;
    const int qd = num_heads * head_dim, kvd = num_kv_heads * head_dim;
    const int kvh = head / (num_heads / num_kv_heads);
    const float *q = qkv + (size_t)t * (qd + 2 * kvd) + head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += bk.nt) qs[d] = q[d];
    bgs_bar(bk.nt);
    const int *table = bt + bt_off[seq[t]];
    const int last = pos[t];
    const long long head_off = (long long)kvh * block_size * head_dim;
    const long long v_off = (long long)num_kv_heads * block_size * head_dim;
    float m, l;
    float *acc = part_acc[warp];
#if BGS_ATTN_LR > 0
    // The row-split form for the head size this cubin was built for (a 16-byte aligned cache,
    // as every device allocation is); anything else takes the scalar form.
    if (head_dim == BGS_HEAD_DIM && ((unsigned long long)cache & 15ull) == 0)
        attention_rows<BGS_ATTN_LR>(warps, qs, cache, table, last, block_stride, head_off, v_off,
                                    head_dim, block_size, scale, acc, m, l);
    else
#endif
        attention_scalar(warps, qs, cache, table, last, block_stride, head_off, v_off, head_dim,
                         block_size, scale, acc, m, l);
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
    bgs_bar(bk.nt);
    if (warp != 0) return;
    wt *o = out + (size_t)t * qd + head * head_dim;
    if (warps == 1) {
        for (int d = lane; d < head_dim; d += 32) o[d] = st(part_acc[0][d] / l);
        return;
    }
    // Several warps: combine their (max, sum, accumulator) states in warp order.
    float mm = BGS_NEG_INF;
    for (int w = 0; w < warps; w++) mm = fmaxf(mm, part_m[w]);
    float ll = 0.0f, oo[BGS_MAX_HEAD_DIM / 32];
#pragma unroll
    for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) oo[r] = 0.0f;
    for (int w = 0; w < warps; w++) {
        // A warp without positions (m = -inf) weighs nothing.
        const float f = part_m[w] == BGS_NEG_INF ? 0.0f : expf(part_m[w] - mm);
        ll = ll + part_l[w] * f;
#pragma unroll
        for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) {
            const int d = lane + 32 * r;
            if (d < head_dim) oo[r] = oo[r] + part_acc[w][d] * f;
        }
    }
#pragma unroll
    for (int r = 0; r < BGS_MAX_HEAD_DIM / 32; r++) {
        const int d = lane + 32 * r;
        if (d < head_dim) o[d] = st(oo[r] / ll);
    }
}
extern "C" __global__ void bgs_attention(const float *qkv, const wt *cache, const int *pos,
                                         const int *seq, const int *bt_off, const int *bt,
                                         wt *out, int num_heads, int num_kv_heads,
                                         int head_dim, int block_size, long long block_stride,
                                         float scale) {
    BGS_PDL_BEGIN();
    attention_body(BGS_LAUNCH_BLK, qkv, cache, pos, seq, bt_off, bt, out, num_heads,
                   num_kv_heads, head_dim, block_size, block_stride, scale);
}

// ---- Attention on tensor cores: one block per (kv head, token) ----
//
// bgs_attention_mma (bf16/f16 models with head_dim 16, 32 or 64, sm_80+: built with
// -DBGS_ATTN_MMA=1 where the host's `attention_mma_built` says so, launched where
// `plan::mma_attention_shared` allows) computes, for the `group` query heads
// (<= 16) that share kv head blockIdx.x, what bgs_attention computes per head: the same warps
// (W = blockDim / 32), the same groups of 32 positions (group g to warp g % W), the same online
// softmax in f32 per group and the same combine of the warps' states in warp order, so a
// token's result still depends only on its own positions and W. What changes is how a group
// is reduced: the group's 32 key and value rows are staged once in shared memory
// (cp.async), and the products run as m16n8k16 MMAs with the group's query heads as the 16
// rows, positions (scores) and dimensions (values) as the columns. Per-head blocks loaded
// every row once per query head and spent ~300 dependent instructions per head per group
// (shuffle trees); here a group costs 16-32 MMAs and a few shuffles for all heads together.
// Precision: tensor cores multiply wt values, so q and the softmax weights (f32) are each
// split into hi + lo in wt (lo = the rounding error of hi) and both halves are multiplied:
// the products are those of f32 q and weights to ~2^-16, summed in f32 (the order inside an
// MMA is the hardware's). K and V are wt already.
// Shared memory (dynamic, 128 * head_dim bytes per warp): while the groups run, each warp's K
// then V tile, 32 rows of head_dim wt each, 16-byte chunks swizzled (chunk c of row r at
// c ^ (r % 8), so ldmatrix's 8 rows hit 8 bank groups); afterwards, per warp, its 16 rows'
// f32 accumulators ([16][head_dim]) and running max and sum ([16][2]) for the combine.
// `-DBGS_ATTN_MMA=1` comes from the host (`attention_mma_built`), which alone decides where
// the kernel applies; the checks below only refuse a definition the code cannot honour.
#ifndef BGS_ATTN_MMA
#define BGS_ATTN_MMA 0
#endif
// Prefetch a token's K/V rows into L2 before waiting on the previous kernel (1, the default;
// 0 through BGS_LLM_KERNEL_DEFINES for a comparison). The same bits either way.
#ifndef BGS_ATTN_PREFETCH_L2
#define BGS_ATTN_PREFETCH_L2 1
#endif
// Steps of at most this many tokens copy each warp's first group of earlier steps' K/V rows
// into shared memory before waiting on the previous kernel (the scan for the rows a step
// writes reads this many positions a warp); larger ones copy every row after the wait, as
// does 0. The same bits either way (checked on the H200). 256 by default: on the H200,
// 2026-12-04, the Qwen2.5-0.5B shape's invariant decode step went from 0.9288 to 0.9092 ms at
// batch 1 and 1.254 to 1.228 at 16, SmolLM2-135M's from 0.735 to 0.721 at 1
// (bench/results/20261204-gpu-attention-prestage); 0 through BGS_LLM_KERNEL_DEFINES turns it
// off.
#ifndef BGS_ATTN_FRESH_SCAN
#define BGS_ATTN_FRESH_SCAN 256
#endif
#if BGS_ATTN_MMA && (BGS_DT == 0 || BGS_HEAD_DIM <= 0 || BGS_HEAD_DIM % 16 != 0 || \
                     BGS_HEAD_DIM > 64 || 32 % (BGS_HEAD_DIM / 8) != 0)
#error "BGS_ATTN_MMA needs 16-bit values and a head size of 16, 32 or 64"
#endif
#if BGS_ATTN_MMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "BGS_ATTN_MMA needs sm_80 or later (cp.async, ldmatrix, bf16 MMA)"
#endif

// One m16n8k16 MMA of 16-bit values (the tensor-core attention and GEMM). Compiled for the
// 16-bit types only; the host launches its callers on sm_80+ alone.
#if BGS_DT != 0 && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#define BGS_HAVE_MMA 1
// c += a (16x16, row) * b (16x8, col), f32 accumulators.
__device__ __forceinline__ void mma_16816(float *c, const unsigned *a, unsigned b0, unsigned b1) {
#if BGS_DT == 2
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// Shared-memory addresses and asynchronous copies (the tensor-core attention's K/V tiles, the
// staged small GEMM tiles' weights).
__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// 16 bytes global -> shared without registers; `bytes` 0 writes zeros (reads nothing).
__device__ __forceinline__ void cp_async16(unsigned dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most `pending` (0..3) of this thread's committed copy groups are in flight.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
    if (pending >= 3)
        asm volatile("cp.async.wait_group 3;" ::: "memory");
    else if (pending == 2)
        asm volatile("cp.async.wait_group 2;" ::: "memory");
    else if (pending == 1)
        asm volatile("cp.async.wait_group 1;" ::: "memory");
    else
        asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#else
#define BGS_HAVE_MMA 0
#endif

#if BGS_ATTN_MMA
#define MMA_HD BGS_HEAD_DIM
#define MMA_KS (MMA_HD / 16)  // k-steps of Q K^T
#define MMA_DT (MMA_HD / 8)   // 8-dimension tiles of P V
#define MMA_LR (MMA_HD / 8)   // 16-byte chunks a row
#define MMA_RP (32 / MMA_LR)  // rows a warp-wide staging step covers
#define MMA_SWZ(r, c) ((c) ^ ((r) & ((MMA_LR < 8 ? MMA_LR : 8) - 1)))

__device__ __forceinline__ unsigned pack_wt2(wt lo, wt hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}
// (x0, x1) as hi + lo pairs of wt: hi rounded to nearest, lo the rounded remainder.
__device__ __forceinline__ void split_wt2(float x0, float x1, unsigned &hi, unsigned &lo) {
    const wt h0 = st(x0), h1 = st(x1);
    hi = pack_wt2(h0, h1);
    lo = pack_wt2(st(x0 - ld(h0)), st(x1 - ld(h1)));
}
// Two 8x8 b16 matrices (lanes 0-7 and 8-15 give their rows' addresses).
__device__ __forceinline__ void ldsm_x2(unsigned addr, unsigned &r0, unsigned &r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x2_trans(unsigned addr, unsigned &r0, unsigned &r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr)
                 : "memory");
}
#endif

__device__ __forceinline__ void attention_mma_body(const bgs_blk &bk, const float *qkv,
                                                   const wt *cache, const int *pos,
                                                   const int *seq, const int *bt_off,
                                                   const int *bt, wt *out, int num_heads,
                                                   int num_kv_heads, int head_dim,
                                                   int block_size, long long block_stride,
                                                   float scale) {
#if BGS_ATTN_MMA
    extern __shared__ __align__(16) unsigned char attn_smem[];
    BGS_SKIP_IF(1, bk.pdl);
    const int kvh = bk.x, t = bk.y;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = bk.nt / 32;
    const int group = num_heads / num_kv_heads;
    const int qd = num_heads * MMA_HD, kvd = num_kv_heads * MMA_HD;
    // Fragment coordinates: rows g and g + 8 (query heads), columns 2 * tq, 2 * tq + 1.
    const int g = lane / 4, tq = lane % 4;
    wt *ktile = (wt *)attn_smem + warp * 64 * MMA_HD;
    wt *vtile = ktile + 32 * MMA_HD;
    // The step inputs (positions, block tables) are written before the step starts and never
    // during it, so they are read before waiting on the previous kernel (a launch with
    // programmatic dependent launch): the chain seq -> table offset -> block id is off the
    // path that follows the wait. Each group's block ids are loaded a group ahead.
    const int *table = bt + bt_off[seq[t]];
    const int last = pos[t];
    int blk = warp * 32 + lane <= last ? table[(warp * 32 + lane) / block_size] : 0;
    const long long head_off = (long long)kvh * block_size * MMA_HD;
    const long long v_off = (long long)num_kv_heads * block_size * MMA_HD;
    // Copies rows p0 .. p0 + 31 of K and V into the warp's tiles (lane l holds row p0 + l's
    // block id in `gb`): rows in [lo, hi) are copied, rows past `last` are zeros when
    // `zero_tail` (weights 0 must not meet NaN), the rest are left as they are.
    auto stage = [&](int p0, int gb, int lo, int hi, bool zero_tail) {
#pragma unroll
        for (int i = 0; i < MMA_LR; i++) {
            const int r = i * MMA_RP + lane / MMA_LR, c = lane % MMA_LR;
            const int pr = p0 + r;
            const int br = __shfl_sync(0xffffffffu, gb, r);
            const bool copy = pr >= lo && pr < hi && pr <= last;
            if (!copy && !(zero_tail && pr > last)) continue;
            const int bytes = copy ? 16 : 0;
            const wt *src = copy ? cache + (long long)br * block_stride + head_off +
                                       (long long)(pr % block_size) * MMA_HD + c * 8
                                 : cache;
            const int at = r * MMA_HD + MMA_SWZ(r, c) * 8;
            cp_async16(smem_u32(ktile + at), src, bytes);
            cp_async16(smem_u32(vtile + at), copy ? src + v_off : cache, bytes);
        }
    };
    // The rows this step writes into the token's sequence (its own position, and in a ragged
    // prefill those of its sequence's other tokens in the step) start at `fresh`: the lowest
    // position of a token of the same item in the step (a padding token counts as item 0 at
    // position 0, which only makes item 0 wait for everything). Rows below it were written by
    // earlier steps, so the warp's first group copies them into its tiles before the wait;
    // the rows from `fresh` on are copied after it. Which rows are copied when changes no
    // value. In the persistent kernel (no programmatic launch) the previous op has ended at the
    // grid barrier, so every row is old; past BGS_ATTN_FRESH_SCAN tokens the scan is skipped
    // and every row is copied after the wait.
    int fresh = last + 1;
    if (bk.pdl) {
        if (bk.gy <= BGS_ATTN_FRESH_SCAN) {
            const int item = seq[t];
            for (int u = lane; u < bk.gy; u += 32)
                if (seq[u] == item) fresh = min(fresh, pos[u]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                fresh = min(fresh, __shfl_xor_sync(0xffffffffu, fresh, off));
        } else {
            fresh = 0;
        }
    }
    const int first = warp * 32;  // the warp's first group (none when first > last)
    if (first <= last) stage(first, blk, 0, fresh, true);
#if BGS_ATTN_PREFETCH_L2
    // Every other K and V row this warp will stage, fetched into L2 before the wait: rows of
    // earlier steps are there already, and a row the previous kernel writes (this step's own
    // position) is written through L2, which every multiprocessor sees alike, so a prefetch
    // can make a copy arrive sooner but never older. Lane l takes row l of each group.
    for (int p = first + lane; p <= last; p += 32 * warps) {
        if (p < first + 32 && p < fresh) continue;  // in the tiles already
        const int br = p < first + 32 ? blk : table[p / block_size];
        const wt *src = cache + (long long)br * block_stride + head_off +
                        (long long)(p % block_size) * MMA_HD;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(src));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(src + v_off));
    }
#endif
    if (bk.pdl) BGS_PDL_BEGIN();
    // The first group's rows that this step writes, now that the previous kernel has.
    if (first <= last && fresh <= min(last, first + 31)) stage(first, blk, fresh, last + 1, false);

    // The group's queries as A fragments (16 x 16 per k-step; heads past the group are 0).
    unsigned qhi[MMA_KS][4], qlo[MMA_KS][4];
    const float *qb = qkv + (size_t)t * (qd + 2 * kvd) + (size_t)kvh * group * MMA_HD;
#pragma unroll
    for (int ks = 0; ks < MMA_KS; ks++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = g + 8 * (r & 1), col = ks * 16 + 2 * tq + 8 * (r >> 1);
            const float x0 = row < group ? qb[row * MMA_HD + col] : 0.0f;
            const float x1 = row < group ? qb[row * MMA_HD + col + 1] : 0.0f;
            split_wt2(x0, x1, qhi[ks][r], qlo[ks][r]);
        }
    }
    float o[MMA_DT][4];
#pragma unroll
    for (int d = 0; d < MMA_DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m0 = BGS_NEG_INF, m1 = BGS_NEG_INF, l0 = 0.0f, l1 = 0.0f;  // rows g, g + 8
    for (int p0 = first; p0 <= last; p0 += 32 * warps) {
        // The first group is in the tiles (or on its way); each later one is staged here.
        if (p0 != first) stage(p0, blk, 0, last + 1, true);
        const int pn = p0 + 32 * warps + lane;
        const int next_blk = pn <= last ? table[pn / block_size] : 0;
        cp_async_wait_all();
        __syncwarp();
        // Scores S = Q K^T: 4 tiles of 8 positions.
        float s[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < MMA_KS; ks++) {
                const int r = nt * 8 + (lane & 7), c = 2 * ks + ((lane >> 3) & 1);
                unsigned b0, b1;
                ldsm_x2(smem_u32(ktile + r * MMA_HD + MMA_SWZ(r, c) * 8), b0, b1);
                mma_16816(s[nt], qhi[ks], b0, b1);
                mma_16816(s[nt], qlo[ks], b0, b1);
            }
        }
        // Online softmax over the group, rows g (s[.][0..1]) and g + 8 (s[.][2..3]); a row's
        // 32 scores sit in the 4 lanes of its quad.
        float x0 = BGS_NEG_INF, x1 = BGS_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const bool ok = p0 + nt * 8 + 2 * tq + j <= last;
                s[nt][j] = ok ? s[nt][j] * scale : BGS_NEG_INF;
                s[nt][2 + j] = ok ? s[nt][2 + j] * scale : BGS_NEG_INF;
                x0 = fmaxf(x0, s[nt][j]);
                x1 = fmaxf(x1, s[nt][2 + j]);
            }
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
        }
        const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);  // finite: position p0 <= last
        const float c0 = expf(m0 - n0), c1 = expf(m1 - n1);  // 0 on the first group
        float e0 = 0.0f, e1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                s[nt][j] = expf(s[nt][j] - n0);  // exp(-inf) = 0 past `last`
                s[nt][2 + j] = expf(s[nt][2 + j] - n1);
                e0 = e0 + s[nt][j];
                e1 = e1 + s[nt][2 + j];
            }
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            e0 = e0 + __shfl_xor_sync(0xffffffffu, e0, off);
            e1 = e1 + __shfl_xor_sync(0xffffffffu, e1, off);
        }
        l0 = l0 * c0 + e0;
        l1 = l1 * c1 + e1;
        m0 = n0;
        m1 = n1;
#pragma unroll
        for (int d = 0; d < MMA_DT; d++) {
            o[d][0] = o[d][0] * c0;
            o[d][1] = o[d][1] * c0;
            o[d][2] = o[d][2] * c1;
            o[d][3] = o[d][3] * c1;
        }
        // O += P V: the weights' C fragments are the A fragments of 2 k-steps of 16
        // positions; V's B fragments come transposed from the tile.
#pragma unroll
        for (int k2 = 0; k2 < 2; k2++) {
            unsigned ph[4], pl[4];
            split_wt2(s[2 * k2][0], s[2 * k2][1], ph[0], pl[0]);
            split_wt2(s[2 * k2][2], s[2 * k2][3], ph[1], pl[1]);
            split_wt2(s[2 * k2 + 1][0], s[2 * k2 + 1][1], ph[2], pl[2]);
            split_wt2(s[2 * k2 + 1][2], s[2 * k2 + 1][3], ph[3], pl[3]);
            const int r = 16 * k2 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
            for (int d = 0; d < MMA_DT; d++) {
                unsigned b0, b1;
                ldsm_x2_trans(smem_u32(vtile + r * MMA_HD + MMA_SWZ(r, d) * 8), b0, b1);
                mma_16816(o[d], ph, b0, b1);
                mma_16816(o[d], pl, b0, b1);
            }
        }
        __syncwarp();  // every lane's ldmatrix is done before the next group's copies land
        blk = next_blk;
    }
    bgs_bar(bk.nt);  // the tiles' space becomes the combine's
    float *pacc = (float *)attn_smem + warp * 16 * (MMA_HD + 2);
    float *pml = pacc + 16 * MMA_HD;
#pragma unroll
    for (int d = 0; d < MMA_DT; d++) {
        pacc[g * MMA_HD + d * 8 + 2 * tq] = o[d][0];
        pacc[g * MMA_HD + d * 8 + 2 * tq + 1] = o[d][1];
        pacc[(g + 8) * MMA_HD + d * 8 + 2 * tq] = o[d][2];
        pacc[(g + 8) * MMA_HD + d * 8 + 2 * tq + 1] = o[d][3];
    }
    if (tq == 0) {
        pml[2 * g] = m0;
        pml[2 * g + 1] = l0;
        pml[2 * (g + 8)] = m1;
        pml[2 * (g + 8) + 1] = l1;
    }
    bgs_bar(bk.nt);
    // Each output value: the warps' states combined in warp order (as bgs_attention does).
    for (int i = threadIdx.x; i < group * MMA_HD; i += bk.nt) {
        const int h = i / MMA_HD, d = i % MMA_HD;
        float mm = BGS_NEG_INF;
        for (int w = 0; w < warps; w++)
            mm = fmaxf(mm, ((float *)attn_smem)[w * 16 * (MMA_HD + 2) + 16 * MMA_HD + 2 * h]);
        float ll = 0.0f, oo = 0.0f;
        for (int w = 0; w < warps; w++) {
            const float *wb = (float *)attn_smem + w * 16 * (MMA_HD + 2);
            const float mw = wb[16 * MMA_HD + 2 * h];
            // A warp without positions (m = -inf) weighs nothing.
            const float f = mw == BGS_NEG_INF ? 0.0f : expf(mw - mm);
            ll = ll + wb[16 * MMA_HD + 2 * h + 1] * f;
            oo = oo + wb[h * MMA_HD + d] * f;
        }
        out[(size_t)t * qd + (size_t)(kvh * group + h) * MMA_HD + d] = st(oo / ll);
    }
#else
    // Not built for this dtype, head size or device: the host never launches it here.
    __trap();
#endif
}
extern "C" __global__ void bgs_attention_mma(const float *qkv, const wt *cache, const int *pos,
                                             const int *seq, const int *bt_off, const int *bt,
                                             wt *out, int num_heads, int num_kv_heads,
                                             int head_dim, int block_size,
                                             long long block_stride, float scale) {
    // (BGS_PDL_BEGIN in the body, after the step inputs' loads.)
    attention_mma_body(BGS_LAUNCH_BLK, qkv, cache, pos, seq, bt_off, bt, out, num_heads,
                       num_kv_heads, head_dim, block_size, block_stride, scale);
}

// ---- Projections of the fused form (small buckets; every bucket with the invariant option) --
//
// y[t][r] = sum_k x[t][k] * w[r][k] over the row's 16-byte chunks: lane l takes chunks l,
// l + 32, ... in order (each chunk's BGS_PER16 products in memory order), then the warp's
// butterfly. A result depends only on its own row and token, never on how many tokens share
// the launch, so every bucket gives a token the same bits (`batch_invariant_gemm`). One warp
// per unit (a row, or the two rows an epilogue pairs), the block's BGS_PROJ_WARPS warps taking
// units blockIdx.x * 8 + warp, then + gridDim.x * 8, ...; blockIdx.y = a group of
// BGS_PROJ_TOKENS tokens, so the weights are read once per group. Rows must be whole 16-byte
// chunks (the host only picks this form when every width is).
// The fused form's kernels put the layer's other steps into the projections around them:
//   bgs_proj_norm_rope_kv  RMSNorm of the residual (prologue) -> QKV -> bias, RoPE, q in
//                          place, k/v into the paged cache (bgs_rope_kv's epilogue)
//   bgs_proj_add           attention output -> o_proj -> residual += (and act -> down_proj)
//   bgs_proj_norm_silu     RMSNorm (prologue) -> gate/up -> silu(g) * u (bgs_silu_mul's)
// so a layer is 5 launches instead of 9, and the norm, RoPE and SiLU arithmetic is the
// unfused kernels' operation for operation.
#define BGS_PROJ_TOKENS 8
#define BGS_PROJ_WARPS 8  // 256 threads = BGS_NORM_THREADS: the prologue is bgs_add_rmsnorm's

// acc[r][t] += the unit's R rows (wr[r]) · token t's row of x (row stride `in`), t < nt, over
// this lane's chunks; U chunks' weight loads are issued before their arithmetic.
template <int R, int U>
__device__ __forceinline__ void proj_dot(const wt *const *wr, const wt *x, int in, int nt,
                                         float (&acc)[R][BGS_PROJ_TOKENS]) {
    const int lane = threadIdx.x % 32;
    const int chunks = in / BGS_PER16;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        bgs_u4 wv[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < chunks) {
#pragma unroll
                for (int r = 0; r < R; r++) wv[r][u] = ((const bgs_u4 *)wr[r])[c0 + 32 * u];
            }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
            float we[R][BGS_PER16];
#pragma unroll
            for (int r = 0; r < R; r++) unpack16(wv[r][u], we[r]);
#pragma unroll
            for (int t = 0; t < BGS_PROJ_TOKENS; t++) {
                if (t >= nt) break;
                float xe[BGS_PER16];
                unpack16(((const bgs_u4 *)(x + (size_t)t * in))[c], xe);
#pragma unroll
                for (int r = 0; r < R; r++) {
#pragma unroll
                    for (int k = 0; k < BGS_PER16; k++) acc[r][t] = acc[r][t] + we[r][k] * xe[k];
                }
            }
        }
    }
}

// Every lane gets acc's warp sums; lane t < BGS_PROJ_TOKENS keeps token t's in `mine`
// (select, not a dynamic index: the arrays stay in registers).
template <int R>
__device__ __forceinline__ void proj_reduce(float (&acc)[R][BGS_PROJ_TOKENS], float (&mine)[R],
                                            int nt) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < R; r++) mine[r] = 0.0f;
#pragma unroll
    for (int t = 0; t < BGS_PROJ_TOKENS; t++) {
        if (t >= nt) break;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float s = warp_sum(acc[r][t]);
            if (lane == t) mine[r] = s;
        }
    }
}

// The prologue of the norm kernels: xs[t][i] = w[i] * (x[t][i] / rms(x[t])) in `wt` for the
// block's nt tokens (row stride `in`), bgs_add_rmsnorm's arithmetic (per-thread strided sums,
// then its tree, every token's tree side by side).
__device__ __forceinline__ void proj_norm_prologue(const float *x, const float *nw, float eps,
                                                   wt *xs, int in, int nt) {
    __shared__ float sh[BGS_PROJ_TOKENS][BGS_NORM_THREADS];
    const int tid = threadIdx.x;
#pragma unroll
    for (int t = 0; t < BGS_PROJ_TOKENS; t++) {
        float acc = 0.0f;
        if (t < nt)
            for (int i = tid; i < in; i += BGS_NORM_THREADS) {
                const float v = x[(size_t)t * in + i];
                acc = acc + v * v;
            }
        sh[t][tid] = acc;
    }
    __syncthreads();
    for (int s = BGS_NORM_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
#pragma unroll
            for (int t = 0; t < BGS_PROJ_TOKENS; t++) sh[t][tid] += sh[t][tid + s];
        }
        __syncthreads();
    }
    for (int t = 0; t < nt; t++) {
        const float inv = rms_inv(sh[t][0], in, eps);
        for (int i = tid; i < in; i += BGS_NORM_THREADS)
            xs[(size_t)t * in + i] = rms_scale(nw[i], x[(size_t)t * in + i], inv);
    }
    __syncthreads();
}

// y[t][r] = w[r] · x[t] (ADD: y[t][r] += it) for the block's token group: the fused form's
// plain projection and its residual-add variant.
template <bool ADD>
__device__ __forceinline__ void proj_rows(const bgs_blk &bk, const wt *w, const wt *x, float *y,
                                          int out, int in, int n) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int t0 = bk.y * BGS_PROJ_TOKENS, nt = min(BGS_PROJ_TOKENS, n - t0);
    for (int u = bk.x * BGS_PROJ_WARPS + warp; u < out; u += bk.gx * BGS_PROJ_WARPS) {
        float acc[1][BGS_PROJ_TOKENS] = {};
        const wt *wr[1] = {w + (size_t)u * in};
        proj_dot<1, 4>(wr, x + (size_t)t0 * in, in, nt, acc);
        float mine[1];
        proj_reduce<1>(acc, mine, nt);
        if (lane < nt) {
            float *o = y + (size_t)(t0 + lane) * out + u;
            *o = ADD ? *o + mine[0] : mine[0];
        }
    }
}

// y[t][r] = w[r] · x[t] (f32 out): a projection without a fused step (the LM head with the
// invariant option).
extern "C" __global__ void bgs_proj(const wt *w, const wt *x, float *y, int out, int in, int n) {
    BGS_PDL_BEGIN();
    proj_rows<false>(BGS_LAUNCH_BLK, w, x, y, out, in, n);
}

// res[t][r] += w[r] · x[t]: o_proj and down_proj with the residual add (one writer per
// element, the add bgs_add_rmsnorm does).
extern "C" __global__ void bgs_proj_add(const wt *w, const wt *x, float *res, int out, int in,
                                        int n) {
    BGS_PDL_BEGIN();
    proj_rows<true>(BGS_LAUNCH_BLK, w, x, res, out, in, n);
}

// act[t][i] = silu(g) * u with g = w[i] · xn[t], u = w[inter + i] · xn[t], xn = the
// post-attention norm of the residual (prologue; dynamic shared memory: BGS_PROJ_TOKENS *
// in elements of `wt`).
__device__ __forceinline__ void proj_norm_silu_body(const bgs_blk &bk, const wt *w,
                                                    const float *res, const float *nw,
                                                    float eps, wt *act, int inter, int in,
                                                    int n) {
    extern __shared__ __attribute__((aligned(16))) unsigned char proj_smem[];
    wt *xs = (wt *)proj_smem;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int t0 = bk.y * BGS_PROJ_TOKENS, nt = min(BGS_PROJ_TOKENS, n - t0);
    proj_norm_prologue(res + (size_t)t0 * in, nw, eps, xs, in, nt);
    for (int u = bk.x * BGS_PROJ_WARPS + warp; u < inter; u += bk.gx * BGS_PROJ_WARPS) {
        float acc[2][BGS_PROJ_TOKENS] = {};
        const wt *wr[2] = {w + (size_t)u * in, w + (size_t)(inter + u) * in};
        proj_dot<2, 4>(wr, xs, in, nt, acc);
        float mine[2];
        proj_reduce<2>(acc, mine, nt);
        if (lane < nt) act[(size_t)(t0 + lane) * inter + u] = silu_times(mine[0], mine[1]);
    }
}
extern "C" __global__ void bgs_proj_norm_silu(const wt *w, const float *res, const float *nw,
                                              float eps, wt *act, int inter, int in, int n) {
    BGS_PDL_BEGIN();
    proj_norm_silu_body(BGS_LAUNCH_BLK, w, res, nw, eps, act, inter, in, n);
}

// The QKV epilogue of one rotate-half pair: x1 and x2 are the projection's values of rows
// base + i and base + i + half of head h (q heads, then k, then v, in the fused weight's row
// order) for token t. bgs_rope_kv's arithmetic: + bias, q and k rotated at pos[t], q into
// qkv ([T][q + 2 kv] f32, where attention reads it), k and v into the paged cache at slot[t]
// (nothing for -1).
__device__ __forceinline__ void qkv_pair_store(int h, int i, int t, float x1, float x2,
                                               float *qkv, const float *bias, const int *pos,
                                               const int *slot, const float *inv_freq,
                                               wt *cache, int num_heads, int num_kv_heads,
                                               int head_dim, int block_size,
                                               long long block_stride) {
    const int half = head_dim / 2, base = h * head_dim;
    const int qd = num_heads * head_dim, kvd = num_kv_heads * head_dim;
    if (bias) {
        x1 = x1 + bias[base + i];
        x2 = x2 + bias[base + i + half];
    }
    const int s = slot[t];
    wt *kc = 0;
    if (s >= 0) {
        const long long blk = s / block_size, off = s % block_size;
        kc = cache + blk * block_stride + off * head_dim;
    }
    if (h < num_heads + num_kv_heads) {
        float r1, r2;
        rope_rotate(x1, x2, (float)pos[t], inv_freq[i], r1, r2);
        if (h < num_heads) {
            float *row = qkv + (size_t)t * (qd + 2 * kvd);
            row[base + i] = r1;
            row[base + i + half] = r2;
        } else if (kc) {
            wt *k = kc + (long long)(h - num_heads) * block_size * head_dim;
            k[i] = st(r1);
            k[i + half] = st(r2);
        }
    } else if (kc) {
        wt *v = kc + (long long)num_kv_heads * block_size * head_dim +
                (long long)(h - num_heads - num_kv_heads) * block_size * head_dim;
        v[i] = st(x1);
        v[i + half] = st(x2);
    }
}

// The fused QKV step: xn = the input norm of the residual (prologue), then for unit j (head h =
// j / half, i = j % half of the q, k and v heads in the fused weight's row order) rows base + i
// and base + i + half, and bgs_rope_kv's epilogue: + bias, q and k rotated at pos[t], q into
// qkv ([T][q + 2 kv] f32, where attention reads it), k and v into the paged cache at slot[t]
// (nothing for -1).
__device__ __forceinline__ void proj_norm_rope_kv_body(
    const bgs_blk &bk, const wt *w, const float *res, const float *nw, float eps, float *qkv,
    const float *bias, const int *pos, const int *slot, const float *inv_freq, wt *cache,
    int num_heads, int num_kv_heads, int head_dim, int block_size, long long block_stride,
    int in, int n) {
    extern __shared__ __attribute__((aligned(16))) unsigned char proj_smem[];
    wt *xs = (wt *)proj_smem;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int t0 = bk.y * BGS_PROJ_TOKENS, nt = min(BGS_PROJ_TOKENS, n - t0);
    proj_norm_prologue(res + (size_t)t0 * in, nw, eps, xs, in, nt);
    const int half = head_dim / 2;
    const int units = (num_heads + 2 * num_kv_heads) * half;
    for (int u = bk.x * BGS_PROJ_WARPS + warp; u < units; u += bk.gx * BGS_PROJ_WARPS) {
        const int h = u / half, i = u % half, base = h * head_dim;
        float acc[2][BGS_PROJ_TOKENS] = {};
        const wt *wr[2] = {w + (size_t)(base + i) * in, w + (size_t)(base + i + half) * in};
        proj_dot<2, 4>(wr, xs, in, nt, acc);
        float mine[2];
        proj_reduce<2>(acc, mine, nt);
        if (lane >= nt) continue;
        qkv_pair_store(h, i, t0 + lane, mine[0], mine[1], qkv, bias, pos, slot, inv_freq, cache,
                       num_heads, num_kv_heads, head_dim, block_size, block_stride);
    }
}
extern "C" __global__ void bgs_proj_norm_rope_kv(
    const wt *w, const float *res, const float *nw, float eps, float *qkv, const float *bias,
    const int *pos, const int *slot, const float *inv_freq, wt *cache, int num_heads,
    int num_kv_heads, int head_dim, int block_size, long long block_stride, int in, int n) {
    BGS_PDL_BEGIN();
    proj_norm_rope_kv_body(BGS_LAUNCH_BLK, w, res, nw, eps, qkv, bias, pos, slot, inv_freq,
                           cache, num_heads, num_kv_heads, head_dim, block_size, block_stride,
                           in, n);
}

// gu: [T][2 * inter] f32 (gate then up, the fused GEMM's output); out[t][i] = silu(g) * u.
__device__ __forceinline__ void silu_mul_body(const bgs_blk &bk, const float *gu, wt *out,
                                              int inter, int tokens) {
    // y = the token (no 64-bit division per element), x strides over `inter`.
    const int t = bk.y;
    if (t >= tokens) return;
    const float *g = gu + (size_t)t * 2 * inter;
    wt *o = out + (size_t)t * inter;
    for (int i = bk.x * bk.nt + threadIdx.x; i < inter; i += bk.gx * bk.nt)
        o[i] = silu_times(g[i], g[inter + i]);
}
extern "C" __global__ void bgs_silu_mul(const float *gu, wt *out, int inter, int tokens) {
    BGS_PDL_BEGIN();
    silu_mul_body(BGS_LAUNCH_BLK, gu, out, inter, tokens);
}

// out[s] = xn[rows[s]]: the sampled tokens' normed rows, the LM head's input.
__device__ __forceinline__ void gather_rows_body(const bgs_blk &bk, const wt *xn, const int *rows,
                                                 wt *out, int hidden) {
    const int s = bk.x;
    const wt *src = xn + (size_t)rows[s] * hidden;
    wt *dst = out + (size_t)s * hidden;
    for (int i = threadIdx.x; i < hidden; i += bk.nt) dst[i] = src[i];
}
extern "C" __global__ void bgs_gather_rows(const wt *xn, const int *rows, wt *out, int hidden) {
    BGS_PDL_BEGIN();
    gather_rows_body(BGS_LAUNCH_BLK, xn, rows, out, hidden);
}

// The better of two candidates: the larger value, the lower index among equal values (NaN
// never wins: every comparison with it is false).
__device__ __forceinline__ void better(float &bv, unsigned &bi, float v, unsigned i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The argmax of row[lo..hi) by one block of T (virtual) threads, ties to the lowest id:
// strided scan in index order (strictly larger values only, so NaN never wins), then a fixed
// shared-memory tree over sv/si (T entries); the winner is sv[0], si[0] (si[0] = 0xffffffff
// where nothing is above -inf). bk.pt physical threads run the T virtual ones (vt = tid, tid +
// pt, ...; in a launch pt = T, one each): every virtual thread computes what a real one would,
// so the result does not depend on pt.
template <int T>
__device__ __forceinline__ void argmax_block(const bgs_blk &bk, const float *row, int lo, int hi,
                                             float *sv, unsigned *si) {
    for (int vt = threadIdx.x; vt < T; vt += bk.pt) {
        float bv = BGS_NEG_INF;
        unsigned bi = 0xffffffffu;
        for (int i = lo + vt; i < hi; i += T) {
            const float v = row[i];
            if (v > bv) {
                bv = v;
                bi = (unsigned)i;
            }
        }
        sv[vt] = bv;
        si[vt] = bi;
    }
    __syncthreads();
    for (int h = T / 2; h > 0; h >>= 1) {
        // Level h reads entries >= h and writes entries < h: no virtual thread's write is
        // another's read within a level.
        for (int vt = threadIdx.x; vt < h; vt += bk.pt) {
            float v = sv[vt];
            unsigned i = si[vt];
            better(v, i, sv[vt + h], si[vt + h]);
            sv[vt] = v;
            si[vt] = i;
        }
        __syncthreads();
    }
}

// next[s] = argmax(logits[s]) with ties to the lowest id; one block of BGS_ARGMAX_THREADS
// (virtual) threads per row (argmax_block).
__device__ __forceinline__ void argmax_body(const bgs_blk &bk, const float *logits,
                                            unsigned *next, int vocab) {
    __shared__ float sv[BGS_ARGMAX_THREADS];
    __shared__ unsigned si[BGS_ARGMAX_THREADS];
    const int s = bk.x;
    argmax_block<BGS_ARGMAX_THREADS>(bk, logits + (size_t)s * vocab, 0, vocab, sv, si);
    // No value above -inf (all -inf or NaN): id 0, as the CPU's argmax gives.
    if (threadIdx.x == 0) next[s] = si[0] == 0xffffffffu ? 0u : si[0];
}
extern "C" __global__ void bgs_argmax(const float *logits, unsigned *next, int vocab) {
    BGS_SKIP_IF(64, true);
    BGS_PDL_BEGIN();
    argmax_body(BGS_LAUNCH_BLK, logits, next, vocab);
}

// The launched LM head's argmax over more multiprocessors: grid (rows, parts), block y of row s
// takes the contiguous slice y of the row (ceil(vocab / parts) ids), scans it as bgs_argmax
// scans a row (argmax_block) and writes its (value, id) to cand[s][y]; the row's last block (a fence, then a
// count in done[s]) combines the parts in order with the same rule and zeroes the count. The
// largest value with the lowest id among its ties is that of the parts' winners, whatever the
// slices, so the same id as bgs_argmax (which the persistent form keeps: one block a row).
// BGS_ARGMAX_SPLIT_THREADS comes from the host (`plan::ARGMAX_SPLIT_THREADS`).
#if !defined(BGS_ARGMAX_SPLIT_THREADS) || (BGS_ARGMAX_SPLIT_THREADS & (BGS_ARGMAX_SPLIT_THREADS - 1))
#error "BGS_ARGMAX_SPLIT_THREADS (a power of two) must be defined (plan::ARGMAX_SPLIT_THREADS)"
#endif
extern "C" __global__ void __launch_bounds__(BGS_ARGMAX_SPLIT_THREADS)
    bgs_argmax_split(const float *logits, unsigned *next, int vocab, unsigned *cand,
                     unsigned *done) {
    constexpr int T = BGS_ARGMAX_SPLIT_THREADS;
    __shared__ float sv[T];
    __shared__ unsigned si[T];
    const int s = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
    const int span = (vocab + parts - 1) / parts;
    const int lo = part * span, hi = min(vocab, lo + span);
    BGS_SKIP_IF(64, true);
    BGS_PDL_BEGIN();
    argmax_block<T>(BGS_LAUNCH_BLK, logits + (size_t)s * vocab, lo, hi, sv, si);
    if (threadIdx.x != 0) return;
    unsigned *c = cand + 2 * ((size_t)s * parts + part);
    c[0] = __float_as_uint(sv[0]);
    c[1] = si[0];
    __threadfence();
    if (atomicAdd(done + s, 1u) != (unsigned)parts - 1) return;
    __threadfence();
    float v = BGS_NEG_INF;
    unsigned id = 0xffffffffu;
    for (int y = 0; y < parts; y++) {
        const unsigned *cy = cand + 2 * ((size_t)s * parts + y);
        unsigned a, b;
        asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(cy) : "memory");
        better(v, id, __uint_as_float(a), b);
    }
    // No value above -inf (all -inf or NaN): id 0, as the CPU's argmax gives.
    next[s] = id == 0xffffffffu ? 0u : id;
    done[s] = 0u;
}

// bgs_gemm_tc (16-bit models on sm_80+, where `plan::tc_gemm_applies`): y[t][r] = w[r] · x[t]
// in f32 on tensor cores: the batch-invariant form of every projection (`batch_invariant_gemm`)
// and, optionally, the small buckets' GEMM (`tensor_core_gemm_max_tokens`; on the H200 about
// as fast as cuBLAS at 1-4 tokens, slower beyond: docs/gpu-model.md). A block of BGS_TC_WARPS warps owns 16 output rows and up to BGS_TC_TOKENS
// tokens. The input width is cut into chunks of 32 values; warp w takes chunks w, w + WARPS,
// w + 2 WARPS, ... and accumulates them in that order with m16n8k16 MMAs (f32), then the warps'
// partial sums are added in warp order through shared memory. That split depends on the input
// width alone, never on the tokens or the bucket, and each MMA column holds its own token's
// dot products, so a token's outputs are the same bits whatever else is in the step.
//
// Fragments come straight from global memory in 16-byte loads: lane (g = lane / 4, q = lane %
// 4) loads values 8q .. 8q+7 of a chunk for rows g and g + 8 of w and for token g of each
// 8-token tile of x. Those are two MMA k-steps: step 0 puts values 8q+{0,1} and 8q+{2,3} where
// the fragment layout has columns 2q+{0,1} and 2q+8+{0,1}, step 1 values 8q+{4,5} and
// 8q+{6,7}. w and x are permuted alike, so every dot product is a sum of the same products.
// Weights never change during a step, so the first chunks' weights are loaded before waiting
// on the previous kernel (programmatic dependent launch), overlapping its tail.
// Three tile widths: BGS_TC_TOKENS tokens (the kernels' plain names), BGS_TC_SMALL_TOKENS
// (the `_small` entry points, decode at small batch: `Plan::tc_kernel`) and BGS_TC_MID_TOKENS
// (the `_mid` entry points: a bucket past the small width in one token block, so its weights
// are read once rather than once per small block). A tile's width only sizes its fragments
// (registers, hence blocks per multiprocessor) and its token blocks; every output is the same
// sum of the same products in the same order whatever the width, so they all give a token the
// same bits. Chunks whose weights a warp loads ahead: BGS_TC_UNROLL for the wide tiles,
// BGS_TC_SMALL_UNROLL for the small and mid ones (registers again; the order of the sums is
// the chunks' whatever the unroll).
// BGS_TC_WARPS, BGS_TC_TOKENS, BGS_TC_SMALL_TOKENS, BGS_TC_MID_TOKENS and BGS_TC_SMALL_UNROLL
// come from the host (`plan::TC_WARPS`, `plan::TC_TOKENS`, `plan::TC_SMALL_TOKENS`,
// `plan::TC_MID_TOKENS`, `plan::TC_SMALL_UNROLL`).
#if !defined(BGS_TC_WARPS) || !defined(BGS_TC_TOKENS) || BGS_TC_TOKENS % 8 != 0 || \
    !defined(BGS_TC_SMALL_TOKENS) || BGS_TC_SMALL_TOKENS % 8 != 0 ||                \
    BGS_TC_SMALL_TOKENS > BGS_TC_TOKENS || !defined(BGS_TC_SMALL_UNROLL)
#error "BGS_TC_WARPS, BGS_TC_TOKENS, BGS_TC_SMALL_TOKENS (multiples of 8) and BGS_TC_SMALL_UNROLL must be defined"
#endif
#if !defined(BGS_TC_MID_TOKENS) || BGS_TC_MID_TOKENS % 8 != 0 ||       \
    BGS_TC_MID_TOKENS <= BGS_TC_SMALL_TOKENS || BGS_TC_MID_TOKENS >= BGS_TC_TOKENS
#error "BGS_TC_MID_TOKENS (a multiple of 8 between the small and the wide widths) must be defined (plan::TC_MID_TOKENS)"
#endif
#define BGS_TC_UNROLL 4
#if BGS_HAVE_MMA
// 16 read-only bytes (the weights: never written while a step runs).
__device__ __forceinline__ bgs_u4 ld_nc16(const bgs_u4 *p) {
    bgs_u4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d)
        : "l"(p));
    return v;
}
#endif
#if BGS_HAVE_MMA
// One 16-row x TOK-token tile of y = x · wᵀ (tokens t0.. of n): the MMA's rows 0-7 are
// w's rows ra.. and its rows 8-15 w's rows rb.. (rb = ra + 8 for a plain tile; the QKV
// epilogue pairs the two halves RoPE rotates), of `out` rows. x is the row of token t0 (rows
// `in` values apart). The warps' MMA sums, then epi(row, col, s) for every (row, col) of the
// tile, s the warps' partial sums added in warp order (rows and tokens past the ends
// included: the epilogue skips them). Every thread of the group takes part; `pdl`: wait on
// the previous grid after the first weights are in flight (a launch with programmatic
// dependent launch) and before x is read.
// The warps' partial sums of a tile, one array per warp group G and tile width (a __shared__
// variable in tc_tile itself would be one per instantiation, epilogue included).
template <int TOK>
__device__ __forceinline__ float (*tc_red0())[16][TOK + 1] {
    __shared__ float red[BGS_TC_WARPS][16][TOK + 1];
    return red;
}
template <int TOK>
__device__ __forceinline__ float (*tc_red1())[16][TOK + 1] {
    __shared__ float red[BGS_TC_WARPS][16][TOK + 1];
    return red;
}
// G: which group of BGS_TC_WARPS warps of the block computes the tile (threads G * 256 ..);
// it synchronizes with named barrier 1 + G of its own threads only, so two groups can compute
// two tiles side by side (bgs_gemm_tc_silu).
// Where a tile's weight fragments come from: wsrc(c, h) is this lane's 16 bytes of chunk c
// for the MMA's rows 0-7 (h = 0: w's row ra + g) or 8-15 (h = 1: row rb + g), values 8q ..
// 8q + 7. TcGlobalW loads them from global memory; TcStagedW reads the copies this thread
// made in shared memory (tc_stage). The same bytes either way, so the same bits.
struct TcGlobalW {
    const bgs_u4 *wa, *wb;
    __device__ __forceinline__ bgs_u4 operator()(int c, int h) const {
        return ld_nc16((h ? wb : wa) + 4 * c);
    }
};
// Rows past `out` read the last row (never stored).
__device__ __forceinline__ TcGlobalW tc_global_w(const wt *w, int ra, int rb, int out, int in) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    return TcGlobalW{(const bgs_u4 *)(w + (size_t)min(ra + g, out - 1) * in) + q,
                     (const bgs_u4 *)(w + (size_t)min(rb + g, out - 1) * in) + q};
}
// A warp's staged weights of one tile: the warp's k-th chunk (c = warp + k * BGS_TC_WARPS)
// at s[(2k + h) * 32 + lane], so a warp's 16-byte reads of one (k, h) are 512 contiguous
// bytes (no bank conflicts). TC_STAGE_U4(in) is one warp's region, in bgs_u4.
#define TC_STAGE_U4(in) ((((in) / 32 + BGS_TC_WARPS - 1) / BGS_TC_WARPS) * 64)
struct TcStagedW {
    const bgs_u4 *s;
    int warp, lane;
    __device__ __forceinline__ bgs_u4 operator()(int c, int h) const {
        return s[(2 * ((c - warp) / BGS_TC_WARPS) + h) * 32 + lane];
    }
};
// Copy this thread's weight fragments of a tile (what tc_global_w would load) into its warp's
// region `s` (TcStagedW's layout), asynchronously: the caller commits and waits.
__device__ __forceinline__ void tc_stage(const wt *w, int ra, int rb, int out, int in,
                                         bgs_u4 *s, int warp) {
    const int lane = threadIdx.x % 32;
    const TcGlobalW src = tc_global_w(w, ra, rb, out, in);
    for (int c = warp, k = 0; c < in / 32; c += BGS_TC_WARPS, k++) {
        cp_async16(smem_u32(s + (2 * k) * 32 + lane), src.wa + 4 * c, 16);
        cp_async16(smem_u32(s + (2 * k + 1) * 32 + lane), src.wb + 4 * c, 16);
    }
}
// The dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned tc_dynamic_smem() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
template <int G, int TOK, class WSrc, class Epi>
__device__ __forceinline__ void tc_tile_from(WSrc wsrc, const wt *x, int t0, int in, int n,
                                             bool pdl, Epi epi) {
    constexpr int TILES = TOK / 8;
    constexpr int UNROLL = TOK == BGS_TC_TOKENS ? BGS_TC_UNROLL : BGS_TC_SMALL_UNROLL;
    float(*red)[16][TOK + 1] = G ? tc_red1<TOK>() : tc_red0<TOK>();
    const int tid = threadIdx.x - G * BGS_TC_WARPS * 32;
    const int lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int chunks = in / 32;
    const int tiles = min(TILES, (n - t0 + 7) / 8);
    float acc[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    bgs_u4 a[UNROLL][2];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int c = warp + u * BGS_TC_WARPS;
        if (c < chunks) {
            a[u][0] = wsrc(c, 0);
            a[u][1] = wsrc(c, 1);
        }
    }
    if (pdl) BGS_PDL_BEGIN();
    for (int c0 = warp; c0 < chunks; c0 += UNROLL * BGS_TC_WARPS) {
        bgs_u4 b[UNROLL][TILES];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + u * BGS_TC_WARPS;
#pragma unroll
            for (int j = 0; j < TILES; j++) {
                const int t = t0 + 8 * j + g;
                b[u][j] = bgs_u4{0u, 0u, 0u, 0u};
                if (c < chunks && j < tiles && t < n)
                    b[u][j] = ((const bgs_u4 *)(x + (size_t)(t - t0) * in))[4 * c + q];
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (c0 + u * BGS_TC_WARPS >= chunks) break;
            const unsigned s0[4] = {a[u][0].a, a[u][1].a, a[u][0].b, a[u][1].b};
            const unsigned s1[4] = {a[u][0].c, a[u][1].c, a[u][0].d, a[u][1].d};
#pragma unroll
            for (int j = 0; j < TILES; j++) {
                if (j >= tiles) break;
                mma_16816(acc[j], s0, b[u][j].a, b[u][j].b);
                mma_16816(acc[j], s1, b[u][j].c, b[u][j].d);
            }
        }
        // The next chunks' weights (in flight while the next x loads go out).
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + (UNROLL + u) * BGS_TC_WARPS;
            if (c < chunks) {
                a[u][0] = wsrc(c, 0);
                a[u][1] = wsrc(c, 1);
            }
        }
    }
    // The accumulator fragments: c0, c1 at (row g, tokens 2q, 2q+1), c2, c3 at row g + 8.
#pragma unroll
    for (int j = 0; j < TILES; j++) {
        red[warp][g][8 * j + 2 * q] = acc[j][0];
        red[warp][g][8 * j + 2 * q + 1] = acc[j][1];
        red[warp][g + 8][8 * j + 2 * q] = acc[j][2];
        red[warp][g + 8][8 * j + 2 * q + 1] = acc[j][3];
    }
    asm volatile("bar.sync %0, %1;" ::"r"(1 + G), "r"(BGS_TC_WARPS * 32) : "memory");
    for (int e = tid; e < 16 * TOK; e += BGS_TC_WARPS * 32) {
        const int row = e % 16, col = e / 16;
        float s = red[0][row][col];
#pragma unroll
        for (int k = 1; k < BGS_TC_WARPS; k++) s += red[k][row][col];
        epi(row, col, s);
    }
}
template <int G, int TOK, class Epi>
__device__ __forceinline__ void tc_tile(const wt *w, const wt *x, int ra, int rb, int t0, int out,
                                        int in, int n, bool pdl, Epi epi) {
    tc_tile_from<G, TOK>(tc_global_w(w, ra, rb, out, in), x, t0, in, n, pdl, epi);
}
// The staged form of the small-tile entry points (`plan::tc_stage`): a block owns row tiles
// bk.x, bk.x + gx, ... (`mine` of them, at most BGS_TC_STAGE_MAX) rather than one, and where
// the launch gave it room for all of their weights (groups warp groups a tile) it copies them
// into shared memory at once, before waiting on the previous kernel: every weight byte of the
// block is in flight together, where loading them into registers takes one round trip per
// BGS_TC_SMALL_UNROLL chunks a warp and one wave of blocks per multiprocessor slot. Each tile
// is then computed as tc_tile computes it, from the staged copies: the same bits.
#if !defined(BGS_TC_STAGE_MAX) || BGS_TC_STAGE_MAX < 1 || BGS_TC_STAGE_MAX > 4
#error "BGS_TC_STAGE_MAX (1..=4: cp_async_wait_pending's range) must be defined (plan::TC_STAGE_MAX)"
#endif
__device__ __forceinline__ bool tc_staged(const bgs_blk &bk, int mine, int groups, int in) {
    return mine <= BGS_TC_STAGE_MAX &&
           tc_dynamic_smem() >= (unsigned)(mine * groups * BGS_TC_WARPS * TC_STAGE_U4(in) * 16);
}
#endif

// y[t][r] = x[t] · w[r] (ADD: y[t][r] += it, the folded form's o_proj and down_proj with the
// residual add: one writer per element, bgs_add_rmsnorm's add).
// STAGE (the small-tile entry points): the block's row tiles bk.x, bk.x + gx, ..., staged
// where the launch gave the room (tc_staged); otherwise the one tile bk.x.
template <bool ADD, int TOK, bool STAGE = false>
__device__ __forceinline__ void gemm_tc_body(const bgs_blk &bk, const wt *w, const wt *x, float *y,
                                             int out, int in, int n) {
#if BGS_HAVE_MMA
    const int t0 = bk.y * TOK;
    if (!ADD) BGS_SKIP_IF(32, bk.pdl);
    auto epi = [&](int r0) {
        return [=](int row, int col, float s) {
            const int r = r0 + row, t = t0 + col;
            if (r < out && t < n) {
                float *o = y + (size_t)t * out + r;
                *o = ADD ? *o + s : s;
            }
        };
    };
    if constexpr (!STAGE) {
        const int r0 = bk.x * 16;
        tc_tile<0, TOK>(w, x + (size_t)t0 * in, r0, r0 + 8, t0, out, in, n, bk.pdl, epi(r0));
        return;
    }
    const int rt = (out + 15) / 16, mine = (rt - bk.x + bk.gx - 1) / bk.gx;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (tc_staged(bk, mine, 1, in)) {
        extern __shared__ bgs_u4 tc_stage_smem[];
        auto region = [&](int i) { return tc_stage_smem + (i * BGS_TC_WARPS + warp) * TC_STAGE_U4(in); };
        for (int i = 0; i < mine; i++) {
            const int r0 = (bk.x + i * bk.gx) * 16;
            tc_stage(w, r0, r0 + 8, out, in, region(i), warp);
            cp_async_commit();
        }
        if (bk.pdl) BGS_PDL_BEGIN();
        for (int i = 0; i < mine; i++) {
            const int r0 = (bk.x + i * bk.gx) * 16;
            if (i) __syncthreads();  // the previous tile's partial sums are read
            cp_async_wait_pending(mine - 1 - i);
            tc_tile_from<0, TOK>(TcStagedW{region(i), warp, lane}, x + (size_t)t0 * in, t0, in, n,
                                 false, epi(r0));
        }
        return;
    }
    for (int i = 0; i < mine; i++) {
        const int r0 = (bk.x + i * bk.gx) * 16;
        if (i) __syncthreads();
        tc_tile<0, TOK>(w, x + (size_t)t0 * in, r0, r0 + 8, t0, out, in, n, bk.pdl && !i,
                        epi(r0));
    }
#else
    // Never launched: f32 models and devices before sm_80 use cuBLAS (`plan::tc_gemm_applies`).
    __trap();
#endif
}

#if BGS_HAVE_MMA
// The folded form's norm: xs[t][i] = the norm of the nt rows of the residual at x in `wt`
// (rows `in` values apart in both), bgs_add_rmsnorm's arithmetic with a warp per
// row and no block barrier: lane l holds the strided sums of that kernel's threads l, l + 32,
// ..., l + 224 (BGS_NORM_THREADS = 256 of them), adds them in its tree's first three levels
// (thread i + 128 into i, then i + 64, then i + 32), and the warp's shuffles are its last five
// (lane i + s into i): the same pairs, so the same bits. A lane loads its whole share of the
// row (BGS_TC_NORM_SPAN values per virtual thread: in <= 256 * BGS_TC_NORM_SPAN, which
// `plan::tc_fold_fits` checks) and the norm weights at once, so a row costs one round trip
// to memory rather than one per value. Every thread of the block takes part (the warps
// stride over the rows). x is read through L2 (ld.global.cg): other blocks of the grid wrote
// it, and an L1 line of this multiprocessor may hold an older copy.
#if BGS_NORM_THREADS != 256
#error "tc_norm_rows transcribes the tree of 256 norm threads"
#endif
#ifndef BGS_TC_NORM_SPAN
#error "BGS_TC_NORM_SPAN must be defined (plan::TC_NORM_SPAN)"
#endif
__device__ __forceinline__ float ld_cg(const float *p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void tc_norm_rows(const float *x, const float *nw, float eps, wt *xs,
                                             int in, int nt) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int t = warp; t < nt; t += warps) {
        const float *xr = x + (size_t)t * in;
        float v[8][BGS_TC_NORM_SPAN], w[8][BGS_TC_NORM_SPAN];
#pragma unroll
        for (int k = 0; k < 8; k++)
#pragma unroll
            for (int m = 0; m < BGS_TC_NORM_SPAN; m++) {
                const int i = lane + 32 * k + BGS_NORM_THREADS * m;
                v[k][m] = i < in ? ld_cg(xr + i) : 0.0f;
                w[k][m] = i < in ? nw[i] : 0.0f;
            }
        float p[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float acc = 0.0f;
#pragma unroll
            for (int m = 0; m < BGS_TC_NORM_SPAN; m++)
                if (lane + 32 * k + BGS_NORM_THREADS * m < in) acc = acc + v[k][m] * v[k][m];
            p[k] = acc;
        }
        const float l1[4] = {p[0] + p[4], p[1] + p[5], p[2] + p[6], p[3] + p[7]};
        const float l2[2] = {l1[0] + l1[2], l1[1] + l1[3]};
        float sum = l2[0] + l2[1];
        for (int s = 16; s > 0; s >>= 1) sum = sum + __shfl_down_sync(0xffffffffu, sum, s);
        const float inv = rms_inv(__shfl_sync(0xffffffffu, sum, 0), in, eps);
        wt *o = xs + (size_t)t * in;
#pragma unroll
        for (int k = 0; k < 8; k++)
#pragma unroll
            for (int m = 0; m < BGS_TC_NORM_SPAN; m++) {
                const int i = lane + 32 * k + BGS_NORM_THREADS * m;
                if (i < in) o[i] = rms_scale(w[k][m], v[k][m], inv);
            }
    }
}

// Both tiles of the gate/up projection and SiLU·up: w is the fused [gate; up] weight (2 *
// inter rows), act[t][i] = silu(g) * u in `wt` with g and u bgs_gemm_tc's values for rows i and
// inter + i. A block of two warp groups: the first computes 16 gate rows while the second
// computes the same 16 up rows, for up to TOK tokens; x is token t0's input row.
// STAGE (the small-tile entry point): the block's row tiles bk.x, bk.x + gx, ..., staged where
// the launch gave the room (tc_staged, both groups' weights); otherwise the one tile bk.x.
template <int TOK, bool STAGE = false>
__device__ __forceinline__ void tc_silu_tiles(const bgs_blk &bk, const wt *w, const wt *x,
                                              wt *act, int inter, int in, int n) {
    __shared__ float gate[16][TOK + 1], up[16][TOK + 1];
    const int t0 = bk.y * TOK;
    // act for row tile r0, once both groups' values are in gate and up.
    auto store_act = [&](int r0) {
        __syncthreads();
        for (int e = threadIdx.x; e < 16 * TOK; e += 2 * BGS_TC_WARPS * 32) {
            const int row = e % 16, col = e / 16;
            const int r = r0 + row, t = t0 + col;
            if (r < inter && t < n)
                act[(size_t)t * inter + r] = silu_times(gate[row][col], up[row][col]);
        }
    };
    if constexpr (!STAGE) {
        const int r0 = bk.x * 16;
        if ((int)threadIdx.x < BGS_TC_WARPS * 32)
            tc_tile<0, TOK>(w, x, r0, r0 + 8, t0, inter, in, n, bk.pdl,
                            [&](int row, int col, float s) { gate[row][col] = s; });
        else
            tc_tile<1, TOK>(w + (size_t)inter * in, x, r0, r0 + 8, t0, inter, in, n, bk.pdl,
                            [&](int row, int col, float s) { up[row][col] = s; });
        store_act(r0);
        return;
    }
    const bool first = (int)threadIdx.x < BGS_TC_WARPS * 32;  // the gate group
    const int warp = (threadIdx.x / 32) % BGS_TC_WARPS, lane = threadIdx.x % 32;
    const wt *wg = first ? w : w + (size_t)inter * in;  // this group's rows
    const int rt = (inter + 15) / 16, mine = (rt - bk.x + bk.gx - 1) / bk.gx;
    const bool staged = tc_staged(bk, mine, 2, in);
    extern __shared__ bgs_u4 tc_stage_smem[];
    auto region = [&](int i) {
        return tc_stage_smem + ((i * 2 + !first) * BGS_TC_WARPS + warp) * TC_STAGE_U4(in);
    };
    if (staged) {
        for (int i = 0; i < mine; i++) {
            const int r0 = (bk.x + i * bk.gx) * 16;
            tc_stage(wg, r0, r0 + 8, inter, in, region(i), warp);
            cp_async_commit();
        }
        if (bk.pdl) BGS_PDL_BEGIN();
    }
    for (int i = 0; i < mine; i++) {
        const int r0 = (bk.x + i * bk.gx) * 16;
        if (i) __syncthreads();  // the previous tile's gate and up values are read
        const bool pdl = !staged && bk.pdl && !i;
        if (staged) cp_async_wait_pending(mine - 1 - i);
        if (first) {
            auto epi = [&](int row, int col, float s) { gate[row][col] = s; };
            if (staged)
                tc_tile_from<0, TOK>(TcStagedW{region(i), warp, lane}, x, t0, in, n, false, epi);
            else
                tc_tile<0, TOK>(wg, x, r0, r0 + 8, t0, inter, in, n, pdl, epi);
        } else {
            auto epi = [&](int row, int col, float s) { up[row][col] = s; };
            if (staged)
                tc_tile_from<1, TOK>(TcStagedW{region(i), warp, lane}, x, t0, in, n, false, epi);
            else
                tc_tile<1, TOK>(wg, x, r0, r0 + 8, t0, inter, in, n, pdl, epi);
        }
        store_act(r0);
    }
}
#endif

// The gate/up projection with bgs_silu_mul as its epilogue (the same bits as bgs_gemm_tc then
// bgs_silu_mul, without the f32 gate/up activations or a launch).
template <int TOK, bool STAGE = false>
__device__ __forceinline__ void gemm_tc_silu_body(const bgs_blk &bk, const wt *w, const wt *x,
                                                  wt *act, int inter, int in, int n) {
#if BGS_HAVE_MMA
    BGS_SKIP_IF(16, bk.pdl);
    tc_silu_tiles<TOK, STAGE>(bk, w, x + (size_t)bk.y * TOK * in, act, inter, in, n);
#else
    __trap();  // never planned: 16-bit models on sm_80+ only (`plan::tc_gemm_applies`)
#endif
}

// The folded form's o and down steps: bgs_gemm_tc with the residual add (res[t][r] += y, one
// writer per element: bgs_add_rmsnorm's add), then the norm of the residual rows of the
// block's token block into xn (norm weights nw) by the block that finishes that token block
// last: each block's adds are made visible (__threadfence) before it counts itself in done[y],
// and the block that brings the count to the grid's width norms every row of the token block
// (tc_norm_rows, bgs_add_rmsnorm's bits, reading through L2) and zeroes the count for the next
// launch. So the norm that bgs_add_rmsnorm would launch next runs at the end of this grid.
template <int TOK, bool STAGE>
__device__ __forceinline__ void gemm_tc_add_norm_body(const wt *w, const wt *x, float *res,
                                                      int out, int in, int n, const float *nw,
                                                      float eps, wt *xn, unsigned *done) {
#if BGS_HAVE_MMA
    __shared__ unsigned last;
    BGS_SKIP_IF(in == out ? 4 : 8, true);
    gemm_tc_body<true, TOK, STAGE>(BGS_LAUNCH_BLK, w, x, res, out, in, n);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done + blockIdx.y, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int t0 = blockIdx.y * TOK, nt = min(TOK, n - t0);
    tc_norm_rows(res + (size_t)t0 * out, nw, eps, xn + (size_t)t0 * out, out, nt);
    if (threadIdx.x == 0) done[blockIdx.y] = 0u;
#else
    __trap();
#endif
}

// The folded form's QKV step: the QKV tile over the normed rows xn (the previous down step's
// epilogue wrote them), then bgs_rope_kv's epilogue (qkv_pair_store). The tile's MMA rows 0-7
// are rows i0 .. i0 + 7 of a head and rows 8-15 the rows half further on, the pairs RoPE
// rotates (head_dim a multiple of 16: `plan::tc_fold_fits`): block x is head
// x / (head_dim / 16), i0 = 8 * (x % (head_dim / 16)). Each output is bgs_gemm_tc's sum, so
// the same bits as bgs_gemm_tc and bgs_rope_kv.
template <int TOK>
__device__ __forceinline__ void gemm_tc_rope_kv_body(
    const wt *w, const wt *xn, float *qkv, const float *bias, const int *pos, const int *slot,
    const float *inv_freq, wt *cache, int num_heads, int num_kv_heads, int head_dim,
    int block_size, long long block_stride, int in, int n) {
#if BGS_HAVE_MMA
    __shared__ float tile[16][TOK + 1];
    BGS_SKIP_IF(2, true);
    const int per_head = head_dim / 16, half = head_dim / 2;
    const int h = blockIdx.x / per_head, i0 = 8 * (blockIdx.x % per_head);
    const int ra = h * head_dim + i0, t0 = blockIdx.y * TOK;
    const int nt = min(TOK, n - t0);
    const int out = (num_heads + 2 * num_kv_heads) * head_dim;
    tc_tile<0, TOK>(w, xn + (size_t)t0 * in, ra, ra + half, t0, out, in, n, true,
                    [&](int row, int col, float s) { tile[row][col] = s; });
    __syncthreads();
    for (int e = threadIdx.x; e < 8 * nt; e += blockDim.x) {
        const int i = e % 8, col = e / 8;
        qkv_pair_store(h, i0 + i, t0 + col, tile[i][col], tile[8 + i][col], qkv, bias, pos, slot,
                       inv_freq, cache, num_heads, num_kv_heads, head_dim, block_size,
                       block_stride);
    }
#else
    __trap();
#endif
}

// The weights of the op after next, fetched into L2 by the folded form's o_proj, gate/up and
// down_proj launches: `pf`, `pf_bytes` from the host (gate/up's weights for o_proj, down's for
// gate/up, the next layer's QKV for down_proj; none where that op stages its own weights
// before its wait, `plan::Plan::body`). BGS_TC_PREFETCH_NEXT (a mask, 7 by default; through
// BGS_LLM_KERNEL_DEFINES for a comparison) turns each off: 1 o_proj's (a square matrix), 2
// gate/up's, 4 down_proj's. Each thread of the grid issues one
// `prefetch.global.L2` a 128-byte line (lines i, i + threads, ...) before waiting on the
// previous kernel, so the lines stream from memory while the latency-bound kernels before
// that op run and it finds them in L2 (weights never change while a step runs). A hint: it
// changes no value and holds nothing up.
#ifndef BGS_TC_PREFETCH_NEXT
#define BGS_TC_PREFETCH_NEXT 7
#endif
__device__ __forceinline__ void prefetch_lines_l2(int bit, const void *pf, long long pf_bytes) {
#if BGS_TC_PREFETCH_NEXT
    if (!(BGS_TC_PREFETCH_NEXT & bit)) return;
    const long long threads = (long long)gridDim.x * gridDim.y * blockDim.x;
    const long long me =
        ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    for (long long off = me * 128; off < pf_bytes; off += threads * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)pf + off));
#endif
}

// The tensor-core kernels' entry points for one tile width TOK, names suffixed SUF:
//   bgs_gemm_tc             y = x · wᵀ
//   bgs_gemm_tc_silu        gate/up with SiLU·up (512 threads: at most 128 registers a
//                           thread, or the launch runs out of them)
//   bgs_gemm_tc_add_norm    the folded form's o and down steps: res += x · wᵀ, then the next
//                           norm of res into xn by the token block's last block
//   bgs_gemm_tc_rope_kv     the folded form's QKV step
#define BGS_TC_ENTRY_POINTS(SUF, TOK, STAGE)                                                        \
    extern "C" __global__ void bgs_gemm_tc##SUF(const wt *w, const wt *x, float *y, int out,   \
                                                int in, int n) {                               \
        gemm_tc_body<false, TOK, STAGE>(BGS_LAUNCH_BLK, w, x, y, out, in, n);                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(2 * BGS_TC_WARPS * 32)                        \
        bgs_gemm_tc_silu##SUF(const wt *w, const wt *x, wt *act, int inter, int in, int n,     \
                              const void *pf, long long pf_bytes) {                            \
        prefetch_lines_l2(2, pf, pf_bytes);                                                    \
        gemm_tc_silu_body<TOK, STAGE>(BGS_LAUNCH_BLK, w, x, act, inter, in, n);                    \
    }                                                                                          \
    extern "C" __global__ void bgs_gemm_tc_add_norm##SUF(                                      \
        const wt *w, const wt *x, float *res, int out, int in, int n, const float *nw,         \
        float eps, wt *xn, unsigned *done, const void *pf, long long pf_bytes) {               \
        prefetch_lines_l2(in == out ? 1 : 4, pf, pf_bytes);                                    \
        gemm_tc_add_norm_body<TOK, STAGE>(w, x, res, out, in, n, nw, eps, xn, done);            \
    }                                                                                          \
    extern "C" __global__ void bgs_gemm_tc_rope_kv##SUF(                                       \
        const wt *w, const wt *xn, float *qkv, const float *bias, const int *pos,              \
        const int *slot, const float *inv_freq, wt *cache, int num_heads, int num_kv_heads,    \
        int head_dim, int block_size, long long block_stride, int in, int n) {                 \
        gemm_tc_rope_kv_body<TOK>(w, xn, qkv, bias, pos, slot, inv_freq, cache, num_heads,     \
                                  num_kv_heads, head_dim, block_size, block_stride, in, n);    \
    }
BGS_TC_ENTRY_POINTS(, BGS_TC_TOKENS, false)
BGS_TC_ENTRY_POINTS(_small, BGS_TC_SMALL_TOKENS, true)
BGS_TC_ENTRY_POINTS(_mid, BGS_TC_MID_TOKENS, true)

// ---- Large tiles: buckets of many tokens (`tensor_core_large_tiles_min_tokens`) ----
//
// bgs_gemm_tc and bgs_gemm_tc_silu over blocks of TCL_ROWS weight rows x TCL_TOKENS tokens.
// A wide tile is 16 rows x 32 tokens, each of its warps taking one class of the input's
// chunks (w, w + 8, ...) for all of the tile's outputs, its fragments loaded straight from
// global memory: past a few token blocks each weight is read again per 32 tokens and each
// token's row per 16 output rows, and the step is bound by those reads. Here the block's
// weights and token rows go through shared memory and each warp owns a 32-row x TCL_WN-token
// part of the block's outputs, visiting every chunk itself, class by class: class w's chunks
// in order into an accumulator with the wide tile's MMAs (the same two k-steps a chunk, the
// same fragments: a row sits at the same place of its 16-row MMA tile, a token at the same
// column of its 8), then that class sum added to the total in class order. That is the wide
// tile's warp w partial sum and its adds in warp order, so the same bits. A stage holds
// TCL_CH chunks of one class; TCL_ST stages are in flight (cp.async). The weights of the
// first stages are requested before the wait on the previous kernel, the token rows after.
// The SiLU form pairs a warp's two 16-row MMA tiles as 16 gate rows and the same 16 up rows,
// so silu(g) * u is computed in registers. Geometry from the host (`plan::TC_LARGE_*`).
#if !defined(BGS_TC_LARGE_WARP_ROWS) || !defined(BGS_TC_LARGE_WARP_TOKENS) || \
    !defined(BGS_TC_LARGE_CHUNKS) || !defined(BGS_TC_LARGE_STAGES)
#error "BGS_TC_LARGE_WARP_ROWS, _WARP_TOKENS, _CHUNKS and _STAGES must be defined (plan::TC_LARGE_*)"
#endif
#define TCL_WR BGS_TC_LARGE_WARP_ROWS
#define TCL_WC (BGS_TC_WARPS / TCL_WR)
#define TCL_WN BGS_TC_LARGE_WARP_TOKENS
#define TCL_NT (TCL_WN / 8)
#define TCL_ROWS (32 * TCL_WR)
#define TCL_TOKENS (TCL_WC * TCL_WN)
#define TCL_CH BGS_TC_LARGE_CHUNKS
#define TCL_ST BGS_TC_LARGE_STAGES
#if BGS_TC_WARPS % TCL_WR != 0 || TCL_WN % 8 != 0 || TCL_ST < 2 || TCL_ST > 5 || TCL_CH < 1
#error "large tiles: warp rows must divide the warps, warp tokens be a multiple of 8, 2..=5 stages"
#endif
#if BGS_TC_WARPS != 8 || TCL_ROWS % 64 != 0 || TCL_TOKENS % 64 != 0
#error "large tiles: 256 threads a block copying 64 rows a round (rows and tokens multiples of 64)"
#endif
// One stage in bgs_u4: the weights [TCL_CH][TCL_ROWS][4], then the token rows
// [TCL_CH][TCL_TOKENS][4] (a chunk of a row is 64 bytes: 4 x 16).
#define TCL_W_U4 (TCL_CH * TCL_ROWS * 4)
#define TCL_STAGE_U4 (TCL_CH * (TCL_ROWS + TCL_TOKENS) * 4)
// BGS_TCL_SKIP (timing only, through BGS_LLM_KERNEL_DEFINES; 0 by default): bit 1 leaves out
// the copies into shared memory, bit 2 the MMAs, so a step's time with either gone says what
// the other costs. The values are wrong with any bit set.
#ifndef BGS_TCL_SKIP
#define BGS_TCL_SKIP 0
#endif
#if BGS_HAVE_MMA
// Where the walk over the chunks is: class `cls` (chunks cls, cls + 8, ...), its j0-th chunk
// on; cls == the walk's end class (8 unless split) once past the last.
struct TclCursor {
    int cls, j0;
};
// Chunks of class cls of `chunks`.
__device__ __forceinline__ int tcl_class_len(int chunks, int cls) {
    return cls < chunks ? (chunks - cls + 7) / 8 : 0;
}
__device__ __forceinline__ void tcl_settle(TclCursor &c, int chunks, int cend) {
    while (c.cls < cend && c.j0 >= tcl_class_len(chunks, c.cls)) {
        c.cls++;
        c.j0 = 0;
    }
}
__device__ __forceinline__ int tcl_count(const TclCursor &c, int chunks) {
    return min(TCL_CH, tcl_class_len(chunks, c.cls) - c.j0);
}
#endif

// Split (`plan::Plan::tc_large_split`, the `_split` entry points): where a projection has
// fewer large tiles than multiprocessors (o, down_proj and QKV: 896 or 1,152 rows), each tile
// is computed by `groups` blocks, block z of a tile taking classes 8z/groups .. 8(z+1)/groups
// - 1. A split block stores each of its class sums (a warp's accumulator fragments, exactly
// the values the unsplit walk adds) to `part` as the class ends, instead of adding it to a
// total; the tile's last block (each counts itself in done[tile] after a fence, as the
// folded add-norm's blocks do) reads the eight class sums back through L2 and adds them in
// class order, + 0 for an empty class: the unsplit walk's adds, so the same bits.
// part: f32 [tiles][8 classes][2 * TCL_NT float4][256 threads] (`plan::TC_LARGE_SPLIT_PART_BYTES`
// a tile and class); done: u32 [tiles], zero between launches (the last block zeroes its own).
// Block x of a split grid is tile x / groups, class group x % groups; tile = y * tiles in a row
// + x / groups.
//
// SILU: `out` is the intermediate width; w holds the gate rows then the up rows, yo is act
// (wt). Otherwise yo is y (f32) of `out` rows.
template <bool SILU, bool SPLIT>
__device__ __forceinline__ void gemm_tc_large_body(const bgs_blk &bk, const wt *w, const wt *x,
                                                   void *yo, int out, int in, int n,
                                                   float *part = nullptr,
                                                   unsigned *done = nullptr, int groups = 1) {
#if BGS_HAVE_MMA
    BGS_SKIP_IF(SILU ? 16 : 32, bk.pdl);
    extern __shared__ bgs_u4 tcl_smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, q = lane % 4;
    const int wr = warp / TCL_WC, wc = warp % TCL_WC;
    const int t0 = bk.y * TCL_TOKENS;
    const int chunks = in / 32;
    // The block's row tile and the classes it walks ([cbeg, cend): all 8 unless split).
    const int bx = SPLIT ? bk.x / groups : bk.x;
    const int cbeg = SPLIT ? 8 * (bk.x % groups) / groups : 0;
    const int cend = SPLIT ? 8 * (bk.x % groups + 1) / groups : 8;
    // The global row of the block's weight row i; past the end, the last row (computed, never
    // stored: as the wide tiles load). SiLU: rows 32k .. 32k + 15 are gate rows (units u0 + 16k
    // ..), rows 32k + 16 .. the same units' up rows.
    auto grow = [&](int i) -> int {
        if (SILU) {
            const int u = min(bx * (TCL_ROWS / 2) + (i / 32) * 16 + i % 16, out - 1);
            return u + (i % 32 >= 16 ? out : 0);
        }
        return min(bx * TCL_ROWS + i, out - 1);
    };
    // A stage's copies: 16 bytes a thread a round, e = (jj * rows + i) * 4 + quarter (the smem
    // layout itself) = tid + 256 k. A round covers 64 rows, so thread tid copies quarter tid % 4
    // of rows tid / 4 + 64 s (s < TCL_ROWS / 64, and as many token rows): one source row per
    // s, computed once, and only the chunk's offset per copy. Token rows past n read row n - 1
    // (never stored).
    constexpr int WS = TCL_ROWS / 64, XS = TCL_TOKENS / 64;
    const wt *wsrc[WS];
    const wt *xsrc[XS];
#pragma unroll
    for (int k = 0; k < WS; k++) wsrc[k] = w + (size_t)grow(tid / 4 + 64 * k) * in + (tid % 4) * 8;
#pragma unroll
    for (int k = 0; k < XS; k++)
        xsrc[k] = x + (size_t)min(t0 + tid / 4 + 64 * k, n - 1) * in + (tid % 4) * 8;
    const unsigned dst0 = smem_u32(tcl_smem) + tid * 16;
    auto issue_w = [&](int stage, TclCursor c) {
        const unsigned d = dst0 + stage * (TCL_STAGE_U4 * 16);
        const int cnt = tcl_count(c, chunks);
#pragma unroll
        for (int jj = 0; jj < TCL_CH; jj++) {
            if ((BGS_TCL_SKIP & 1) || jj >= cnt) break;
            const int off = (c.cls + 8 * (c.j0 + jj)) * 32;
#pragma unroll
            for (int k = 0; k < WS; k++)
                cp_async16(d + (jj * TCL_ROWS * 4 + 256 * k) * 16, wsrc[k] + off, 16);
        }
    };
    auto issue_x = [&](int stage, TclCursor c) {
        const unsigned d = dst0 + (stage * TCL_STAGE_U4 + TCL_W_U4) * 16;
        const int cnt = tcl_count(c, chunks);
#pragma unroll
        for (int jj = 0; jj < TCL_CH; jj++) {
            if ((BGS_TCL_SKIP & 1) || jj >= cnt) break;
            const int off = (c.cls + 8 * (c.j0 + jj)) * 32;
#pragma unroll
            for (int k = 0; k < XS; k++)
                cp_async16(d + (jj * TCL_TOKENS * 4 + 256 * k) * 16, xsrc[k] + off, 16);
        }
    };
    auto advance = [&](TclCursor &c) {
        c.j0 += TCL_CH;
        tcl_settle(c, chunks, cend);
    };
    TclCursor ic{cbeg, 0};
    tcl_settle(ic, chunks, cend);
    const TclCursor first = ic;
    // The first stages' weights before the wait (weights never change during a step), their
    // token rows after it; one commit group a stage.
#pragma unroll
    for (int s = 0; s < TCL_ST - 1; s++) {
        if (ic.cls < cend) issue_w(s, ic);
        if (ic.cls < cend) advance(ic);
    }
    if (bk.pdl) BGS_PDL_BEGIN();
    ic = first;
#pragma unroll
    for (int s = 0; s < TCL_ST - 1; s++) {
        if (ic.cls < cend) {
            issue_x(s, ic);
            advance(ic);
        }
        cp_async_commit();
    }
    float acc[2][TCL_NT][4], tot[2][TCL_NT][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int j = 0; j < TCL_NT; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[m][j][k] = tot[m][j][k] = 0.f;
    TclCursor cc = first;
    int stage = 0;
    while (cc.cls < cend) {
        cp_async_wait_pending(TCL_ST - 2);  // this stage's copies (this thread's) are in
        __syncthreads();                    // ... and every thread's; the stage before is free
        const int refill = (stage + TCL_ST - 1) % TCL_ST;
        if (ic.cls < cend) {
            issue_w(refill, ic);
            issue_x(refill, ic);
            advance(ic);
        }
        cp_async_commit();
        const bgs_u4 *sw = tcl_smem + stage * TCL_STAGE_U4, *sx = sw + TCL_W_U4;
        const int cnt = tcl_count(cc, chunks);
#pragma unroll
        for (int jj = 0; jj < TCL_CH; jj++) {
            if (jj >= cnt) break;
            bgs_u4 a[2][2], b[TCL_NT];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    a[m][h] = sw[(jj * TCL_ROWS + wr * 32 + m * 16 + h * 8 + g) * 4 + q];
#pragma unroll
            for (int j = 0; j < TCL_NT; j++)
                b[j] = sx[(jj * TCL_TOKENS + wc * TCL_WN + j * 8 + g) * 4 + q];
            if (BGS_TCL_SKIP & 2) {
                // (Timing only: keep the fragment loads, drop the MMAs.)
                acc[0][0][0] += __uint_as_float(a[0][0].a ^ a[1][1].d ^ b[0].a ^ b[TCL_NT - 1].d);
                continue;
            }
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const unsigned s0[4] = {a[m][0].a, a[m][1].a, a[m][0].b, a[m][1].b};
                const unsigned s1[4] = {a[m][0].c, a[m][1].c, a[m][0].d, a[m][1].d};
#pragma unroll
                for (int j = 0; j < TCL_NT; j++) {
                    mma_16816(acc[m][j], s0, b[j].a, b[j].b);
                    mma_16816(acc[m][j], s1, b[j].c, b[j].d);
                }
            }
        }
        const int cls = cc.cls;
        advance(cc);
        if (SPLIT && cc.cls != cls) {
            // Class cls is done: its sum to `part` (the last block adds them in class order).
            // (16 bytes a store: bgs_u4, the kernels' own vector type, holding the f32 bits.)
            bgs_u4 *pp = (bgs_u4 *)part + ((size_t)(bk.y * (bk.gx / groups) + bx) * 8 + cls) *
                                              (2 * TCL_NT) * 256 + tid;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < TCL_NT; j++) {
                    bgs_u4 v;
                    v.a = __float_as_uint(acc[m][j][0]);
                    v.b = __float_as_uint(acc[m][j][1]);
                    v.c = __float_as_uint(acc[m][j][2]);
                    v.d = __float_as_uint(acc[m][j][3]);
                    pp[(m * TCL_NT + j) * 256] = v;
#pragma unroll
                    for (int k = 0; k < 4; k++) acc[m][j][k] = 0.f;
                }
        } else if (cc.cls != cls) {
            // Class cls is done: its sum into the total (the wide tile's warp-order adds),
            // then + 0 for each empty class after it (a wide tile's warps without chunks).
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < TCL_NT; j++)
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        tot[m][j][k] = cls == 0 ? acc[m][j][k] : tot[m][j][k] + acc[m][j][k];
                        acc[m][j][k] = 0.f;
                    }
            for (int e = cls + 1; e < cc.cls; e++)
#pragma unroll
                for (int m = 0; m < 2; m++)
#pragma unroll
                    for (int j = 0; j < TCL_NT; j++)
#pragma unroll
                        for (int k = 0; k < 4; k++) tot[m][j][k] = tot[m][j][k] + 0.f;
        }
        stage = stage + 1 == TCL_ST ? 0 : stage + 1;
    }
    cp_async_wait_all();
    if (SPLIT) {
        // The tile's last block adds the class sums in class order (the unsplit walk's adds).
        __shared__ unsigned last;
        const int tile = bk.y * (bk.gx / groups) + bx;
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(done + tile, 1u) == (unsigned)groups - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        for (int cls = 0; cls < 8; cls++) {
            const bgs_u4 *pp =
                (const bgs_u4 *)part + ((size_t)tile * 8 + cls) * (2 * TCL_NT) * 256 + tid;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < TCL_NT; j++) {
                    float v[4] = {0.f, 0.f, 0.f, 0.f};
                    if (cls < chunks) {
                        const float *e = (const float *)(pp + (m * TCL_NT + j) * 256);
                        asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                                     : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                                     : "l"(e)
                                     : "memory");
                    }
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        tot[m][j][k] = cls == 0 ? v[k] : tot[m][j][k] + v[k];
                }
        }
        if (tid == 0) done[tile] = 0u;
    }
    // The accumulator fragments: k 0, 1 at (row g, tokens 2q, 2q + 1), k 2, 3 at row g + 8.
#pragma unroll
    for (int j = 0; j < TCL_NT; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int t = t0 + wc * TCL_WN + j * 8 + 2 * q + (k & 1);
            if (t >= n) continue;
            if (SILU) {
                const int u = bx * (TCL_ROWS / 2) + wr * 16 + g + (k >= 2 ? 8 : 0);
                if (u < out)
                    ((wt *)yo)[(size_t)t * out + u] = silu_times(tot[0][j][k], tot[1][j][k]);
            } else {
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const int r = bx * TCL_ROWS + wr * 32 + m * 16 + g + (k >= 2 ? 8 : 0);
                    if (r < out) ((float *)yo)[(size_t)t * out + r] = tot[m][j][k];
                }
            }
        }
#else
    __trap();  // never planned: 16-bit models on sm_80+ only (`plan::tc_gemm_applies`)
#endif
}
extern "C" __global__ void __launch_bounds__(BGS_TC_WARPS * 32)
    bgs_gemm_tc_large(const wt *w, const wt *x, float *y, int out, int in, int n) {
    gemm_tc_large_body<false, false>(BGS_LAUNCH_BLK, w, x, y, out, in, n);
}
extern "C" __global__ void __launch_bounds__(BGS_TC_WARPS * 32)
    bgs_gemm_tc_silu_large(const wt *w, const wt *x, wt *act, int inter, int in, int n,
                           const void *pf, long long pf_bytes) {
    prefetch_lines_l2(2, pf, pf_bytes);
    gemm_tc_large_body<true, false>(BGS_LAUNCH_BLK, w, x, act, inter, in, n);
}
extern "C" __global__ void __launch_bounds__(BGS_TC_WARPS * 32)
    bgs_gemm_tc_large_split(const wt *w, const wt *x, float *y, int out, int in, int n,
                            float *part, unsigned *done, int groups) {
    gemm_tc_large_body<false, true>(BGS_LAUNCH_BLK, w, x, y, out, in, n, part, done, groups);
}
extern "C" __global__ void __launch_bounds__(BGS_TC_WARPS * 32)
    bgs_gemm_tc_silu_large_split(const wt *w, const wt *x, wt *act, int inter, int in, int n,
                                 const void *pf, long long pf_bytes, float *part,
                                 unsigned *done, int groups) {
    prefetch_lines_l2(2, pf, pf_bytes);
    gemm_tc_large_body<true, true>(BGS_LAUNCH_BLK, w, x, act, inter, in, n, part, done, groups);
}

// ---- The persistent form: a whole op list in one launch ----
//
// bgs_persistent runs a table of ops (struct bgs_op, include/bgs_llm_ops.h, written by
// `persistent::encode` from the same op list the host would launch one kernel at a time):
// for each op, the grid's blocks take the op's virtual blocks v = blockIdx.x, + gridDim.x, ...
// and run the kernel's body as block (v % gx, v / gx) of the op's grid, then every block
// waits at a grid barrier before the next op. Each body computes exactly what its launch
// would (same blocks, same threads per block, same reductions), so the step's bits are
// those of the launched ops; what goes is a launch and its drain per op. The host launches it
// cooperatively, so every block of the grid is resident (a grid barrier needs that) or the
// launch fails.
//
// While an op runs, the grid also prefetches into L2 the weights of a later op (the table's
// pf_ptr / pf_bytes, chosen by the host): weights never change during a step, so they can
// stream from memory while the barriers and the small ops run.
#include "bgs_llm_ops.h"

// One table argument, converted to the body's parameter type by the call (pointers whole, a
// 4-byte int or float from the low bytes, long long whole): the body's signature, which is
// its kernel's, decides; the host wrote the arguments in that order and kind.
struct bgs_op_arg {
    bgs_u64 v;
    template <class T> __device__ __forceinline__ operator T *() const { return (T *)v; }
    __device__ __forceinline__ operator int() const { return (int)(unsigned)v; }
    __device__ __forceinline__ operator float() const { return __uint_as_float((unsigned)v); }
    __device__ __forceinline__ operator long long() const { return (long long)v; }
};

__device__ __forceinline__ void bgs_run_op(const struct bgs_op *op, const bgs_blk &bk) {
    const bgs_op_arg *a = (const bgs_op_arg *)op->args;
    switch (op->kernel) {
    case BGS_OP_EMBED:
        embed_body(bk, a[0], a[1], a[2], a[3]);
        break;
    case BGS_OP_ADD_RMSNORM:
        add_rmsnorm_body(bk, a[0], a[1], a[2], a[3], a[4], a[5]);
        break;
    case BGS_OP_ROPE_KV:
        rope_kv_body(bk, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
        break;
    case BGS_OP_ATTENTION:
        attention_body(bk, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                       a[11], a[12]);
        break;
    case BGS_OP_ATTENTION_MMA:
        attention_mma_body(bk, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                           a[10], a[11], a[12]);
        break;
    case BGS_OP_SILU_MUL:
        silu_mul_body(bk, a[0], a[1], a[2], a[3]);
        break;
    case BGS_OP_GATHER_ROWS:
        gather_rows_body(bk, a[0], a[1], a[2], a[3]);
        break;
    case BGS_OP_ARGMAX:
        argmax_body(bk, a[0], a[1], a[2]);
        break;
    case BGS_OP_PROJ:
        proj_rows<false>(bk, a[0], a[1], a[2], a[3], a[4], a[5]);
        break;
    case BGS_OP_PROJ_ADD:
        proj_rows<true>(bk, a[0], a[1], a[2], a[3], a[4], a[5]);
        break;
    case BGS_OP_PROJ_NORM_SILU:
        proj_norm_silu_body(bk, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
        break;
    case BGS_OP_PROJ_NORM_ROPE_KV:
        proj_norm_rope_kv_body(bk, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                               a[10], a[11], a[12], a[13], a[14], a[15], a[16]);
        break;
    case BGS_OP_GEMM_TC:
        gemm_tc_body<false, BGS_TC_TOKENS>(bk, a[0], a[1], a[2], a[3], a[4], a[5]);
        break;
    // (BGS_OP_GEMM_TC_SILU takes two warp groups, more than a persistent block: never
    // encoded, `persistent::encode` refuses it.)
    case BGS_OP_NOP:  // measures the barriers alone (GpuModel::persistent_barrier_ms)
        break;
    default:
        __trap();  // the host encodes only the kernels above
    }
}

// Every block of the grid arrives, then leaves once all have: the count reaches `target` (the
// barrier's number times the grid). Thread 0's release add publishes the block's writes
// (ordered before it by the first __syncthreads), its acquire loads make every other block's
// visible before the second __syncthreads lets the block's threads on.
__device__ __forceinline__ void bgs_grid_sync(unsigned *count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned seen;
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// Prefetch [p, p + bytes) into L2, one 128-byte line per thread and step across the grid.
__device__ __forceinline__ void bgs_prefetch_l2(bgs_u64 p, bgs_u64 bytes) {
    const bgs_u64 step = 128ull * gridDim.x * blockDim.x;
    for (bgs_u64 off = 128ull * (blockIdx.x * blockDim.x + threadIdx.x); off < bytes; off += step)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

__device__ __forceinline__ bgs_u64 bgs_globaltimer() {
    bgs_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Blocks a multiprocessor must fit (__launch_bounds__' second argument: it caps the
// registers a thread may use at 65536 / (256 * this)). Experiments set it through
// BGS_LLM_KERNEL_DEFINES.
#ifndef BGS_OP_MIN_BLOCKS
#define BGS_OP_MIN_BLOCKS 1
#endif

// sync: two words, zero at launch (the last block out zeroes them again for the next replay):
// [0] the barriers' arrivals, [1] the blocks that have finished. stamps (profiling, may be
// null): block 0 writes the global timer as it starts each op, and once more at its end.
extern "C" __global__ void __launch_bounds__(BGS_OP_THREADS, BGS_OP_MIN_BLOCKS)
    bgs_persistent(const struct bgs_op *ops, int n_ops, unsigned *sync, bgs_u64 *stamps) {
    for (int k = 0; k < n_ops; k++) {
        const struct bgs_op *op = ops + k;
        if (stamps && blockIdx.x == 0 && threadIdx.x == 0) stamps[k] = bgs_globaltimer();
        if (op->pf_bytes) bgs_prefetch_l2(op->pf_ptr, op->pf_bytes);
        bgs_blk bk;
        bk.gx = (int)op->gx;
        bk.gy = (int)op->gy;
        bk.nt = (int)op->block;
        bk.pt = min(bk.nt, BGS_OP_THREADS);
        bk.pdl = false;
        const int nv = bk.gx * bk.gy;
        for (int v = blockIdx.x; v < nv; v += gridDim.x) {
            bk.x = v % bk.gx;
            bk.y = v / bk.gx;
            if ((int)threadIdx.x < bk.pt) bgs_run_op(op, bk);
            // The next virtual block reuses the shared memory this one may still read.
            __syncthreads();
        }
        if (k + 1 < n_ops) {
            // The next record's lines into L1 while the barrier waits (the table never
            // changes), so its fields are not an L2 round trip after it: a record of 200 bytes
            // at any 8-byte offset touches at most 3 lines, each holding one of bytes 0, 128
            // and its last.
            if (threadIdx.x < 3) {
                const unsigned at = threadIdx.x < 2 ? 128u * threadIdx.x : sizeof(struct bgs_op) - 1u;
                asm volatile("prefetch.global.L1 [%0];" ::"l"((const char *)(op + 1) + at));
            }
            bgs_grid_sync(sync, (unsigned)(k + 1) * gridDim.x);
        }
    }
    if (stamps && blockIdx.x == 0 && threadIdx.x == 0) stamps[n_ops] = bgs_globaltimer();
    if (threadIdx.x == 0) {
        // Every block has passed the last barrier before any adds here, so the last one out
        // may zero both words: no block reads them again in this launch.
        if (atomicAdd(sync + 1, 1u) == gridDim.x - 1) {
            sync[0] = 0u;
            sync[1] = 0u;
            __threadfence();
        }
    }
}
