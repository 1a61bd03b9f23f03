/* bgs_step_policy.h: the generation step policy (which sequences run in one batched forward
 * step, with how many tokens, and which waiting sequences are admitted).
 *
 * Hand-written (not generated). Portable C99 with no libc calls, no allocation, no globals and
 * no recursion, so that the same code runs on the host (crates/llm compiles it with the `cc`
 * crate and calls it through a safe Rust wrapper) and later inside the GPU's step loop
 * (NVRTC: define BGS_STEP_POLICY_API as `__device__` before including this file).
 *
 * Usage:
 *   - declarations only: include the header;
 *   - definitions: `#define BGS_STEP_POLICY_IMPL` before including it in exactly one unit
 *     (BGS_STEP_POLICY_API sets the linkage; empty = external, the host build's choice).
 *
 * The policy (see docs/generation.md for the whole engine):
 *   1. KV reservation. An admitted ("running") sequence reserves the blocks for every token it
 *      can ever hold in the KV cache: `reserve_tokens` = prompt + max generated - 1 (the last
 *      sampled token is never fed back). Blocks are allocated lazily as positions advance, but
 *      the unallocated rest of a running sequence's reservation is never handed to anyone
 *      else. So a running sequence can never starve for a block, nothing is preempted and no
 *      running sequence is ever corrupted or dropped. The price: blocks reserved for tokens
 *      that an early EOS never produces sit idle until the sequence ends.
 *   2. Decode first. Every running sequence in the decode phase that is `ready` (its consumer
 *      has credit, no frame is pending) gets exactly 1 token, in array order, while budget
 *      lasts (callers keep max_batched_tokens >= max_running so every ready decoder runs).
 *   3. Prefill chunks. The remaining token budget goes to sequences still prefilling, in array
 *      (FIFO) order: each takes min(prompt tokens left, budget left) (chunked prefill,
 *      Sarathi-style: decodes and prefill chunks share one step).
 *   4. Admission. Waiting sequences are admitted strictly FIFO while the running count stays
 *      below max_running, budget is left, and the blocks not yet committed (free minus the
 *      unallocated reservations of running sequences) cover the new sequence's whole
 *      reservation. The first waiting sequence that does not fit stops admission (no
 *      overtaking: a large request is not starved by a stream of small ones). An admitted
 *      sequence gets its first prefill chunk in the same step.
 *   For every sequence given tokens, `new_blocks` = blocks it must allocate before the step so
 *   that its block table covers positions [0, pos + tokens).
 *
 * Invariants kept (tested by crates/llm/tests/policy.rs, including property tests):
 *   sum(tokens) <= max_batched_tokens; sum(new_blocks) <= free_blocks; after the step, the
 *   blocks still free cover every running sequence's unallocated reservation; admission is a
 *   FIFO prefix of the waiting sequences; prefill chunks are handed out in FIFO order; every
 *   ready decoder gets its token; pos + tokens never exceeds reserve_tokens.
 */
#ifndef BGS_STEP_POLICY_H
#define BGS_STEP_POLICY_H

/* Fixed-width types: the same block (and guard) as the generated bgs_*.h headers. */
#ifndef BGS_FIXED_TYPES
#define BGS_FIXED_TYPES
#if defined(__bpf__) || defined(__BPF__)
typedef __u8 bgs_u8;
typedef __u16 bgs_u16;
typedef __u32 bgs_u32;
typedef __u64 bgs_u64;
#elif defined(__CUDACC_RTC__)
/* NVRTC has no system headers. */
typedef unsigned char bgs_u8;
typedef unsigned short bgs_u16;
typedef unsigned int bgs_u32;
typedef unsigned long long bgs_u64;
#else
#include <stdint.h>
typedef uint8_t bgs_u8;
typedef uint16_t bgs_u16;
typedef uint32_t bgs_u32;
typedef uint64_t bgs_u64;
#endif
#endif

#ifndef BGS_STEP_POLICY_API
#define BGS_STEP_POLICY_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Layout version of the structs below; bump on any change (the Rust wrapper checks it). */
#define BGS_SP_ABI_VERSION 1u

/* Sequence states (bgs_sp_seq.state). */
#define BGS_SP_WAITING 0u /* admitted by the engine, holds no blocks, not yet running */
#define BGS_SP_PREFILL 1u /* running; prompt tokens are left to process */
#define BGS_SP_DECODE 2u  /* running; feeds its last sampled token */

/* Return values of bgs_step_plan below zero: the inputs were invalid, `out` is unspecified. */
#define BGS_SP_ERR_LIMITS (-1)  /* block_size, max_batched_tokens or max_running is 0 */
#define BGS_SP_ERR_STATE (-2)   /* a sequence's state is not one of BGS_SP_* */
#define BGS_SP_ERR_RESERVE (-3) /* a sequence holds more blocks than its reservation, or
                                   a decoder has no token left in its reservation */
#define BGS_SP_ERR_OVERCOMMIT (-4) /* running reservations exceed the free blocks */

/* Engine-wide limits of one step (all 32-bit words: the layout is the same everywhere). */
struct bgs_sp_limits {
    bgs_u32 block_size;         /* tokens per KV block, >= 1 */
    bgs_u32 free_blocks;        /* blocks in the allocator's free pool now */
    bgs_u32 max_batched_tokens; /* token budget of one step, >= 1 */
    bgs_u32 max_running;        /* most sequences running at once, >= 1 */
};

/* One live sequence, in FIFO (arrival) order. */
struct bgs_sp_seq {
    bgs_u32 state;          /* BGS_SP_WAITING / BGS_SP_PREFILL / BGS_SP_DECODE */
    bgs_u32 prompt_left;    /* prompt tokens not yet processed (WAITING: the whole prompt) */
    bgs_u32 pos;            /* tokens already in the KV cache (the next position) */
    bgs_u32 blocks_held;    /* blocks in its block table now */
    bgs_u32 reserve_tokens; /* most tokens it will ever hold in the KV cache */
    bgs_u32 ready;          /* nonzero: may take tokens this step (credit, nothing pending) */
};

/* The decision for one sequence (same index as its bgs_sp_seq). */
struct bgs_sp_out {
    bgs_u32 admit;      /* 1: a WAITING sequence starts running this step */
    bgs_u32 tokens;     /* tokens it processes this step (0: sits out) */
    bgs_u32 new_blocks; /* blocks to allocate before the step */
    bgs_u32 reserved;   /* 0 (padding; keeps the struct a multiple of 8 bytes) */
};

/* Plan one step for `n` sequences. Returns the total tokens scheduled (>= 0) or a negative
 * BGS_SP_ERR_*; writes out[0..n). Deterministic: the same inputs give the same plan. */
BGS_STEP_POLICY_API int bgs_step_plan(const struct bgs_sp_limits *limits,
                                      const struct bgs_sp_seq *seqs, bgs_u32 n,
                                      struct bgs_sp_out *out);

/* Blocks needed to hold `tokens` tokens. */
BGS_STEP_POLICY_API bgs_u32 bgs_sp_blocks_for(bgs_u64 tokens, bgs_u32 block_size);

/* BGS_SP_ABI_VERSION and the struct sizes, for the host wrapper's layout check. */
BGS_STEP_POLICY_API bgs_u32 bgs_sp_abi(bgs_u32 *limits_size, bgs_u32 *seq_size,
                                       bgs_u32 *out_size);

#ifdef BGS_STEP_POLICY_IMPL

BGS_STEP_POLICY_API bgs_u32 bgs_sp_blocks_for(bgs_u64 tokens, bgs_u32 block_size) {
    if (block_size == 0u) {
        return 0u;
    }
    return (bgs_u32)((tokens + (bgs_u64)block_size - 1u) / (bgs_u64)block_size);
}

BGS_STEP_POLICY_API bgs_u32 bgs_sp_abi(bgs_u32 *limits_size, bgs_u32 *seq_size,
                                       bgs_u32 *out_size) {
    *limits_size = (bgs_u32)sizeof(struct bgs_sp_limits);
    *seq_size = (bgs_u32)sizeof(struct bgs_sp_seq);
    *out_size = (bgs_u32)sizeof(struct bgs_sp_out);
    return BGS_SP_ABI_VERSION;
}

BGS_STEP_POLICY_API int bgs_step_plan(const struct bgs_sp_limits *limits,
                                      const struct bgs_sp_seq *seqs, bgs_u32 n,
                                      struct bgs_sp_out *out) {
    const bgs_u32 bs = limits->block_size;
    bgs_u64 budget = limits->max_batched_tokens;
    bgs_u64 committed = 0u; /* unallocated reservations of running sequences */
    bgs_u64 uncommitted;
    bgs_u64 total = 0u;
    bgs_u32 running = 0u;
    bgs_u32 i;

    if (bs == 0u || limits->max_batched_tokens == 0u || limits->max_running == 0u) {
        return BGS_SP_ERR_LIMITS;
    }
    if (budget > 0x7fffffffu) {
        budget = 0x7fffffffu; /* the return value is an int */
    }

    /* Pass 0: validate, clear the outputs, count what running sequences still may claim. */
    for (i = 0u; i < n; i++) {
        const struct bgs_sp_seq *s = &seqs[i];
        out[i].admit = 0u;
        out[i].tokens = 0u;
        out[i].new_blocks = 0u;
        out[i].reserved = 0u;
        if (s->state == BGS_SP_WAITING) {
            continue;
        }
        if (s->state != BGS_SP_PREFILL && s->state != BGS_SP_DECODE) {
            return BGS_SP_ERR_STATE;
        }
        {
            bgs_u32 need = bgs_sp_blocks_for(s->reserve_tokens, bs);
            if (s->blocks_held > need) {
                return BGS_SP_ERR_RESERVE;
            }
            if (s->state == BGS_SP_DECODE && s->pos >= s->reserve_tokens) {
                return BGS_SP_ERR_RESERVE;
            }
            committed += (bgs_u64)(need - s->blocks_held);
        }
        running++;
    }
    if (committed > (bgs_u64)limits->free_blocks) {
        return BGS_SP_ERR_OVERCOMMIT;
    }
    uncommitted = (bgs_u64)limits->free_blocks - committed;

    /* Pass 1: one token for every ready decoder. */
    for (i = 0u; i < n && budget > 0u; i++) {
        const struct bgs_sp_seq *s = &seqs[i];
        if (s->state == BGS_SP_DECODE && s->ready != 0u) {
            out[i].tokens = 1u;
            budget -= 1u;
        }
    }

    /* Pass 2: prefill chunks (running sequences first, then admissions), FIFO. Running
     * sequences precede waiting ones in FIFO order, but the array may interleave them (a
     * sequence ahead ended): one pass in array order keeps FIFO over both. */
    for (i = 0u; i < n && budget > 0u; i++) {
        const struct bgs_sp_seq *s = &seqs[i];
        bgs_u64 chunk;
        if (s->ready == 0u) {
            if (s->state == BGS_SP_WAITING) {
                break; /* FIFO: nothing behind a waiting sequence may be admitted first */
            }
            continue;
        }
        if (s->state == BGS_SP_WAITING) {
            bgs_u64 need = bgs_sp_blocks_for(s->reserve_tokens, bs);
            if (running >= limits->max_running || need > uncommitted ||
                s->reserve_tokens < s->prompt_left || s->prompt_left == 0u) {
                break;
            }
            uncommitted -= need;
            running++;
            out[i].admit = 1u;
        } else if (s->state != BGS_SP_PREFILL || s->prompt_left == 0u) {
            continue;
        }
        chunk = s->prompt_left;
        if (chunk > budget) {
            chunk = budget;
        }
        /* Never past the reservation (defensive: an engine bug must not over-commit). */
        if ((bgs_u64)s->pos + chunk > (bgs_u64)s->reserve_tokens) {
            chunk = s->reserve_tokens > s->pos ? (bgs_u64)(s->reserve_tokens - s->pos) : 0u;
        }
        out[i].tokens = (bgs_u32)chunk;
        budget -= chunk;
    }

    /* Pass 3: blocks each scheduled sequence must add to cover [0, pos + tokens). */
    for (i = 0u; i < n; i++) {
        const struct bgs_sp_seq *s = &seqs[i];
        if (out[i].tokens != 0u) {
            bgs_u32 want = bgs_sp_blocks_for((bgs_u64)s->pos + out[i].tokens, bs);
            out[i].new_blocks = want > s->blocks_held ? want - s->blocks_held : 0u;
            total += out[i].tokens;
        }
    }
    return (int)total;
}

#endif /* BGS_STEP_POLICY_IMPL */

#ifdef __cplusplus
}
#endif

#endif /* BGS_STEP_POLICY_H */
