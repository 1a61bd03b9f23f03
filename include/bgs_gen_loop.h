/* bgs_gen_loop.h: the generation step loop's logic (admission, cancel, step planning with KV
 * block allocation, advancing sequences by a step's sampled tokens, and the reply frames
 * they owe), written once for the host engine and for the GPU-resident step loop.
 *
 * Hand-written (not generated). Portable C (C99 constructs; built as C11 only because the
 * generated headers it includes use _Static_assert) with no libc calls, no allocation, no
 * globals and no recursion, in the style of bgs_step_policy.h (which it calls): crates/llm compiles it for
 * the host (csrc/gen_loop.c) and drives it through a safe Rust wrapper (`CGenLoop` in
 * crates/llm/src/gen_loop.rs); the GPU's dispatcher will compile the same file with NVRTC
 * (define BGS_GEN_LOOP_API as `__device__`; BGS_STEP_POLICY_API follows it unless defined).
 *
 * Usage:
 *   - declarations only: include the header;
 *   - definitions: `#define BGS_GEN_LOOP_IMPL` before including it in exactly one unit. The
 *     step policy's definitions come from BGS_STEP_POLICY_IMPL in some unit (the host build
 *     compiles csrc/step_policy.c; a device unit defines both IMPL macros).
 *
 * The semantics are those of the Rust engine (`GenerationEngine`, crates/llm/src/engine.rs;
 * docs/generation.md): crates/llm/tests/gen_loop.rs runs both on the same schedules and
 * requires identical frames. In short:
 *   - admission validates a generate request (statuses 20 bad param, 23 bad flags, 21 busy
 *     past the table, 22 for a stream id already live) and queues it FIFO;
 *   - each step, the policy (bgs_step_plan) picks the tokens of every sequence that is ready
 *     (waiting: always; running: credit for BGS_GL_STEP_CREDIT frames and no token frame
 *     owed); blocks come from a LIFO free stack into per-sequence block tables;
 *   - after the model step, every item that sampled either ends (EOS: not sent, final
 *     [0, generated]; a token outside the vocabulary: final Internal) or owes a token frame,
 *     and ends with length (final [1, generated]) at its generation limit;
 *   - frames owed are listed in FIFO order (a token frame before the final frame of the same
 *     stream); the caller publishes them and reports how many of each stream's frames went
 *     out (bgs_gl_delivered). A stream whose final frame went out leaves the table.
 *   - cancel ends every sequence of a connection at once: blocks freed, a token frame not yet
 *     published dropped, one final Cancelled frame owed (also over an end already owed).
 *
 * Bounds (the Rust engine has none of these; its callers never exceed them):
 *   - a prompt holds at most limits.max_prompt tokens (at most BGS_GL_MAX_PROMPT, the ring
 *     slot's payload words): longer prompts are refused with bad param (the ring cannot carry
 *     them anyway);
 *   - at most limits.max_seqs sequences are live (running + waiting + owing frames), the
 *     Rust engine's `capacity()`; beyond that, busy;
 *   - at most limits.max_eos EOS ids.
 *
 * State: one caller-provided area of bgs_gl_state_bytes(limits) bytes, 4-byte aligned, made
 * of 32-bit words at offsets fixed at init (the word BGS_GL_H_* of the header region name
 * them), so that it can live in device memory and be inspected from the host:
 *   header (BGS_GL_HEADER_WORDS) | EOS ids (max_eos) | free block stack (num_blocks) |
 *   FIFO order of live slots (max_seqs) | sequence table (max_seqs records of seq_words:
 *   BGS_GL_S_* fields, then the prompt (max_prompt words), then the block table
 *   (max_blocks_per_seq words)) | step items (max_running × BGS_GL_ITEM_WORDS) | step tokens
 *   (step_token_cap) | policy scratch (max_seqs bgs_sp_seq, max_seqs bgs_sp_out, max_seqs
 *   view slots) | block bitmap (check scratch).
 */
#ifndef BGS_GEN_LOOP_H
#define BGS_GEN_LOOP_H

#ifndef BGS_GEN_LOOP_API
#define BGS_GEN_LOOP_API
#endif
#ifndef BGS_STEP_POLICY_API
#define BGS_STEP_POLICY_API BGS_GEN_LOOP_API
#endif

#include "bgs_protocol.h"
#include "bgs_ring.h"
#include "bgs_step_policy.h"
#include "bgs_llm_step.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Layout version of the structs and state words below; bump on any change. */
#define BGS_GL_ABI_VERSION 1u
/* First word of an initialised state ("BGGL"). */
#define BGS_GL_MAGIC 0x4c474742u

/* Most prompt tokens a sequence holds: a ring slot's payload (bgs_ring.h BGS_RING_SLOT_WORDS). */
#define BGS_GL_MAX_PROMPT BGS_RING_SLOT_WORDS
/* Credit a stream needs to take part in a step: its token frame and possibly its final. */
#define BGS_GL_STEP_CREDIT 2u
/* finish_reason words of the end-of-stream frame. */
#define BGS_GL_FINISH_EOS 0u
#define BGS_GL_FINISH_LENGTH 1u
/* A table slot holds no sequence (bgs_gl_slot_stream). */
#define BGS_GL_NO_STREAM 0xffffffffu

/* Errors (negative returns). */
#define BGS_GL_ERR_LIMITS (-1)        /* bgs_gl_init: a limit is 0 or too large */
#define BGS_GL_ERR_EOS (-2)           /* bgs_gl_init: more EOS ids than max_eos */
#define BGS_GL_ERR_STATE (-3)         /* the state was not initialised (bad magic) */
#define BGS_GL_POLICY_FAILED (-4)     /* bgs_gl_plan: the policy rejected its inputs (a bug);
                                         every live sequence now owes a final Internal */
#define BGS_GL_ERR_STEP (-5)          /* bgs_gl_finish / bgs_gl_pack: no step is planned */
#define BGS_GL_ERR_GEOMETRY (-6)      /* bgs_gl_pack: the step does not fit the geometry */

/* Engine-wide limits (all 32-bit words). */
struct bgs_gl_limits {
    bgs_u32 block_size;         /* tokens per KV block, >= 1 */
    bgs_u32 num_blocks;         /* blocks in the KV pool, >= 1 */
    bgs_u32 max_seqs;           /* live sequences at most (running + waiting), >= max_running */
    bgs_u32 max_running;        /* sequences running at once (slots), >= 1 */
    bgs_u32 max_batched_tokens; /* token budget of one step, >= max_running */
    bgs_u32 max_prompt;         /* prompt tokens at most, 1..=BGS_GL_MAX_PROMPT */
    bgs_u32 vocab_size;         /* token ids are below it, >= 1 */
    bgs_u32 max_positions;      /* the model's context (prompt + generated), >= 2 */
    bgs_u32 max_eos;            /* EOS ids the state can hold */
    bgs_u32 ignore_eos;         /* nonzero: every request generates past EOS */
};

/* A generate request as the ring delivers it. */
struct bgs_gl_request {
    bgs_u64 conn;          /* connection token (what bgs_gl_cancel names) */
    bgs_u32 stream;        /* credit stream / engine stream id */
    bgs_u32 conn_seq;      /* carried for the completion entries */
    bgs_u32 request_id;    /* carried for the completion entries */
    bgs_u32 route;         /* carried for the completion entries */
    bgs_u32 param;         /* max new tokens */
    bgs_u32 flags;         /* BGS_FLAG_IGNORE_EOS only */
    bgs_u32 words;         /* prompt tokens */
    bgs_u32 reserved;      /* 0 (alignment of `payload`) */
    const bgs_u32 *payload; /* `words` prompt token ids */
};

/* One frame owed by a stream. */
struct bgs_gl_frame {
    bgs_u32 slot;       /* sequence table slot (for bgs_gl_delivered) */
    bgs_u32 stream;     /* the request's stream */
    bgs_u32 status;     /* BGS_STATUS_TOKEN / _END_OF_STREAM / _CANCELLED / _INTERNAL */
    bgs_u32 final_;     /* 1: ends the stream */
    bgs_u32 seq;        /* token index (token frames) / number of token frames (final) */
    bgs_u32 words;      /* payload words used (0..=2) */
    bgs_u32 word[2];    /* token id, or [finish_reason, generated] */
};

/* One item of the planned step (read with bgs_gl_item). Offsets are words of the state. */
struct bgs_gl_item {
    bgs_u32 slot;       /* sequence table slot */
    bgs_u32 stream;     /* its stream */
    bgs_u32 tokens;     /* input tokens this step (>= 1) */
    bgs_u32 pos;        /* position of the first */
    bgs_u32 sample;     /* 1: sample after the last token */
    bgs_u32 tok_at;     /* state word offset of the tokens (step token area) */
    bgs_u32 bt_at;      /* state word offset of the sequence's block table */
    bgs_u32 n_blocks;   /* blocks in the table (cover [0, pos + tokens)) */
};

/* What bgs_gl_pack wrote (the GPU model's step-input buffer, bgs_llm_step.h). */
struct bgs_gl_packed {
    bgs_u32 tokens;        /* real tokens */
    bgs_u32 bucket;        /* token bucket (captured graph) */
    bgs_u32 samples;       /* sampled rows */
    bgs_u32 sample_bucket; /* LM-head bucket, 0 when nothing is sampled */
    bgs_u32 words;         /* words of the buffer to copy */
    bgs_u32 reserved;      /* 0 */
};

/* Header words (state[BGS_GL_H_*]). */
#define BGS_GL_H_MAGIC 0u
#define BGS_GL_H_ABI 1u
#define BGS_GL_H_BLOCK_SIZE 2u
#define BGS_GL_H_NUM_BLOCKS 3u
#define BGS_GL_H_MAX_SEQS 4u
#define BGS_GL_H_MAX_RUNNING 5u
#define BGS_GL_H_MAX_BATCHED 6u
#define BGS_GL_H_MAX_PROMPT 7u
#define BGS_GL_H_VOCAB 8u
#define BGS_GL_H_MAX_POS 9u
#define BGS_GL_H_MAX_EOS 10u
#define BGS_GL_H_IGNORE_EOS 11u
#define BGS_GL_H_MAX_BPS 12u      /* block-table words per sequence */
#define BGS_GL_H_SEQ_WORDS 13u    /* sequence record stride */
#define BGS_GL_H_TOKEN_CAP 14u    /* step token area words */
#define BGS_GL_H_N_EOS 15u
#define BGS_GL_H_FREE_TOP 16u     /* blocks on the free stack */
#define BGS_GL_H_N_LIVE 17u       /* live slots in the FIFO order array */
#define BGS_GL_H_N_ITEMS 18u      /* items of the planned step (0: none) */
#define BGS_GL_H_STEP_TOKENS 19u  /* tokens of the planned step */
#define BGS_GL_H_EOS_AT 20u       /* offsets (words) of the regions */
#define BGS_GL_H_FREE_AT 21u
#define BGS_GL_H_ORDER_AT 22u
#define BGS_GL_H_SEQ_AT 23u
#define BGS_GL_H_ITEMS_AT 24u
#define BGS_GL_H_TOKENS_AT 25u
#define BGS_GL_H_VIEWS_AT 26u
#define BGS_GL_H_OUTS_AT 27u
#define BGS_GL_H_VIEW_OF_AT 28u
#define BGS_GL_H_BITMAP_AT 29u
#define BGS_GL_H_WORDS 30u        /* words of the whole state */
#define BGS_GL_HEADER_WORDS 32u

/* Sequence record words (state[seq_at + slot * seq_words + BGS_GL_S_*]). */
#define BGS_GL_S_LIVE 0u         /* 1: the slot holds a sequence */
#define BGS_GL_S_STREAM 1u
#define BGS_GL_S_CONN_LO 2u
#define BGS_GL_S_CONN_HI 3u
#define BGS_GL_S_CONN_SEQ 4u
#define BGS_GL_S_REQUEST_ID 5u
#define BGS_GL_S_ROUTE 6u
#define BGS_GL_S_RUNNING 7u      /* admitted by the policy: holds a KV reservation */
#define BGS_GL_S_PROMPT_LEN 8u
#define BGS_GL_S_POS 9u          /* tokens whose K/V are in the blocks (next position) */
#define BGS_GL_S_GENERATED 10u   /* tokens generated (EOS excluded) */
#define BGS_GL_S_MAX_GEN 11u     /* generation limit: max new, context and pool */
#define BGS_GL_S_IGNORE_EOS 12u
#define BGS_GL_S_EMITTED 13u     /* token frames published */
#define BGS_GL_S_PENDING 14u     /* 1: a token frame is owed */
#define BGS_GL_S_LAST 15u        /* last sampled token (fed back; the pending frame's word) */
#define BGS_GL_S_END 16u         /* status of the final frame owed, 0: not ended */
#define BGS_GL_S_END_WORDS 17u
#define BGS_GL_S_END_W0 18u
#define BGS_GL_S_END_W1 19u
#define BGS_GL_S_N_BLOCKS 20u
#define BGS_GL_SEQ_FIXED 24u     /* then the prompt, then the block table */

/* Step item words (state[items_at + k * BGS_GL_ITEM_WORDS + BGS_GL_I_*]). */
#define BGS_GL_I_SLOT 0u
#define BGS_GL_I_TOKENS 1u
#define BGS_GL_I_POS 2u
#define BGS_GL_I_SAMPLE 3u
#define BGS_GL_I_TOK_AT 4u
#define BGS_GL_ITEM_WORDS 8u

/* Results of bgs_gl_check (0: every invariant holds). */
#define BGS_GL_CHECK_BLOCK_RANGE 1u   /* a block id outside the pool */
#define BGS_GL_CHECK_BLOCK_TWICE 2u   /* a block in two tables, or in a table and free */
#define BGS_GL_CHECK_CONSERVED 3u     /* tables + free stack != num_blocks */
#define BGS_GL_CHECK_IDLE_HOLDS 4u    /* a sequence not running (or ended) holds blocks */
#define BGS_GL_CHECK_OVER_RESERVE 5u  /* a table exceeds its reservation */
#define BGS_GL_CHECK_OWED 6u          /* reservations owe more blocks than are free */
#define BGS_GL_CHECK_RUNNING 7u       /* more running sequences than max_running */
#define BGS_GL_CHECK_ORDER 8u         /* the FIFO order and the live slots disagree */

/* Bytes of state for `limits`; 0 when a limit is invalid (see bgs_gl_init) or the state would
 * exceed 1 GiB. */
BGS_GEN_LOOP_API bgs_u64 bgs_gl_state_bytes(const struct bgs_gl_limits *limits);

/* Lay out and clear the state (bgs_gl_state_bytes(limits) bytes): every block free, no
 * sequence. Returns 0 or BGS_GL_ERR_LIMITS / BGS_GL_ERR_EOS. */
BGS_GEN_LOOP_API int bgs_gl_init(bgs_u32 *state, const struct bgs_gl_limits *limits,
                                 const bgs_u32 *eos_ids, bgs_u32 n_eos);

/* Validate and queue a generate request: 0 (admitted) or the BGS_STATUS_* to answer it with. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_admit(bgs_u32 *state, const struct bgs_gl_request *request);

/* bgs_gl_admit with its two passes over the table done by the caller (the device loop does
 * them lane-parallel): `stream_live` nonzero when a live sequence holds request->stream,
 * `free_slot` the lowest table slot not live (max_seqs when none). The same checks in the same
 * order, the same result. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_admit_scanned(bgs_u32 *state, const struct bgs_gl_request *request,
                                              bgs_u32 stream_live, bgs_u32 free_slot);

/* Connection `conn` ended: each of its sequences frees its blocks, drops an unpublished token
 * frame and owes one final Cancelled frame. Returns how many sequences it touched. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_cancel(bgs_u32 *state, bgs_u64 conn);

/* Frames owed now, in FIFO order (at most 2 × max_seqs): writes out[0..n), returns n. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_owed(const bgs_u32 *state, struct bgs_gl_frame *out);

/* The first `published` (0..=2) frames bgs_gl_owed listed for `slot` went out. A sequence
 * whose final frame went out leaves the table. */
BGS_GEN_LOOP_API void bgs_gl_delivered(bgs_u32 *state, bgs_u32 slot, bgs_u32 published);

/* Plan one step. credit[slot] (max_seqs words, indexed by table slot; read for live slots
 * only) = frames the slot's stream may publish now. Returns the items planned (0: no model
 * step) or a negative BGS_GL_*. Read the items with bgs_gl_item; then call bgs_gl_finish
 * with the sampled tokens, or bgs_gl_fail_step when the model step failed. */
BGS_GEN_LOOP_API int bgs_gl_plan(bgs_u32 *state, const bgs_u32 *credit);

/* bgs_gl_plan in two halves, for a caller that builds the policy's views itself (the device
 * loop, lane-parallel): bgs_gl_view writes live slot `slot`'s view (0: an ended sequence the
 * plan skips, 1: written); the caller stores the views of the live slots in FIFO order, ended
 * ones left out, at the state's views and view -> slot arrays (bgs_gl_views), then calls
 * bgs_gl_plan_viewed with their count. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_view(const bgs_u32 *state, bgs_u32 slot, const bgs_u32 *credit,
                                     struct bgs_sp_seq *view);
BGS_GEN_LOOP_API void bgs_gl_views(bgs_u32 *state, struct bgs_sp_seq **views, bgs_u32 **view_of);
BGS_GEN_LOOP_API int bgs_gl_plan_viewed(bgs_u32 *state, bgs_u32 n);

/* Item k (< the count bgs_gl_plan returned) of the planned step: 0, or -1 when out of range. */
BGS_GEN_LOOP_API int bgs_gl_item(const bgs_u32 *state, bgs_u32 k, struct bgs_gl_item *out);

/* Advance the planned step's sequences by its result: next[k] is item k's sampled token
 * (read for sampling items only). Writes the frames owed now (bgs_gl_owed) into `frames`
 * and returns their count, or BGS_GL_ERR_STEP when no step was planned. */
BGS_GEN_LOOP_API int bgs_gl_finish(bgs_u32 *state, const bgs_u32 *next,
                                   struct bgs_gl_frame *frames);

/* bgs_gl_finish without the owed frames (the device loop collects them lane-parallel): 0, or
 * BGS_GL_ERR_STEP when no step was planned. */
BGS_GEN_LOOP_API int bgs_gl_advance(bgs_u32 *state, const bgs_u32 *next);

/* The model step failed: every item's sequence ends with a final Internal frame. */
BGS_GEN_LOOP_API void bgs_gl_fail_step(bgs_u32 *state);

/* Write the planned step into the GPU model's step-input buffer (bgs_llm_step.h's layout,
 * `geo`'s sizes; `buf` holds bgs_llm_step_words(geo) words): token ids, positions, item
 * index and KV slot per token (padding: 0, 0, 0, -1), each sampling item's last token row
 * (padding rows 0), and the block tables packed with their offsets. Returns 0 or
 * BGS_GL_ERR_STEP / BGS_GL_ERR_GEOMETRY (the step exceeds the geometry; nothing usable). */
BGS_GEN_LOOP_API int bgs_gl_pack(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo,
                                 bgs_i32 *buf, struct bgs_gl_packed *out);

/* Words of the step-input buffer for `geo` (bgs_llm_step_words, exported for the host). */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_step_words(const struct bgs_llm_step_geometry *geo);

/* Queries. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_live(const bgs_u32 *state);        /* sequences in the table */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_running(const bgs_u32 *state);     /* running, not ended */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_free_blocks(const bgs_u32 *state);
BGS_GEN_LOOP_API bgs_u32 bgs_gl_holds(const bgs_u32 *state, bgs_u32 stream); /* 1: live */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_slot_stream(const bgs_u32 *state, bgs_u32 slot);
/* Check the bookkeeping (blocks conserved, disjoint tables, reservations covered, ...):
 * 0 or a BGS_GL_CHECK_*. Uses the bitmap scratch, hence not const. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_check(bgs_u32 *state);

/* BGS_GL_ABI_VERSION and the struct sizes, for the host wrapper's layout check. */
BGS_GEN_LOOP_API bgs_u32 bgs_gl_abi(bgs_u32 *limits_size, bgs_u32 *request_size,
                                    bgs_u32 *frame_size, bgs_u32 *item_size,
                                    bgs_u32 *packed_size, bgs_u32 *geometry_size);

#ifdef BGS_GEN_LOOP_IMPL

#define BGS_GL_FN static BGS_GEN_LOOP_API

BGS_GL_FN bgs_u32 bgs_gl_min32(bgs_u64 a, bgs_u64 b) {
    return (bgs_u32)(a < b ? a : b);
}

BGS_GL_FN bgs_u32 *bgs_gl_seq(bgs_u32 *st, bgs_u32 slot) {
    return st + st[BGS_GL_H_SEQ_AT] + slot * st[BGS_GL_H_SEQ_WORDS];
}

BGS_GL_FN const bgs_u32 *bgs_gl_cseq(const bgs_u32 *st, bgs_u32 slot) {
    return st + st[BGS_GL_H_SEQ_AT] + slot * st[BGS_GL_H_SEQ_WORDS];
}

/* Block-table words per sequence: a sequence never holds more than its reservation (at most
 * max_positions - 1 tokens) nor more than the pool. */
BGS_GL_FN bgs_u32 bgs_gl_max_bps(const struct bgs_gl_limits *l) {
    bgs_u32 need = bgs_sp_blocks_for(l->max_positions, l->block_size);
    return need < l->num_blocks ? need : l->num_blocks;
}

/* Step tokens at most: the budget, and never more than every running sequence's whole
 * prompt (decoders take 1 token, which a prompt of >= 1 token covers). */
BGS_GL_FN bgs_u32 bgs_gl_token_cap(const struct bgs_gl_limits *l) {
    return bgs_gl_min32(l->max_batched_tokens, (bgs_u64)l->max_running * l->max_prompt);
}

BGS_GL_FN int bgs_gl_limits_ok(const struct bgs_gl_limits *l) {
    return l->block_size >= 1u && l->num_blocks >= 1u && l->max_running >= 1u &&
           l->max_seqs >= l->max_running && l->max_batched_tokens >= l->max_running &&
           l->max_batched_tokens <= 0x7fffffffu && l->max_prompt >= 1u &&
           l->max_prompt <= BGS_GL_MAX_PROMPT && l->vocab_size >= 1u &&
           l->max_positions >= 2u &&
           (bgs_u64)l->num_blocks * (bgs_u64)l->block_size <= 0xffffffffu;
}

/* Region offsets for `l` into `at` (same order as the BGS_GL_H_*_AT words); returns the total
 * words, or 0 past 1 GiB. */
BGS_GL_FN bgs_u64 bgs_gl_layout(const struct bgs_gl_limits *l, bgs_u64 *at) {
    bgs_u64 w = BGS_GL_HEADER_WORDS;
    bgs_u64 seq_words = BGS_GL_SEQ_FIXED + (bgs_u64)l->max_prompt + bgs_gl_max_bps(l);
    at[0] = w; w += l->max_eos;                                      /* EOS ids */
    at[1] = w; w += l->num_blocks;                                   /* free stack */
    at[2] = w; w += l->max_seqs;                                     /* FIFO order */
    at[3] = w; w += (bgs_u64)l->max_seqs * seq_words;                /* sequence table */
    at[4] = w; w += (bgs_u64)l->max_running * BGS_GL_ITEM_WORDS;     /* step items */
    at[5] = w; w += bgs_gl_token_cap(l);                             /* step tokens */
    at[6] = w; w += (bgs_u64)l->max_seqs * (sizeof(struct bgs_sp_seq) / 4u); /* views */
    at[7] = w; w += (bgs_u64)l->max_seqs * (sizeof(struct bgs_sp_out) / 4u); /* outs */
    at[8] = w; w += l->max_seqs;                                     /* view -> slot */
    at[9] = w; w += ((bgs_u64)l->num_blocks + 31u) / 32u;            /* block bitmap */
    return w > (1ull << 28) ? 0u : w;
}

BGS_GEN_LOOP_API bgs_u64 bgs_gl_state_bytes(const struct bgs_gl_limits *limits) {
    bgs_u64 at[10];
    if (!bgs_gl_limits_ok(limits)) {
        return 0u;
    }
    return bgs_gl_layout(limits, at) * 4u;
}

BGS_GEN_LOOP_API int bgs_gl_init(bgs_u32 *state, const struct bgs_gl_limits *limits,
                                 const bgs_u32 *eos_ids, bgs_u32 n_eos) {
    bgs_u64 at[10];
    bgs_u64 words;
    bgs_u64 i;
    if (!bgs_gl_limits_ok(limits)) {
        return BGS_GL_ERR_LIMITS;
    }
    if (n_eos > limits->max_eos) {
        return BGS_GL_ERR_EOS;
    }
    words = bgs_gl_layout(limits, at);
    if (words == 0u) {
        return BGS_GL_ERR_LIMITS;
    }
    for (i = 0u; i < words; i++) {
        state[i] = 0u;
    }
    state[BGS_GL_H_MAGIC] = BGS_GL_MAGIC;
    state[BGS_GL_H_ABI] = BGS_GL_ABI_VERSION;
    state[BGS_GL_H_BLOCK_SIZE] = limits->block_size;
    state[BGS_GL_H_NUM_BLOCKS] = limits->num_blocks;
    state[BGS_GL_H_MAX_SEQS] = limits->max_seqs;
    state[BGS_GL_H_MAX_RUNNING] = limits->max_running;
    state[BGS_GL_H_MAX_BATCHED] = limits->max_batched_tokens;
    state[BGS_GL_H_MAX_PROMPT] = limits->max_prompt;
    state[BGS_GL_H_VOCAB] = limits->vocab_size;
    state[BGS_GL_H_MAX_POS] = limits->max_positions;
    state[BGS_GL_H_MAX_EOS] = limits->max_eos;
    state[BGS_GL_H_IGNORE_EOS] = limits->ignore_eos != 0u;
    state[BGS_GL_H_MAX_BPS] = bgs_gl_max_bps(limits);
    state[BGS_GL_H_SEQ_WORDS] = BGS_GL_SEQ_FIXED + limits->max_prompt + bgs_gl_max_bps(limits);
    state[BGS_GL_H_TOKEN_CAP] = bgs_gl_token_cap(limits);
    state[BGS_GL_H_N_EOS] = n_eos;
    for (i = 0u; i < 10u; i++) {
        state[BGS_GL_H_EOS_AT + i] = (bgs_u32)at[i];
    }
    state[BGS_GL_H_WORDS] = (bgs_u32)words;
    for (i = 0u; i < n_eos; i++) {
        state[at[0] + i] = eos_ids[i];
    }
    /* The free stack pops block 0 first, then 1, ... (the Rust BlockAllocator's order). */
    for (i = 0u; i < limits->num_blocks; i++) {
        state[at[1] + i] = limits->num_blocks - 1u - (bgs_u32)i;
    }
    state[BGS_GL_H_FREE_TOP] = limits->num_blocks;
    return 0;
}

BGS_GL_FN bgs_u32 bgs_gl_find_stream(const bgs_u32 *st, bgs_u32 stream) {
    const bgs_u32 *order = st + st[BGS_GL_H_ORDER_AT];
    bgs_u32 k;
    for (k = 0u; k < st[BGS_GL_H_N_LIVE]; k++) {
        if (bgs_gl_cseq(st, order[k])[BGS_GL_S_STREAM] == stream) {
            return order[k];
        }
    }
    return BGS_GL_NO_STREAM;
}

/* The lowest table slot not live, or max_seqs. */
BGS_GL_FN bgs_u32 bgs_gl_first_free(const bgs_u32 *st) {
    bgs_u32 slot;
    for (slot = 0u; slot < st[BGS_GL_H_MAX_SEQS]; slot++) {
        if (bgs_gl_cseq(st, slot)[BGS_GL_S_LIVE] == 0u) {
            break;
        }
    }
    return slot;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_admit(bgs_u32 *state, const struct bgs_gl_request *r) {
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC) {
        return BGS_STATUS_INTERNAL;
    }
    return bgs_gl_admit_scanned(state, r,
                                bgs_gl_find_stream(state, r->stream) != BGS_GL_NO_STREAM,
                                bgs_gl_first_free(state));
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_admit_scanned(bgs_u32 *state, const struct bgs_gl_request *r,
                                              bgs_u32 stream_live, bgs_u32 free_slot) {
    bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    bgs_u32 *s;
    bgs_u32 status;
    bgs_u32 p = r->words;
    bgs_u32 max_pos = state[BGS_GL_H_MAX_POS];
    bgs_u64 pool = (bgs_u64)state[BGS_GL_H_NUM_BLOCKS] * state[BGS_GL_H_BLOCK_SIZE];
    bgs_u64 max_gen;
    bgs_u32 slot;
    bgs_u32 i;
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC) {
        return BGS_STATUS_INTERNAL;
    }
    if (state[BGS_GL_H_N_LIVE] >= state[BGS_GL_H_MAX_SEQS]) {
        return BGS_STATUS_BUSY;
    }
    if (stream_live != 0u) {
        return BGS_STATUS_INTERNAL; /* the executor reused a live stream id: its bug */
    }
    /* The Rust engine's order: payload words and param, flags, vocabulary, context, pool. */
    status = bgs_op_check(BGS_OP_GENERATE, p, r->param);
    if (status != 0u) {
        return status;
    }
    if ((r->flags & ~bgs_op_allowed_flags(BGS_OP_GENERATE)) != 0u) {
        return BGS_STATUS_BAD_FLAGS;
    }
    for (i = 0u; i < p; i++) {
        if (r->payload[i] >= state[BGS_GL_H_VOCAB]) {
            return BGS_STATUS_BAD_PARAM;
        }
    }
    if (p > state[BGS_GL_H_MAX_PROMPT]) {
        return BGS_STATUS_BAD_PARAM; /* this core's bound (a ring slot's payload) */
    }
    if ((bgs_u64)p + 1u > max_pos) {
        return BGS_STATUS_BAD_PARAM; /* no room for a generated token */
    }
    if ((bgs_u64)p > pool) {
        return BGS_STATUS_BAD_PARAM; /* can never fit the KV pool */
    }
    /* Generation ends with length at the first of: max new tokens, the context, the whole KV
     * pool. None depends on the rest of the batch. */
    max_gen = r->param;
    if (max_gen > (bgs_u64)max_pos - p) {
        max_gen = (bgs_u64)max_pos - p;
    }
    if (max_gen > pool - p + 1u) {
        max_gen = pool - p + 1u;
    }
    slot = free_slot;
    if (slot >= state[BGS_GL_H_MAX_SEQS]) {
        return BGS_STATUS_INTERNAL; /* the live count and the table disagree */
    }
    s = bgs_gl_seq(state, slot);
    for (i = 0u; i < BGS_GL_SEQ_FIXED; i++) {
        s[i] = 0u;
    }
    s[BGS_GL_S_LIVE] = 1u;
    s[BGS_GL_S_STREAM] = r->stream;
    s[BGS_GL_S_CONN_LO] = (bgs_u32)r->conn;
    s[BGS_GL_S_CONN_HI] = (bgs_u32)(r->conn >> 32);
    s[BGS_GL_S_CONN_SEQ] = r->conn_seq;
    s[BGS_GL_S_REQUEST_ID] = r->request_id;
    s[BGS_GL_S_ROUTE] = r->route;
    s[BGS_GL_S_PROMPT_LEN] = p;
    s[BGS_GL_S_MAX_GEN] = (bgs_u32)max_gen;
    s[BGS_GL_S_IGNORE_EOS] =
        state[BGS_GL_H_IGNORE_EOS] != 0u || (r->flags & BGS_FLAG_IGNORE_EOS) != 0u;
    for (i = 0u; i < p; i++) {
        s[BGS_GL_SEQ_FIXED + i] = r->payload[i];
    }
    order[state[BGS_GL_H_N_LIVE]] = slot;
    state[BGS_GL_H_N_LIVE] += 1u;
    return 0u;
}

/* End sequence `s` now: free its blocks (pushed in table order), drop an unpublished token
 * frame unless `keep_pending`, owe a final frame of `status` with `words` words. */
BGS_GL_FN void bgs_gl_end(bgs_u32 *st, bgs_u32 *s, bgs_u32 status, bgs_u32 words, bgs_u32 w0,
                          bgs_u32 w1, int keep_pending) {
    bgs_u32 *free_stack = st + st[BGS_GL_H_FREE_AT];
    bgs_u32 *table = s + BGS_GL_SEQ_FIXED + st[BGS_GL_H_MAX_PROMPT];
    bgs_u32 i;
    for (i = 0u; i < s[BGS_GL_S_N_BLOCKS]; i++) {
        free_stack[st[BGS_GL_H_FREE_TOP]] = table[i];
        st[BGS_GL_H_FREE_TOP] += 1u;
    }
    s[BGS_GL_S_N_BLOCKS] = 0u;
    s[BGS_GL_S_RUNNING] = 0u;
    if (!keep_pending) {
        s[BGS_GL_S_PENDING] = 0u;
    }
    s[BGS_GL_S_END] = status;
    s[BGS_GL_S_END_WORDS] = words;
    s[BGS_GL_S_END_W0] = w0;
    s[BGS_GL_S_END_W1] = w1;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_cancel(bgs_u32 *state, bgs_u64 conn) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    bgs_u32 k;
    bgs_u32 n = 0u;
    for (k = 0u; k < state[BGS_GL_H_N_LIVE]; k++) {
        bgs_u32 *s = bgs_gl_seq(state, order[k]);
        if (s[BGS_GL_S_CONN_LO] == (bgs_u32)conn && s[BGS_GL_S_CONN_HI] == (bgs_u32)(conn >> 32)) {
            bgs_gl_end(state, s, BGS_STATUS_CANCELLED, 0u, 0u, 0u, 0);
            n++;
        }
    }
    return n;
}

/* Frames the sequence in `slot` owes now (0..=2): a pending token frame, then its final one. */
BGS_GL_FN bgs_u32 bgs_gl_owes(const bgs_u32 *state, bgs_u32 slot) {
    const bgs_u32 *s = bgs_gl_cseq(state, slot);
    return (s[BGS_GL_S_PENDING] != 0u) + (s[BGS_GL_S_END] != 0u);
}

/* Writes the frames the sequence in `slot` owes (bgs_gl_owes of them) at out[0..). */
BGS_GL_FN void bgs_gl_owed_by(const bgs_u32 *state, bgs_u32 slot, struct bgs_gl_frame *out) {
    const bgs_u32 *s = bgs_gl_cseq(state, slot);
    bgs_u32 seq = s[BGS_GL_S_EMITTED];
    if (s[BGS_GL_S_PENDING] != 0u) {
        out->slot = slot;
        out->stream = s[BGS_GL_S_STREAM];
        out->status = BGS_STATUS_TOKEN;
        out->final_ = 0u;
        out->seq = seq;
        out->words = 1u;
        out->word[0] = s[BGS_GL_S_LAST];
        out->word[1] = 0u;
        out++;
        seq++;
    }
    if (s[BGS_GL_S_END] != 0u) {
        out->slot = slot;
        out->stream = s[BGS_GL_S_STREAM];
        out->status = s[BGS_GL_S_END];
        out->final_ = 1u;
        out->seq = seq;
        out->words = s[BGS_GL_S_END_WORDS];
        out->word[0] = s[BGS_GL_S_END_W0];
        out->word[1] = s[BGS_GL_S_END_W1];
    }
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_owed(const bgs_u32 *state, struct bgs_gl_frame *out) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    bgs_u32 k;
    bgs_u32 n = 0u;
    for (k = 0u; k < state[BGS_GL_H_N_LIVE]; k++) {
        bgs_gl_owed_by(state, order[k], out + n);
        n += bgs_gl_owes(state, order[k]);
    }
    return n;
}

/* bgs_gl_delivered's part for one slot: the pending frame is emitted and, when the final frame
 * went out too, the slot is no longer live. Returns 1 when the slot left the table (its entry
 * in the FIFO order is then stale until bgs_gl_drop_left closes the order up). Touches only
 * the slot's own words, so different slots may be marked at once (the dispatcher's lanes). */
BGS_GL_FN bgs_u32 bgs_gl_delivered_mark(bgs_u32 *state, bgs_u32 slot, bgs_u32 published) {
    bgs_u32 *s;
    if (slot >= state[BGS_GL_H_MAX_SEQS]) {
        return 0u;
    }
    s = bgs_gl_seq(state, slot);
    if (s[BGS_GL_S_LIVE] == 0u) {
        return 0u;
    }
    if (s[BGS_GL_S_PENDING] != 0u && published > 0u) {
        s[BGS_GL_S_PENDING] = 0u;
        s[BGS_GL_S_EMITTED] += 1u;
        published--;
    }
    if (s[BGS_GL_S_END] == 0u || published == 0u) {
        return 0u;
    }
    /* The final frame went out: the slot leaves the table. */
    s[BGS_GL_S_LIVE] = 0u;
    return 1u;
}

/* Close up the FIFO order over the slots bgs_gl_delivered_mark took out (order kept). */
BGS_GL_FN void bgs_gl_drop_left(bgs_u32 *state) {
    bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    bgs_u32 k;
    bgs_u32 j = 0u;
    for (k = 0u; k < state[BGS_GL_H_N_LIVE]; k++) {
        if (bgs_gl_cseq(state, order[k])[BGS_GL_S_LIVE] != 0u) {
            order[j++] = order[k];
        }
    }
    state[BGS_GL_H_N_LIVE] = j;
}

BGS_GEN_LOOP_API void bgs_gl_delivered(bgs_u32 *state, bgs_u32 slot, bgs_u32 published) {
    if (bgs_gl_delivered_mark(state, slot, published) != 0u) {
        bgs_gl_drop_left(state);
    }
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_view(const bgs_u32 *state, bgs_u32 slot, const bgs_u32 *credit,
                                     struct bgs_sp_seq *view) {
    const bgs_u32 *s = bgs_gl_cseq(state, slot);
    bgs_u32 p = s[BGS_GL_S_PROMPT_LEN];
    if (s[BGS_GL_S_END] != 0u) {
        return 0u;
    }
    view->state = s[BGS_GL_S_RUNNING] == 0u ? BGS_SP_WAITING
                  : s[BGS_GL_S_POS] < p    ? BGS_SP_PREFILL
                                           : BGS_SP_DECODE;
    view->prompt_left = s[BGS_GL_S_POS] < p ? p - s[BGS_GL_S_POS] : 0u;
    view->pos = s[BGS_GL_S_POS];
    view->blocks_held = s[BGS_GL_S_N_BLOCKS];
    view->reserve_tokens = p + s[BGS_GL_S_MAX_GEN] - 1u;
    /* Waiting: always ready (it owes nothing until its prompt is done; gating admission on
     * credit let one stream behind on acknowledgements hold up every admission behind it in
     * FIFO order). Running: no token frame owed and credit for BGS_GL_STEP_CREDIT. */
    view->ready = s[BGS_GL_S_PENDING] == 0u &&
                  (view->state == BGS_SP_WAITING || credit[slot] >= BGS_GL_STEP_CREDIT);
    return 1u;
}

BGS_GEN_LOOP_API void bgs_gl_views(bgs_u32 *state, struct bgs_sp_seq **views, bgs_u32 **view_of) {
    *views = (struct bgs_sp_seq *)(state + state[BGS_GL_H_VIEWS_AT]);
    *view_of = state + state[BGS_GL_H_VIEW_OF_AT];
}

BGS_GEN_LOOP_API int bgs_gl_plan(bgs_u32 *state, const bgs_u32 *credit) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    struct bgs_sp_seq *views;
    bgs_u32 *view_of;
    bgs_u32 n = 0u;
    bgs_u32 k;
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC) {
        return BGS_GL_ERR_STATE;
    }
    bgs_gl_views(state, &views, &view_of);
    for (k = 0u; k < state[BGS_GL_H_N_LIVE]; k++) {
        if (bgs_gl_view(state, order[k], credit, &views[n]) != 0u) {
            view_of[n] = order[k];
            n++;
        }
    }
    return bgs_gl_plan_viewed(state, n);
}

/* bgs_gl_plan_viewed's pieces (the device loop runs the policy and the items lane-parallel and
 * calls the same pieces). */
BGS_GL_FN void bgs_gl_sp_limits(const bgs_u32 *state, struct bgs_sp_limits *lim) {
    lim->block_size = state[BGS_GL_H_BLOCK_SIZE];
    lim->free_blocks = state[BGS_GL_H_FREE_TOP];
    lim->max_batched_tokens = state[BGS_GL_H_MAX_BATCHED];
    lim->max_running = state[BGS_GL_H_MAX_RUNNING];
}

/* The policy failed: an engine bug (the loop keeps the policy's invariants); ending every
 * stream beats spinning on a plan that keeps failing. */
BGS_GL_FN int bgs_gl_plan_failed(bgs_u32 *state, bgs_u32 n) {
    const bgs_u32 *view_of = state + state[BGS_GL_H_VIEW_OF_AT];
    bgs_u32 k;
    for (k = 0u; k < n; k++) {
        bgs_gl_end(state, bgs_gl_seq(state, view_of[k]), BGS_STATUS_INTERNAL, 0u, 0u, 0u, 0);
    }
    return BGS_GL_POLICY_FAILED;
}

/* Whether view k's decision fits what is left (all or nothing, like the Rust allocator; never
 * short: the policy only hands out uncommitted blocks. The table never exceeds the
 * reservation (policy), hence max_bps; the step's tokens never exceed the budget nor the
 * prompts (token_cap)). `free_top`, `n_tokens`: the free stack and the step's tokens before
 * this view's item. */
BGS_GL_FN bgs_u32 bgs_gl_item_room(const bgs_u32 *state, const bgs_u32 *s,
                                   const struct bgs_sp_out *o, bgs_u32 free_top,
                                   bgs_u32 n_tokens) {
    return o->new_blocks <= free_top &&
           s[BGS_GL_S_N_BLOCKS] + o->new_blocks <= state[BGS_GL_H_MAX_BPS] &&
           n_tokens + o->tokens <= state[BGS_GL_H_TOKEN_CAP];
}

/* View k's item (its decision fits: bgs_gl_item_room): its new blocks from the free stack
 * below `free_top`, the item at index `at`, its input tokens from `n_tokens` on. */
BGS_GL_FN void bgs_gl_plan_item(bgs_u32 *state, bgs_u32 slot, const struct bgs_sp_out *o,
                                bgs_u32 free_top, bgs_u32 at, bgs_u32 n_tokens) {
    bgs_u32 *s = bgs_gl_seq(state, slot);
    bgs_u32 *table = s + BGS_GL_SEQ_FIXED + state[BGS_GL_H_MAX_PROMPT];
    const bgs_u32 *free_stack = state + state[BGS_GL_H_FREE_AT];
    bgs_u32 *item = state + state[BGS_GL_H_ITEMS_AT] + at * BGS_GL_ITEM_WORDS;
    bgs_u32 *tokens = state + state[BGS_GL_H_TOKENS_AT];
    bgs_u32 j;
    bgs_u32 known;
    for (j = 0u; j < o->new_blocks; j++) {
        table[s[BGS_GL_S_N_BLOCKS] + j] = free_stack[free_top - 1u - j];
    }
    s[BGS_GL_S_N_BLOCKS] += o->new_blocks;
    item[BGS_GL_I_SLOT] = slot;
    item[BGS_GL_I_TOKENS] = o->tokens;
    item[BGS_GL_I_POS] = s[BGS_GL_S_POS];
    known = s[BGS_GL_S_PROMPT_LEN] + s[BGS_GL_S_GENERATED];
    item[BGS_GL_I_SAMPLE] = s[BGS_GL_S_POS] + o->tokens == known;
    item[BGS_GL_I_TOK_AT] = state[BGS_GL_H_TOKENS_AT] + n_tokens;
    /* Inputs: prompt tokens, then the last sampled token (the only generated token that is
     * ever fed: earlier ones are in the KV cache). */
    for (j = 0u; j < o->tokens; j++) {
        bgs_u32 p = s[BGS_GL_S_POS] + j;
        tokens[n_tokens + j] =
            p < s[BGS_GL_S_PROMPT_LEN] ? s[BGS_GL_SEQ_FIXED + p] : s[BGS_GL_S_LAST];
    }
}

/* The items of the policy's decisions (outs[0..n)), in view order. Returns their count. */
BGS_GL_FN int bgs_gl_plan_items(bgs_u32 *state, bgs_u32 n) {
    const struct bgs_sp_out *outs = (const struct bgs_sp_out *)(state + state[BGS_GL_H_OUTS_AT]);
    const bgs_u32 *view_of = state + state[BGS_GL_H_VIEW_OF_AT];
    bgs_u32 n_items = 0u;
    bgs_u32 n_tokens = 0u;
    bgs_u32 k;
    for (k = 0u; k < n; k++) {
        bgs_u32 *s = bgs_gl_seq(state, view_of[k]);
        if (outs[k].admit != 0u) {
            s[BGS_GL_S_RUNNING] = 1u;
        }
        if (outs[k].tokens == 0u) {
            continue;
        }
        if (bgs_gl_item_room(state, s, &outs[k], state[BGS_GL_H_FREE_TOP], n_tokens) == 0u) {
            bgs_gl_end(state, s, BGS_STATUS_INTERNAL, 0u, 0u, 0u, 0);
            continue;
        }
        bgs_gl_plan_item(state, view_of[k], &outs[k], state[BGS_GL_H_FREE_TOP], n_items,
                         n_tokens);
        state[BGS_GL_H_FREE_TOP] -= outs[k].new_blocks;
        n_tokens += outs[k].tokens;
        n_items++;
    }
    state[BGS_GL_H_N_ITEMS] = n_items;
    state[BGS_GL_H_STEP_TOKENS] = n_tokens;
    return (int)n_items;
}

BGS_GEN_LOOP_API int bgs_gl_plan_viewed(bgs_u32 *state, bgs_u32 n) {
    struct bgs_sp_limits lim;
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC) {
        return BGS_GL_ERR_STATE;
    }
    state[BGS_GL_H_N_ITEMS] = 0u;
    state[BGS_GL_H_STEP_TOKENS] = 0u;
    if (n == 0u) {
        return 0;
    }
    bgs_gl_sp_limits(state, &lim);
    if (bgs_step_plan(&lim, (const struct bgs_sp_seq *)(state + state[BGS_GL_H_VIEWS_AT]), n,
                      (struct bgs_sp_out *)(state + state[BGS_GL_H_OUTS_AT])) < 0) {
        return bgs_gl_plan_failed(state, n);
    }
    return bgs_gl_plan_items(state, n);
}

BGS_GEN_LOOP_API int bgs_gl_item(const bgs_u32 *state, bgs_u32 k, struct bgs_gl_item *out) {
    const bgs_u32 *item;
    const bgs_u32 *s;
    if (k >= state[BGS_GL_H_N_ITEMS]) {
        return -1;
    }
    item = state + state[BGS_GL_H_ITEMS_AT] + k * BGS_GL_ITEM_WORDS;
    s = bgs_gl_cseq(state, item[BGS_GL_I_SLOT]);
    out->slot = item[BGS_GL_I_SLOT];
    out->stream = s[BGS_GL_S_STREAM];
    out->tokens = item[BGS_GL_I_TOKENS];
    out->pos = item[BGS_GL_I_POS];
    out->sample = item[BGS_GL_I_SAMPLE];
    out->tok_at = item[BGS_GL_I_TOK_AT];
    out->bt_at = state[BGS_GL_H_SEQ_AT] + item[BGS_GL_I_SLOT] * state[BGS_GL_H_SEQ_WORDS] +
                 BGS_GL_SEQ_FIXED + state[BGS_GL_H_MAX_PROMPT];
    out->n_blocks = s[BGS_GL_S_N_BLOCKS];
    return 0;
}

BGS_GEN_LOOP_API int bgs_gl_finish(bgs_u32 *state, const bgs_u32 *next,
                                   struct bgs_gl_frame *frames) {
    const int r = bgs_gl_advance(state, next);
    return r != 0 ? r : (int)bgs_gl_owed(state, frames);
}

BGS_GEN_LOOP_API int bgs_gl_advance(bgs_u32 *state, const bgs_u32 *next) {
    const bgs_u32 *items = state + state[BGS_GL_H_ITEMS_AT];
    const bgs_u32 *eos = state + state[BGS_GL_H_EOS_AT];
    bgs_u32 n_items = state[BGS_GL_H_N_ITEMS];
    bgs_u32 k;
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC || n_items == 0u) {
        return BGS_GL_ERR_STEP;
    }
    state[BGS_GL_H_N_ITEMS] = 0u;
    state[BGS_GL_H_STEP_TOKENS] = 0u;
    for (k = 0u; k < n_items; k++) {
        const bgs_u32 *item = items + k * BGS_GL_ITEM_WORDS;
        bgs_u32 *s = bgs_gl_seq(state, item[BGS_GL_I_SLOT]);
        bgs_u32 t = next[k];
        bgs_u32 is_eos = 0u;
        bgs_u32 e;
        s[BGS_GL_S_POS] += item[BGS_GL_I_TOKENS];
        if (s[BGS_GL_S_POS] != s[BGS_GL_S_PROMPT_LEN] + s[BGS_GL_S_GENERATED]) {
            continue; /* a prefill chunk that did not reach the prompt's end */
        }
        if (t >= state[BGS_GL_H_VOCAB]) {
            bgs_gl_end(state, s, BGS_STATUS_INTERNAL, 0u, 0u, 0u, 0);
            continue;
        }
        for (e = 0u; e < state[BGS_GL_H_N_EOS]; e++) {
            is_eos |= eos[e] == t;
        }
        if (s[BGS_GL_S_IGNORE_EOS] == 0u && is_eos != 0u) {
            /* EOS is not sent as a token frame. */
            bgs_gl_end(state, s, BGS_STATUS_END_OF_STREAM, 2u, BGS_GL_FINISH_EOS,
                       s[BGS_GL_S_GENERATED], 0);
            continue;
        }
        s[BGS_GL_S_GENERATED] += 1u;
        s[BGS_GL_S_LAST] = t;
        s[BGS_GL_S_PENDING] = 1u;
        if (s[BGS_GL_S_GENERATED] >= s[BGS_GL_S_MAX_GEN]) {
            bgs_gl_end(state, s, BGS_STATUS_END_OF_STREAM, 2u, BGS_GL_FINISH_LENGTH,
                       s[BGS_GL_S_GENERATED], 1);
        }
    }
    return 0;
}

BGS_GEN_LOOP_API void bgs_gl_fail_step(bgs_u32 *state) {
    const bgs_u32 *items = state + state[BGS_GL_H_ITEMS_AT];
    bgs_u32 n_items = state[BGS_GL_H_N_ITEMS];
    bgs_u32 k;
    state[BGS_GL_H_N_ITEMS] = 0u;
    state[BGS_GL_H_STEP_TOKENS] = 0u;
    for (k = 0u; k < n_items; k++) {
        bgs_gl_end(state, bgs_gl_seq(state, items[k * BGS_GL_ITEM_WORDS + BGS_GL_I_SLOT]),
                   BGS_STATUS_INTERNAL, 0u, 0u, 0u, 0);
    }
}

/* The smallest bucket holding n (n >= 1), 0 if none. */
BGS_GL_FN bgs_u32 bgs_gl_bucket(bgs_u32 n) {
    bgs_u32 b;
    for (b = 0u; b < BGS_LLM_STEP_N_BUCKETS; b++) {
        if (bgs_llm_step_bucket(b) >= (n > 0u ? n : 1u)) {
            return bgs_llm_step_bucket(b);
        }
    }
    return 0u;
}

/* bgs_gl_pack in pieces (shared with the device loop's lane-parallel form). */

/* The step as a whole fits the geometry: 0, or BGS_GL_ERR_STEP / BGS_GL_ERR_GEOMETRY. */
BGS_GL_FN int bgs_gl_pack_fits(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo) {
    const bgs_u32 bs = geo->block_size;
    if (state[BGS_GL_H_MAGIC] != BGS_GL_MAGIC || state[BGS_GL_H_N_ITEMS] == 0u) {
        return BGS_GL_ERR_STEP;
    }
    /* The same limits as the Rust pack_step; the loop's own invariants already keep tokens,
     * vocabulary, positions and block tables valid. */
    if (bs != state[BGS_GL_H_BLOCK_SIZE] || state[BGS_GL_H_N_ITEMS] > geo->max_seqs ||
        state[BGS_GL_H_STEP_TOKENS] > geo->max_tokens || bs == 0u) {
        return BGS_GL_ERR_GEOMETRY;
    }
    return 0;
}

/* Blocks item k's table needs for this step. */
BGS_GL_FN bgs_u32 bgs_gl_item_blocks(const bgs_u32 *item, bgs_u32 bs) {
    return bgs_sp_blocks_for((bgs_u64)item[BGS_GL_I_POS] + item[BGS_GL_I_TOKENS], bs);
}

/* The item's block table fits the geometry: 1, else 0. */
BGS_GL_FN bgs_u32 bgs_gl_item_fits(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo,
                                   const bgs_u32 *item) {
    const bgs_u32 need = bgs_gl_item_blocks(item, geo->block_size);
    const bgs_u32 *s = bgs_gl_cseq(state, item[BGS_GL_I_SLOT]);
    const bgs_u32 *table = s + BGS_GL_SEQ_FIXED + state[BGS_GL_H_MAX_PROMPT];
    bgs_u32 j;
    if (need > geo->max_blocks_per_seq || need > s[BGS_GL_S_N_BLOCKS]) {
        return 0u;
    }
    for (j = 0u; j < need; j++) {
        if (table[j] >= geo->num_blocks) {
            return 0u;
        }
    }
    return 1u;
}

/* `out` for a step of `samples` sampled rows: 0, or BGS_GL_ERR_GEOMETRY. */
BGS_GL_FN int bgs_gl_pack_out(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo,
                              bgs_u32 samples, struct bgs_gl_packed *out) {
    if (samples > geo->max_samples) {
        return BGS_GL_ERR_GEOMETRY;
    }
    out->tokens = state[BGS_GL_H_STEP_TOKENS];
    out->bucket = bgs_gl_bucket(out->tokens);
    out->samples = samples;
    out->sample_bucket = samples == 0u ? 0u : bgs_gl_bucket(samples);
    out->reserved = 0u;
    if (out->bucket == 0u || (samples != 0u && out->sample_bucket == 0u)) {
        return BGS_GL_ERR_GEOMETRY;
    }
    return 0;
}

/* Item k's words: its table offset `bt_at` and table, its tokens from row `t` on (token id,
 * position, item index, KV slot), and, when it samples, row `row` of the sampled rows. */
BGS_GL_FN void bgs_gl_pack_item(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo,
                                bgs_i32 *buf, bgs_u32 k, const bgs_u32 *item, bgs_u32 t,
                                bgs_u32 bt_at, bgs_u32 row) {
    const bgs_u32 bs = geo->block_size;
    const bgs_u32 *s = bgs_gl_cseq(state, item[BGS_GL_I_SLOT]);
    const bgs_u32 *table = s + BGS_GL_SEQ_FIXED + state[BGS_GL_H_MAX_PROMPT];
    const bgs_u32 *tok = state + item[BGS_GL_I_TOK_AT];
    const bgs_u32 need = bgs_gl_item_blocks(item, bs);
    const bgs_u32 tok_o = bgs_llm_step_tok(geo), pos_o = bgs_llm_step_pos(geo);
    const bgs_u32 seq_o = bgs_llm_step_seq(geo), slot_o = bgs_llm_step_slot(geo);
    bgs_u32 j;
    buf[bgs_llm_step_bt_off(geo) + k] = (bgs_i32)bt_at;
    for (j = 0u; j < need; j++) {
        buf[bgs_llm_step_bt(geo) + bt_at + j] = (bgs_i32)table[j];
    }
    for (j = 0u; j < item[BGS_GL_I_TOKENS]; j++) {
        bgs_u32 p = item[BGS_GL_I_POS] + j;
        buf[tok_o + t + j] = (bgs_i32)tok[j];
        buf[pos_o + t + j] = (bgs_i32)p;
        buf[seq_o + t + j] = (bgs_i32)k;
        buf[slot_o + t + j] = (bgs_i32)(table[p / bs] * bs + p % bs);
    }
    if (item[BGS_GL_I_SAMPLE] != 0u) {
        buf[bgs_llm_step_rows(geo) + row] = (bgs_i32)(t + item[BGS_GL_I_TOKENS] - 1u);
    }
}

/* Padding token row k (past the step's tokens). */
BGS_GL_FN void bgs_gl_pack_pad(const struct bgs_llm_step_geometry *geo, bgs_i32 *buf, bgs_u32 k) {
    buf[bgs_llm_step_tok(geo) + k] = BGS_LLM_STEP_PAD_TOKEN;
    buf[bgs_llm_step_pos(geo) + k] = BGS_LLM_STEP_PAD_POS;
    buf[bgs_llm_step_seq(geo) + k] = BGS_LLM_STEP_PAD_SEQ;
    buf[bgs_llm_step_slot(geo) + k] = BGS_LLM_STEP_PAD_SLOT;
}

BGS_GEN_LOOP_API int bgs_gl_pack(const bgs_u32 *state, const struct bgs_llm_step_geometry *geo,
                                 bgs_i32 *buf, struct bgs_gl_packed *out) {
    const bgs_u32 *items = state + state[BGS_GL_H_ITEMS_AT];
    const bgs_u32 n_items = state[BGS_GL_H_N_ITEMS];
    bgs_u32 t = 0u;
    bgs_u32 bt_at = 0u;
    bgs_u32 samples = 0u;
    bgs_u32 k;
    int r = bgs_gl_pack_fits(state, geo);
    if (r != 0) {
        return r;
    }
    /* Check first (nothing is written for a step that does not fit). */
    for (k = 0u; k < n_items; k++) {
        const bgs_u32 *item = items + k * BGS_GL_ITEM_WORDS;
        if (bgs_gl_item_fits(state, geo, item) == 0u) {
            return BGS_GL_ERR_GEOMETRY;
        }
        samples += item[BGS_GL_I_SAMPLE] != 0u;
    }
    r = bgs_gl_pack_out(state, geo, samples, out);
    if (r != 0) {
        return r;
    }
    samples = 0u;
    for (k = 0u; k < n_items; k++) {
        const bgs_u32 *item = items + k * BGS_GL_ITEM_WORDS;
        bgs_gl_pack_item(state, geo, buf, k, item, t, bt_at, samples);
        bt_at += bgs_gl_item_blocks(item, geo->block_size);
        t += item[BGS_GL_I_TOKENS];
        samples += item[BGS_GL_I_SAMPLE] != 0u;
    }
    for (k = t; k < geo->max_tokens; k++) {
        bgs_gl_pack_pad(geo, buf, k);
    }
    for (k = samples; k < geo->max_samples; k++) {
        buf[bgs_llm_step_rows(geo) + k] = BGS_LLM_STEP_PAD_ROW;
    }
    for (k = n_items; k < geo->max_seqs; k++) {
        buf[bgs_llm_step_bt_off(geo) + k] = 0;
    }
    out->words = bgs_llm_step_bt(geo) + bt_at;
    return 0;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_step_words(const struct bgs_llm_step_geometry *geo) {
    return bgs_llm_step_words(geo);
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_live(const bgs_u32 *state) {
    return state[BGS_GL_H_N_LIVE];
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_running(const bgs_u32 *state) {
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    bgs_u32 k;
    bgs_u32 n = 0u;
    for (k = 0u; k < state[BGS_GL_H_N_LIVE]; k++) {
        const bgs_u32 *s = bgs_gl_cseq(state, order[k]);
        n += s[BGS_GL_S_RUNNING] != 0u && s[BGS_GL_S_END] == 0u;
    }
    return n;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_free_blocks(const bgs_u32 *state) {
    return state[BGS_GL_H_FREE_TOP];
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_holds(const bgs_u32 *state, bgs_u32 stream) {
    return bgs_gl_find_stream(state, stream) != BGS_GL_NO_STREAM;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_slot_stream(const bgs_u32 *state, bgs_u32 slot) {
    const bgs_u32 *s;
    if (slot >= state[BGS_GL_H_MAX_SEQS]) {
        return BGS_GL_NO_STREAM;
    }
    s = bgs_gl_cseq(state, slot);
    return s[BGS_GL_S_LIVE] != 0u ? s[BGS_GL_S_STREAM] : BGS_GL_NO_STREAM;
}

/* Mark block b in the bitmap; 0 when it was already marked or is out of range. */
BGS_GL_FN bgs_u32 bgs_gl_mark(bgs_u32 *bitmap, bgs_u32 num_blocks, bgs_u32 b, bgs_u32 *err) {
    if (b >= num_blocks) {
        *err = BGS_GL_CHECK_BLOCK_RANGE;
        return 0u;
    }
    if ((bitmap[b / 32u] >> (b % 32u)) & 1u) {
        *err = BGS_GL_CHECK_BLOCK_TWICE;
        return 0u;
    }
    bitmap[b / 32u] |= 1u << (b % 32u);
    return 1u;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_check(bgs_u32 *state) {
    const bgs_u32 nb = state[BGS_GL_H_NUM_BLOCKS];
    const bgs_u32 *order = state + state[BGS_GL_H_ORDER_AT];
    const bgs_u32 *free_stack = state + state[BGS_GL_H_FREE_AT];
    bgs_u32 *bitmap = state + state[BGS_GL_H_BITMAP_AT];
    bgs_u64 held = 0u;
    bgs_u64 owed = 0u;
    bgs_u32 running = 0u;
    bgs_u32 live_slots = 0u;
    bgs_u32 err = 0u;
    bgs_u32 k;
    for (k = 0u; k < (nb + 31u) / 32u; k++) {
        bitmap[k] = 0u;
    }
    for (k = 0u; k < state[BGS_GL_H_FREE_TOP]; k++) {
        if (!bgs_gl_mark(bitmap, nb, free_stack[k], &err)) {
            return err;
        }
    }
    for (k = 0u; k < state[BGS_GL_H_MAX_SEQS]; k++) {
        live_slots += bgs_gl_cseq(state, k)[BGS_GL_S_LIVE] != 0u;
    }
    if (live_slots != state[BGS_GL_H_N_LIVE]) {
        return BGS_GL_CHECK_ORDER;
    }
    for (k = 0u; k < state[BGS_GL_H_N_LIVE]; k++) {
        const bgs_u32 *s;
        const bgs_u32 *table;
        bgs_u32 j;
        if (order[k] >= state[BGS_GL_H_MAX_SEQS]) {
            return BGS_GL_CHECK_ORDER;
        }
        s = bgs_gl_cseq(state, order[k]);
        if (s[BGS_GL_S_LIVE] == 0u) {
            return BGS_GL_CHECK_ORDER;
        }
        table = s + BGS_GL_SEQ_FIXED + state[BGS_GL_H_MAX_PROMPT];
        if ((s[BGS_GL_S_RUNNING] == 0u || s[BGS_GL_S_END] != 0u) && s[BGS_GL_S_N_BLOCKS] != 0u) {
            return BGS_GL_CHECK_IDLE_HOLDS;
        }
        for (j = 0u; j < s[BGS_GL_S_N_BLOCKS]; j++) {
            if (!bgs_gl_mark(bitmap, nb, table[j], &err)) {
                return err;
            }
        }
        held += s[BGS_GL_S_N_BLOCKS];
        if (s[BGS_GL_S_RUNNING] != 0u && s[BGS_GL_S_END] == 0u) {
            bgs_u32 need = bgs_sp_blocks_for(
                (bgs_u64)s[BGS_GL_S_PROMPT_LEN] + s[BGS_GL_S_MAX_GEN] - 1u,
                state[BGS_GL_H_BLOCK_SIZE]);
            if (s[BGS_GL_S_N_BLOCKS] > need) {
                return BGS_GL_CHECK_OVER_RESERVE;
            }
            owed += need - s[BGS_GL_S_N_BLOCKS];
            running++;
        }
    }
    if (held + state[BGS_GL_H_FREE_TOP] != nb) {
        return BGS_GL_CHECK_CONSERVED;
    }
    if (owed > state[BGS_GL_H_FREE_TOP]) {
        return BGS_GL_CHECK_OWED;
    }
    if (running > state[BGS_GL_H_MAX_RUNNING]) {
        return BGS_GL_CHECK_RUNNING;
    }
    return 0u;
}

BGS_GEN_LOOP_API bgs_u32 bgs_gl_abi(bgs_u32 *limits_size, bgs_u32 *request_size,
                                    bgs_u32 *frame_size, bgs_u32 *item_size,
                                    bgs_u32 *packed_size, bgs_u32 *geometry_size) {
    *limits_size = (bgs_u32)sizeof(struct bgs_gl_limits);
    *request_size = (bgs_u32)sizeof(struct bgs_gl_request);
    *frame_size = (bgs_u32)sizeof(struct bgs_gl_frame);
    *item_size = (bgs_u32)sizeof(struct bgs_gl_item);
    *packed_size = (bgs_u32)sizeof(struct bgs_gl_packed);
    *geometry_size = (bgs_u32)sizeof(struct bgs_llm_step_geometry);
    return BGS_GL_ABI_VERSION;
}

#undef BGS_GL_FN

#endif /* BGS_GEN_LOOP_IMPL */

#ifdef __cplusplus
}
#endif

#endif /* BGS_GEN_LOOP_H */
