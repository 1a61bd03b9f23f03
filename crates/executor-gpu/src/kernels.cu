/* bgs GPU executor kernels (CUDA C++), compiled by NVRTC at start-up for the device's
 * architecture with -rdc=true and linked against libcudadevrt.a by nvJitLink (device-side
 * graph launch). See docs/gpu.md for the design.
 *
 * The ring layout comes from the generated include/bgs_ring.h (one source of truth); the
 * executor's own structs are mirrored in src/layout.rs and checked at start-up by
 * bgs_layout_probe. Host-shared words are accessed with system-scope acquire/release
 * (docs/ring.md, "CUDA producers and consumers").
 */
#if defined(__CUDACC_RTC__)
/* NVRTC has no system headers and no __builtin_offsetof, so the header's static asserts
 * cannot be evaluated here: provide the fixed-width types and turn the asserts off. The same
 * source is compiled with clang (-x cuda) in CI with the asserts on, and bgs_layout_probe
 * checks the offsets on the device at start-up. */
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

#ifndef BGS_VALID_STATUS_MASK
#error "BGS_VALID_STATUS_MASK (bit s set when status s < 32 is a known status) must be defined"
#endif

#define BGS_GPU_MAX_SLOTS 64
#define BGS_GPU_REPEAT_BITS 9 /* repeat counts 1..=256 = sums of 2^0 .. 2^8 */
#define BGS_GPU_STAGED (~0ull) /* slot_ctl.pos: the request is staged in slot_ctl.staged */

/* Executor control block, in mapped host memory (host writes stop; the GPU reports errors). */
struct bgs_gpu_ctl {
    bgs_u32 stop;          /*  0: host sets 1: the scheduler exits instead of relaunching */
    bgs_u32 error;         /*  4: cudaError_t of a failed device-side launch, 0 if none */
    bgs_u32 error_where;   /*  8: 1 work launch, 2 scheduler relaunch, 3 chain launch, 4 publish launch */
    bgs_u32 stopped;       /* 12: the scheduler saw stop and exited */
    bgs_u64 full_spins;    /* 16: publish found the completion ring full */
    bgs_u64 chain_errors;  /* 24: repeat-chain launches that failed (answered Internal) */
};

/* Per-slot dispatch state: device memory (device launch) or mapped host memory (host launch). */
struct bgs_gpu_slot_ctl {
    bgs_u64 pos;                    /*  0: ring position, or BGS_GPU_STAGED */
    bgs_u32 busy;                   /*  8: 1 from assignment until the completion is published */
    bgs_u32 pad0;                   /* 12 */
    bgs_u8 pad1[48];                /* 16 */
    struct bgs_request_entry staged; /* 64: host launch copies the request here */
    bgs_u8 pad2[8];                 /* 1144 */
};

/* Per-slot work state, device memory. in/out are what the captured cuBLAS/cuFFT calls use. */
struct bgs_gpu_slot {
    bgs_u64 conn;                   /*   0 */
    bgs_u32 conn_seq;               /*   8 */
    bgs_u32 request_id;             /*  12 */
    bgs_u32 route;                  /*  16 */
    bgs_u32 status;                 /*  20 */
    bgs_u32 out_words;              /*  24 */
    bgs_u32 from_out;               /*  28: 1: reply from out[], 0: from in[] (echo) */
    bgs_u32 op;                     /*  32 */
    bgs_u32 param;                  /*  36 */
    bgs_u32 words;                  /*  40 */
    bgs_u32 device_chain;           /*  44: 1: the start kernel tail-launches the chain */
    bgs_u64 chain[2][BGS_GPU_REPEAT_BITS]; /* 48: [gemm|fft][k]: graph of 2^k repeats */
    bgs_u64 publish;                /* 192: the slot's publish graph */
    bgs_u8 pad[56];                 /* 200 */
    bgs_u32 in[BGS_RING_SLOT_WORDS]; /* 256 */
    float out[64];                  /* 1280 */
};

/* The scheduler's arguments, device memory. */
struct bgs_gpu_sched {
    bgs_u64 ring;                   /*   0: region base (device address) */
    bgs_u64 ctl;                    /*   8: struct bgs_gpu_ctl * */
    bgs_u64 slot_ctl;               /*  16: struct bgs_gpu_slot_ctl[nslots] */
    bgs_u64 self;                   /*  24: the scheduler's own graph exec */
    bgs_u32 nslots;                 /*  32 */
    bgs_u32 budget;                 /*  36: fire-and-forget launches per execution (< 120) */
    bgs_u32 next;                   /*  40: round-robin cursor, kept across executions */
    bgs_u32 pad;                    /*  44 */
    bgs_u64 work[BGS_GPU_MAX_SLOTS]; /* 48: each slot's start graph */
    bgs_u64 executions;             /* 560: scheduler executions (relaunches + 1) */
    bgs_u64 dispatched;             /* 568: requests launched by the scheduler */
};

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

/* The reply plan of a request: the same rules as the CPU executor (crates/executor). Returns
 * the repeat count for gemm8/fft32 (1..=256), 0 when no compute runs. */
__device__ __forceinline__ bgs_u32 plan(bgs_u32 op, bgs_u32 param, bgs_u32 words, bgs_u32 *status,
                                        bgs_u32 *out_words, bgs_u32 *from_out) {
    *from_out = 0;
    if (op == BGS_RING_OP_REJECT) {
        bool known = param < 32 && ((BGS_VALID_STATUS_MASK >> param) & 1u);
        *status = known ? param : BGS_STATUS_INTERNAL;
        *out_words = 0;
        return 0;
    }
    if (op == BGS_OP_ECHO) {
        *status = BGS_STATUS_OK;
        *out_words = words;
        return 0;
    }
    if (op == BGS_OP_GEMM8 || op == BGS_OP_FFT32) {
        if (words != BGS_ONE_SHOT_WORDS || param > BGS_MAX_REPEAT) {
            *status = BGS_STATUS_BAD_PARAM;
            *out_words = 0;
            return 0;
        }
        *status = BGS_STATUS_OK;
        *out_words = BGS_ONE_SHOT_WORDS;
        *from_out = 1;
        return param == 0 ? 1 : param;
    }
    *status = BGS_STATUS_UNKNOWN_OP;
    *out_words = 0;
    return 0;
}

/* ---- the resident scheduler: one thread, device-launched, tail-relaunches itself ---- */
extern "C" __global__ void bgs_scheduler(struct bgs_gpu_sched *s) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    bgs_u8 *ring = (bgs_u8 *)s->ring;
    struct bgs_gpu_ctl *ctl = (struct bgs_gpu_ctl *)s->ctl;
    struct bgs_gpu_slot_ctl *sc = (struct bgs_gpu_slot_ctl *)s->slot_ctl;
    struct bgs_ring_header *h = ring_header(ring);
    const bgs_u32 n = s->nslots;
    const bgs_u32 budget = s->budget;
    bgs_u32 next = s->next;
    bgs_u32 launches = 0;
    bgs_u32 idle = 0;
    bgs_u64 pos = ld_relaxed_sys(&h->request_head);
    s->executions += 1; /* device memory: only the scheduler writes it */
    for (;;) {
        if ((idle & 63u) == 0 && ld_acquire_sys32(&ctl->stop)) {
            s->next = next;
            st_release_sys32(&ctl->stopped, 1);
            return; /* no relaunch: the executor is shutting down */
        }
        if (launches >= budget) break;
        /* A free slot first: a request is only taken when it can be launched at once. */
        int slot = -1;
        for (bgs_u32 i = 0; i < n; i++) {
            bgs_u32 j = next + i;
            if (j >= n) j -= n;
            if (((volatile bgs_u32 *)&sc[j].busy)[0] == 0) {
                slot = (int)j;
                break;
            }
        }
        if (slot < 0) {
            idle++;
            continue;
        }
        struct bgs_request_slot *rs = request_slot(ring, pos);
        bgs_u64 seq = ld_acquire_sys(&rs->seq);
        long long d = (long long)(seq - (pos + 1));
        if (d == 0) {
            bgs_u64 old = cas_sys(&h->request_head, pos, pos + 1);
            if (old != pos) {
                pos = old;
                continue;
            }
            ((volatile bgs_u64 *)&sc[slot].pos)[0] = pos;
            ((volatile bgs_u32 *)&sc[slot].busy)[0] = 1;
            __threadfence();
            cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)s->work[slot], cudaStreamGraphFireAndForget);
            if (err != cudaSuccess) {
                /* The request stays unanswered on the device; the host's monitor answers
                 * the rest of the ring with Internal once it sees the error. */
                record_error(ctl, (bgs_u32)err, 1);
                s->next = next;
                return;
            }
            launches++;
            s->dispatched += 1;
            next = (bgs_u32)slot + 1;
            if (next >= n) next = 0;
            pos++;
            idle = 0;
        } else if (d < 0) {
            idle++; /* empty (or the oldest claimed entry is not published yet) */
        } else {
            pos = ld_relaxed_sys(&h->request_head);
        }
    }
    s->next = next;
    /* Before the 120 fire-and-forget launches per execution: run again after this execution
     * and its children finish. */
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)s->self, cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) record_error(ctl, (bgs_u32)err, 2);
}

/* ---- per-slot start: copy-in, free the ring slot, plan, launch the repeat chain ---- */
extern "C" __global__ void bgs_slot_start(bgs_u8 *ring, struct bgs_gpu_ctl *ctl,
                                          struct bgs_gpu_slot_ctl *sc, struct bgs_gpu_slot *s) {
    __shared__ const struct bgs_request_entry *e;
    __shared__ struct bgs_request_slot *rs;
    __shared__ bgs_u64 pos;
    __shared__ bgs_u64 meta_raw[7]; /* the entry's first 56 bytes */
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
            rs = request_slot(ring, pos);
            /* The scheduler saw seq == pos + 1 already; this acquire orders our reads. */
            while (ld_acquire_sys(&rs->seq) != pos + 1) {
            }
            e = &rs->entry;
        }
    }
    __syncthreads();
    /* One parallel pass over host memory (each read is a PCIe round trip): the header words
     * and every payload word (the slot always has room for 256). */
    const volatile bgs_u32 *src = e->payload;
    if (t < 14) meta[t] = ((const volatile bgs_u32 *)e)[t];
    for (bgs_u32 i = t; i < BGS_RING_SLOT_WORDS; i += blockDim.x) s->in[i] = src[i];
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
    if (!s->device_chain) return; /* host launch: the host thread launches the rest */
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

/* ---- per-slot publish: push the completion (Vyukov push, CAS on the tail), free the slot ---- */
extern "C" __global__ void bgs_slot_publish(bgs_u8 *ring, struct bgs_gpu_ctl *ctl,
                                            struct bgs_gpu_slot_ctl *sc, struct bgs_gpu_slot *s) {
    __shared__ struct bgs_completion_slot *cs;
    __shared__ bgs_u64 cpos;
    const bgs_u32 t = threadIdx.x;
    if (t == 0) {
        struct bgs_ring_header *h = ring_header(ring);
        const bgs_u64 cap = (bgs_u64)h->completion_capacity;
        bgs_u64 pos = ld_relaxed_sys(&h->completion_tail);
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
            (void)cap;
        }
    }
    __syncthreads();
    if (cs != 0) {
        const bgs_u32 n = s->out_words > BGS_RING_SLOT_WORDS ? BGS_RING_SLOT_WORDS : s->out_words;
        const bgs_u32 *src = s->from_out ? (const bgs_u32 *)s->out : s->in;
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
            for (int i = 0; i < 6; i++) ce->reserved[i] = 0;
        }
    }
    __syncthreads();
    if (t == 0) {
        if (cs != 0) {
            __threadfence_system();
            st_release_sys(&cs->seq, cpos + 1); /* publish: the last write of the entry */
        }
        __threadfence_system();
        st_release_sys32(&sc->busy, 0); /* the slot may take the next request */
    }
}

/* ---- start-up self-check: offsets as this compiler lays them out ---- */
#define BGS_PROBE(i, type, field) out[i] = (bgs_u64)((const char *)&((type *)base)->field - (const char *)base)
extern "C" __global__ void bgs_layout_probe(bgs_u64 *out) {
    const char *base = (const char *)out; /* any address: only differences are stored */
    BGS_PROBE(0, struct bgs_ring_header, request_capacity);
    BGS_PROBE(1, struct bgs_ring_header, request_slots_offset);
    BGS_PROBE(2, struct bgs_ring_header, request_head);
    BGS_PROBE(3, struct bgs_ring_header, completion_tail);
    BGS_PROBE(4, struct bgs_request_slot, entry.words);
    BGS_PROBE(5, struct bgs_request_slot, entry.route);
    BGS_PROBE(6, struct bgs_request_slot, entry.payload);
    BGS_PROBE(7, struct bgs_completion_slot, entry.status);
    BGS_PROBE(8, struct bgs_completion_slot, entry.route);
    BGS_PROBE(9, struct bgs_completion_slot, entry.payload);
    BGS_PROBE(10, struct bgs_gpu_slot_ctl, staged);
    BGS_PROBE(11, struct bgs_gpu_slot, chain);
    BGS_PROBE(12, struct bgs_gpu_slot, publish);
    BGS_PROBE(13, struct bgs_gpu_slot, in);
    BGS_PROBE(14, struct bgs_gpu_slot, out);
    BGS_PROBE(15, struct bgs_gpu_sched, work);
    BGS_PROBE(22, struct bgs_gpu_sched, dispatched);
    BGS_PROBE(23, struct bgs_gpu_ctl, chain_errors);
    out[16] = sizeof(struct bgs_request_slot);
    out[17] = sizeof(struct bgs_completion_slot);
    out[18] = sizeof(struct bgs_gpu_slot_ctl);
    out[19] = sizeof(struct bgs_gpu_slot);
    out[20] = sizeof(struct bgs_gpu_sched);
    out[21] = sizeof(struct bgs_gpu_ctl);
}
