/* bgs GPU executor kernels (CUDA C++), compiled by NVRTC at start-up for the device's
 * architecture with -rdc=true and linked against libcudadevrt.a by nvJitLink (device-side
 * graph launch). See docs/gpu.md for the design.
 *
 * Every struct shared with the host comes from a header generated from the Rust definitions:
 * the ring's from include/bgs_ring.h, the executor's own and the io_uring SQE/CQE from
 * include/bgs_gpu.h (src/layout.rs, src/c_header.rs); bgs_layout_probe reports their layout as
 * this compiler laid it out, and start-up compares it with Rust's. Host-shared words are accessed with system-scope acquire/release
 * (docs/ring.md, "CUDA producers and consumers").
 */
#if defined(__CUDACC_RTC__)
/* NVRTC has no system headers and no __builtin_offsetof, so the header's static asserts
 * cannot be evaluated here: provide the fixed-width types and turn the asserts off. The same
 * source is compiled with clang (-x cuda) in CI with the asserts on, and bgs_layout_probe
 * reports the offsets on the device at start-up. */
#define BGS_FIXED_TYPES
typedef unsigned char bgs_u8;
typedef unsigned short bgs_u16;
typedef unsigned int bgs_u32;
typedef unsigned long long bgs_u64;
#define BGS_STATIC_ASSERT(cond, msg)
#define BGS_OFFSETOF(type, field) 0
#endif
#include "bgs_ring.h"
#include "bgs_protocol.h"
#include "bgs_gpu.h"

#ifndef BGS_VALID_STATUS_MASK
#error "BGS_VALID_STATUS_MASK (bit s set when status s < 32 is a known status) must be defined"
#endif

/* ---- system-scope accessors for host-shared words ---- */
__device__ __forceinline__ bgs_u64 ld_acquire_sys(const bgs_u64 *p) {
    bgs_u64 v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ bgs_u64 ld_relaxed_sys(const bgs_u64 *p) {
    bgs_u64 v;
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ bgs_u32 ld_acquire_sys32(const bgs_u32 *p) {
    bgs_u32 v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ bgs_u64 ld_acquire_gpu(const bgs_u64 *p) {
    bgs_u64 v;
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(bgs_u64 *p, bgs_u64 v) {
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys32(bgs_u32 *p, bgs_u32 v) {
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ bgs_u64 cas_sys(bgs_u64 *p, bgs_u64 expect, bgs_u64 desired) {
    return atomicCAS_system((unsigned long long *)p, expect, desired);
}

__device__ __forceinline__ struct bgs_ring_header *ring_header(bgs_u8 *ring) {
    return (struct bgs_ring_header *)ring;
}
__device__ __forceinline__ struct bgs_request_slot *request_slot(bgs_u8 *ring, bgs_u64 pos) {
    struct bgs_ring_header *h = ring_header(ring);
    bgs_u64 mask = (bgs_u64)h->request_capacity - 1;
    return (struct bgs_request_slot *)(ring + h->request_slots_offset +
                                       (pos & mask) * (bgs_u64)BGS_RING_REQUEST_SLOT_SIZE);
}
__device__ __forceinline__ struct bgs_completion_slot *completion_slot(bgs_u8 *ring, bgs_u64 pos) {
    struct bgs_ring_header *h = ring_header(ring);
    bgs_u64 mask = (bgs_u64)h->completion_capacity - 1;
    return (struct bgs_completion_slot *)(ring + h->completion_slots_offset +
                                          (pos & mask) * (bgs_u64)BGS_RING_COMPLETION_SLOT_SIZE);
}

__device__ __forceinline__ void record_error(struct bgs_gpu_ctl *ctl, bgs_u32 err, bgs_u32 where) {
    if (atomicCAS_system(&ctl->error, 0u, err) == 0u) {
        st_release_sys32(&ctl->error_where, where);
    }
}

/* The reply plan of a request (src/plan.rs `plan`): the op rules come from the generated op
 * table (bgs_op_* in bgs_protocol.h). Returns the repeat count for gemm8/fft32 (1..=256), 0 when
 * no compute runs. Never called for BGS_RING_OP_CANCEL entries: the dispatchers skip them. */
__device__ __forceinline__ bgs_u32 plan(bgs_u32 op, bgs_u32 param, bgs_u32 words, bgs_u32 *status,
                                        bgs_u32 *out_words, bgs_u32 *from_out) {
    *from_out = 0;
    *out_words = 0;
    if (op == BGS_RING_OP_REJECT) {
        bool known = param < 32 && ((BGS_VALID_STATUS_MASK >> param) & 1u);
        *status = known ? param : BGS_STATUS_INTERNAL;
        return 0;
    }
    /* The ops the GPU serves; generate needs a model, which this executor does not have. */
    if (op != BGS_OP_ECHO && op != BGS_OP_GEMM8 && op != BGS_OP_FFT32) {
        *status = BGS_STATUS_UNKNOWN_OP;
        return 0;
    }
    /* The framer checked these; re-checked so that a producer bypassing it gets an error. */
    const bgs_u32 bad = bgs_op_check(op, words, param);
    if (bad != 0) {
        *status = bad;
        return 0;
    }
    *status = BGS_STATUS_OK;
    *out_words = bgs_op_reply_words(op, words);
    if (op == BGS_OP_ECHO) return 0;
    *from_out = 1;
    return bgs_op_param_value(op, param);
}

/* ---- the resident scheduler: one warp, device-launched, tail-relaunches itself ----
 * Per round: the lanes read the busy words of up to 64 slots (device memory), then the seq
 * words of up to 32 consecutive request slots at once (one PCIe round trip), then op / words /
 * param of the published prefix, and claim that whole prefix with one CAS on request_head.
 * Each claimed request gets a free slot (round robin) and one graph launch: the slot's fused
 * work graph (start -> 2^k library calls -> publish) when the request needs no compute or a
 * power-of-two repeat count, else the slot's start graph, which tail-launches the exact
 * repeat chain and the publish graph. After an idle round only one seq is read (a batch of
 * one), so an idle scheduler does not poll 32 host lines. BGS_RING_OP_CANCEL entries (a
 * connection ended) are claimed with the rest and freed without a slot or an answer: the GPU
 * keeps no per-connection state, and a completion for them would be a stray reply. */
#define FULL_MASK 0xffffffffu
__device__ __forceinline__ bgs_u64 shfl64(bgs_u64 v, int src) {
    return __shfl_sync(FULL_MASK, v, src);
}
__device__ __forceinline__ bgs_u64 globaltimer_ns() {
    bgs_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* Fire-and-forget launch of a slot's graph. A fused work graph frees its slot (publish clears
 * busy) while its execution is still finishing, and a device graph cannot be launched while it
 * runs (cudaErrorInvalidValue): retry that for up to 20 ms before reporting it. */
__device__ __forceinline__ cudaError_t launch_work(bgs_u64 g, bgs_u32 *retries) {
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)g, cudaStreamGraphFireAndForget);
    if (err != cudaErrorInvalidValue) return err;
    const bgs_u64 t0 = globaltimer_ns();
    while (err == cudaErrorInvalidValue && globaltimer_ns() - t0 < 20000000ull) {
        *retries += 1;
        __nanosleep(200);
        err = cudaGraphLaunch((cudaGraphExec_t)g, cudaStreamGraphFireAndForget);
    }
    return err;
}

extern "C" __global__ void bgs_scheduler(struct bgs_gpu_sched *s) {
    if (blockIdx.x != 0 || blockDim.x != 32) return;
    const bgs_u32 lane = threadIdx.x;
    bgs_u8 *ring = (bgs_u8 *)s->ring;
    struct bgs_gpu_ctl *ctl = (struct bgs_gpu_ctl *)s->ctl;
    struct bgs_gpu_slot_ctl *sc = (struct bgs_gpu_slot_ctl *)s->slot_ctl;
    const bgs_u64 *fused = (const bgs_u64 *)s->fused;
    struct bgs_ring_header *h = ring_header(ring);
    const bgs_u32 n = s->nslots;
    const bgs_u32 budget = s->budget;
    const bool lanes_launch = s->lanes != 0;
    bgs_u32 next = s->next;
    bgs_u32 launches = 0;
    bgs_u32 rounds = 0;
    bool empty = true; /* the last seq read found nothing: read one seq, not a batch */
    bgs_u32 batches = 0;
    bgs_u32 retries = 0;
    bgs_u64 pos = shfl64(lane == 0 ? ld_relaxed_sys(&h->request_head) : 0, 0);
    for (;;) {
        if ((rounds++ & 63u) == 0) {
            bgs_u32 stop = lane == 0 ? ld_acquire_sys32(&ctl->stop) : 0;
            if (__shfl_sync(FULL_MASK, stop, 0)) {
                atomicAdd(&s->retries, retries);
                if (lane == 0) {
                    s->next = next;
                    s->executions += 1;
                    s->batches += batches;
                    st_release_sys32(&ctl->stopped, 1);
                }
                return; /* no relaunch: the executor is shutting down */
            }
        }
        if (launches >= budget) break;
        /* Free slots (a request is only taken when it can be launched at once). */
        const bool f0 = lane < n && ((volatile bgs_u32 *)&sc[lane].busy)[0] == 0;
        const bool f1 = lane + 32 < n && ((volatile bgs_u32 *)&sc[lane + 32].busy)[0] == 0;
        const bgs_u64 freemask = (bgs_u64)__ballot_sync(FULL_MASK, f0) |
                                 ((bgs_u64)__ballot_sync(FULL_MASK, f1) << 32);
        bgs_u32 want = (bgs_u32)__popcll(freemask);
        if (want == 0) continue;
        if (want > 32) want = 32;
        if (want > budget - launches) want = budget - launches;
        if (empty) want = 1;
        /* The seq words of positions pos .. pos + want - 1, in parallel. */
        long long d = -1;
        if (lane < want) {
            const bgs_u64 seq = ld_acquire_sys(&request_slot(ring, pos + lane)->seq);
            d = (long long)(seq - (pos + lane + 1));
        }
        const bgs_u32 ready = __ballot_sync(FULL_MASK, lane < want && d == 0);
        const bgs_u32 m = ready == FULL_MASK ? 32u : (bgs_u32)(__ffs(~ready) - 1);
        if (m == 0) {
            const long long d0 = shfl64((bgs_u64)d, 0);
            if (d0 > 0) {
                /* Another consumer took it: reload the head. */
                pos = shfl64(lane == 0 ? ld_relaxed_sys(&h->request_head) : 0, 0);
            } else {
                empty = true; /* empty (or the oldest claimed entry is not published yet) */
            }
            continue;
        }
        /* op / words / param of the published prefix (after this lane's acquire of its seq),
         * and one CAS claiming all m (issued together: the loads do not feed the CAS). */
        bgs_u32 op = 0, words = 0, param = 0;
        if (lane < m) {
            const volatile struct bgs_request_entry *e = &request_slot(ring, pos + lane)->entry;
            op = e->op;
            words = e->words;
            param = e->param;
        }
        bgs_u64 old = 0;
        if (lane == 0) old = cas_sys(&h->request_head, pos, pos + m);
        old = shfl64(old, 0);
        if (old != pos) {
            pos = old;
            continue;
        }
        /* Cancel entries: free their ring slots now (consumed, never answered). */
        const bool cancel = lane < m && op == BGS_RING_OP_CANCEL;
        const bool work = lane < m && !cancel;
        const bgs_u32 workmask = __ballot_sync(FULL_MASK, work);
        const bgs_u32 nwork = (bgs_u32)__popc(workmask);
        if (cancel) {
            st_release_sys(&request_slot(ring, pos + lane)->seq,
                           pos + lane + (bgs_u64)h->request_capacity);
        }
        /* The i-th work lane takes the i-th free slot at or after the round-robin cursor. */
        const bgs_u32 rank = (bgs_u32)__popc(workmask & ((1u << lane) - 1u));
        int slot = -1;
        bgs_u64 g = 0;
        if (work) {
            bgs_u32 c = 0;
            for (bgs_u32 k = 0; k < n; k++) {
                bgs_u32 j = next + k;
                if (j >= n) j -= n;
                if ((freemask >> j) & 1ull) {
                    if (c == rank) {
                        slot = (int)j;
                        break;
                    }
                    c++;
                }
            }
            if (words > BGS_RING_SLOT_WORDS) words = BGS_RING_SLOT_WORDS;
            bgs_u32 status, out_words, from_out;
            const bgs_u32 r = plan(op, param, words, &status, &out_words, &from_out);
            const bgs_u64 *fs = fused + (bgs_u64)slot * BGS_GPU_FUSED;
            if (r == 0) {
                g = fs[BGS_GPU_FUSED_NONE];
            } else if ((r & (r - 1)) == 0) {
                g = fs[(op == BGS_OP_GEMM8 ? 0 : BGS_GPU_REPEAT_BITS) + (31 - __clz(r))];
            } else {
                g = s->work[slot]; /* start graph: exact chain for other repeat counts */
            }
            ((volatile bgs_u64 *)&sc[slot].pos)[0] = pos + lane;
            ((volatile bgs_u32 *)&sc[slot].busy)[0] = 1;
            __threadfence();
        }
        __syncwarp();
        cudaError_t err = cudaSuccess;
        if (lanes_launch) {
            if (work) err = launch_work(g, &retries);
        } else {
            for (bgs_u32 i = 0; i < m; i++) {
                const bgs_u64 gi = shfl64(g, (int)i);
                if (lane == 0 && ((workmask >> i) & 1u) && err == cudaSuccess)
                    err = launch_work(gi, &retries);
            }
        }
        if (__any_sync(FULL_MASK, err != cudaSuccess)) {
            /* Requests stay unanswered on the device; the host's monitor answers the rest of
             * the ring with Internal once it sees the error. */
            if (err != cudaSuccess) record_error(ctl, (bgs_u32)err, 1);
            atomicAdd(&s->retries, retries);
            if (lane == 0) s->next = next;
            return;
        }
        if (nwork != 0) {
            const int last = __shfl_sync(FULL_MASK, slot, 31 - __clz((int)workmask));
            next = (bgs_u32)last + 1;
            if (next >= n) next = 0;
        }
        launches += nwork;
        batches++;
        if (lane == 0) s->dispatched += nwork;
        pos += m;
        empty = false;
    }
    atomicAdd(&s->retries, retries);
    if (lane != 0) return;
    s->next = next;
    s->executions += 1; /* device memory: only the scheduler writes it */
    s->batches += batches;
    /* Before the 120 fire-and-forget launches per execution: run again after this execution
     * and its children finish. */
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)s->self_exec, cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) record_error(ctl, (bgs_u32)err, 2);
}

/* ---- per-slot start: copy-in, free the ring slot, plan, launch the repeat chain ---- */
extern "C" __global__ void bgs_slot_start(bgs_u8 *ring, struct bgs_gpu_ctl *ctl,
                                          struct bgs_gpu_slot_ctl *sc, struct bgs_gpu_slot *s,
                                          bgs_u32 fused) {
    __shared__ const struct bgs_request_entry *e;
    __shared__ struct bgs_request_slot *rs;
    __shared__ bgs_u64 pos;
    __shared__ bgs_u64 meta_raw[BGS_GPU_ENTRY_META_WORDS / 2]; /* the entry before its payload */
    bgs_u32 *meta = (bgs_u32 *)meta_raw;
    __shared__ bgs_u32 words;
    const bgs_u32 t = threadIdx.x;
    if (t == 0) {
        pos = ((volatile bgs_u64 *)&sc->pos)[0];
        if (pos == BGS_GPU_STAGED) {
            rs = 0;
            e = &sc->staged;
            __threadfence_system();
        } else {
            /* The scheduler's lane acquired seq == pos + 1 (synchronizing with the producer's
             * release) before it launched this graph, and the launch orders this grid after
             * that acquire: the entry can be read at once, without another PCIe round trip. */
            rs = request_slot(ring, pos);
            e = &rs->entry;
        }
    }
    __syncthreads();
    /* One parallel pass over host memory (each read is a PCIe round trip): the header words
     * and every payload word (the slot always has room for 256). */
    const volatile bgs_u32 *src = e->payload;
    if (t < BGS_GPU_ENTRY_META_WORDS) meta[t] = ((const volatile bgs_u32 *)e)[t];
    for (bgs_u32 i = t; i < BGS_RING_SLOT_WORDS; i += blockDim.x) s->input[i] = src[i];
    __syncthreads();
    if (t == 0) {
        const struct bgs_request_entry *m = (const struct bgs_request_entry *)meta;
        bgs_u32 w = m->words;
        words = w > BGS_RING_SLOT_WORDS ? BGS_RING_SLOT_WORDS : w;
        s->conn = m->conn;
        s->conn_seq = m->conn_seq;
        s->request_id = m->request_id;
        s->route = m->route;
        s->op = m->op;
        s->publish_ns = m->publish_ns;
        s->param = m->param;
        s->words = words;
    }
    __syncthreads();
    if (t != 0) return;
    if (rs != 0) {
        /* Consumed: free the request slot for the producer of pos + capacity. */
        st_release_sys(&rs->seq, pos + (bgs_u64)ring_header(ring)->request_capacity);
    }
    bgs_u32 status, out_words, from_out;
    bgs_u32 r = plan(s->op, s->param, words, &status, &out_words, &from_out);
    s->status = status;
    s->out_words = out_words;
    s->from_out = from_out;
    /* fused: this graph's own nodes run the compute and the publish; host launch: the host
     * thread launches the rest. */
    if (fused || !s->device_chain) return;
    if (r != 0) {
        const int which = s->op == BGS_OP_GEMM8 ? 0 : 1;
        for (int k = 0; k < BGS_GPU_REPEAT_BITS; k++) {
            if ((r >> k) & 1u) {
                cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)s->chain[which][k], cudaStreamGraphTailLaunch);
                if (err != cudaSuccess) {
                    atomicAdd((unsigned long long *)&ctl->chain_errors, 1ull);
                    s->status = BGS_STATUS_INTERNAL;
                    s->out_words = 0;
                    break;
                }
            }
        }
    }
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)s->publish, cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) record_error(ctl, (bgs_u32)err, 4);
}

/* ---- GPU-written SENDs ---- */
__device__ __forceinline__ struct bgs_tx_entry *tx_entry(const struct bgs_gpu_tx *tx, bgs_u32 idx) {
    const struct bgs_tx_header *th = (const struct bgs_tx_header *)tx->table;
    return (struct bgs_tx_entry *)(tx->table + th->entries_offset) + idx;
}

/* The entry of `cookie` (the host's insert probes the same window), or -1, with a consistent
 * snapshot of its fd and turn. One 16-byte load reads cookie, fd and next_seq together; after a
 * full fence the cookie is read again: the host tombstones an entry (release) before it writes
 * anything of a new connection into it, so an unchanged cookie means fd and next_seq were this
 * connection's (a stale next_seq is only an older turn: the reply then goes to the host). */
__device__ __forceinline__ int tx_lookup(const struct bgs_gpu_tx *tx, bgs_u64 cookie, bgs_u32 *fd,
                                         bgs_u32 *next_seq) {
    const struct bgs_tx_header *th = (const struct bgs_tx_header *)tx->table;
    const bgs_u32 log2 = th->capacity_log2;
    const bgs_u32 h = log2 == 0 ? 0u : (bgs_u32)((cookie * BGS_TX_HASH_MUL) >> (64 - log2));
    const bgs_u32 mask = (1u << log2) - 1u;
    for (bgs_u32 i = 0; i < BGS_TX_PROBES; i++) {
        const bgs_u32 idx = (h + i) & mask;
        struct bgs_tx_entry *e = tx_entry(tx, idx);
        bgs_u64 c, w;
        asm volatile("ld.relaxed.sys.v2.u64 {%0, %1}, [%2];" : "=l"(c), "=l"(w) : "l"(e) : "memory");
        if (c == cookie) {
            __threadfence_system();
            if (ld_acquire_sys(&e->cookie) != cookie) return -1;
            *fd = (bgs_u32)w;
            *next_seq = (bgs_u32)(w >> 32);
            return (int)idx;
        }
        if (c == 0) return -1;
    }
    return -1;
}

/* Write one SQE into the GPU's submission queue and publish it. Publish kernels of several
 * slots run at once: each claims an index (device atomics), waits for room (the kernel's SQPOLL
 * thread advances sq_head), fills the entry, and publishes the tail in claim order. */
__device__ void tx_submit(struct bgs_gpu_tx *tx, bgs_u32 opcode, bgs_u32 fd, bgs_u64 off,
                          bgs_u64 addr, bgs_u32 len, bgs_u32 op_flags, bgs_u64 addr3,
                          bgs_u64 user_data) {
    struct bgs_tx_header *th = (struct bgs_tx_header *)tx->table;
    const bgs_u32 my = atomicAdd(&tx->reserve, 1u);
    const bgs_u32 *sq_head = (const bgs_u32 *)(tx->rings + tx->off_sq_head);
    bool counted = false;
    while (my - ld_acquire_sys32(sq_head) >= tx->sq_entries) {
        if (!counted) {
            counted = true;
            atomicAdd_system((unsigned long long *)&th->gpu_sq_full, 1ull);
        }
        __nanosleep(1000);
    }
    /* Built in registers, then stored as whole u64 words in order. */
    union {
        struct bgs_io_uring_sqe e;
        bgs_u64 w[BGS_SQE_BYTES / 8];
    } sqe;
    sqe.e.opcode = (bgs_u8)opcode;
    sqe.e.flags = 0;
    sqe.e.ioprio = 0;
    sqe.e.fd = (int)fd;
    sqe.e.off_or_addr2 = off;
    sqe.e.addr_or_splice_off_in = addr;
    sqe.e.len = len;
    sqe.e.op_flags = op_flags;
    sqe.e.user_data = user_data;
    sqe.e.buf = 0;
    sqe.e.personality = 0;
    sqe.e.splice_fd_in_or_file_index_or_addr_len = 0;
    sqe.e.addr3_or_cmd[0] = addr3;
    sqe.e.addr3_or_cmd[1] = 0;
    volatile bgs_u64 *q = (volatile bgs_u64 *)(tx->sqes + (bgs_u64)(my & tx->sq_mask) * BGS_SQE_BYTES);
#pragma unroll
    for (int i = 0; i < BGS_SQE_BYTES / 8; i++) q[i] = sqe.w[i];
    while (((volatile bgs_u32 *)&tx->committed)[0] != my) {
    }
    __threadfence_system(); /* the payload and the SQE before the tail */
    st_release_sys32((bgs_u32 *)(tx->rings + tx->off_sq_tail), my + 1);
    __threadfence();
    atomicExch(&tx->committed, my + 1);
}

/* ---- per-slot publish: push the completion (Vyukov push, CAS on the tail), free the slot ----
 * The tail position comes from a device-memory hint (the last position any publish kernel of
 * this executor claimed, plus one) instead of a PCIe read of completion_tail: the common case
 * is one seq acquire and one CAS. A stale hint (another producer moved the tail) shows up as
 * seq > pos and falls back to reading completion_tail. */
extern "C" __global__ void bgs_slot_publish(bgs_u8 *ring, struct bgs_gpu_ctl *ctl,
                                            struct bgs_gpu_slot_ctl *sc, struct bgs_gpu_slot *s) {
    __shared__ struct bgs_completion_slot *cs;
    __shared__ bgs_u64 cpos;
    __shared__ int tx_idx; /* >= 0: this reply goes out as a GPU-written SEND from entry tx_idx */
    __shared__ bgs_u32 tx_fd;
    __shared__ bgs_u32 tx_paused; /* the host paused the GPU's sends: queue nothing on the ring */
    const bgs_u32 t = threadIdx.x;
    struct bgs_gpu_tx *tx = (struct bgs_gpu_tx *)s->tx;
    if (tx != 0) {
        /* GPU-written SEND when the host has not paused them, the connection is registered
         * and this reply holds its turn (crates/ring/src/tx.rs); HTTP, closing and
         * rejection-without-frame replies, and replies that are not the turn, go to the host's
         * reply stage instead. The pause word is read relaxed, before the lookup's loads, so
         * the two PCIe reads overlap (a stale value only sends or defers one reply either way,
         * which the turn keeps in order). */
        if (t == 0) {
            tx_idx = -1;
            const struct bgs_tx_header *th = (const struct bgs_tx_header *)tx->table;
            bgs_u32 paused;
            asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(paused) : "l"(&th->gpu_sends_paused) : "memory");
            const bgs_u32 host_only = BGS_ROUTE_HTTP | BGS_ROUTE_CLOSE | BGS_ROUTE_NO_FRAME |
                                      BGS_ROUTE_EOF | BGS_ROUTE_RESET;
            if ((s->route & host_only) == 0) {
                bgs_u32 fd = 0, turn = 0;
                const int idx = tx_lookup(tx, s->conn, &fd, &turn);
                if (paused == 0 && idx >= 0 && turn == s->conn_seq) {
                    tx_idx = idx;
                    tx_fd = fd;
                }
            }
            tx_paused = paused;
        }
        __syncthreads();
        if (tx_idx >= 0) {
            const struct bgs_tx_header *th = (const struct bgs_tx_header *)tx->table;
            const bgs_u64 buf_off = th->bufs_offset + (bgs_u64)tx_idx * BGS_TX_BUF_BYTES;
            bgs_u32 *buf = (bgs_u32 *)(tx->table + buf_off);
            const bgs_u32 n = s->out_words > BGS_RING_SLOT_WORDS ? BGS_RING_SLOT_WORDS : s->out_words;
            const bgs_u32 *src = s->from_out ? (const bgs_u32 *)s->out : s->input;
            /* The binary reply frame: BGS_HEADER_LEN-byte header, then the payload words. */
            for (bgs_u32 i = t; i < n; i += blockDim.x) buf[BGS_HEADER_LEN / 4 + i] = src[i];
            if (t == 0) {
                buf[0] = BGS_REPLY_MAGIC;
                buf[1] = BGS_VERSION | (s->status << 16);
                buf[2] = s->request_id;
                buf[3] = n;
                buf[4] = 0; /* seq: one-shot replies are not streamed */
                buf[5] = 0;
            }
            __syncthreads();
            if (t == 0) {
                struct bgs_tx_entry *e = tx_entry(tx, (bgs_u32)tx_idx);
                const bgs_u32 len = BGS_HEADER_LEN + 4u * n;
                ((volatile bgs_u32 *)e->reserved)[0] = len; /* the reaper checks the CQE against it */
                const bgs_u64 ud = (BGS_TX_UD_SEND << 56) | ((bgs_u64)(bgs_u32)tx_idx << 32) | s->conn_seq;
                tx_submit(tx, BGS_IORING_OP_SEND, tx_fd, 0, tx->table_host + buf_off, len,
                          BGS_MSG_WAITALL, 0, ud);
                atomicAdd_system((unsigned long long *)&((struct bgs_tx_header *)th)->gpu_sends, 1ull);
                st_release_sys32(&sc->busy, 0); /* the slot may take the next request */
            }
            return;
        }
    }
    if (t == 0 && s->sole_producer) {
        /* The only producer (this executor's publish kernels among themselves): positions come
         * from a device-memory counter, so the claim costs no PCIe round trip; the slot's seq
         * says whether the consumer has freed it (seq == pos), else the ring is full. The host
         * word completion_tail is kept current with a fire-and-forget max after publishing. */
        bgs_u64 *counter = (bgs_u64 *)s->tail_hint;
        const bgs_u64 pos = atomicAdd((unsigned long long *)counter, 1ull);
        struct bgs_completion_slot *c = completion_slot(ring, pos);
        cs = c;
        cpos = pos;
        bool counted = false;
        while (ld_acquire_sys(&c->seq) != pos) {
            if (!counted) {
                counted = true;
                atomicAdd((unsigned long long *)&ctl->full_spins, 1ull);
            }
            if (ld_acquire_sys32(&ctl->stop)) {
                cs = 0; /* shutting down: the position stays unpublished */
                break;
            }
            __nanosleep(2000);
        }
    } else if (t == 0) {
        struct bgs_ring_header *h = ring_header(ring);
        bgs_u64 *hint = (bgs_u64 *)s->tail_hint;
        bgs_u64 pos = ((volatile bgs_u64 *)hint)[0];
        cs = 0;
        bool counted = false;
        for (;;) {
            struct bgs_completion_slot *c = completion_slot(ring, pos);
            bgs_u64 seq = ld_acquire_sys(&c->seq);
            long long d = (long long)(seq - pos);
            if (d == 0) {
                bgs_u64 old = cas_sys(&h->completion_tail, pos, pos + 1);
                if (old == pos) {
                    cs = c;
                    cpos = pos;
                    atomicMax((unsigned long long *)hint, (unsigned long long)(pos + 1));
                    break;
                }
                pos = old;
            } else if (d < 0) {
                /* Full: the transport is behind. Wait (nothing is dropped) unless stopping. */
                if (!counted) {
                    counted = true;
                    atomicAdd((unsigned long long *)&ctl->full_spins, 1ull);
                }
                if (ld_acquire_sys32(&ctl->stop)) break;
                __nanosleep(2000);
                pos = ld_relaxed_sys(&h->completion_tail);
            } else {
                pos = ld_relaxed_sys(&h->completion_tail);
            }
        }
    }
    __syncthreads();
    if (cs != 0) {
        const bgs_u32 n = s->out_words > BGS_RING_SLOT_WORDS ? BGS_RING_SLOT_WORDS : s->out_words;
        const bgs_u32 *src = s->from_out ? (const bgs_u32 *)s->out : s->input;
        for (bgs_u32 i = t; i < n; i += blockDim.x) cs->entry.payload[i] = src[i];
        if (t == 0) {
            struct bgs_completion_entry *ce = &cs->entry;
            ce->conn = s->conn;
            ce->conn_seq = s->conn_seq;
            ce->status = (bgs_u16)s->status;
            ce->final_ = 1;
            ce->request_id = s->request_id;
            ce->words = n;
            ce->stream_seq = 0;
            ce->route = s->route;
            ce->stream = 0; /* one-shot replies take no stream credit (ring layout v2) */
            ce->op = s->op; /* the reply stage counts requests by op and duration (v3) */
            ce->publish_ns = s->publish_ns;
            for (unsigned i = 0; i < sizeof(ce->reserved) / sizeof(ce->reserved[0]); i++)
                ce->reserved[i] = 0;
        }
    }
    __syncthreads();
    if (t == 0) {
        __threadfence_system();
        if (cs != 0) st_release_sys(&cs->seq, cpos + 1); /* publish: the last write of the entry */
        if (cs != 0 && s->sole_producer)
            atomicMax_system((unsigned long long *)&ring_header(ring)->completion_tail, cpos + 1);
        if (tx != 0 && cs != 0) {
            /* Handed to the host's reply stage: it cannot be woken by a GPU write, so if it
             * sleeps on the completion ring's futex, bump the word and queue a FUTEX_WAKE.
             * Not while the host pauses our sends: the SQPOLL thread that would run the wake
             * sleeps then, and BPF's completion watch wakes the stage instead. */
            struct bgs_tx_header *th = (struct bgs_tx_header *)tx->table;
            struct bgs_ring_header *h = ring_header(ring);
            atomicAdd_system((unsigned long long *)&th->gpu_deferred, 1ull);
            __threadfence_system();
            if (tx_paused == 0 && ld_acquire_sys32(&h->completion_waiters) != 0) {
                atomicAdd_system(&h->completion_doorbell, 1u);
                __threadfence_system();
                tx_submit(tx, BGS_IORING_OP_FUTEX_WAKE, BGS_FUTEX2_FLAGS, 0x7fffffffull,
                          tx->futex_host, 0, 0, BGS_FUTEX_BITSET_MATCH_ANY, BGS_TX_UD_WAKE << 56);
                atomicAdd_system((unsigned long long *)&th->gpu_wakes, 1ull);
            }
        }
        st_release_sys32(&sc->busy, 0); /* the slot may take the next request */
    }
}

/* ---- the reaper of the GPU's io_uring completions: one thread, resident until stop ----
 * The GPU is the only consumer of its ring's CQ. A SEND completion passes the connection's turn
 * on (next_seq = conn_seq + 1), whether the send succeeded or not: a failed connection is
 * reclaimed by the host when its reset or EOF marker gets the turn. */
extern "C" __global__ void bgs_tx_reaper(struct bgs_gpu_tx *tx, struct bgs_gpu_ctl *ctl) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    struct bgs_tx_header *th = (struct bgs_tx_header *)tx->table;
    bgs_u32 *cq_head = (bgs_u32 *)(tx->rings + tx->off_cq_head);
    const bgs_u32 *cq_tail = (const bgs_u32 *)(tx->rings + tx->off_cq_tail);
    bgs_u32 head = ((volatile bgs_u32 *)cq_head)[0];
    bgs_u32 idle = 0;
    for (;;) {
        const bgs_u32 tail = ld_acquire_sys32(cq_tail);
        if (tail == head) {
            if ((idle & 63u) == 0 && ld_acquire_sys32(&ctl->stop)) return;
            idle++;
            __nanosleep(idle < 1024 ? 100 : 2000);
            continue;
        }
        idle = 0;
        while (head != tail) {
            const volatile struct bgs_io_uring_cqe *c = (const volatile struct bgs_io_uring_cqe *)(
                tx->rings + tx->off_cqes + (bgs_u64)(head & tx->cq_mask) * BGS_CQE_BYTES);
            const bgs_u64 ud = c->user_data;
            const int res = c->res;
            if ((ud >> 56) == BGS_TX_UD_SEND) {
                const bgs_u32 idx = (bgs_u32)(ud >> 32) & 0xffffffu;
                const bgs_u32 seq = (bgs_u32)ud;
                struct bgs_tx_entry *e = tx_entry(tx, idx);
                const bgs_u32 want = ((volatile bgs_u32 *)e->reserved)[0];
                if (res < 0 || (bgs_u32)res != want) {
                    ((volatile bgs_u32 *)&e->gpu_errors)[0] = e->gpu_errors + 1;
                    atomicAdd_system((unsigned long long *)&th->gpu_send_errors, 1ull);
                }
                ((volatile bgs_u32 *)&e->gpu_sends)[0] = e->gpu_sends + 1;
                atomicAdd_system((unsigned long long *)&th->gpu_completed, 1ull);
                __threadfence_system();
                st_release_sys32(&e->next_seq, seq + 1); /* pass the turn */
            } else {
                atomicAdd_system((unsigned long long *)&th->gpu_other_cqes, 1ull);
                if (res < 0) atomicAdd_system((unsigned long long *)&th->gpu_wake_errors, 1ull);
            }
            head++;
        }
        st_release_sys32(cq_head, head);
    }
}

/* ---- the completion notifier's wait (docs/gpu.md, "Completion notifier") ----
 * One thread, launched by the host's notifier thread on its own stream and followed by an event
 * created with CU_EVENT_BLOCKING_SYNC: the host sleeps in cuEventSynchronize (the driver waits
 * for the GPU's interrupt; no host CPU spins) until this kernel returns. It returns when the
 * completion at position `seen` is published and the host's completion_tail (the word the
 * transport's emptiness check reads) has passed it, after `budget_ns` (globaltimer), or at stop.
 * Phase 1 polls the device-memory claim counter the publish kernels share (tail_hint: every
 * publish claims its position there first, in both producer modes), so waiting costs no PCIe
 * traffic; phase 2, once a position at or past `seen` is claimed, polls the two host words of
 * that position until the publish is visible to the host. Completions written as GPU SENDs
 * claim no position and wake nobody: the host's reply stage never sees them. */
extern "C" __global__ void bgs_completion_wait(bgs_u8 *ring, struct bgs_gpu_ctl *ctl,
                                               const bgs_u64 *claimed, bgs_u64 seen,
                                               bgs_u64 budget_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const bgs_u64 t0 = globaltimer_ns();
    bgs_u32 polls = 0;
    while (ld_acquire_gpu(claimed) <= seen) {
        if (globaltimer_ns() - t0 >= budget_ns) return;
        if ((++polls & 255u) == 0 && ld_acquire_sys32(&ctl->stop)) return;
        __nanosleep(500);
    }
    struct bgs_ring_header *h = ring_header(ring);
    const struct bgs_completion_slot *cs = completion_slot(ring, seen);
    /* Published: seq == seen + 1 (or later, once consumed and reused); signed distance. */
    while ((long long)(ld_acquire_sys(&cs->seq) - (seen + 1)) < 0 ||
           ld_acquire_sys(&h->completion_tail) <= seen) {
        if (globaltimer_ns() - t0 >= budget_ns) return;
        if (ld_acquire_sys32(&ctl->stop)) return;
        __nanosleep(200);
    }
}

/* ---- start-up self-check: offsets as this compiler lays them out ----
 * out: BGS_GPU_LAYOUT_LEN words, in the order of bgs_executor_gpu::c_header::layout_table. */
extern "C" __global__ void bgs_layout_probe(bgs_u64 *out) {
    bgs_gpu_layout(out);
}
