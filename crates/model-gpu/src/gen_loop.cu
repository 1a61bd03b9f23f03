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
/* Relaxed: no ordering of their own; a batch orders them with one fence (gld_batch_*). */
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
/* The fields of one completion entry (not its seq) at `cs`. */
__device__ __forceinline__ void gld_write_entry(struct bgs_completion_slot *cs, bgs_u64 conn,
                                                bgs_u32 conn_seq, bgs_u32 request_id,
                                                bgs_u32 route, bgs_u32 op, bgs_u64 publish_ns,
                                                bgs_u32 status, bgs_u32 final_,
                                                bgs_u32 stream_seq, bgs_u32 stream_plus_one,
                                                const bgs_u32 *payload, bgs_u32 words) {
    struct bgs_completion_entry *ce = &cs->entry;
    ce->conn = conn;
    ce->conn_seq = conn_seq;
    ce->status = (bgs_u16)status;
    ce->final_ = (bgs_u16)final_;
    ce->request_id = request_id;
    ce->words = words;
    ce->stream_seq = stream_seq;
    ce->route = route;
    ce->stream = stream_plus_one;
    ce->op = op;
    ce->publish_ns = publish_ns;
    ce->reserved[0] = 0;
    ce->reserved[1] = 0;
    for (bgs_u32 i = 0; i < words; i++) ce->payload[i] = payload[i];
}

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

/* A batch of completion entries (lane 0): the frames of one publication share the ring-room
 * reads, the fence and the tail update that gld_publish pays per entry (each a PCIe round
 * trip or a system fence: ~7 us a frame on the H200, 0.7 ms of a step of 100 sequences).
 *   room: the seqs of up to GLD_ROOM_READS slots ahead are read together (relaxed loads, all
 *     in flight at once), then one fence orders them before the entry writes (the acquire
 *     that gld_publish's per-slot ld.acquire gives: the consumer's reads of a freed slot are
 *     done before we overwrite it);
 *   add: writes an entry's fields into the next slot (no seq yet);
 *   commit: one system fence (every entry's fields before any seq), then each seq (relaxed
 *     stores, posted), then one completion_tail max and one frame count.
 * The consumer sees an entry only through its seq, as with gld_publish. */
#define GLD_ROOM_READS 16u
struct gld_batch {
    bgs_u64 pos;   /* the next slot's position */
    bgs_u64 room;  /* slots from pos known free */
    bgs_u64 first; /* pos when the batch began */
};
__device__ __forceinline__ void gld_batch_begin(struct gld_ctx *c, struct gld_batch *b) {
    b->pos = c->s[BGS_GLD_S_TAIL];
    b->first = b->pos;
    b->room = 0;
}
/* 1 when the next slot is free (reading ahead when the known room ran out), 0 when full. */
__device__ int gld_batch_room(struct gld_ctx *c, struct gld_batch *b) {
    if (b->room != 0) return 1;
    bgs_u64 seq[GLD_ROOM_READS];
#pragma unroll
    for (bgs_u32 i = 0; i < GLD_ROOM_READS; i++)
        seq[i] = gld_ld_relaxed_sys(&gld_completion_slot(c->ring, b->pos + i)->seq);
    bgs_u64 free_ = 0;
    while (free_ < GLD_ROOM_READS && seq[free_] == b->pos + free_) free_++;
    __threadfence_system();
    b->room = free_;
    if (free_ == 0) {
        gld_add(c, BGS_GLD_C_RING_FULL, 1);
        return 0;
    }
    return 1;
}
__device__ __forceinline__ void gld_batch_add(struct gld_ctx *c, struct gld_batch *b,
                                              bgs_u64 conn, bgs_u32 conn_seq,
                                              bgs_u32 request_id, bgs_u32 route, bgs_u32 op,
                                              bgs_u64 publish_ns, bgs_u32 status, bgs_u32 final_,
                                              bgs_u32 stream_seq, bgs_u32 stream_plus_one,
                                              const bgs_u32 *payload, bgs_u32 words) {
    gld_write_entry(gld_completion_slot(c->ring, b->pos), conn, conn_seq, request_id, route, op,
                    publish_ns, status, final_, stream_seq, stream_plus_one, payload, words);
    b->pos++;
    b->room--;
}
__device__ void gld_batch_commit(struct gld_ctx *c, struct gld_batch *b) {
    if (b->pos == b->first) return;
    __threadfence_system();
    for (bgs_u64 p = b->first; p < b->pos; p++)
        gld_st_relaxed_sys(&gld_completion_slot(c->ring, p)->seq, p + 1);
    atomicMax_system((unsigned long long *)&gld_header(c->ring)->completion_tail,
                     (unsigned long long)b->pos);
    c->s[BGS_GLD_S_TAIL] = b->pos;
    gld_add(c, BGS_GLD_C_FRAMES, b->pos - b->first);
    b->first = b->pos;
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

/* Publish `n` owed frames (lane 0), in order, each stream until its credit or the ring runs
 * out; report each stream's count with bgs_gl_delivered, and give back the credit-stream
 * index of every stream that left the table. Returns 0 when the ring was full. */
__device__ int gld_publish_frames(struct gld_ctx *c, const struct bgs_gl_frame *f, bgs_u32 n) {
    bgs_u32 *credit = (bgs_u32 *)c->p[BGS_GLD_P_CREDIT];
    bgs_u32 *published = (bgs_u32 *)c->p[BGS_GLD_P_PUBLISHED];
    bgs_u32 *stream_free = (bgs_u32 *)c->p[BGS_GLD_P_STREAM_FREE];
    const bgs_u64 *stream_ns = (const bgs_u64 *)c->p[BGS_GLD_P_STREAM_NS];
    const bgs_u32 *st = c->state;
    int room = 1;
    struct gld_batch b;
    gld_batch_begin(c, &b);
    bgs_u32 k = 0;
    while (k < n) {
        const bgs_u32 slot = f[k].slot;
        const bgs_u32 stream = f[k].stream;
        const bgs_u32 *s = st + st[BGS_GL_H_SEQ_AT] + slot * st[BGS_GL_H_SEQ_WORDS];
        const bgs_u64 conn = (bgs_u64)s[BGS_GL_S_CONN_LO] | ((bgs_u64)s[BGS_GL_S_CONN_HI] << 32);
        bgs_u32 sent = 0;
        bgs_u32 j = k;
        for (; j < n && f[j].slot == slot; j++) {
            if (!room || sent >= credit[slot]) continue;
            if (!gld_batch_room(c, &b)) {
                room = 0;
                continue;
            }
            gld_batch_add(c, &b, conn, s[BGS_GL_S_CONN_SEQ], s[BGS_GL_S_REQUEST_ID],
                          s[BGS_GL_S_ROUTE], BGS_OP_GENERATE, stream_ns[stream], f[j].status,
                          f[j].final_, f[j].seq, stream + 1u, f[j].word, f[j].words);
            sent++;
            published[stream] += 1u;
        }
        if (sent < j - k && room) gld_add(c, BGS_GLD_C_CREDIT_STALLS, 1);
        credit[slot] -= sent;
        if (sent != 0u) {
            bgs_gl_delivered(c->state, slot, sent);
            if (bgs_gl_slot_stream(c->state, slot) != stream) {
                /* The final frame went out: the credit stream is free for the next request. */
                const bgs_u64 top = c->s[BGS_GLD_S_STREAM_TOP];
                stream_free[top] = stream;
                c->s[BGS_GLD_S_STREAM_TOP] = top + 1;
            }
        }
        k = j;
    }
    gld_batch_commit(c, &b);
    return room;
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
    __shared__ int sh_planned; /* bgs_gl_plan's answer, for every lane */
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
        /* What is owed (lane-parallel), then lane 0 publishes it. */
        struct bgs_gl_frame *frames = (struct bgs_gl_frame *)params[BGS_GLD_P_FRAMES];
        const bgs_u32 n_owed = gld_owed(c.state, frames, lane);
        __syncwarp();
        if (lane == 0) {
            if (c.p[BGS_GLD_P_CHECK] != 0 && gld_check_owed(&c, frames, n_owed) != 0) {
                gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_OWED);
                sh_cmd = 2;
            } else if (n_owed != 0u) {
                const bgs_u64 before = c.shadow[BGS_GLD_C_FRAMES];
                gld_publish_frames(&c, frames, n_owed);
                moved |= c.shadow[BGS_GLD_C_FRAMES] != before;
            }
        }
        __syncwarp();
        if (sh_cmd == 2) break;
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
                sh_planned = 0;
            } else {
                sh_planned = bgs_gl_plan_viewed(c.state, n_views);
            }
            t_pack = gld_now_ns();
        }
        __syncwarp();
        if (sh_cmd == 2) break;
        const int planned = sh_planned;
        const struct bgs_llm_step_geometry *geo =
            (const struct bgs_llm_step_geometry *)params[BGS_GLD_P_GEO];
        bgs_i32 *inputs = (bgs_i32 *)params[BGS_GLD_P_INPUTS];
        struct bgs_gl_packed pk = {0u, 0u, 0u, 0u, 0u, 0u};
        int packed = 0;
        if (planned > 0) {
            packed = gld_pack(c.state, geo, inputs, &pk, lane);
            __syncwarp(); /* every lane's words are in before lane 0 checks and launches */
        }
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
    __syncwarp(); /* every lane's frames are in before lane 0 checks and publishes them */
    if (lane != 0) return;
    if (c.p[BGS_GLD_P_CHECK] != 0) {
        if (gld_check_owed(&c, frames, n) != 0) {
            gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK_OWED);
            return;
        }
        const bgs_u32 bad = bgs_gl_check(c.state);
        if (bad != 0u) {
            gld_set(&c, BGS_GLD_C_CHECK, bad);
            gld_error(c.ctl, BGS_GLD_E_CHECK, BGS_GLD_W_CHECK);
            return;
        }
    }
    /* Frames go out now, with the credit D computed before the step (the step used at most
     * BGS_GL_STEP_CREDIT of it per stream); D refreshes credit and retries what is left. */
    const bgs_u64 t_publish = gld_now_ns();
    gld_add(&c, BGS_GLD_C_FINISH_NS, t_publish - t_finish);
    if (n > 0) gld_publish_frames(&c, frames, n);
    gld_add(&c, BGS_GLD_C_PUBLISH_NS, gld_now_ns() - t_publish);
    cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)params[BGS_GLD_P_SELF],
                                      cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) gld_error(c.ctl, (bgs_u64)err, BGS_GLD_W_RELAUNCH);
}
