/* The GPU-resident generation step loop: the device dispatcher (docs/gpu-model.md, "The
 * resident step loop"; issue 9 part 3).
 *
 * Compiled by NVRTC with -rdc=true and linked with libcudadevrt.a by nvJitLink (device graph
 * launches), like crates/executor-gpu/src/kernels.cu, and loaded into the GpuModel's context.
 * The per-sequence logic is include/bgs_gen_loop.h (the same C the host engine CGenEngine runs
 * and the tests prove equal to the Rust engine); this file adds only what the device needs
 * around it: ring intake, credit, completion publication, and the launch sequence.
 *
 * Two graphs of one kernel node each, instantiated with the device-launch flag:
 *   D (bgs_gld_dispatch): reads request-ring entries, admits / cancels / answers one-shot
 *     requests, publishes owed frames, plans and packs a step; then either tail-launches
 *     body[bucket] -> head[sample bucket] -> F and returns, or (nothing to run) polls with
 *     __nanosleep backoff for P_IDLE_ROUNDS rounds and tail-relaunches itself.
 *   F (bgs_gld_finish): after the head graph wrote `next`: bgs_gl_finish, publishes the frames,
 *     tail-relaunches D.
 * Tail launches of one execution run in order after it completes, and D's writes (the packed
 * step inputs) are visible to the graphs it tail-launches; no graph is ever launched while it
 * runs (each runs only after the one before it ended), and no execution makes more than three
 * launches (far below the 120 fire-and-forget / tail limits of docs/gpu.md).
 *
 * One warp per kernel: lane 0 owns the loop state (every bgs_gl_* call that changes it); the
 * other lanes help with host-memory traffic (the prompt copy, the per-stream credit reads),
 * where 32 independent PCIe reads in flight beat 32 in a row, and with the walks over the
 * table that only read it (the census, gld_owed, gld_pack, gld_admit_scans, gld_plan_views),
 * where one thread's dependent loads cost ~1 us a sequence.
 *
 * Shared words: P_* (parameters, device memory, written by the host before the first launch),
 * S_* (the dispatcher's own words, device memory), C_* (the control block in mapped host
 * memory that the host monitor reads), all u64 at the indices of the generated header
 * bgs_gen_dispatch.h (crates/model-gpu/src/gen_exec.rs `dispatch_header`).
 */
/* The generated headers provide the fixed-width types under NVRTC (no system headers). */
#define BGS_GEN_LOOP_API __device__
#define BGS_GEN_LOOP_IMPL
#define BGS_STEP_POLICY_IMPL
#include "bgs_gen_loop.h"
#include "bgs_gen_dispatch.h"

#ifndef BGS_VALID_STATUS_MASK
#error "BGS_VALID_STATUS_MASK (bit s set when status s < 32 is a known status) must be defined"
#endif

/* Lanes of the dispatcher's warp. The host emulation (tests/dispatch_emu.cpp, which compiles
 * this file as plain C++ with GLD_HOST_EMU) runs one thread as the whole warp: every
 * lane-strided loop then covers all its elements in that thread. */
#ifndef GLD_LANES
#define GLD_LANES 32u
#endif

#ifdef GLD_HOST_EMU
/* One host thread: plain accesses are the whole memory model. */
__device__ __forceinline__ bgs_u64 gld_ld_acquire_sys(const bgs_u64 *p) {
    return *(const volatile bgs_u64 *)p;
}
__device__ __forceinline__ bgs_u32 gld_ld_acquire_sys32(const bgs_u32 *p) {
    return *(const volatile bgs_u32 *)p;
}
__device__ __forceinline__ void gld_st_release_sys(bgs_u64 *p, bgs_u64 v) {
    *(volatile bgs_u64 *)p = v;
}
__device__ __forceinline__ bgs_u64 gld_ld_relaxed_sys(const bgs_u64 *p) {
    return *(const volatile bgs_u64 *)p;
}
__device__ __forceinline__ void gld_st_relaxed_sys(bgs_u64 *p, bgs_u64 v) {
    *(volatile bgs_u64 *)p = v;
}
/* The warp's lanes are host threads (tests/dispatch_emu.cpp). */
__device__ __forceinline__ bgs_u32 gld_warp_scan(bgs_u32 v, bgs_u32 *total) {
    return bgs_emu_warp_scan(v, total);
}
__device__ __forceinline__ bgs_u32 gld_warp_sum(bgs_u32 v) {
    bgs_u32 total;
    bgs_emu_warp_scan(v, &total);
    return total;
}
__device__ __forceinline__ bgs_u64 gld_now_ns() { return bgs_emu_now_ns(); }
#else

/* ---- system-scope accessors for host-shared words (as in kernels.cu) ---- */
__device__ __forceinline__ bgs_u64 gld_ld_acquire_sys(const bgs_u64 *p) {
    bgs_u64 v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ bgs_u32 gld_ld_acquire_sys32(const bgs_u32 *p) {
    bgs_u32 v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void gld_st_release_sys(bgs_u64 *p, bgs_u64 v) {
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/* Relaxed: no ordering of their own; gld_publish_frames orders them with system fences. */
__device__ __forceinline__ bgs_u64 gld_ld_relaxed_sys(const bgs_u64 *p) {
    bgs_u64 v;
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void gld_st_relaxed_sys(bgs_u64 *p, bgs_u64 v) {
    asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/* Sum over the dispatcher's warp (every lane calls it and gets the sum). */
__device__ __forceinline__ bgs_u32 gld_warp_sum(bgs_u32 v) {
    return __reduce_add_sync(0xffffffffu, v);
}
/* Exclusive prefix sum of `v` over the warp in lane order; `*total` = the warp's sum (every
 * lane calls it). */
__device__ __forceinline__ bgs_u32 gld_warp_scan(bgs_u32 v, bgs_u32 *total) {
    const bgs_u32 lane = threadIdx.x % 32u;
    bgs_u32 x = v;
    for (bgs_u32 o = 1u; o < 32u; o <<= 1) {
        const bgs_u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    *total = __shfl_sync(0xffffffffu, x, 31);
    return x - v;
}
__device__ __forceinline__ bgs_u64 gld_now_ns() {
    bgs_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#endif

__device__ __forceinline__ struct bgs_ring_header *gld_header(bgs_u8 *ring) {
    return (struct bgs_ring_header *)ring;
}
__device__ __forceinline__ struct bgs_request_slot *gld_request_slot(bgs_u8 *ring, bgs_u64 pos) {
    struct bgs_ring_header *h = gld_header(ring);
    bgs_u64 mask = (bgs_u64)h->request_capacity - 1;
    return (struct bgs_request_slot *)(ring + h->request_slots_offset +
                                       (pos & mask) * (bgs_u64)BGS_RING_REQUEST_SLOT_SIZE);
}
__device__ __forceinline__ struct bgs_completion_slot *gld_completion_slot(bgs_u8 *ring, bgs_u64 pos) {
    struct bgs_ring_header *h = gld_header(ring);
    bgs_u64 mask = (bgs_u64)h->completion_capacity - 1;
    return (struct bgs_completion_slot *)(ring + h->completion_slots_offset +
                                          (pos & mask) * (bgs_u64)BGS_RING_COMPLETION_SLOT_SIZE);
}

/* The first error wins; `where` says which call failed (a W_ code of gen_exec.rs). */
__device__ __forceinline__ void gld_error(bgs_u64 *ctl, bgs_u64 err, bgs_u64 where) {
    if (atomicCAS_system((unsigned long long *)&ctl[BGS_GLD_C_ERROR], 0ull,
                         (unsigned long long)err) == 0ull) {
        gld_st_release_sys(&ctl[BGS_GLD_C_ERROR_WHERE], where);
    }
}

/* Everything a kernel reads from the parameter words. */
struct gld_ctx {
    const bgs_u64 *p;
    bgs_u64 *s;
    bgs_u64 *ctl;
    bgs_u64 *shadow; /* device-memory copy of the control block's counters */
    bgs_u8 *ring;
    bgs_u32 *state;
};
__device__ __forceinline__ struct gld_ctx gld_ctx_of(const bgs_u64 *params) {
    struct gld_ctx c;
    c.p = params;
    c.s = (bgs_u64 *)params[BGS_GLD_P_SCRATCH];
    c.ctl = (bgs_u64 *)params[BGS_GLD_P_CTL];
    c.shadow = (bgs_u64 *)params[BGS_GLD_P_CTL_SHADOW];
    c.ring = (bgs_u8 *)params[BGS_GLD_P_RING];
    c.state = (bgs_u32 *)params[BGS_GLD_P_STATE];
    return c;
}

/* Control-block counters: only one of D and F runs at a time and only lane 0 writes. Each
 * counter lives in device memory (the shadow) and its new value is stored to the host copy:
 * a read of mapped host memory is a PCIe round trip, a store is posted. The host reads whole
 * aligned u64 words. */
__device__ __forceinline__ void gld_add(struct gld_ctx *c, bgs_u32 w, bgs_u64 v) {
    const bgs_u64 n = c->shadow[w] + v;
    c->shadow[w] = n;
    ((volatile bgs_u64 *)c->ctl)[w] = n;
}
/* Gauges: stored to the host only when they change (idle rounds write nothing). */
__device__ __forceinline__ void gld_set(struct gld_ctx *c, bgs_u32 w, bgs_u64 v) {
    if (c->shadow[w] != v) {
        c->shadow[w] = v;
        ((volatile bgs_u64 *)c->ctl)[w] = v;
    }
}

/* Publish one completion entry (lane 0). The dispatcher is the completion ring's only producer
 * (the host executor's sole-producer mode): its position comes from a device-memory counter,
 * the slot's seq says whether the consumer freed it (seq == pos), and completion_tail is kept
 * current with a max after the publish. Returns 0 when the ring is full (nothing written: the
 * caller retries later; the loop keeps the frame owed). */
/* The fields of one completion entry (not its seq) at `cs`, in five stores where there were
 * fourteen: a store to host memory is a PCIe write of its own, so the fields go out as 16-byte
 * vectors (a completion slot is 1088 bytes and the slots start page-aligned, so each group
 * below is 16-byte aligned: the offsets are bgs_ring.h's static asserts). The payload goes
 * out in pairs of words; a token frame's second word is a don't-care zero past `words`. */
#ifdef GLD_HOST_EMU
__device__ __forceinline__ void gld_st_v4(void *p, bgs_u32 a, bgs_u32 b, bgs_u32 c, bgs_u32 d) {
    bgs_u32 *q = (bgs_u32 *)p;
    q[0] = a;
    q[1] = b;
    q[2] = c;
    q[3] = d;
}
__device__ __forceinline__ void gld_st_v2(void *p, bgs_u32 a, bgs_u32 b) {
    bgs_u32 *q = (bgs_u32 *)p;
    q[0] = a;
    q[1] = b;
}
#else
__device__ __forceinline__ void gld_st_v4(void *p, bgs_u32 a, bgs_u32 b, bgs_u32 c, bgs_u32 d) {
    asm volatile("st.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}
__device__ __forceinline__ void gld_st_v2(void *p, bgs_u32 a, bgs_u32 b) {
    asm volatile("st.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
#endif
__device__ __forceinline__ void gld_write_entry(struct bgs_completion_slot *cs, bgs_u64 conn,
                                                bgs_u32 conn_seq, bgs_u32 request_id,
                                                bgs_u32 route, bgs_u32 op, bgs_u64 publish_ns,
                                                bgs_u32 status, bgs_u32 final_,
                                                bgs_u32 stream_seq, bgs_u32 stream_plus_one,
                                                const bgs_u32 *payload, bgs_u32 words) {
    struct bgs_completion_entry *ce = &cs->entry;
    ce->conn = conn;
    gld_st_v4(&ce->conn_seq, conn_seq, (status & 0xffffu) | (final_ << 16), request_id, words);
    gld_st_v4(&ce->stream_seq, stream_seq, route, stream_plus_one, op);
    gld_st_v4(&ce->publish_ns, (bgs_u32)publish_ns, (bgs_u32)(publish_ns >> 32), 0u, 0u);
    for (bgs_u32 i = 0; i < words; i += 2u)
        gld_st_v2(&ce->payload[i], payload[i], i + 1u < words ? payload[i + 1u] : 0u);
}
BGS_STATIC_ASSERT(sizeof(struct bgs_completion_slot) % 16u == 0u, "completion slots stay 16-byte aligned");
BGS_STATIC_ASSERT(BGS_OFFSETOF(struct bgs_completion_slot, entry) +
                          BGS_OFFSETOF(struct bgs_completion_entry, conn_seq) == 16,
                  "conn_seq .. words: one 16-byte store");
BGS_STATIC_ASSERT(BGS_OFFSETOF(struct bgs_completion_entry, stream_seq) ==
                          BGS_OFFSETOF(struct bgs_completion_entry, conn_seq) + 16,
                  "stream_seq .. op: one 16-byte store");
BGS_STATIC_ASSERT(BGS_OFFSETOF(struct bgs_completion_entry, publish_ns) ==
                          BGS_OFFSETOF(struct bgs_completion_entry, conn_seq) + 32,
                  "publish_ns, reserved: one 16-byte store");
BGS_STATIC_ASSERT(BGS_OFFSETOF(struct bgs_completion_entry, payload) ==
                          BGS_OFFSETOF(struct bgs_completion_entry, conn_seq) + 48,
                  "payload: pairs of words, 8-byte aligned");

__device__ int gld_publish(struct gld_ctx *c, bgs_u64 conn, bgs_u32 conn_seq, bgs_u32 request_id,
                           bgs_u32 route, bgs_u32 op, bgs_u64 publish_ns, bgs_u32 status,
                           bgs_u32 final_, bgs_u32 stream_seq, bgs_u32 stream_plus_one,
                           const bgs_u32 *payload, bgs_u32 words) {
    const bgs_u64 pos = c->s[BGS_GLD_S_TAIL];
    struct bgs_completion_slot *cs = gld_completion_slot(c->ring, pos);
    if (gld_ld_acquire_sys(&cs->seq) != pos) {
        gld_add(c, BGS_GLD_C_RING_FULL, 1);
        return 0;
    }
    gld_write_entry(cs, conn, conn_seq, request_id, route, op, publish_ns, status, final_,
                    stream_seq, stream_plus_one, payload, words);
    __threadfence_system();
    gld_st_release_sys(&cs->seq, pos + 1); /* publish: the last write of the entry */
    atomicMax_system((unsigned long long *)&gld_header(c->ring)->completion_tail,
                     (unsigned long long)(pos + 1));
    c->s[BGS_GLD_S_TAIL] = pos + 1;
    gld_add(c, BGS_GLD_C_FRAMES, 1);
    return 1;
}

/* Credit of every table slot (all lanes): window minus the stream's frames in flight
 * (published by us, not yet acknowledged in the region's stream_acks). More acks than frames
 * reads as nothing in flight, as in the CPU executor (crates/executor `Sink::in_flight`). */
__device__ void gld_credit(struct gld_ctx *c, bgs_u32 lane) {
    const bgs_u32 n = (bgs_u32)c->p[BGS_GLD_P_MAX_SEQS];
    const bgs_u32 window = (bgs_u32)c->p[BGS_GLD_P_WINDOW];
    bgs_u32 *credit = (bgs_u32 *)c->p[BGS_GLD_P_CREDIT];
    const bgs_u32 *published = (const bgs_u32 *)c->p[BGS_GLD_P_PUBLISHED];
    struct bgs_ring_header *h = gld_header(c->ring);
    for (bgs_u32 k = lane; k < n; k += GLD_LANES) {
        const bgs_u32 stream = bgs_gl_slot_stream(c->state, k);
        bgs_u32 cr = 0u;
        if (stream != BGS_GL_NO_STREAM && stream < BGS_RING_MAX_STREAMS) {
            const bgs_u32 acked = gld_ld_acquire_sys32(&h->stream_acks[stream]);
            bgs_u32 d = published[stream] - acked;
            if (d > 0x7fffffffu) d = 0u;
            cr = d >= window ? 0u : window - d;
        }
        credit[k] = cr;
    }
}

/* The table as bgs_gl_plan is about to see it (all lanes, after the round's publication):
 * sequences waiting for admission, sequences ended whose final frame is not yet out, and the
 * running ones: how many, how many the policy will skip because a token frame of theirs is
 * still owed (not yet published), and how many because their credit is below
 * BGS_GL_STEP_CREDIT (readers behind on acknowledgements). Summed per launched step into
 * C_WAITING_SEEN, C_ENDED_SEEN, C_RUNNING_SEEN, C_PENDING_WAITS and C_CREDIT_WAITS: a served
 * run whose steps carry fewer tokens than it has sequences says here what held them back. */
struct gld_census {
    bgs_u32 running, pending, low_credit, waiting, ended;
};
__device__ struct gld_census gld_census_of(struct gld_ctx *c, bgs_u32 lane) {
    const bgs_u32 n = (bgs_u32)c->p[BGS_GLD_P_MAX_SEQS];
    const bgs_u32 *credit = (const bgs_u32 *)c->p[BGS_GLD_P_CREDIT];
    bgs_u32 running = 0u, pending = 0u, low = 0u, waiting = 0u, ended = 0u;
    /* An empty table (the idle polling rounds): nothing to count, so no pass over it. */
    const bgs_u32 slots = c->state[BGS_GL_H_N_LIVE] != 0u ? n : 0u;
    for (bgs_u32 k = lane; k < slots; k += GLD_LANES) {
        if (bgs_gl_slot_stream(c->state, k) == BGS_GL_NO_STREAM) continue;
        const bgs_u32 *s = bgs_gl_cseq(c->state, k);
        if (s[BGS_GL_S_END] != 0u) {
            ended++; /* its final frame not yet published: it holds a table slot */
            continue;
        }
        if (s[BGS_GL_S_RUNNING] == 0u) {
            waiting++;
            continue;
        }
        running++;
        pending += s[BGS_GL_S_PENDING] != 0u;
        low += credit[k] < BGS_GL_STEP_CREDIT;
    }
    struct gld_census r;
    r.running = gld_warp_sum(running);
    r.pending = gld_warp_sum(pending);
    r.low_credit = gld_warp_sum(low);
    r.waiting = gld_warp_sum(waiting);
    r.ended = gld_warp_sum(ended);
    return r;
}

/* bgs_gl_drop_left, lane-parallel (all lanes call it): the order's live slots, kept in order by
 * a prefix sum; a chunk's writes land at or before its own reads, which the chunk finished
 * before any lane writes. */
__device__ void gld_drop_left(bgs_u32 *state, bgs_u32 lane) {
    bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    const bgs_u32 live = state[BGS_GL_H_N_LIVE];
    bgs_u32 kept = 0u;
    for (bgs_u32 k0 = 0u; k0 < live; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        const bgs_u32 slot = k < live ? order[k] : 0u;
        const bgs_u32 keep = k < live && bgs_gl_cseq(state, slot)[BGS_GL_S_LIVE] != 0u;
        bgs_u32 total;
        const bgs_u32 to = kept + gld_warp_scan(keep, &total);
        __syncwarp(); /* the chunk's reads before its writes */
        if (keep) order[to] = slot;
        kept += total;
    }
    __syncwarp();
    if (lane == 0u) state[BGS_GL_H_N_LIVE] = kept;
    __syncwarp();
}

/* Publish `n` owed frames (all lanes call it; every lane gets the answer): each stream's
 * frames until its credit runs out, all of them in order until the ring runs out; report each
 * stream's count to the table (bgs_gl_delivered's per-slot part), and give back the
 * credit-stream index of every stream that left the table. Returns 0 when the ring was full.
 *
 * Lane-parallel: one thread's per-frame stores to host memory cost ~557 us a step at 256
 * slots on the H200 (bench/results/20261201-gpu-step-loop-lanes). bgs_gl_owed lists each
 * slot once, with at most two frames (a token, then the final one), so each slot's frames
 * are a run that starts where the previous frame's slot differs; the run's first lane handles
 * the whole run. What it may send is min(run length, the slot's credit); a prefix sum of those
 * places each frame in the ring, where the free slots from the tail (read in parallel, first
 * busy one found by a scan) cut the list. The outcome equals the one-thread walk's with the
 * same ring: frames in list order, each stream up to its credit, the list cut where the ring
 * is full. Each lane writes its entries' fields, fences, then sets their seqs (the consumer
 * reads each entry through its own seq, in ring order); lane 0 moves the shared words. */
__device__ __forceinline__ bgs_u32 gld_run_starts(const struct bgs_gl_frame *f, bgs_u32 n,
                                                  bgs_u32 j) {
    return j < n && (j == 0u || f[j - 1u].slot != f[j].slot);
}
__device__ __forceinline__ bgs_u32 gld_run_len(const struct bgs_gl_frame *f, bgs_u32 n,
                                               bgs_u32 j) {
    return 1u + (j + 1u < n && f[j + 1u].slot == f[j].slot);
}
__device__ int gld_publish_frames(struct gld_ctx *c, const struct bgs_gl_frame *f, bgs_u32 n,
                                  bgs_u32 lane) {
    __shared__ bgs_u64 sh_tail;
    bgs_u32 *credit = (bgs_u32 *)c->p[BGS_GLD_P_CREDIT];
    bgs_u32 *published = (bgs_u32 *)c->p[BGS_GLD_P_PUBLISHED];
    bgs_u32 *stream_free = (bgs_u32 *)c->p[BGS_GLD_P_STREAM_FREE];
    const bgs_u64 *stream_ns = (const bgs_u64 *)c->p[BGS_GLD_P_STREAM_NS];
    bgs_u32 *st = c->state;
    if (lane == 0u) sh_tail = c->s[BGS_GLD_S_TAIL];
    __syncwarp();
    const bgs_u64 tail = sh_tail;
    /* 1. What credit allows: each run's min(length, credit), summed. */
    bgs_u32 allowed = 0u;
    for (bgs_u32 k0 = 0u; k0 < n; k0 += GLD_LANES) {
        const bgs_u32 j = k0 + lane;
        const bgs_u32 e = gld_run_starts(f, n, j)
                              ? bgs_gl_min32(gld_run_len(f, n, j), credit[f[j].slot])
                              : 0u;
        allowed += gld_warp_sum(e);
    }
    /* 2. Room: the free slots from the tail, up to `allowed` (a slot is free for position
     * pos when its seq == pos); the first busy one ends it. */
    bgs_u32 room = 0u;
    for (bgs_u32 b = 0u; b < allowed; b += GLD_LANES) {
        const bgs_u32 i = b + lane;
        const bgs_u32 busy =
            i < allowed && gld_ld_relaxed_sys(&gld_completion_slot(c->ring, tail + i)->seq) !=
                               tail + i;
        bgs_u32 busy_total;
        const bgs_u32 before = gld_warp_scan(busy, &busy_total);
        if (busy_total != 0u) {
            room = b + gld_warp_sum(busy && before == 0u ? lane : 0u);
            break;
        }
        room = allowed - b < GLD_LANES ? allowed : b + GLD_LANES;
    }
    /* Every lane's room reads before any lane's entry writes (the acquire that the
     * consumer's release of each slot pairs with). */
    __threadfence_system();
    __syncwarp();
    /* 3. The entries, then each run's bookkeeping (the run's own slot and stream only). */
    bgs_u32 at = 0u, left_at = 0u, stalls = 0u;
    for (bgs_u32 k0 = 0u; k0 < n; k0 += GLD_LANES) {
        const bgs_u32 j = k0 + lane;
        const bgs_u32 starts = gld_run_starts(f, n, j);
        const bgs_u32 slot = starts ? f[j].slot : 0u;
        const bgs_u32 len = starts ? gld_run_len(f, n, j) : 0u;
        const bgs_u32 e = starts ? bgs_gl_min32(len, credit[slot]) : 0u;
        bgs_u32 e_total;
        const bgs_u32 mine = at + gld_warp_scan(e, &e_total);
        const bgs_u32 sent = mine >= room ? 0u : bgs_gl_min32(e, room - mine);
        const bgs_u32 stream = starts ? f[j].stream : 0u;
        if (sent != 0u) {
            const bgs_u32 *s = bgs_gl_cseq(st, slot);
            const bgs_u64 conn =
                (bgs_u64)s[BGS_GL_S_CONN_LO] | ((bgs_u64)s[BGS_GL_S_CONN_HI] << 32);
            for (bgs_u32 i = 0u; i < sent; i++) {
                const struct bgs_gl_frame *fr = &f[j + i];
                gld_write_entry(gld_completion_slot(c->ring, tail + mine + i), conn,
                                s[BGS_GL_S_CONN_SEQ], s[BGS_GL_S_REQUEST_ID], s[BGS_GL_S_ROUTE],
                                BGS_OP_GENERATE, stream_ns[stream], fr->status, fr->final_,
                                fr->seq, stream + 1u, fr->word, fr->words);
            }
            __threadfence_system(); /* this lane's fields before its seqs */
            for (bgs_u32 i = 0u; i < sent; i++)
                gld_st_relaxed_sys(&gld_completion_slot(c->ring, tail + mine + i)->seq,
                                   tail + mine + i + 1u);
        }
        /* Credit-limited (not cut by the ring): the one-thread walk's credit stall. */
        stalls += starts && e < len && mine + e <= room;
        if (starts) credit[slot] -= sent;
        bgs_u32 left = 0u;
        if (sent != 0u) {
            published[stream] += sent;
            left = bgs_gl_delivered_mark(st, slot, sent);
        }
        /* The final frame went out: the credit stream is free for the next request. */
        bgs_u32 left_total;
        const bgs_u32 left_before = gld_warp_scan(left, &left_total);
        if (left) stream_free[c->s[BGS_GLD_S_STREAM_TOP] + left_at + left_before] = stream;
        at += e_total;
        left_at += left_total;
    }
    stalls = gld_warp_sum(stalls);
    __syncwarp(); /* every lane's marks are in before the order closes up */
    if (left_at != 0u) gld_drop_left(st, lane);
    if (lane == 0u) {
        const bgs_u32 sent_total = bgs_gl_min32(allowed, room);
        if (room < allowed) gld_add(c, BGS_GLD_C_RING_FULL, 1);
        if (stalls != 0u) gld_add(c, BGS_GLD_C_CREDIT_STALLS, stalls);
        if (sent_total != 0u) {
            atomicMax_system((unsigned long long *)&gld_header(c->ring)->completion_tail,
                             (unsigned long long)(tail + sent_total));
            c->s[BGS_GLD_S_TAIL] = tail + sent_total;
            gld_add(c, BGS_GLD_C_FRAMES, sent_total);
        }
        c->s[BGS_GLD_S_STREAM_TOP] += left_at;
    }
    __syncwarp();
    return room >= allowed;
}

/* ---- lane-parallel forms of the C functions' table walks (all lanes call them) ----
 * The same words as bgs_gl_owed, bgs_gl_pack, bgs_gl_admit's passes and bgs_gl_plan's views,
 * which one thread spent 0.3-0.9 ms each on at 512 live sequences on the H200 (dependent
 * loads; bench/results/20261201-gpu-step-loop-lanes). Here lane l takes entries l,
 * l + GLD_LANES, ..., in chunks of GLD_LANES whose output positions come from a warp prefix
 * sum, so the output order is the C functions'. With P_CHECK the dispatcher compares each
 * against the C function after every use (gld_check_*). */

/* bgs_gl_owed: the frames owed now, in FIFO order. Returns their count (every lane). */
__device__ bgs_u32 gld_owed(const bgs_u32 *state, struct bgs_gl_frame *out, bgs_u32 lane) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    const bgs_u32 live = state[BGS_GL_H_N_LIVE];
    bgs_u32 n = 0u;
    for (bgs_u32 k0 = 0u; k0 < live; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        const bgs_u32 owes = k < live ? bgs_gl_owes(state, order[k]) : 0u;
        bgs_u32 total;
        const bgs_u32 at = n + gld_warp_scan(owes, &total);
        if (owes != 0u) bgs_gl_owed_by(state, order[k], out + at);
        n += total;
    }
    return n;
}

/* bgs_gl_pack: the planned step into the step-input buffer. Returns 0 or the C function's
 * error (every lane); `out` is filled on every lane. Item k's tokens start at its I_TOK_AT
 * (bgs_gl_plan hands them out in item order: the running count bgs_gl_pack keeps); its table
 * offset and sampled row come from prefix sums. */
__device__ int gld_pack(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo,
                        bgs_i32 *buf, struct bgs_gl_packed *out, bgs_u32 lane) {
    const bgs_u32 *items = state + state[BGS_GL_H_ITEMS_AT];
    const bgs_u32 n_items = state[BGS_GL_H_N_ITEMS];
    int r = bgs_gl_pack_fits(state, geo);
    if (r != 0) return r;
    /* Check first (nothing is written for a step that does not fit). */
    bgs_u32 bad = 0u, samples = 0u;
    for (bgs_u32 k = lane; k < n_items; k += GLD_LANES) {
        const bgs_u32 *item = items + k * BGS_GL_ITEM_WORDS;
        bad |= bgs_gl_item_fits(state, geo, item) == 0u;
        samples += item[BGS_GL_I_SAMPLE] != 0u;
    }
    if (gld_warp_sum(bad) != 0u) return BGS_GL_ERR_GEOMETRY;
    r = bgs_gl_pack_out(state, geo, gld_warp_sum(samples), out);
    if (r != 0) return r;
    bgs_u32 bt_at = 0u, rows = 0u;
    for (bgs_u32 k0 = 0u; k0 < n_items; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        const bgs_u32 *item = k < n_items ? items + k * BGS_GL_ITEM_WORDS : 0;
        const bgs_u32 need = item != 0 ? bgs_gl_item_blocks(item, geo->block_size) : 0u;
        const bgs_u32 sample = item != 0 && item[BGS_GL_I_SAMPLE] != 0u;
        bgs_u32 bt_total, rows_total;
        const bgs_u32 my_bt = bt_at + gld_warp_scan(need, &bt_total);
        const bgs_u32 my_row = rows + gld_warp_scan(sample, &rows_total);
        if (item != 0)
            bgs_gl_pack_item(state, geo, buf, k, item,
                             item[BGS_GL_I_TOK_AT] - state[BGS_GL_H_TOKENS_AT], my_bt, my_row);
        bt_at += bt_total;
        rows += rows_total;
    }
    for (bgs_u32 k = out->tokens + lane; k < geo->max_tokens; k += GLD_LANES)
        bgs_gl_pack_pad(geo, buf, k);
    for (bgs_u32 k = rows + lane; k < geo->max_samples; k += GLD_LANES)
        buf[bgs_llm_step_rows(geo) + k] = BGS_LLM_STEP_PAD_ROW;
    for (bgs_u32 k = n_items + lane; k < geo->max_seqs; k += GLD_LANES)
        buf[bgs_llm_step_bt_off(geo) + k] = 0;
    out->words = bgs_llm_step_bt(geo) + bt_at;
    return 0;
}

/* bgs_gl_admit's passes over the table for a request on `stream`: whether a live sequence
 * holds it, and the lowest slot not live (max_seqs when none). Every lane gets both. */
__device__ void gld_admit_scans(const bgs_u32 *state, bgs_u32 stream, bgs_u32 lane,
                                bgs_u32 *stream_live, bgs_u32 *free_slot) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    const bgs_u32 live = state[BGS_GL_H_N_LIVE], max_seqs = state[BGS_GL_H_MAX_SEQS];
    bgs_u32 hit = 0u;
    for (bgs_u32 k = lane; k < live; k += GLD_LANES)
        hit |= bgs_gl_cseq(state, order[k])[BGS_GL_S_STREAM] == stream;
    *stream_live = gld_warp_sum(hit) != 0u;
    *free_slot = max_seqs;
    for (bgs_u32 s0 = 0u; s0 < max_seqs; s0 += GLD_LANES) {
        const bgs_u32 slot = s0 + lane;
        const bgs_u32 f = slot < max_seqs && bgs_gl_cseq(state, slot)[BGS_GL_S_LIVE] == 0u;
        bgs_u32 total;
        const bgs_u32 before = gld_warp_scan(f, &total);
        if (total != 0u) {
            /* The first free lane's slot: the only lane with a free slot and none before. */
            *free_slot = gld_warp_sum(f && before == 0u ? slot : 0u);
            break;
        }
    }
}

/* bgs_gl_plan's views, lane-parallel: live sequences in FIFO order, ended ones left out
 * (bgs_gl_view decides each), packed by a warp prefix sum. Returns their count (every lane). */
__device__ bgs_u32 gld_plan_views(bgs_u32 *state, const bgs_u32 *credit, bgs_u32 lane) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    const bgs_u32 live = state[BGS_GL_H_N_LIVE];
    struct bgs_sp_seq *views;
    bgs_u32 *view_of;
    bgs_gl_views(state, &views, &view_of);
    bgs_u32 n = 0u;
    for (bgs_u32 k0 = 0u; k0 < live; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        struct bgs_sp_seq v;
        const bgs_u32 in = k < live ? bgs_gl_view(state, order[k], credit, &v) : 0u;
        bgs_u32 total;
        const bgs_u32 at = n + gld_warp_scan(in, &total);
        if (in) {
            views[at] = v;
            view_of[at] = order[k];
        }
        n += total;
    }
    return n;
}

/* Sum of a 64-bit value over the warp (every lane gets it): four sums of 16-bit pieces, so
 * no piece's sum can overflow 32 bits. */
__device__ __forceinline__ bgs_u64 gld_warp_sum64(bgs_u64 v) {
    bgs_u64 r = 0u;
    for (bgs_u32 c = 0u; c < 4u; c++) r += (bgs_u64)gld_warp_sum((bgs_u32)(v >> (16u * c)) & 0xffffu) << (16u * c);
    return r;
}

/* bgs_step_plan, lane-parallel (all lanes call it; every lane gets the answer): the same outs
 * and return value. Passes 0, 1 and 3 are per sequence (sums and a prefix sum: pass 1's
 * decoders take one token each in FIFO order until the budget runs out); pass 2, FIFO over
 * prefill chunks and admissions with a shrinking budget, stays on lane 0, which visits only
 * the sequences it can act on (waiting, or prefilling with prompt left and ready), found 32 at
 * a time. Invalid inputs (never, from the loop's own views) go to the C function, so the
 * error returned is its. */
__device__ int gld_step_plan(const struct bgs_sp_limits *lim, const struct bgs_sp_seq *seqs,
                             bgs_u32 n, struct bgs_sp_out *out, bgs_u32 lane) {
    __shared__ int sh_r;
    __shared__ bgs_u64 sh_budget;
    __shared__ bgs_u32 sh_stop;
    const bgs_u32 bs = lim->block_size;
    if (bs == 0u || lim->max_batched_tokens == 0u || lim->max_running == 0u)
        return BGS_SP_ERR_LIMITS;
    bgs_u64 budget = lim->max_batched_tokens;
    if (budget > 0x7fffffffu) budget = 0x7fffffffu;
    /* Pass 0: clear, validate, what running sequences may still claim. */
    bgs_u64 committed = 0u;
    bgs_u32 running = 0u, bad = 0u;
    for (bgs_u32 i = lane; i < n; i += GLD_LANES) {
        const struct bgs_sp_seq *q = &seqs[i];
        out[i].admit = 0u;
        out[i].tokens = 0u;
        out[i].new_blocks = 0u;
        out[i].reserved = 0u;
        if (q->state == BGS_SP_WAITING) continue;
        const bgs_u32 need = bgs_sp_blocks_for(q->reserve_tokens, bs);
        bad |= (q->state != BGS_SP_PREFILL && q->state != BGS_SP_DECODE) ||
               q->blocks_held > need || (q->state == BGS_SP_DECODE && q->pos >= q->reserve_tokens);
        committed += (bgs_u64)(need - q->blocks_held);
        running++;
    }
    if (gld_warp_sum(bad) != 0u) {
        __syncwarp();
        if (lane == 0u) sh_r = bgs_step_plan(lim, seqs, n, out);
        __syncwarp();
        return sh_r;
    }
    committed = gld_warp_sum64(committed);
    running = gld_warp_sum(running);
    if (committed > (bgs_u64)lim->free_blocks) return BGS_SP_ERR_OVERCOMMIT;
    bgs_u64 uncommitted = (bgs_u64)lim->free_blocks - committed;
    /* Pass 1: one token for every ready decoder, in order, while the budget lasts. */
    bgs_u32 decoders = 0u;
    for (bgs_u32 i0 = 0u; i0 < n; i0 += GLD_LANES) {
        const bgs_u32 i = i0 + lane;
        const bgs_u32 d = i < n && seqs[i].state == BGS_SP_DECODE && seqs[i].ready != 0u;
        bgs_u32 total;
        const bgs_u32 before = decoders + gld_warp_scan(d, &total);
        if (d && before < budget) out[i].tokens = 1u;
        decoders += total;
    }
    budget -= decoders < budget ? decoders : budget;
    /* Pass 2 (lane 0 acts): prefill chunks, running sequences first then admissions, FIFO. */
    if (lane == 0u) {
        sh_budget = budget;
        sh_stop = budget == 0u;
    }
    __syncwarp();
    for (bgs_u32 i0 = 0u; i0 < n && sh_stop == 0u; i0 += GLD_LANES) {
        const bgs_u32 i = i0 + lane;
        const struct bgs_sp_seq *q = &seqs[i];
        const bgs_u32 acts = i < n && (q->state == BGS_SP_WAITING ||
                                       (q->state == BGS_SP_PREFILL && q->ready != 0u &&
                                        q->prompt_left != 0u));
        /* The acting lanes as bits (distinct powers of two: their sum is their or). */
        const bgs_u32 mask = gld_warp_sum(acts ? 1u << lane : 0u);
        if (lane == 0u) {
            for (bgs_u32 l = 0u; l < GLD_LANES && sh_stop == 0u; l++) {
                if ((mask >> l & 1u) == 0u) continue;
                const bgs_u32 k = i0 + l;
                const struct bgs_sp_seq *w = &seqs[k];
                if (w->ready == 0u) { /* waiting, not ready: nothing behind it goes first */
                    sh_stop = 1u;
                    break;
                }
                if (w->state == BGS_SP_WAITING) {
                    const bgs_u64 need = bgs_sp_blocks_for(w->reserve_tokens, bs);
                    if (running >= lim->max_running || need > uncommitted ||
                        w->reserve_tokens < w->prompt_left || w->prompt_left == 0u) {
                        sh_stop = 1u;
                        break;
                    }
                    uncommitted -= need;
                    running++;
                    out[k].admit = 1u;
                }
                bgs_u64 chunk = w->prompt_left;
                if (chunk > sh_budget) chunk = sh_budget;
                if ((bgs_u64)w->pos + chunk > (bgs_u64)w->reserve_tokens)
                    chunk = w->reserve_tokens > w->pos ? (bgs_u64)(w->reserve_tokens - w->pos) : 0u;
                out[k].tokens = (bgs_u32)chunk;
                sh_budget -= chunk;
                if (sh_budget == 0u) sh_stop = 1u;
            }
        }
        __syncwarp();
    }
    /* Pass 3: the blocks each scheduled sequence adds to cover [0, pos + tokens). */
    bgs_u64 total = 0u;
    for (bgs_u32 i = lane; i < n; i += GLD_LANES) {
        if (out[i].tokens == 0u) continue;
        const bgs_u32 want = bgs_sp_blocks_for((bgs_u64)seqs[i].pos + out[i].tokens, bs);
        out[i].new_blocks = want > seqs[i].blocks_held ? want - seqs[i].blocks_held : 0u;
        total += out[i].tokens;
    }
    return (int)gld_warp_sum64(total);
}

/* bgs_gl_plan_viewed, lane-parallel (all lanes call it; every lane gets the answer): the policy
 * (gld_step_plan), then the items: each view's item index, blocks and input tokens come from
 * prefix sums of the decisions before it, so its lane builds it with the C piece
 * (bgs_gl_plan_item) where the one-thread loop would. A decision that does not fit (an engine
 * bug the C loop answers by ending that stream, which gives its blocks back and so changes
 * what every later view gets) sends the whole step to the C loop instead. */
__device__ int gld_plan_viewed(bgs_u32 *state, bgs_u32 n, bgs_u32 lane) {
    __shared__ int sh_r;
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC) return BGS_GL_ERR_STATE;
    __syncwarp(); /* every lane read the header words before lane 0 resets them */
    if (lane == 0u) {
        state[BGS_GL_H_N_ITEMS] = 0u;
        state[BGS_GL_H_STEP_TOKENS] = 0u;
    }
    if (n == 0u) {
        __syncwarp();
        return 0;
    }
    struct bgs_sp_limits lim;
    bgs_gl_sp_limits(state, &lim);
    const struct bgs_sp_seq *views = (const struct bgs_sp_seq *)(state + state[BGS_GL_H_VIEWS_AT]);
    struct bgs_sp_out *outs = (struct bgs_sp_out *)(state + state[BGS_GL_H_OUTS_AT]);
    const bgs_u32 *view_of = state + state[BGS_GL_H_VIEW_OF_AT];
    const int r = gld_step_plan(&lim, views, n, outs, lane);
    __syncwarp(); /* every lane's decisions are in */
    if (r < 0) {
        if (lane == 0u) sh_r = bgs_gl_plan_failed(state, n);
        __syncwarp();
        return sh_r;
    }
    const bgs_u32 free_top = state[BGS_GL_H_FREE_TOP];
    /* Does every decision fit? */
    bgs_u32 blocks = 0u, toks = 0u, misfit = 0u;
    for (bgs_u32 k0 = 0u; k0 < n; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        const struct bgs_sp_out *o = k < n && outs[k].tokens != 0u ? &outs[k] : 0;
        bgs_u32 bt, tt;
        const bgs_u32 b_before = blocks + gld_warp_scan(o != 0 ? o->new_blocks : 0u, &bt);
        const bgs_u32 t_before = toks + gld_warp_scan(o != 0 ? o->tokens : 0u, &tt);
        misfit |= o != 0 && (b_before > free_top ||
                             bgs_gl_item_room(state, bgs_gl_cseq(state, view_of[k]), o,
                                              free_top - b_before, t_before) == 0u);
        blocks += bt;
        toks += tt;
    }
    if (gld_warp_sum(misfit) != 0u) {
        if (lane == 0u) sh_r = bgs_gl_plan_items(state, n);
        __syncwarp();
        return sh_r;
    }
    bgs_u32 items = 0u;
    blocks = 0u;
    toks = 0u;
    for (bgs_u32 k0 = 0u; k0 < n; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        const struct bgs_sp_out *o = k < n ? &outs[k] : 0;
        const bgs_u32 has = o != 0 && o->tokens != 0u;
        bgs_u32 it, bt, tt;
        const bgs_u32 at = items + gld_warp_scan(has, &it);
        const bgs_u32 b_before = blocks + gld_warp_scan(has ? o->new_blocks : 0u, &bt);
        const bgs_u32 t_before = toks + gld_warp_scan(has ? o->tokens : 0u, &tt);
        if (o != 0 && o->admit != 0u) bgs_gl_seq(state, view_of[k])[BGS_GL_S_RUNNING] = 1u;
        if (has) bgs_gl_plan_item(state, view_of[k], o, free_top - b_before, at, t_before);
        items += it;
        blocks += bt;
        toks += tt;
    }
    __syncwarp();
    if (lane == 0u) {
        state[BGS_GL_H_FREE_TOP] = free_top - blocks;
        state[BGS_GL_H_N_ITEMS] = items;
        state[BGS_GL_H_STEP_TOKENS] = toks;
    }
    __syncwarp();
    return (int)items;
}

/* P_CHECK (lane 0, after gld_plan_viewed): the policy's C function gives the same decisions
 * for the same views (into the check scratch), and the items, input tokens and new table
 * entries are the ones the one-thread loop would have made. 0 when equal. `free_top`: the
 * free stack before the plan. A step the C loop made (a misfit) is its own answer. */
__device__ int gld_check_plan(struct gld_ctx *c, bgs_u32 n, int r, bgs_u32 free_top) {
    const bgs_u32 *st = c->state;
    if (n == 0u || r < 0) return 0;
    struct bgs_sp_limits lim;
    bgs_gl_sp_limits(st, &lim);
    lim.free_blocks = free_top;
    const struct bgs_sp_seq *views = (const struct bgs_sp_seq *)(st + st[BGS_GL_H_VIEWS_AT]);
    const struct bgs_sp_out *outs = (const struct bgs_sp_out *)(st + st[BGS_GL_H_OUTS_AT]);
    const bgs_u32 *view_of = st + st[BGS_GL_H_VIEW_OF_AT];
    struct bgs_sp_out *want = (struct bgs_sp_out *)c->p[BGS_GLD_P_CHECK_SCRATCH];
    /* The views are as the plan read them, except the RUNNING words it set (not in views). */
    if (bgs_step_plan(&lim, views, n, want) < 0) return 1;
    for (bgs_u32 k = 0u; k < n; k++)
        if (want[k].admit != outs[k].admit || want[k].tokens != outs[k].tokens ||
            want[k].new_blocks != outs[k].new_blocks || want[k].reserved != outs[k].reserved)
            return 1;
    const bgs_u32 *items = st + st[BGS_GL_H_ITEMS_AT];
    const bgs_u32 *tokens = st + st[BGS_GL_H_TOKENS_AT];
    const bgs_u32 *free_stack = st + st[BGS_GL_H_FREE_AT];
    /* A viewed sequence that has ended since: a misfit, so the C loop made this step. */
    for (bgs_u32 k = 0u; k < n; k++)
        if (bgs_gl_cseq(st, view_of[k])[BGS_GL_S_END] != 0u) return 0;
    bgs_u32 at = 0u, toks = 0u, top = free_top;
    for (bgs_u32 k = 0u; k < n; k++) {
        const bgs_u32 *s = bgs_gl_cseq(st, view_of[k]);
        if (outs[k].admit != 0u && s[BGS_GL_S_RUNNING] == 0u) return 1;
        if (outs[k].tokens == 0u) continue;
        const bgs_u32 *item = items + at * BGS_GL_ITEM_WORDS;
        const bgs_u32 *table = s + BGS_GL_SEQ_FIXED + st[BGS_GL_H_MAX_PROMPT];
        const bgs_u32 held = s[BGS_GL_S_N_BLOCKS] - outs[k].new_blocks;
        for (bgs_u32 j = 0u; j < outs[k].new_blocks; j++)
            if (table[held + j] != free_stack[top - 1u - j]) return 1;
        if (item[BGS_GL_I_SLOT] != view_of[k] || item[BGS_GL_I_TOKENS] != outs[k].tokens ||
            item[BGS_GL_I_POS] != s[BGS_GL_S_POS] ||
            item[BGS_GL_I_SAMPLE] !=
                (s[BGS_GL_S_POS] + outs[k].tokens == s[BGS_GL_S_PROMPT_LEN] + s[BGS_GL_S_GENERATED]) ||
            item[BGS_GL_I_TOK_AT] != st[BGS_GL_H_TOKENS_AT] + toks)
            return 1;
        for (bgs_u32 j = 0u; j < outs[k].tokens; j++) {
            const bgs_u32 p = s[BGS_GL_S_POS] + j;
            if (tokens[toks + j] !=
                (p < s[BGS_GL_S_PROMPT_LEN] ? s[BGS_GL_SEQ_FIXED + p] : s[BGS_GL_S_LAST]))
                return 1;
        }
        top -= outs[k].new_blocks;
        toks += outs[k].tokens;
        at++;
    }
    return at != st[BGS_GL_H_N_ITEMS] || toks != st[BGS_GL_H_STEP_TOKENS] ||
           top != st[BGS_GL_H_FREE_TOP];
}

/* P_CHECK (lane 0): the views the C loop builds equal gld_plan_views' (0 when equal). */
__device__ int gld_check_views(struct gld_ctx *c, const bgs_u32 *credit, bgs_u32 n) {
    const bgs_u32 *st = c->state;
    const bgs_u32 *order = st + st[BGS_GL_H_ORDER_AT];
    struct bgs_sp_seq *views;
    bgs_u32 *view_of;
    bgs_gl_views((bgs_u32 *)st, &views, &view_of);
    bgs_u32 m = 0u;
    for (bgs_u32 k = 0u; k < st[BGS_GL_H_N_LIVE]; k++) {
        struct bgs_sp_seq v;
        if (bgs_gl_view(st, order[k], credit, &v) == 0u) continue;
        if (m >= n || view_of[m] != order[k]) return 1;
        const bgs_u32 *a = (const bgs_u32 *)&views[m], *b = (const bgs_u32 *)&v;
        for (bgs_u32 w = 0u; w < sizeof(struct bgs_sp_seq) / 4u; w++)
            if (a[w] != b[w]) return 1;
        m++;
    }
    return m != n;
}

/* P_CHECK (lane 0, after the lane-parallel call and a __syncwarp): the C function's answer
 * in the check scratch equals the lane-parallel one. 0 when equal. */
__device__ int gld_check_owed(struct gld_ctx *c, const struct bgs_gl_frame *got, bgs_u32 n) {
    struct bgs_gl_frame *want = (struct bgs_gl_frame *)c->p[BGS_GLD_P_CHECK_SCRATCH];
    const bgs_u32 m = bgs_gl_owed(c->state, want);
    if (m != n) return 1;
    for (bgs_u32 i = 0u; i < n; i++) {
        const bgs_u32 *a = (const bgs_u32 *)&got[i], *b = (const bgs_u32 *)&want[i];
        for (bgs_u32 w = 0u; w < sizeof(struct bgs_gl_frame) / 4u; w++)
            if (a[w] != b[w]) return 1;
    }
    return 0;
}
__device__ int gld_check_pack(struct gld_ctx *c, const struct bgs_llm_step_geometry *geo,
                              const bgs_i32 *got, int r, const struct bgs_gl_packed *pk) {
    bgs_i32 *want = (bgs_i32 *)c->p[BGS_GLD_P_CHECK_SCRATCH];
    struct bgs_gl_packed wpk;
    const int wr = bgs_gl_pack(c->state, geo, want, &wpk);
    if (wr != r) return 1;
    if (r != 0) return 0;
    if (wpk.tokens != pk->tokens || wpk.bucket != pk->bucket || wpk.samples != pk->samples ||
        wpk.sample_bucket != pk->sample_bucket || wpk.words != pk->words)
        return 1;
    for (bgs_u32 i = 0u; i < pk->words; i++)
        if (want[i] != got[i]) return 1;
    return 0;
}

/* A one-shot answer (refusal, echo, rejection, unknown op) waiting for room in the ring. */
__device__ int gld_flush_oneshot(struct gld_ctx *c) {
    bgs_u64 *s = c->s;
    if (s[BGS_GLD_S_PEND] == 0) return 1;
    const bgs_u32 *payload = (const bgs_u32 *)c->p[BGS_GLD_P_PAYLOAD];
    if (!gld_publish(c, s[BGS_GLD_S_PEND_CONN], (bgs_u32)s[BGS_GLD_S_PEND_CONN_SEQ],
                     (bgs_u32)s[BGS_GLD_S_PEND_REQUEST_ID], (bgs_u32)s[BGS_GLD_S_PEND_ROUTE],
                     (bgs_u32)s[BGS_GLD_S_PEND_OP], s[BGS_GLD_S_PEND_PUBLISH_NS],
                     (bgs_u32)s[BGS_GLD_S_PEND_STATUS], 1u, 0u, 0u, payload,
                     (bgs_u32)s[BGS_GLD_S_PEND_WORDS]))
        return 0;
    s[BGS_GLD_S_PEND] = 0;
    gld_add(c, BGS_GLD_C_ONESHOT, 1);
    return 1;
}

/* Take up to P_INTAKE request entries (whole warp; lane 0 decides). Returns how many. */
__device__ bgs_u32 gld_intake(struct gld_ctx *c, bgs_u32 lane) {
    __shared__ bgs_u64 sh_pos;
    __shared__ bgs_u32 sh_go;
    __shared__ const bgs_u32 *sh_src;
    __shared__ bgs_u32 sh_words;
    __shared__ bgs_u32 sh_op; /* the claimed entry's op, read once for every lane */
    struct bgs_ring_header *h = gld_header(c->ring);
    bgs_u32 *payload = (bgs_u32 *)c->p[BGS_GLD_P_PAYLOAD];
    const bgs_u32 max_take = (bgs_u32)c->p[BGS_GLD_P_INTAKE];
    bgs_u32 taken = 0;
    for (;;) {
        if (lane == 0) {
            sh_go = 0;
            /* A one-shot answer still owed blocks intake (bounded state: one at a time). */
            if (taken < max_take && gld_flush_oneshot(c)) {
                for (;;) {
                    const bgs_u64 pos = c->s[BGS_GLD_S_REQ_POS];
                    struct bgs_request_slot *rs = gld_request_slot(c->ring, pos);
                    const long long d = (long long)(gld_ld_acquire_sys(&rs->seq) - (pos + 1));
                    if (d < 0) break; /* empty */
                    if (d > 0) {
                        /* Another consumer took it: reload the head. */
                        c->s[BGS_GLD_S_REQ_POS] = ((volatile bgs_u64 *)&h->request_head)[0];
                        continue;
                    }
                    const bgs_u64 old = atomicCAS_system(
                        (unsigned long long *)&h->request_head, (unsigned long long)pos,
                        (unsigned long long)(pos + 1));
                    if (old != pos) {
                        c->s[BGS_GLD_S_REQ_POS] = old;
                        continue;
                    }
                    c->s[BGS_GLD_S_REQ_POS] = pos + 1;
                    const volatile struct bgs_request_entry *e = &rs->entry;
                    bgs_u32 w = e->words;
                    sh_words = w > BGS_RING_SLOT_WORDS ? BGS_RING_SLOT_WORDS : w;
                    sh_op = e->op;
                    sh_src = (const bgs_u32 *)e->payload;
                    sh_pos = pos;
                    sh_go = 1;
                    break;
                }
            }
        }
        __syncwarp();
        if (!sh_go) break;
        /* The claimed entry's payload, 32 reads in flight at a time. */
        for (bgs_u32 i = lane; i < sh_words; i += GLD_LANES)
            payload[i] = ((const volatile bgs_u32 *)sh_src)[i];
        /* A generate request with a credit stream to take: bgs_gl_admit's passes over the
         * table, lane-parallel (lane 0 alone spent ~1 us a sequence on them). */
        bgs_u32 stream_live = 0u, free_slot = c->state[BGS_GL_H_MAX_SEQS];
        const bgs_u64 stream_top = c->s[BGS_GLD_S_STREAM_TOP];
        if (sh_op == BGS_OP_GENERATE && stream_top != 0) {
            const bgs_u32 stream = ((const bgs_u32 *)c->p[BGS_GLD_P_STREAM_FREE])[stream_top - 1];
            gld_admit_scans(c->state, stream, lane, &stream_live, &free_slot);
        }
        __syncwarp();
        if (lane == 0) {
            const bgs_u64 pos = sh_pos;
            struct bgs_request_slot *rs = gld_request_slot(c->ring, pos);
            const volatile struct bgs_request_entry *e = &rs->entry;
            const bgs_u64 conn = e->conn;
            const bgs_u32 conn_seq = e->conn_seq, request_id = e->request_id;
            const bgs_u32 op = sh_op, param = e->param, flags = e->flags, route = e->route;
            const bgs_u64 publish_ns = e->publish_ns;
            const bgs_u32 words = sh_words;
            /* Consumed: free the request slot for the producer of pos + capacity. */
            gld_st_release_sys(&rs->seq, pos + (bgs_u64)h->request_capacity);
            taken++;
            if (op == BGS_RING_OP_CANCEL) {
                gld_add(c, BGS_GLD_C_CANCELS, 1);
                bgs_gl_cancel(c->state, conn);
            } else {
                gld_add(c, BGS_GLD_C_REQUESTS, 1);
                bgs_u32 status = BGS_STATUS_OK;
                bgs_u32 out_words = 0;
                if (op == BGS_OP_GENERATE) {
                    const bgs_u64 top = c->s[BGS_GLD_S_STREAM_TOP];
                    if (top == 0) {
                        status = BGS_STATUS_BUSY; /* every credit stream is live */
                        gld_add(c, BGS_GLD_C_REFUSED_NO_STREAM, 1);
                    } else {
                        bgs_u32 *stream_free = (bgs_u32 *)c->p[BGS_GLD_P_STREAM_FREE];
                        const bgs_u32 stream = stream_free[top - 1];
                        struct bgs_gl_request r;
                        r.conn = conn;
                        r.stream = stream;
                        r.conn_seq = conn_seq;
                        r.request_id = request_id;
                        r.route = route;
                        r.param = param;
                        r.flags = flags;
                        r.words = words;
                        r.reserved = 0;
                        r.payload = payload;
                        if (c->p[BGS_GLD_P_CHECK] != 0 &&
                            ((bgs_gl_find_stream(c->state, stream) != BGS_GL_NO_STREAM) !=
                                 (stream_live != 0u) ||
                             bgs_gl_first_free(c->state) != free_slot)) {
                            gld_error(c->ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_ADMIT);
                            status = BGS_STATUS_INTERNAL;
                        } else {
                            status = bgs_gl_admit_scanned(c->state, &r, stream_live, free_slot);
                        }
                        if (status == 0u) {
                            c->s[BGS_GLD_S_STREAM_TOP] = top - 1;
                            ((bgs_u64 *)c->p[BGS_GLD_P_STREAM_NS])[stream] = publish_ns;
                            gld_add(c, BGS_GLD_C_ADMITTED, 1);
                        }
                    }
                    if (status != 0u) gld_add(c, BGS_GLD_C_REFUSED, 1);
                } else if (op == BGS_RING_OP_REJECT) {
                    /* A framer rejection carries its status in param. */
                    const bool known = param < 32u && ((BGS_VALID_STATUS_MASK >> param) & 1u);
                    status = known ? param : BGS_STATUS_INTERNAL;
                } else if (op == BGS_OP_ECHO) {
                    /* Answered inline (health checks and the load tool's probes); gemm8 and
                     * fft32 need the one-shot executor's library graphs: UnknownOp here. */
                    status = bgs_op_check(op, words, param);
                    out_words = status == 0u ? bgs_op_reply_words(op, words) : 0u;
                    if (out_words > words) out_words = words;
                } else {
                    status = BGS_STATUS_UNKNOWN_OP;
                }
                if (op != BGS_OP_GENERATE || status != 0u) {
                    bgs_u64 *s = c->s;
                    s[BGS_GLD_S_PEND] = 1;
                    s[BGS_GLD_S_PEND_CONN] = conn;
                    s[BGS_GLD_S_PEND_CONN_SEQ] = conn_seq;
                    s[BGS_GLD_S_PEND_REQUEST_ID] = request_id;
                    s[BGS_GLD_S_PEND_ROUTE] = route;
                    s[BGS_GLD_S_PEND_OP] = op;
                    s[BGS_GLD_S_PEND_PUBLISH_NS] = publish_ns;
                    s[BGS_GLD_S_PEND_STATUS] = status;
                    s[BGS_GLD_S_PEND_WORDS] = out_words;
                    gld_flush_oneshot(c);
                }
            }
        }
        __syncwarp();
    }
    return taken;
}

/* Launch the planned step's graphs (lane 0): body, head, finish, as tail launches. 0 on
 * success; on failure the step is failed (its sequences owe Internal) and the error recorded. */
__device__ int gld_launch_step(struct gld_ctx *c, const struct bgs_gl_packed *pk) {
    const bgs_u64 *body = (const bgs_u64 *)c->p[BGS_GLD_P_BODY];
    const bgs_u64 *head = (const bgs_u64 *)c->p[BGS_GLD_P_HEAD];
    bgs_u64 gb = 0, gh = 0;
    for (bgs_u32 b = 0; b < BGS_LLM_STEP_N_BUCKETS; b++) {
        if (bgs_llm_step_bucket(b) == pk->bucket) gb = body[b];
        if (pk->samples != 0u && bgs_llm_step_bucket(b) == pk->sample_bucket) gh = head[b];
    }
    if (gb == 0 || (pk->samples != 0u && gh == 0)) {
        gld_add(c, BGS_GLD_C_PACK_FAILED, 1);
        gld_error(c->ctl, BGS_GLD_E_NO_GRAPH, BGS_GLD_W_BUCKET);
        return -1;
    }
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)gb, cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) {
        gld_error(c->ctl, (bgs_u64)err, BGS_GLD_W_BODY);
        return -1;
    }
    if (pk->samples != 0u) {
        err = cudaGraphLaunch((cudaGraphExec_t)gh, cudaStreamGraphTailLaunch);
        if (err != cudaSuccess) {
            gld_error(c->ctl, (bgs_u64)err, BGS_GLD_W_HEAD);
            return -1;
        }
    }
    err = cudaGraphLaunch((cudaGraphExec_t)c->p[BGS_GLD_P_FINISH], cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) {
        gld_error(c->ctl, (bgs_u64)err, BGS_GLD_W_FINISH);
        return -1;
    }
    return 0;
}

/* ---- D: the dispatcher ---- */
extern "C" __global__ void bgs_gld_dispatch(const bgs_u64 *params) {
    if (blockIdx.x != 0 || blockDim.x != GLD_LANES) return;
    __shared__ bgs_u32 sh_cmd; /* 0: keep polling, 1: step launched, 2: stop, 3: relaunch */
    const bgs_u32 lane = threadIdx.x;
    struct gld_ctx c = gld_ctx_of(params);
    const bgs_u32 idle_rounds = (bgs_u32)params[BGS_GLD_P_IDLE_ROUNDS];
    bgs_u32 idle = 0;
    bgs_u32 sleep_ns = 64;
    if (lane == 0) {
        gld_add(&c, BGS_GLD_C_EXECUTIONS, 1);
        gld_set(&c, BGS_GLD_C_HEARTBEAT_NS, gld_now_ns());
    }
    for (;;) {
        const bgs_u64 t_round = lane == 0 ? gld_now_ns() : 0;
        __syncwarp(); /* every lane read the last round's sh_cmd before lane 0 resets it */
        if (lane == 0) {
            sh_cmd = 0;
            if (c.state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC) {
                gld_error(c.ctl, BGS_GLD_E_STATE, BGS_GLD_W_STATE);
                sh_cmd = 2;
            } else if (gld_ld_acquire_sys32((const bgs_u32 *)&c.ctl[BGS_GLD_C_STOP]) != 0u) {
                sh_cmd = 2;
            }
        }
        __syncwarp();
        if (sh_cmd == 2) break;
        const bgs_u32 took = gld_intake(&c, lane);
        gld_credit(&c, lane);
        __syncwarp();
        bool moved = took != 0; /* lane 0's is the one used */
        /* What is owed, then its publication (both lane-parallel). */
        struct bgs_gl_frame *frames = (struct bgs_gl_frame *)params[BGS_GLD_P_FRAMES];
        const bgs_u32 n_owed = gld_owed(c.state, frames, lane);
        __syncwarp();
        if (lane == 0 && c.p[BGS_GLD_P_CHECK] != 0 && gld_check_owed(&c, frames, n_owed) != 0) {
            gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_OWED);
            sh_cmd = 2;
        }
        __syncwarp();
        if (sh_cmd == 2) break;
        if (n_owed != 0u) {
            const bgs_u64 before = lane == 0 ? c.shadow[BGS_GLD_C_FRAMES] : 0;
            gld_publish_frames(&c, frames, n_owed, lane);
            if (lane == 0) moved |= c.shadow[BGS_GLD_C_FRAMES] != before;
        }
        const struct gld_census census = gld_census_of(&c, lane);
        const bgs_u32 *credit = (const bgs_u32 *)params[BGS_GLD_P_CREDIT];
        const bgs_u64 t_plan = lane == 0 ? gld_now_ns() : 0;
        const bgs_u32 n_views = gld_plan_views(c.state, credit, lane);
        __syncwarp(); /* every lane's views are in before lane 0 plans on them */
        bgs_u64 t_pack = 0;
        if (lane == 0) {
            if (c.p[BGS_GLD_P_CHECK] != 0 && gld_check_views(&c, credit, n_views) != 0) {
                gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_VIEWS);
                sh_cmd = 2;
            }
        }
        __syncwarp();
        if (sh_cmd == 2) break;
        const bgs_u32 free_before = c.state[BGS_GL_H_FREE_TOP];
        const int planned = gld_plan_viewed(c.state, n_views, lane);
        if (lane == 0) {
            if (c.p[BGS_GLD_P_CHECK] != 0 && gld_check_plan(&c, n_views, planned, free_before) != 0) {
                gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_PLAN);
                sh_cmd = 2;
            }
            t_pack = gld_now_ns();
        }
        __syncwarp();
        if (sh_cmd == 2) break;
        const struct bgs_llm_step_geometry *geo =
            (const struct bgs_llm_step_geometry *)params[BGS_GLD_P_GEO];
        bgs_i32 *inputs = (bgs_i32 *)params[BGS_GLD_P_INPUTS];
        struct bgs_gl_packed pk = {0u, 0u, 0u, 0u, 0u, 0u};
        int packed = 0;
        if (planned > 0) packed = gld_pack(c.state, geo, inputs, &pk, lane);
        /* Every lane's words are in, and every lane read this round's sh_cmd, before lane 0
         * checks, launches and sets it. */
        __syncwarp();
        if (lane == 0) {
            if (planned < 0) {
                /* A policy bug: every live stream now owes Internal (published next round)
                 * and the loop goes on, as the host engine does; counted, not an error (an
                 * error stops the loop: the host then answers in its place). */
                gld_add(&c, BGS_GLD_C_POLICY_FAILED, 1);
            } else if (planned > 0) {
                if (c.p[BGS_GLD_P_CHECK] != 0 && gld_check_pack(&c, geo, inputs, packed, &pk) != 0) {
                    gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_PACK);
                    bgs_gl_fail_step(c.state);
                    sh_cmd = 2;
                } else if (packed != 0) {
                    gld_add(&c, BGS_GLD_C_PACK_FAILED, 1);
                    bgs_gl_fail_step(c.state);
                } else {
                    c.s[BGS_GLD_S_STEP_SAMPLES] = pk.samples;
                    c.s[BGS_GLD_S_STEP_T0] = gld_now_ns();
                    /* The round, planning and packing: the part of a step the GPU's model
                     * work does not hide. */
                    gld_add(&c, BGS_GLD_C_ROUND_NS, t_plan - t_round);
                    gld_add(&c, BGS_GLD_C_PLAN_NS, t_pack - t_plan);
                    gld_add(&c, BGS_GLD_C_PACK_NS, c.s[BGS_GLD_S_STEP_T0] - t_pack);
                    gld_add(&c, BGS_GLD_C_STEP_TOKENS, pk.tokens);
                    gld_add(&c, BGS_GLD_C_RUNNING_SEEN, census.running);
                    gld_add(&c, BGS_GLD_C_PENDING_WAITS, census.pending);
                    gld_add(&c, BGS_GLD_C_CREDIT_WAITS, census.low_credit);
                    gld_add(&c, BGS_GLD_C_WAITING_SEEN, census.waiting);
                    gld_add(&c, BGS_GLD_C_ENDED_SEEN, census.ended);
                    gld_add(&c, BGS_GLD_C_LIVE_SEEN, bgs_gl_live(c.state));
                    if (gld_launch_step(&c, &pk) == 0) {
                        sh_cmd = 1;
                    } else {
                        bgs_gl_fail_step(c.state);
                        sh_cmd = 2;
                    }
                }
                moved = true;
            }
            gld_set(&c, BGS_GLD_C_LIVE, bgs_gl_live(c.state));
            gld_set(&c, BGS_GLD_C_FREE_BLOCKS, bgs_gl_free_blocks(c.state));
            if (sh_cmd == 0) {
                if (moved) {
                    idle = 0;
                    sleep_ns = 64;
                } else if (++idle >= idle_rounds) {
                    sh_cmd = 3;
                } else {
                    /* Backoff: quick re-polls right after work, up to 20 us when idle. */
                    __nanosleep(sleep_ns);
                    if (sleep_ns < 20000u) sleep_ns *= 2u;
                }
            }
        }
        __syncwarp();
        if (sh_cmd != 0) break;
    }
    if (lane != 0) return;
    if (sh_cmd == 2) {
        if (c.ctl[BGS_GLD_C_ERROR] == 0) {
            gld_st_release_sys(&c.ctl[BGS_GLD_C_STOPPED], 1); /* no relaunch: stopping */
        }
        return;
    }
    if (sh_cmd == 3) {
        /* Bounded executions: relaunch (the next execution reads stop again). */
        cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)params[BGS_GLD_P_SELF],
                                          cudaStreamGraphTailLaunch);
        if (err != cudaSuccess) gld_error(c.ctl, (bgs_u64)err, BGS_GLD_W_SELF);
    }
}

/* ---- F: after the step's graphs: advance the sequences, publish, relaunch D ----
 * One warp, as D: the lanes spread the sampled tokens over the items and collect the owed
 * frames (gld_owed); lane 0 advances the sequences (bgs_gl_advance) and publishes. */
extern "C" __global__ void bgs_gld_finish(const bgs_u64 *params) {
    if (blockIdx.x != 0 || blockDim.x != GLD_LANES) return;
    __shared__ int sh_advanced;
    const bgs_u32 lane = threadIdx.x;
    struct gld_ctx c = gld_ctx_of(params);
    const bgs_u32 *st = c.state;
    const bgs_u32 *model_next = (const bgs_u32 *)params[BGS_GLD_P_NEXT];
    bgs_u32 *next = (bgs_u32 *)params[BGS_GLD_P_NEXT_BY_ITEM];
    struct bgs_gl_frame *frames = (struct bgs_gl_frame *)params[BGS_GLD_P_FRAMES];
    /* The head graph wrote one row per sampling item, in item order; bgs_gl_advance reads
     * next[k] for item k. */
    const bgs_u32 n_items = st[BGS_GL_H_N_ITEMS];
    const bgs_u32 *items = st + st[BGS_GL_H_ITEMS_AT];
    bgs_u32 r = 0;
    for (bgs_u32 k0 = 0; k0 < n_items; k0 += GLD_LANES) {
        const bgs_u32 k = k0 + lane;
        const bgs_u32 sample =
            k < n_items && items[k * BGS_GL_ITEM_WORDS + BGS_GL_I_SAMPLE] != 0u;
        bgs_u32 total;
        const bgs_u32 row = r + gld_warp_scan(sample, &total);
        if (k < n_items) next[k] = sample ? model_next[row] : 0u;
        r += total;
    }
    __syncwarp(); /* every item's token is in before lane 0 advances */
    bgs_u64 t_finish = 0;
    if (lane == 0) {
        gld_add(&c, BGS_GLD_C_STEPS, 1);
        gld_add(&c, BGS_GLD_C_SAMPLED, r);
        gld_add(&c, BGS_GLD_C_STEP_NS, gld_now_ns() - c.s[BGS_GLD_S_STEP_T0]);
        t_finish = gld_now_ns();
        sh_advanced = bgs_gl_advance(c.state, next);
        if (sh_advanced < 0) gld_error(c.ctl, BGS_GLD_E_STATE, BGS_GLD_W_FINISH_STEP);
    }
    __syncwarp();
    if (sh_advanced < 0) return;
    const bgs_u32 n = gld_owed(c.state, frames, lane);
    __syncwarp(); /* every lane's frames are in before lane 0 checks them */
    if (lane == 0) {
        sh_advanced = 0;
        bgs_u32 bad = 0u;
        if (c.p[BGS_GLD_P_CHECK] == 0) {
        } else if (gld_check_owed(&c, frames, n) != 0) {
            gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_OWED);
            sh_advanced = -1;
        } else if ((bad = bgs_gl_check(c.state)) != 0u) {
            gld_set(&c, BGS_GLD_C_CHECK, bad);
            gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK);
            sh_advanced = -1;
        }
    }
    __syncwarp();
    if (sh_advanced < 0) return;
    /* Frames go out now, with the credit D computed before the step (the step used at most
     * BGS_GL_STEP_CREDIT of it per stream); D refreshes credit and retries what is left. */
    const bgs_u64 t_publish = lane == 0 ? gld_now_ns() : 0;
    if (lane == 0) gld_add(&c, BGS_GLD_C_FINISH_NS, t_publish - t_finish);
    if (n > 0) gld_publish_frames(&c, frames, n, lane);
    if (lane != 0) return;
    gld_add(&c, BGS_GLD_C_PUBLISH_NS, gld_now_ns() - t_publish);
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)params[BGS_GLD_P_SELF],
                                      cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) gld_error(c.ctl, (bgs_u64)err, BGS_GLD_W_RELAUNCH);
}
