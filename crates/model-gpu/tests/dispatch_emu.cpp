// Host emulation of the resident step loop's dispatcher (src/gen_loop.cu), built and run by
// tests/gen_loop_dispatch.rs with clang++: the real dispatcher source, compiled as plain C++
// (GLD_HOST_EMU; device graph launches are recorded), driven through a real ring layout by an
// emulated transport and an emulated model. The dispatcher's warp is EMU_LANES host threads
// (1, or several: `__syncwarp` is a barrier of them and the warp sums and scans exchange
// through a shared array between two barriers), so the lane-parallel code runs as lanes.
//
// The emulated model's next token depends on the whole history it reads through the step's
// block table and KV slots (not just the last token), so a wrong position, slot, block table
// or fed-back token changes the stream. Every stream is compared with a replay of its prompt
// alone (exact), under a random schedule with credit stalls, a small completion ring that
// fills up, cancels mid-stream, refusals, busy, echo, unknown ops and framer rejections.
// Prints "emu: ok ..." and exits 0, or names the first mismatch and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#ifndef EMU_LANES
#define EMU_LANES 1u
#endif

#define __device__
#define __global__
#define __shared__ static
#define __forceinline__ inline
struct emu_dim3 {
    unsigned x, y, z;
};
static thread_local emu_dim3 threadIdx = {0, 0, 0};
static emu_dim3 blockIdx = {0, 0, 0}, blockDim = {1, 1, 1};
typedef struct emu_graph *cudaGraphExec_t;
typedef struct emu_stream *cudaStream_t;
typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1 } cudaError_t;
#define cudaStreamGraphTailLaunch ((cudaStream_t)1)
static std::vector<unsigned long long> emu_launches;
static cudaError_t cudaGraphLaunch(cudaGraphExec_t g, cudaStream_t s) {
    if (s != cudaStreamGraphTailLaunch) {
        std::fprintf(stderr, "emu: a launch that is not a tail launch\n");
        std::exit(1);
    }
    emu_launches.push_back((unsigned long long)g);
    return cudaSuccess;
}
/* The warp's lanes meet here: every lane of a kernel running on EMU_LANES threads. */
static std::mutex emu_mu;
static std::condition_variable emu_cv;
static unsigned emu_arrived = 0;
static unsigned long long emu_generation = 0;
static unsigned emu_warp = 1; /* lanes of the kernel running now */
static void __syncwarp(unsigned = 0xffffffffu) {
    if (emu_warp == 1) return;
    std::unique_lock<std::mutex> l(emu_mu);
    const unsigned long long g = emu_generation;
    if (++emu_arrived == emu_warp) {
        emu_arrived = 0;
        emu_generation++;
        emu_cv.notify_all();
    } else {
        emu_cv.wait(l, [&] { return emu_generation != g; });
    }
}
/* Exclusive prefix sum of `v` over the lanes (lane order) and their total. */
static unsigned emu_slots[EMU_LANES];
static unsigned bgs_emu_warp_scan(unsigned v, unsigned *total) {
    if (emu_warp == 1) {
        *total = v;
        return 0;
    }
    emu_slots[threadIdx.x] = v;
    __syncwarp();
    unsigned before = 0, all = 0;
    for (unsigned i = 0; i < emu_warp; i++) {
        if (i < threadIdx.x) before += emu_slots[i];
        all += emu_slots[i];
    }
    __syncwarp(); /* nobody overwrites a slot before every lane has read them all */
    *total = all;
    return before;
}
/* Run a kernel with `lanes` threads as its warp (threadIdx.x = the lane). */
template <class F>
static void emu_run(unsigned lanes, F f) {
    blockDim.x = lanes;
    emu_warp = lanes;
    if (lanes == 1) {
        threadIdx.x = 0;
        f();
        return;
    }
    std::vector<std::thread> t;
    for (unsigned i = 0; i < lanes; i++) t.emplace_back([&f, i] {
        threadIdx.x = i;
        f();
    });
    for (std::thread &x : t) x.join();
}
static void __threadfence_system() {}
static void __nanosleep(unsigned) {}
static unsigned long long atomicCAS_system(unsigned long long *p, unsigned long long e,
                                           unsigned long long d) {
    unsigned long long o = *p;
    if (o == e) *p = d;
    return o;
}
static unsigned long long atomicMax_system(unsigned long long *p, unsigned long long v) {
    unsigned long long o = *p;
    if (v > o) *p = v;
    return o;
}
static std::atomic<unsigned long long> emu_clock{0};
static unsigned long long bgs_emu_now_ns() { return emu_clock += 1000; }
#define GLD_HOST_EMU
#define GLD_LANES EMU_LANES
#include "gen_loop.cu"

static const unsigned VOCAB = 100, EOS = 0, NBLOCKS = 64, MAX_POS = 128, WINDOW = 4;
/* Set from the command line: `emu SEED SHAPE` (shape 0: 4 slots, 16-token steps, 4-token
 * blocks; 1: 8 slots, 32-token steps, 8-token blocks). */
static unsigned BS = 4, MAX_RUNNING = 4, MAX_SEQS = 8, MAX_BATCHED = 16;
static const unsigned REQ_CAP = 64, COMP_CAP = 16;
static unsigned long long rng_state = 0x9e3779b97f4a7c15ull;
static unsigned rnd(unsigned n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (unsigned)(rng_state % n);
}
static int fails = 0;
#define CHECK(c, ...)                                   \
    do {                                                \
        if (!(c)) {                                     \
            std::fprintf(stderr, "emu: FAIL: " __VA_ARGS__); \
            std::fprintf(stderr, "\n");                 \
            std::exit(1);                               \
        }                                               \
    } while (0)

// The model's next token from a history (prompt then fed tokens).
static unsigned model_next(const std::vector<unsigned> &hist) {
    unsigned h = 0;
    for (size_t p = 0; p < hist.size(); p++) h += hist[p] * (unsigned)(p + 1) * 2654435761u;
    return (h >> 9) % VOCAB;
}

struct Req {
    unsigned long long conn;
    unsigned id, op, param, flags;
    std::vector<unsigned> prompt;
    int cancel_after; // -1: never; else cancel when this many tokens arrived
    bool cancel_sent = false;
    std::vector<unsigned> tokens;
    bool done = false;
    unsigned final_status = 0, final_seq = 0;
    std::vector<unsigned> final_words;
};

int main(int argc, char **argv) {
    const unsigned long long seed = argc > 1 ? std::strtoull(argv[1], 0, 10) : 1;
    const unsigned shape = argc > 2 ? (unsigned)std::strtoul(argv[2], 0, 10) : 0;
    rng_state ^= seed * 0x2545f4914f6cdd1dull;
    if (shape == 1) {
        BS = 8;
        MAX_RUNNING = 8;
        MAX_SEQS = 12;
        MAX_BATCHED = 32;
    }
    // Ring region: header, request slots, completion slots.
    const size_t req_off = 4096, comp_off = req_off + REQ_CAP * 1088ull;
    const size_t total = comp_off + COMP_CAP * 1088ull;
    std::vector<unsigned long long> region_mem(total / 8 + 1, 0);
    bgs_u8 *ring = (bgs_u8 *)region_mem.data();
    bgs_ring_header *h = (bgs_ring_header *)ring;
    h->request_capacity = REQ_CAP;
    h->completion_capacity = COMP_CAP;
    h->request_slots_offset = req_off;
    h->completion_slots_offset = comp_off;
    for (unsigned i = 0; i < REQ_CAP; i++) gld_request_slot(ring, i)->seq = i;
    for (unsigned i = 0; i < COMP_CAP; i++) gld_completion_slot(ring, i)->seq = i;

    bgs_gl_limits lim = {BS, NBLOCKS, MAX_SEQS, MAX_RUNNING, MAX_BATCHED, 256, VOCAB, MAX_POS, 1, 0};
    std::vector<bgs_u32> state(bgs_gl_state_bytes(&lim) / 4);
    const bgs_u32 eos = EOS;
    CHECK(bgs_gl_init(state.data(), &lim, &eos, 1) == 0, "bgs_gl_init");
    bgs_llm_step_geometry geo = {MAX_BATCHED, MAX_RUNNING, MAX_RUNNING, MAX_POS / BS, BS, NBLOCKS};
    std::vector<bgs_i32> inputs(bgs_llm_step_words(&geo));
    std::vector<bgs_u32> next(geo.max_samples), credit(MAX_SEQS), published(512), stream_free(MAX_SEQS),
        next_by_item(MAX_SEQS), payload(256);
    std::vector<bgs_u64> stream_ns(512), ctl(BGS_GLD_C_WORDS), shadow(BGS_GLD_C_WORDS), scratch(BGS_GLD_S_WORDS),
        body(BGS_LLM_STEP_N_BUCKETS), head(BGS_LLM_STEP_N_BUCKETS);
    std::vector<bgs_gl_frame> frames(2 * MAX_SEQS);
    for (unsigned k = 0; k < MAX_SEQS; k++) stream_free[k] = MAX_SEQS - 1 - k;
    for (unsigned b = 0; b < BGS_LLM_STEP_N_BUCKETS; b++) {
        if (bgs_llm_step_bucket(b) <= geo.max_tokens) body[b] = 0x1000 + bgs_llm_step_bucket(b);
        if (bgs_llm_step_bucket(b) <= geo.max_samples) head[b] = 0x2000 + bgs_llm_step_bucket(b);
    }
    const bgs_u64 SELF = 0x3000, FINISH = 0x4000;
    scratch[BGS_GLD_S_STREAM_TOP] = MAX_SEQS;
    std::vector<bgs_u64> p(BGS_GLD_P_WORDS);
    p[BGS_GLD_P_RING] = (bgs_u64)ring;
    p[BGS_GLD_P_CTL] = (bgs_u64)ctl.data();
    p[BGS_GLD_P_STATE] = (bgs_u64)state.data();
    p[BGS_GLD_P_INPUTS] = (bgs_u64)inputs.data();
    p[BGS_GLD_P_NEXT] = (bgs_u64)next.data();
    p[BGS_GLD_P_GEO] = (bgs_u64)&geo;
    p[BGS_GLD_P_BODY] = (bgs_u64)body.data();
    p[BGS_GLD_P_HEAD] = (bgs_u64)head.data();
    p[BGS_GLD_P_SELF] = SELF;
    p[BGS_GLD_P_FINISH] = FINISH;
    p[BGS_GLD_P_CREDIT] = (bgs_u64)credit.data();
    p[BGS_GLD_P_PUBLISHED] = (bgs_u64)published.data();
    p[BGS_GLD_P_STREAM_FREE] = (bgs_u64)stream_free.data();
    p[BGS_GLD_P_STREAM_NS] = (bgs_u64)stream_ns.data();
    p[BGS_GLD_P_FRAMES] = (bgs_u64)frames.data();
    p[BGS_GLD_P_NEXT_BY_ITEM] = (bgs_u64)next_by_item.data();
    p[BGS_GLD_P_PAYLOAD] = (bgs_u64)payload.data();
    p[BGS_GLD_P_SCRATCH] = (bgs_u64)scratch.data();
    p[BGS_GLD_P_MAX_SEQS] = MAX_SEQS;
    p[BGS_GLD_P_WINDOW] = WINDOW;
    p[BGS_GLD_P_IDLE_ROUNDS] = 3;
    p[BGS_GLD_P_INTAKE] = 5;
    p[BGS_GLD_P_CHECK] = 1;
    p[BGS_GLD_P_CTL_SHADOW] = (bgs_u64)shadow.data();
    std::vector<bgs_u32> check_scratch(std::max<size_t>(2 * MAX_SEQS * sizeof(bgs_gl_frame) / 4, inputs.size()));
    p[BGS_GLD_P_CHECK_SCRATCH] = (bgs_u64)check_scratch.data();
    std::vector<unsigned> kv(NBLOCKS * BS, 0xffffffffu);

    // The schedule: generate requests (random prompts, lengths, flags, some cancelled
    // mid-stream), plus one-shot ops and refusals.
    std::vector<Req> reqs;
    const unsigned N = 120;
    for (unsigned i = 0; i < N; i++) {
        Req r;
        r.conn = 1000 + i;
        r.id = 7000 + i;
        r.op = BGS_OP_GENERATE;
        r.param = 1 + rnd(20);
        r.flags = rnd(3) == 0 ? BGS_FLAG_IGNORE_EOS : 0;
        unsigned len = 1 + rnd(18);
        for (unsigned k = 0; k < len; k++) r.prompt.push_back(1 + rnd(VOCAB - 1));
        r.cancel_after = rnd(5) == 0 ? (int)rnd(6) : -1;
        unsigned kind = rnd(40);
        if (kind == 0) { r.op = BGS_OP_ECHO; r.param = 0; r.flags = 0; r.cancel_after = -1; }
        if (kind == 1) { r.op = BGS_OP_GEMM8; r.param = 1; r.flags = 0; r.cancel_after = -1; }
        if (kind == 2) { r.param = 0; r.cancel_after = -1; }                       /* bad param */
        if (kind == 3) { r.prompt[0] = VOCAB + 5; r.cancel_after = -1; }           /* bad token */
        if (kind == 4) { r.op = BGS_RING_OP_REJECT; r.param = BGS_STATUS_PAYLOAD_TOO_LARGE; r.cancel_after = -1; }
        reqs.push_back(r);
    }
    std::map<unsigned, size_t> by_id;
    for (size_t i = 0; i < reqs.size(); i++) by_id[reqs[i].id] = i;

    unsigned long long req_tail = 0, comp_head = 0;
    size_t next_req = 0;
    unsigned steps = 0, idle_relaunches = 0, cancels_sent = 0;
    auto push_entry = [&](unsigned long long conn, unsigned op, unsigned id, unsigned param,
                          unsigned flags, const std::vector<unsigned> &payload_words) -> bool {
        bgs_request_slot *s = gld_request_slot(ring, req_tail);
        if (s->seq != req_tail) return false; /* full */
        bgs_request_entry &e = s->entry;
        e.conn = conn;
        e.conn_seq = 0;
        e.op = (bgs_u16)op;
        e.version = 1;
        e.request_id = id;
        e.words = (bgs_u32)payload_words.size();
        e.param = param;
        e.flags = flags;
        e.publish_ns = 42 + id;
        e.route = 0;
        for (size_t k = 0; k < payload_words.size(); k++) e.payload[k] = payload_words[k];
        s->seq = req_tail + 1;
        req_tail++;
        h->request_tail = req_tail;
        return true;
    };
    std::vector<unsigned> pending_acks(512, 0);
    auto flush_acks = [&]() {
        for (unsigned k = 0; k < 512; k++) {
            h->stream_acks[k] += pending_acks[k];
            pending_acks[k] = 0;
        }
    };
    auto consume = [&](unsigned max) {
        for (unsigned n = 0; n < max; n++) {
            bgs_completion_slot *s = gld_completion_slot(ring, comp_head);
            if (s->seq != comp_head + 1) return;
            const bgs_completion_entry &c = s->entry;
            CHECK(by_id.count(c.request_id), "a completion for unknown request %u", c.request_id);
            Req &r = reqs[by_id[c.request_id]];
            CHECK(!r.done, "request %u: a frame after its final frame", r.id);
            CHECK(c.conn == r.conn, "request %u: wrong conn", r.id);
            CHECK(c.publish_ns == 42 + r.id, "request %u: publish_ns %llu", r.id, (unsigned long long)c.publish_ns);
            if (c.stream != 0) {
                CHECK(r.op == BGS_OP_GENERATE && c.op == BGS_OP_GENERATE, "request %u: credit on a one-shot", r.id);
                pending_acks[c.stream - 1] += 1; /* acknowledged later (credit stalls) */
            }
            if (!c.final_) {
                CHECK(c.status == BGS_STATUS_TOKEN && c.words == 1, "request %u: token frame status %u words %u", r.id, c.status, c.words);
                CHECK(c.stream_seq == r.tokens.size(), "request %u: token seq %u, want %zu", r.id, c.stream_seq, r.tokens.size());
                r.tokens.push_back(c.payload[0]);
            } else {
                r.done = true;
                r.final_status = c.status;
                r.final_seq = c.stream_seq;
                for (unsigned k = 0; k < c.words; k++) r.final_words.push_back(c.payload[k]);
            }
            s->seq = comp_head + COMP_CAP;
            comp_head++;
            h->completion_head = comp_head;
        }
    };

    for (unsigned iter = 0; iter < 200000; iter++) {
        // The transport: a few new requests, cancels of connections that saw enough tokens,
        // and (not always: the small completion ring fills up) the completions.
        for (unsigned k = rnd(5) == 0 ? 1 + rnd(2) : 0; k > 0 && next_req < reqs.size(); k--) {
            Req &r = reqs[next_req];
            if (!push_entry(r.conn, r.op, r.id, r.param, r.flags, r.prompt)) break;
            next_req++;
        }
        for (Req &r : reqs) {
            if (r.cancel_after >= 0 && !r.cancel_sent && !r.done &&
                r.tokens.size() >= (size_t)r.cancel_after && (&r - &reqs[0]) < (long)next_req) {
                if (push_entry(r.conn, BGS_RING_OP_CANCEL, 0, 0, 0, {})) {
                    r.cancel_sent = true;
                    cancels_sent++;
                }
            }
        }
        /* Stretches without a consumer: the completion ring fills up. */
        if ((iter / 40) % 3 != 0 && rnd(2) == 0) consume(1 + rnd(COMP_CAP));
        if (rnd(3) == 0) flush_acks();

        // The device: D, and the graphs it tail-launched.
        emu_launches.clear();
        emu_run(EMU_LANES, [&] { bgs_gld_dispatch(p.data()); });
        CHECK(ctl[BGS_GLD_C_ERROR] == 0, "dispatcher error %llu at %llu",
              (unsigned long long)ctl[BGS_GLD_C_ERROR], (unsigned long long)ctl[BGS_GLD_C_ERROR_WHERE]);
        if (emu_launches.size() == 1) {
            CHECK(emu_launches[0] == SELF, "an idle execution relaunches itself");
            idle_relaunches++;
        } else {
            CHECK(emu_launches.size() == 2 || emu_launches.size() == 3, "a step launches 2 or 3 graphs, not %zu", emu_launches.size());
            CHECK(emu_launches.back() == FINISH, "the finish graph comes last");
            CHECK(emu_launches[0] >= 0x1000 && emu_launches[0] < 0x2000, "the body graph comes first");
            // The model: write the step's KV, then sample each row from the history its
            // item's block table leads to.
            const bgs_u32 tok_o = bgs_llm_step_tok(&geo), pos_o = bgs_llm_step_pos(&geo),
                          seq_o = bgs_llm_step_seq(&geo), slot_o = bgs_llm_step_slot(&geo),
                          rows_o = bgs_llm_step_rows(&geo), off_o = bgs_llm_step_bt_off(&geo),
                          bt_o = bgs_llm_step_bt(&geo);
            unsigned ntok = 0;
            for (unsigned t = 0; t < geo.max_tokens; t++) {
                if (inputs[slot_o + t] < 0) continue;
                kv[inputs[slot_o + t]] = (unsigned)inputs[tok_o + t];
                ntok++;
            }
            CHECK(emu_launches[0] - 0x1000 >= ntok, "the body bucket holds the step's tokens");
            if (steps == 10) {
                // The P_CHECK comparisons see a difference: the C functions' answers pass,
                // the same answers with one word changed do not.
                gld_ctx c = gld_ctx_of(p.data());
                std::vector<bgs_i32> buf(inputs.size());
                bgs_gl_packed pk;
                CHECK(bgs_gl_pack(state.data(), &geo, buf.data(), &pk) == 0, "pack for the check test");
                CHECK(gld_check_pack(&c, &geo, buf.data(), 0, &pk) == 0, "the pack check passes its own answer");
                buf[bgs_llm_step_pos(&geo)] += 1;
                CHECK(gld_check_pack(&c, &geo, buf.data(), 0, &pk) != 0, "the pack check misses a changed position");
                std::vector<bgs_gl_frame> owed(2 * MAX_SEQS);
                const bgs_u32 n_owed = bgs_gl_owed(state.data(), owed.data());
                CHECK(gld_check_owed(&c, owed.data(), n_owed) == 0, "the owed check passes its own answer");
                CHECK(gld_check_owed(&c, owed.data(), n_owed + 1) != 0, "the owed check misses a count");
                if (n_owed > 0) {
                    owed[0].seq += 1;
                    CHECK(gld_check_owed(&c, owed.data(), n_owed) != 0, "the owed check misses a frame");
                }
            }
            unsigned rows = emu_launches.size() == 3 ? (unsigned)(emu_launches[1] - 0x2000) : 0;
            for (unsigned r = 0; r < rows; r++) {
                const int t = inputs[rows_o + r];
                if (r > 0 && t == 0) break; /* padding rows */
                const unsigned item = (unsigned)inputs[seq_o + t], pos = (unsigned)inputs[pos_o + t];
                const bgs_i32 *table = &inputs[bt_o + inputs[off_o + item]];
                std::vector<unsigned> hist;
                for (unsigned q = 0; q <= pos; q++) hist.push_back(kv[table[q / BS] * BS + q % BS]);
                next[r] = model_next(hist);
            }
            emu_launches.clear();
            emu_run(EMU_LANES, [&] { bgs_gld_finish(p.data()); });
            CHECK(ctl[BGS_GLD_C_ERROR] == 0, "finish error %llu at %llu (check %llu)",
                  (unsigned long long)ctl[BGS_GLD_C_ERROR], (unsigned long long)ctl[BGS_GLD_C_ERROR_WHERE],
                  (unsigned long long)ctl[BGS_GLD_C_CHECK]);
            CHECK(emu_launches.size() == 1 && emu_launches[0] == SELF, "finish relaunches the dispatcher");
            steps++;
        }
        // Every credit stream not on the free stack belongs to a sequence in the table.
        CHECK(scratch[BGS_GLD_S_STREAM_TOP] + bgs_gl_live(state.data()) == MAX_SEQS,
              "credit streams: %llu free, %u sequences live, %u in all (iteration %u)",
              (unsigned long long)scratch[BGS_GLD_S_STREAM_TOP], bgs_gl_live(state.data()), MAX_SEQS,
              iter);
        if (iter % 64 == 63) flush_acks(); /* never starve forever */
        bool all = next_req == reqs.size();
        for (const Req &r : reqs) all = all && r.done;
        if (all) break;
    }
    consume(COMP_CAP);
    flush_acks();

    // Every request answered, as its prompt alone would be.
    unsigned gen_ok = 0, cancelled = 0, busy = 0, oneshot = 0;
    for (const Req &r : reqs) {
        CHECK(r.done, "request %u (op %u) never got its final frame", r.id, r.op);
        if (r.op == BGS_OP_ECHO) {
            CHECK(r.final_status == BGS_STATUS_OK && r.final_words == r.prompt, "echo %u", r.id);
            oneshot++;
            continue;
        }
        if (r.op == BGS_OP_GEMM8) {
            CHECK(r.final_status == BGS_STATUS_UNKNOWN_OP, "gemm8 %u: status %u", r.id, r.final_status);
            oneshot++;
            continue;
        }
        if (r.op == BGS_RING_OP_REJECT) {
            CHECK(r.final_status == BGS_STATUS_PAYLOAD_TOO_LARGE, "reject %u: status %u", r.id, r.final_status);
            oneshot++;
            continue;
        }
        if (r.param == 0 || r.prompt[0] >= VOCAB) {
            /* The table's capacity is checked first (as the host engine does): busy or bad. */
            CHECK((r.final_status == BGS_STATUS_BAD_PARAM || r.final_status == BGS_STATUS_BUSY) &&
                      r.tokens.empty(),
                  "bad request %u: status %u", r.id, r.final_status);
            oneshot++;
            continue;
        }
        if (r.final_status == BGS_STATUS_BUSY) {
            CHECK(r.tokens.empty(), "busy %u sent tokens", r.id);
            busy++;
            continue;
        }
        // The replay of the prompt alone.
        std::vector<unsigned> hist = r.prompt, want;
        unsigned reason = 1;
        for (unsigned g = 0; g < r.param; g++) {
            unsigned t = model_next(hist);
            if (t == EOS && !(r.flags & BGS_FLAG_IGNORE_EOS)) {
                reason = 0;
                break;
            }
            want.push_back(t);
            hist.push_back(t);
        }
        CHECK(r.tokens.size() <= want.size(), "request %u: %zu tokens, the replay has %zu", r.id, r.tokens.size(), want.size());
        for (size_t k = 0; k < r.tokens.size(); k++)
            CHECK(r.tokens[k] == want[k], "request %u: token %zu is %u, the replay says %u", r.id, k, r.tokens[k], want[k]);
        CHECK(r.final_seq == r.tokens.size(), "request %u: final seq %u after %zu tokens", r.id, r.final_seq, r.tokens.size());
        if (r.final_status == BGS_STATUS_CANCELLED) {
            CHECK(r.cancel_sent, "request %u cancelled without a cancel", r.id);
            CHECK(r.final_words.empty(), "cancelled %u has words", r.id);
            cancelled++;
            continue;
        }
        CHECK(r.final_status == BGS_STATUS_END_OF_STREAM, "request %u: final status %u", r.id, r.final_status);
        CHECK(r.tokens.size() == want.size(), "request %u: %zu tokens, the replay has %zu", r.id, r.tokens.size(), want.size());
        CHECK(r.final_words.size() == 2 && r.final_words[0] == reason && r.final_words[1] == want.size(),
              "request %u: end words", r.id);
        gen_ok++;
    }
    // Nothing leaked: every block free, no sequence, every credit stream back.
    CHECK(bgs_gl_check(state.data()) == 0, "bgs_gl_check %u", bgs_gl_check(state.data()));
    CHECK(bgs_gl_live(state.data()) == 0, "%u sequences still live", bgs_gl_live(state.data()));
    CHECK(bgs_gl_free_blocks(state.data()) == NBLOCKS, "blocks leaked");
    CHECK(scratch[BGS_GLD_S_STREAM_TOP] == MAX_SEQS, "credit streams leaked: %llu free",
          (unsigned long long)scratch[BGS_GLD_S_STREAM_TOP]);
    CHECK(h->completion_tail == scratch[BGS_GLD_S_TAIL], "completion_tail follows the dispatcher");
    CHECK(ctl[BGS_GLD_C_STEPS] == steps, "steps counted");
    for (unsigned w = BGS_GLD_C_EXECUTIONS; w < BGS_GLD_C_WORDS; w++)
        CHECK(w == BGS_GLD_C_CHECK || ctl[w] == shadow[w], "control word %u: host %llu, shadow %llu", w,
              (unsigned long long)ctl[w], (unsigned long long)shadow[w]);
    CHECK(gen_ok > 20 && cancelled > 0 && oneshot > 0, "the schedule exercised too little (%u ok, %u cancelled, %u one-shot)",
          gen_ok, cancelled, oneshot);
    // Stop: the dispatcher returns without relaunching and says so.
    ctl[BGS_GLD_C_STOP] = 1;
    emu_launches.clear();
    emu_run(EMU_LANES, [&] { bgs_gld_dispatch(p.data()); });
    CHECK(emu_launches.empty() && ctl[BGS_GLD_C_STOPPED] == 1, "stop");
    // The plans' census: the running sequences seen are at most MAX_RUNNING a step, and those
    // left out (for credit, for a frame still owed) are among them.
    const unsigned long long seen = ctl[BGS_GLD_C_RUNNING_SEEN];
    CHECK(seen <= (unsigned long long)steps * MAX_RUNNING && seen >= steps,
          "running seen %llu over %u steps of at most %u running", seen, steps, MAX_RUNNING);
    CHECK(ctl[BGS_GLD_C_CREDIT_WAITS] <= seen && ctl[BGS_GLD_C_PENDING_WAITS] <= seen,
          "credit waits %llu, pending waits %llu, of %llu running seen",
          (unsigned long long)ctl[BGS_GLD_C_CREDIT_WAITS],
          (unsigned long long)ctl[BGS_GLD_C_PENDING_WAITS], seen);
    std::printf("emu: ok: %u streams exact, %u cancelled, %u busy, %u one-shot; %u steps, %u idle relaunches, "
                "%llu credit stalls, %llu running seen, %llu credit waits, %llu pending waits, %llu ring-full, "
                "%llu frames\n",
                gen_ok, cancelled, busy, oneshot, steps, idle_relaunches,
                (unsigned long long)ctl[BGS_GLD_C_CREDIT_STALLS], seen,
                (unsigned long long)ctl[BGS_GLD_C_CREDIT_WAITS],
                (unsigned long long)ctl[BGS_GLD_C_PENDING_WAITS], (unsigned long long)ctl[BGS_GLD_C_RING_FULL],
                (unsigned long long)ctl[BGS_GLD_C_FRAMES]);
    (void)fails;
    (void)cancels_sent;
    return 0;
}
