//! The GPU-resident generation step loop, host side (docs/gpu-model.md, "The resident step
//! loop"): [`GpuGenExecutor`] compiles the device dispatcher (`src/gen_loop.cu`, which runs
//! `include/bgs_gen_loop.h`), builds its two graphs, launches it once, and then only watches:
//! a monitor thread reads the control block, wakes the transport when frames were published,
//! and on a device error answers what is left with `Internal`.
//!
//! Everything the device and the host share is a `u64` word at an index defined here once
//! ([`layout`]) and rendered into the header the dispatcher includes ([`dispatch_header`]):
//! no struct is mirrored by hand.
//!
//! **Status**: written and compiled (NVRTC, clang) without a GPU; the device run
//! (`bench/gpu/step-loop.sh`) has not happened yet. See the docs for what it must check.

use std::ffi::{CString, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bgs_executor_gpu::{GpuError, compile, libs};
use bgs_llm::gen_loop::{CGenLoop, GlLimits, MAX_PROMPT};
use bgs_protocol::Status;
use bgs_ring::RingRegion;
use cudarc::driver::sys as cu;

use crate::host::{BUCKETS, StepGeometry};
use crate::model::{GpuModel, GpuModelError};

/// Word indices shared by `src/gen_loop.cu` and this module (all `u64`).
pub mod layout {
    /// Parameter words (device memory, written once by the host before the first launch).
    pub const PARAMS: &[(&str, usize)] = &[
        ("RING", P_RING),
        ("CTL", P_CTL),
        ("STATE", P_STATE),
        ("INPUTS", P_INPUTS),
        ("NEXT", P_NEXT),
        ("GEO", P_GEO),
        ("BODY", P_BODY),
        ("HEAD", P_HEAD),
        ("SELF", P_SELF),
        ("FINISH", P_FINISH),
        ("CREDIT", P_CREDIT),
        ("PUBLISHED", P_PUBLISHED),
        ("STREAM_FREE", P_STREAM_FREE),
        ("STREAM_NS", P_STREAM_NS),
        ("FRAMES", P_FRAMES),
        ("NEXT_BY_ITEM", P_NEXT_BY_ITEM),
        ("PAYLOAD", P_PAYLOAD),
        ("SCRATCH", P_SCRATCH),
        ("MAX_SEQS", P_MAX_SEQS),
        ("WINDOW", P_WINDOW),
        ("IDLE_ROUNDS", P_IDLE_ROUNDS),
        ("INTAKE", P_INTAKE),
        ("CHECK", P_CHECK),
        ("CTL_SHADOW", P_CTL_SHADOW),
        ("CHECK_SCRATCH", P_CHECK_SCRATCH),
    ];
    /// Mapped ring region (device address).
    pub const P_RING: usize = 0;
    /// Control block (mapped host memory, device address).
    pub const P_CTL: usize = 1;
    /// The loop state (`bgs_gl_state_bytes`).
    pub const P_STATE: usize = 2;
    /// The model's step-input buffer.
    pub const P_INPUTS: usize = 3;
    /// The model's sampled tokens (one per sampled row).
    pub const P_NEXT: usize = 4;
    /// `struct bgs_llm_step_geometry`.
    pub const P_GEO: usize = 5;
    /// `u64[BGS_LLM_STEP_N_BUCKETS]` body graph execs by bucket index (0: none).
    pub const P_BODY: usize = 6;
    /// `u64[BGS_LLM_STEP_N_BUCKETS]` LM-head graph execs by bucket index (0: none).
    pub const P_HEAD: usize = 7;
    /// The dispatcher's own graph exec.
    pub const P_SELF: usize = 8;
    /// The finish graph exec.
    pub const P_FINISH: usize = 9;
    /// `u32[max_seqs]` credit per table slot.
    pub const P_CREDIT: usize = 10;
    /// `u32[BGS_RING_MAX_STREAMS]` frames published per credit stream.
    pub const P_PUBLISHED: usize = 11;
    /// `u32[max_seqs]` free credit-stream indices (a stack; its top is `S_STREAM_TOP`).
    pub const P_STREAM_FREE: usize = 12;
    /// `u64[BGS_RING_MAX_STREAMS]` the request's `publish_ns` per credit stream.
    pub const P_STREAM_NS: usize = 13;
    /// `struct bgs_gl_frame[2 * max_seqs]`.
    pub const P_FRAMES: usize = 14;
    /// `u32[max_seqs]` sampled token per step item.
    pub const P_NEXT_BY_ITEM: usize = 15;
    /// `u32[BGS_RING_SLOT_WORDS]` the request payload being admitted / the echo reply.
    pub const P_PAYLOAD: usize = 16;
    /// The dispatcher's own words (`S_*`).
    pub const P_SCRATCH: usize = 17;
    /// Table slots (`limits.max_seqs`).
    pub const P_MAX_SEQS: usize = 18;
    /// Frames of one stream in flight at most.
    pub const P_WINDOW: usize = 19;
    /// Idle polling rounds before the dispatcher relaunches itself.
    pub const P_IDLE_ROUNDS: usize = 20;
    /// Request entries taken per round at most.
    pub const P_INTAKE: usize = 21;
    /// Nonzero: `bgs_gl_check` after every step (an engine bug stops the loop).
    pub const P_CHECK: usize = 22;
    /// `u64[C_WORDS]` device-memory copy of the control block's counters (the dispatcher
    /// never reads mapped host memory to count).
    pub const P_CTL_SHADOW: usize = 23;
    /// `u32[check_scratch_words]`: with `P_CHECK`, where the C functions' answers go to be
    /// compared with the lane-parallel ones (`gld_check_owed`, `gld_check_pack`).
    pub const P_CHECK_SCRATCH: usize = 24;
    /// Parameter words.
    pub const P_WORDS: usize = 25;

    /// Dispatcher words (device memory).
    pub const SCRATCH: &[(&str, usize)] = &[
        ("TAIL", S_TAIL),
        ("REQ_POS", S_REQ_POS),
        ("STREAM_TOP", S_STREAM_TOP),
        ("PEND", S_PEND),
        ("PEND_CONN", S_PEND_CONN),
        ("PEND_CONN_SEQ", S_PEND_CONN_SEQ),
        ("PEND_REQUEST_ID", S_PEND_REQUEST_ID),
        ("PEND_ROUTE", S_PEND_ROUTE),
        ("PEND_OP", S_PEND_OP),
        ("PEND_PUBLISH_NS", S_PEND_PUBLISH_NS),
        ("PEND_STATUS", S_PEND_STATUS),
        ("PEND_WORDS", S_PEND_WORDS),
        ("STEP_SAMPLES", S_STEP_SAMPLES),
        ("STEP_T0", S_STEP_T0),
    ];
    /// Next completion position (the dispatcher is the ring's only producer).
    pub const S_TAIL: usize = 0;
    /// Next request position to read.
    pub const S_REQ_POS: usize = 1;
    /// Free credit streams on the stack.
    pub const S_STREAM_TOP: usize = 2;
    /// 1: a one-shot answer waits for room in the completion ring.
    pub const S_PEND: usize = 3;
    /// Its fields.
    pub const S_PEND_CONN: usize = 4;
    /// .
    pub const S_PEND_CONN_SEQ: usize = 5;
    /// .
    pub const S_PEND_REQUEST_ID: usize = 6;
    /// .
    pub const S_PEND_ROUTE: usize = 7;
    /// .
    pub const S_PEND_OP: usize = 8;
    /// .
    pub const S_PEND_PUBLISH_NS: usize = 9;
    /// .
    pub const S_PEND_STATUS: usize = 10;
    /// .
    pub const S_PEND_WORDS: usize = 11;
    /// Sampled rows of the step in flight.
    pub const S_STEP_SAMPLES: usize = 12;
    /// globaltimer when the step was launched.
    pub const S_STEP_T0: usize = 13;
    /// Dispatcher words.
    pub const S_WORDS: usize = 16;

    /// Control block words (mapped host memory; the monitor reads them).
    pub const CTL: &[(&str, usize)] = &[
        ("STOP", C_STOP),
        ("STOPPED", C_STOPPED),
        ("ERROR", C_ERROR),
        ("ERROR_WHERE", C_ERROR_WHERE),
        ("EXECUTIONS", C_EXECUTIONS),
        ("STEPS", C_STEPS),
        ("STEP_TOKENS", C_STEP_TOKENS),
        ("SAMPLED", C_SAMPLED),
        ("ADMITTED", C_ADMITTED),
        ("REFUSED", C_REFUSED),
        ("ONESHOT", C_ONESHOT),
        ("CANCELS", C_CANCELS),
        ("CREDIT_STALLS", C_CREDIT_STALLS),
        ("RING_FULL", C_RING_FULL),
        ("FRAMES", C_FRAMES),
        ("LIVE", C_LIVE),
        ("FREE_BLOCKS", C_FREE_BLOCKS),
        ("HEARTBEAT_NS", C_HEARTBEAT_NS),
        ("POLICY_FAILED", C_POLICY_FAILED),
        ("PACK_FAILED", C_PACK_FAILED),
        ("CHECK", C_CHECK),
        ("REQUESTS", C_REQUESTS),
        ("STEP_NS", C_STEP_NS),
        ("PLAN_NS", C_PLAN_NS),
        ("FINISH_NS", C_FINISH_NS),
        ("CREDIT_WAITS", C_CREDIT_WAITS),
        ("RUNNING_SEEN", C_RUNNING_SEEN),
        ("PENDING_WAITS", C_PENDING_WAITS),
        ("WAITING_SEEN", C_WAITING_SEEN),
        ("ENDED_SEEN", C_ENDED_SEEN),
        ("LIVE_SEEN", C_LIVE_SEEN),
        ("REFUSED_NO_STREAM", C_REFUSED_NO_STREAM),
        ("ROUND_NS", C_ROUND_NS),
        ("PACK_NS", C_PACK_NS),
        ("PUBLISH_NS", C_PUBLISH_NS),
    ];
    /// Host → device: nonzero asks the dispatcher to stop (read with acquire, low 32 bits).
    pub const C_STOP: usize = 0;
    /// Device → host: the dispatcher returned without relaunching (release).
    pub const C_STOPPED: usize = 1;
    /// First error: a `cudaError_t` of a device launch, or an `E_*` code.
    pub const C_ERROR: usize = 2;
    /// Where it happened (`W_*`).
    pub const C_ERROR_WHERE: usize = 3;
    /// Dispatcher executions.
    pub const C_EXECUTIONS: usize = 4;
    /// Model steps finished.
    pub const C_STEPS: usize = 5;
    /// Input tokens of the steps launched.
    pub const C_STEP_TOKENS: usize = 6;
    /// Sampled rows.
    pub const C_SAMPLED: usize = 7;
    /// Generate requests admitted.
    pub const C_ADMITTED: usize = 8;
    /// Generate requests refused (answered at once with the status).
    pub const C_REFUSED: usize = 9;
    /// One-shot answers published (refusals, echo, rejections, unknown ops).
    pub const C_ONESHOT: usize = 10;
    /// Cancel markers taken.
    pub const C_CANCELS: usize = 11;
    /// Times a stream had frames owed and not enough credit.
    pub const C_CREDIT_STALLS: usize = 12;
    /// Times a publish found the completion ring full.
    pub const C_RING_FULL: usize = 13;
    /// Completion entries published.
    pub const C_FRAMES: usize = 14;
    /// Gauge: live sequences.
    pub const C_LIVE: usize = 15;
    /// Gauge: free KV blocks.
    pub const C_FREE_BLOCKS: usize = 16;
    /// globaltimer at the start of the last dispatcher execution.
    pub const C_HEARTBEAT_NS: usize = 17;
    /// Plans the policy rejected (an engine bug; the streams involved end with Internal and
    /// the loop goes on).
    pub const C_POLICY_FAILED: usize = 18;
    /// Steps that did not fit the geometry or had no graph.
    pub const C_PACK_FAILED: usize = 19;
    /// First nonzero `bgs_gl_check` result (`P_CHECK` on).
    pub const C_CHECK: usize = 20;
    /// Requests taken (cancel markers not counted).
    pub const C_REQUESTS: usize = 21;
    /// Sum over steps of launch-to-finish time, ns (globaltimer).
    pub const C_STEP_NS: usize = 22;
    /// Sum over steps of D's `bgs_gl_plan` time, ns.
    pub const C_PLAN_NS: usize = 23;
    /// Sum over steps of F's `bgs_gl_finish` (and check) time, ns.
    pub const C_FINISH_NS: usize = 24;
    /// Sum over launched steps of the running sequences the plan left out for want of credit
    /// (their readers had not acknowledged enough frames; `gld_census_of`).
    pub const C_CREDIT_WAITS: usize = 25;
    /// Sum over launched steps of the running sequences the plan saw.
    pub const C_RUNNING_SEEN: usize = 26;
    /// Sum over launched steps of the running sequences the plan left out because a token
    /// frame of theirs was still owed (not yet published).
    pub const C_PENDING_WAITS: usize = 27;
    /// Sum over launched steps of the sequences waiting for admission the plan saw.
    pub const C_WAITING_SEEN: usize = 28;
    /// Sum over launched steps of the ended sequences still in the table (final frame not
    /// yet published) the plan saw.
    pub const C_ENDED_SEEN: usize = 29;
    /// Sum over launched steps of the table's live count (`bgs_gl_live`) at plan time.
    pub const C_LIVE_SEEN: usize = 30;
    /// Generate requests refused busy because every credit stream was taken.
    pub const C_REFUSED_NO_STREAM: usize = 31;
    /// Sum over launched steps of D's round before planning (intake, credit, publishing
    /// what was owed, the census), ns.
    pub const C_ROUND_NS: usize = 32;
    /// Sum over steps of D's `bgs_gl_pack` time, ns.
    pub const C_PACK_NS: usize = 33;
    /// Sum over steps of F's publication of the step's frames, ns.
    pub const C_PUBLISH_NS: usize = 34;
    /// Control block words.
    pub const C_WORDS: usize = 35;

    /// Error codes of the loop itself (above every `cudaError_t`).
    pub const ERRORS: &[(&str, u64)] = &[
        ("STATE", E_STATE),
        ("POLICY", E_POLICY),
        ("NO_GRAPH", E_NO_GRAPH),
        ("CHECK", E_CHECK),
    ];
    /// The loop state lost its magic, or finish found no step.
    pub const E_STATE: u64 = 0x1_0001;
    /// Reserved: a policy failure is counted (`C_POLICY_FAILED`), not an error, because
    /// every recorded error stops the loop.
    pub const E_POLICY: u64 = 0x1_0002;
    /// No captured graph for a packed bucket.
    pub const E_NO_GRAPH: u64 = 0x1_0003;
    /// `bgs_gl_check` failed after a step.
    pub const E_CHECK: u64 = 0x1_0004;

    /// Where an error happened.
    pub const WHERES: &[(&str, u64)] = &[
        ("SELF", W_SELF),
        ("BODY", W_BODY),
        ("HEAD", W_HEAD),
        ("FINISH", W_FINISH),
        ("RELAUNCH", W_RELAUNCH),
        ("STATE", W_STATE),
        ("BUCKET", W_BUCKET),
        ("PLAN", W_PLAN),
        ("FINISH_STEP", W_FINISH_STEP),
        ("CHECK", W_CHECK),
        ("CHECK_OWED", W_CHECK_OWED),
        ("CHECK_PACK", W_CHECK_PACK),
        ("CHECK_ADMIT", W_CHECK_ADMIT),
        ("CHECK_VIEWS", W_CHECK_VIEWS),
        ("CHECK_PLAN", W_CHECK_PLAN),
    ];
    /// The dispatcher's idle self-relaunch.
    pub const W_SELF: u64 = 1;
    /// Tail launch of the body graph.
    pub const W_BODY: u64 = 2;
    /// Tail launch of the LM-head graph.
    pub const W_HEAD: u64 = 3;
    /// Tail launch of the finish graph.
    pub const W_FINISH: u64 = 4;
    /// The finish kernel's relaunch of the dispatcher.
    pub const W_RELAUNCH: u64 = 5;
    /// The dispatcher's state check.
    pub const W_STATE: u64 = 6;
    /// Bucket lookup.
    pub const W_BUCKET: u64 = 7;
    /// `bgs_gl_plan`.
    pub const W_PLAN: u64 = 8;
    /// `bgs_gl_finish`.
    pub const W_FINISH_STEP: u64 = 9;
    /// `bgs_gl_check`.
    pub const W_CHECK: u64 = 10;
    /// `P_CHECK`: the lane-parallel owed frames differ from `bgs_gl_owed`'s.
    pub const W_CHECK_OWED: u64 = 11;
    /// `P_CHECK`: the lane-parallel step inputs differ from `bgs_gl_pack`'s.
    pub const W_CHECK_PACK: u64 = 12;
    /// `P_CHECK`: the lane-parallel admission passes differ from `bgs_gl_admit`'s.
    pub const W_CHECK_ADMIT: u64 = 13;
    /// `P_CHECK`: the lane-parallel plan views differ from `bgs_gl_plan`'s.
    pub const W_CHECK_VIEWS: u64 = 14;
    /// `P_CHECK`: the lane-parallel policy decisions or step items differ from
    /// `bgs_step_plan`'s and `bgs_gl_plan`'s.
    pub const W_CHECK_PLAN: u64 = 15;

    /// Name of a `W_*` code.
    pub fn where_name(w: u64) -> &'static str {
        WHERES
            .iter()
            .find(|(_, v)| *v == w)
            .map_or("unknown place", |(n, _)| n)
    }
}

/// The header `src/gen_loop.cu` includes as `bgs_gen_dispatch.h`: every word index of
/// [`layout`], from the one definition here.
pub fn dispatch_header() -> String {
    use layout::*;
    let mut h = String::from(
        "/* bgs_gen_dispatch.h: GENERATED by bgs_model_gpu::gen_exec::dispatch_header from the\n \
         * Rust definitions (crates/model-gpu/src/gen_exec.rs); do not edit. */\n\
         #ifndef BGS_GEN_DISPATCH_H\n#define BGS_GEN_DISPATCH_H\n",
    );
    let mut put = |prefix: &str, list: &[(&str, u64)]| {
        for (n, v) in list {
            h.push_str(&format!("#define BGS_GLD_{prefix}{n} {v}ull\n"));
        }
    };
    fn widen(l: &[(&'static str, usize)]) -> Vec<(&'static str, u64)> {
        l.iter().map(|&(n, v)| (n, v as u64)).collect()
    }
    put("P_", &widen(PARAMS));
    put("S_", &widen(SCRATCH));
    put("C_", &widen(CTL));
    put("E_", ERRORS);
    put("W_", WHERES);
    put(
        "",
        &[
            ("P_WORDS", P_WORDS as u64),
            ("S_WORDS", S_WORDS as u64),
            ("C_WORDS", C_WORDS as u64),
        ],
    );
    h.push_str("#endif\n");
    h
}

/// The dispatcher's CUDA C++ source.
pub const DISPATCH_SOURCE: &str = include_str!("gen_loop.cu");
const GEN_LOOP_HEADER: &str = include_str!("../../../include/bgs_gen_loop.h");
const STEP_POLICY_HEADER: &str = include_str!("../../../include/bgs_step_policy.h");
const LLM_STEP_HEADER: &str = include_str!("../../../include/bgs_llm_step.h");

/// The headers the dispatcher includes, by name, for NVRTC.
pub fn dispatch_headers() -> Vec<(&'static str, String)> {
    vec![
        ("bgs_gen_loop.h", GEN_LOOP_HEADER.into()),
        ("bgs_step_policy.h", STEP_POLICY_HEADER.into()),
        ("bgs_llm_step.h", LLM_STEP_HEADER.into()),
        ("bgs_protocol.h", compile::PROTOCOL_HEADER.into()),
        ("bgs_ring.h", compile::RING_HEADER.into()),
        ("bgs_gen_dispatch.h", dispatch_header()),
    ]
}

/// NVRTC compile of the dispatcher (`-rdc=true`: it launches graphs; link the result with
/// `libcudadevrt.a`, see [`link_dispatcher`]).
pub fn compile_dispatcher(major: i32, minor: i32) -> Result<Vec<u8>, GpuError> {
    let headers = dispatch_headers();
    let refs: Vec<(&str, &str)> = headers.iter().map(|(n, t)| (*n, t.as_str())).collect();
    compile::nvrtc_compile_source(
        "gen_loop.cu",
        DISPATCH_SOURCE,
        &refs,
        &compile::nvrtc_options(major, minor),
    )
}

/// Link the dispatcher's relocatable cubin with the device runtime (nvJitLink at `nvjitlink`).
pub fn link_dispatcher(
    nvjitlink: &str,
    major: i32,
    minor: i32,
    cubin: &[u8],
    cudadevrt: &Path,
) -> Result<Vec<u8>, GpuError> {
    compile::nvjitlink(nvjitlink, &format!("sm_{major}{minor}"), cubin, cudadevrt)
}

/// The dispatcher's kernel cache key: a 128-bit hash of its source and headers, the NVRTC
/// options, the device name and the tool versions (`versions`).
pub fn dispatcher_cache_key(options: &[String], device: &str, versions: &str) -> String {
    let headers = dispatch_headers();
    let opts = options.join("\u{1}");
    let mut parts: Vec<&[u8]> = vec![b"bgs-gen-dispatch", DISPATCH_SOURCE.as_bytes()];
    for (n, t) in &headers {
        parts.push(n.as_bytes());
        parts.push(t.as_bytes());
    }
    parts.extend([opts.as_bytes(), device.as_bytes(), versions.as_bytes()]);
    format!(
        "gld-{:016x}{:016x}",
        compile::fnv1a(0xcbf2_9ce4_8422_2325, &parts),
        compile::fnv1a(0x6c62_272e_07bb_0142, &parts)
    )
}

/// Settings of the resident step loop.
#[derive(Debug, Clone)]
pub struct GenLoopConfig {
    /// Sequences running at once (`--slots`).
    pub slots: usize,
    /// Admitted requests beyond the slots (waiting for a slot or for blocks).
    pub max_waiting: usize,
    /// Token budget of one step (at least `slots`, at most the model's token bucket).
    pub max_batched_tokens: usize,
    /// Every request generates past EOS.
    pub ignore_eos: bool,
    /// Frames of one stream in flight at most (the CPU executor's `stream_window`).
    pub stream_window: u32,
    /// Request entries taken per dispatcher round at most.
    pub intake: u32,
    /// Idle rounds (with `__nanosleep` backoff up to 20 us) before the dispatcher relaunches
    /// itself; bounds an execution's length, not the reaction time.
    pub idle_rounds: u32,
    /// `bgs_gl_check` after every step (tests; costs a pass over the table).
    pub check: bool,
    /// The monitor's longest period between looks at the control block (it wakes the
    /// transport when frames were published) while sequences are live or frames flow; once
    /// it has learned the step period it sleeps through most of each step and looks every
    /// quarter of this around the step's end (`pacer`).
    pub monitor_poll: Duration,
    /// The monitor's period while nothing is live and no frame went out (an idle server's
    /// host cost); a new request's first frame comes after its prefill, by which time the
    /// monitor is back at `monitor_poll`.
    pub monitor_idle_poll: Duration,
    /// Where CUDA libraries live (nvJitLink, libcudadevrt.a).
    pub cuda_home: Option<PathBuf>,
    /// Kernel cache directory (else `$XDG_CACHE_HOME/bgs`, `~/.cache/bgs`).
    pub cache_dir: Option<PathBuf>,
}

impl Default for GenLoopConfig {
    fn default() -> Self {
        GenLoopConfig {
            slots: 16,
            max_waiting: 16,
            max_batched_tokens: 512,
            ignore_eos: false,
            stream_window: 16,
            intake: 32,
            idle_rounds: 4096,
            check: false,
            monitor_poll: Duration::from_micros(200),
            monitor_idle_poll: Duration::from_millis(1),
            cuda_home: None,
            cache_dir: None,
        }
    }
}

/// The loop's limits for a model of `geo`, `vocab` tokens, `max_positions` and `n_eos` EOS
/// ids; the message names the setting that does not fit.
pub fn gen_limits(
    cfg: &GenLoopConfig,
    geo: &StepGeometry,
    vocab: usize,
    max_positions: usize,
    n_eos: usize,
) -> Result<GlLimits, String> {
    let max_seqs = cfg.slots + cfg.max_waiting;
    let streams = bgs_ring::MAX_STREAMS;
    if cfg.slots == 0 {
        return Err("step loop: slots is 0".into());
    }
    if cfg.slots > geo.max_seqs {
        return Err(format!(
            "step loop: {} slots but the model's graphs hold {} sequences per step",
            cfg.slots, geo.max_seqs
        ));
    }
    if max_seqs > streams {
        return Err(format!(
            "step loop: slots + max_waiting = {max_seqs} exceeds the ring's {streams} credit streams"
        ));
    }
    if cfg.slots > geo.max_samples {
        return Err(format!(
            "step loop: {} slots but the model's LM head samples {} rows per step",
            cfg.slots, geo.max_samples
        ));
    }
    if cfg.max_batched_tokens < cfg.slots || cfg.max_batched_tokens > geo.max_tokens {
        return Err(format!(
            "step loop: max_batched_tokens {} must be between slots ({}) and the model's step \
             capacity ({} tokens)",
            cfg.max_batched_tokens, cfg.slots, geo.max_tokens
        ));
    }
    if cfg.stream_window < 2 {
        return Err(format!(
            "step loop: stream_window {} is below the 2 frames a step may owe",
            cfg.stream_window
        ));
    }
    if cfg.intake == 0 || cfg.idle_rounds == 0 {
        return Err("step loop: intake and idle_rounds must be at least 1".into());
    }
    let fits = |what: &str, v: usize| {
        u32::try_from(v).map_err(|_| format!("step loop: {what} {v} does not fit u32"))
    };
    Ok(GlLimits {
        block_size: fits("block_size", geo.block_size)?,
        num_blocks: fits("num_blocks", geo.num_blocks)?,
        max_seqs: fits("slots + max_waiting", max_seqs)?,
        max_running: fits("slots", cfg.slots)?,
        max_batched_tokens: fits("max_batched_tokens", cfg.max_batched_tokens)?,
        max_prompt: MAX_PROMPT,
        vocab_size: fits("vocab_size", vocab)?,
        max_positions: fits("max positions", max_positions)?,
        max_eos: fits("EOS ids", n_eos)?,
        ignore_eos: u32::from(cfg.ignore_eos),
    })
}

/// Credit of a stream with `published` frames out and `acked` acknowledged: what the
/// dispatcher's `gld_credit` computes (the same wrap rule as the CPU executor: more acks than
/// frames reads as nothing in flight).
pub fn credit(window: u32, published: u32, acked: u32) -> u32 {
    let d = published.wrapping_sub(acked);
    let d = if d > i32::MAX as u32 { 0 } else { d };
    window.saturating_sub(d)
}

/// Counters of the control block.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GenLoopStats {
    /// Dispatcher executions.
    pub executions: u64,
    /// Model steps finished.
    pub steps: u64,
    /// Input tokens of the steps.
    pub step_tokens: u64,
    /// Sampled rows.
    pub sampled: u64,
    /// Requests taken.
    pub requests: u64,
    /// Generate requests admitted.
    pub admitted: u64,
    /// Generate requests refused.
    pub refused: u64,
    /// One-shot answers published.
    pub oneshot: u64,
    /// Cancel markers.
    pub cancels: u64,
    /// Credit stalls.
    pub credit_stalls: u64,
    /// Completion ring full.
    pub ring_full: u64,
    /// Completion entries published.
    pub frames: u64,
    /// Live sequences (gauge).
    pub live: u64,
    /// Free KV blocks (gauge).
    pub free_blocks: u64,
    /// Policy failures.
    pub policy_failed: u64,
    /// Steps that could not be packed or launched.
    pub pack_failed: u64,
    /// Mean launch-to-finish time of a step, ns (0 before the first).
    pub mean_step_ns: u64,
    /// Mean time D spent planning and packing a step, ns.
    pub mean_plan_ns: u64,
    /// Mean time F spent advancing the sequences and publishing a step's frames, ns.
    pub mean_finish_ns: u64,
    /// Mean of D's round before planning over launched steps (intake, credit, owed frames,
    /// census), ns.
    pub mean_round_ns: u64,
    /// Mean `bgs_gl_pack` time per step, ns.
    pub mean_pack_ns: u64,
    /// Mean time F spends publishing a step's frames, ns.
    pub mean_publish_ns: u64,
    /// Running sequences left out of a step for want of credit, summed over steps.
    pub credit_waits: u64,
    /// Running sequences the plans saw, summed over steps (over `steps`: the mean a step
    /// could have carried).
    pub running_seen: u64,
    /// Running sequences left out of a step because a token frame was still owed, summed
    /// over steps.
    pub pending_waits: u64,
    /// Sequences waiting for admission, summed over steps.
    pub waiting_seen: u64,
    /// Ended sequences still holding a table slot (final frame not yet out), summed over
    /// steps.
    pub ended_seen: u64,
    /// The table's live count at plan time, summed over steps.
    pub live_seen: u64,
    /// Requests refused busy because every credit stream was taken.
    pub refused_no_stream: u64,
    /// Looks of the host monitor at the control block (its host cost is about one wake-up
    /// each; `crate::pacer`). Not a device word: 0 from `from_ctl`, filled by the executor.
    pub monitor_looks: u64,
}

impl GenLoopStats {
    /// The counters of a control block's words.
    pub fn from_ctl(w: &[u64]) -> GenLoopStats {
        use layout::*;
        let steps = w[C_STEPS];
        GenLoopStats {
            executions: w[C_EXECUTIONS],
            steps,
            step_tokens: w[C_STEP_TOKENS],
            sampled: w[C_SAMPLED],
            requests: w[C_REQUESTS],
            admitted: w[C_ADMITTED],
            refused: w[C_REFUSED],
            oneshot: w[C_ONESHOT],
            cancels: w[C_CANCELS],
            credit_stalls: w[C_CREDIT_STALLS],
            ring_full: w[C_RING_FULL],
            frames: w[C_FRAMES],
            live: w[C_LIVE],
            free_blocks: w[C_FREE_BLOCKS],
            policy_failed: w[C_POLICY_FAILED],
            pack_failed: w[C_PACK_FAILED],
            mean_step_ns: w[C_STEP_NS].checked_div(steps).unwrap_or(0),
            mean_plan_ns: w[C_PLAN_NS].checked_div(steps).unwrap_or(0),
            mean_finish_ns: w[C_FINISH_NS].checked_div(steps).unwrap_or(0),
            mean_round_ns: w[C_ROUND_NS].checked_div(steps).unwrap_or(0),
            mean_pack_ns: w[C_PACK_NS].checked_div(steps).unwrap_or(0),
            mean_publish_ns: w[C_PUBLISH_NS].checked_div(steps).unwrap_or(0),
            credit_waits: w[C_CREDIT_WAITS],
            running_seen: w[C_RUNNING_SEEN],
            pending_waits: w[C_PENDING_WAITS],
            waiting_seen: w[C_WAITING_SEEN],
            ended_seen: w[C_ENDED_SEEN],
            live_seen: w[C_LIVE_SEEN],
            refused_no_stream: w[C_REFUSED_NO_STREAM],
            monitor_looks: 0,
        }
    }
}

/// One line for the control block's error word.
pub fn describe_error(err: u64, at: u64) -> String {
    use layout::*;
    let what = match ERRORS.iter().find(|(_, v)| *v == err) {
        Some((n, _)) => format!("step loop error {n}"),
        None => format!("device graph launch failed with cudaError {err}"),
    };
    format!("{what} at {}", where_name(at))
}

/// Words of `include/bgs_gen_loop.h` the failure path reads from a copy of the device state
/// (header word offsets and sequence record fields); `tests::state_words_match_the_header`
/// checks them against the header's text.
mod gl {
    pub const H_MAGIC: usize = 0;
    pub const H_MAX_SEQS: usize = 4;
    pub const H_SEQ_WORDS: usize = 13;
    pub const H_SEQ_AT: usize = 23;
    pub const S_LIVE: usize = 0;
    pub const S_STREAM: usize = 1;
    pub const S_CONN_LO: usize = 2;
    pub const S_CONN_HI: usize = 3;
    pub const S_CONN_SEQ: usize = 4;
    pub const S_REQUEST_ID: usize = 5;
    pub const S_ROUTE: usize = 6;
    pub const S_EMITTED: usize = 13;
    pub const MAGIC: u32 = 0x4c47_4742;
}

/// The final `Internal` frame owed by each live sequence of a loop state (the failure path):
/// (conn, conn_seq, request_id, route, credit stream, token frames published).
pub fn live_sequences(state: &[u32]) -> Vec<(u64, u32, u32, u32, u32, u32)> {
    if state.len() < 32 || state[gl::H_MAGIC] != gl::MAGIC {
        return Vec::new();
    }
    let (n, stride, at) = (
        state[gl::H_MAX_SEQS] as usize,
        state[gl::H_SEQ_WORDS] as usize,
        state[gl::H_SEQ_AT] as usize,
    );
    (0..n)
        .filter_map(|k| state.get(at + k * stride..at + k * stride + gl::S_EMITTED + 1))
        .filter(|s| s[gl::S_LIVE] != 0)
        .map(|s| {
            (
                u64::from(s[gl::S_CONN_LO]) | (u64::from(s[gl::S_CONN_HI]) << 32),
                s[gl::S_CONN_SEQ],
                s[gl::S_REQUEST_ID],
                s[gl::S_ROUTE],
                s[gl::S_STREAM],
                s[gl::S_EMITTED],
            )
        })
        .collect()
}

fn ck(r: cu::CUresult, what: &str) -> Result<(), GpuError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            what: what.to_string(),
            name: format!("{r:?}"),
        })
    }
}

const HOST_FLAGS: u32 = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
const REGISTER_FLAGS: u32 = cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_DEVICEMAP;
/// `CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`.
const DEVICE_LAUNCH_FLAG: u64 = 4;

/// Raw device resources of the loop (freed in `Device::free`).
struct Device {
    ctx: cu::CUcontext,
    module: cu::CUmodule,
    stream: cu::CUstream,
    allocs: Vec<u64>,
    ctl_host: *mut u64,
    region_host: *mut c_void,
    graphs: Vec<cu::CUgraph>,
    execs: Vec<cu::CUgraphExec>,
    state_dev: u64,
    state_bytes: usize,
}

// SAFETY: the handles and pointers are owned by the executor; every use makes the context
// current first; the control block is only accessed through atomics (`ctl`).
unsafe impl Send for Device {}
// SAFETY: as above; shared use is read-only atomics on the control block.
unsafe impl Sync for Device {}

impl Device {
    fn current(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the model's live context.
        ck(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    fn ctl(&self, w: usize) -> &AtomicU64 {
        assert!(w < layout::C_WORDS);
        // SAFETY: `ctl_host` is C_WORDS aligned u64 of pinned memory living as long as `self`;
        // the device writes it with system-scope atomics / aligned stores.
        unsafe { AtomicU64::from_ptr(self.ctl_host.add(w)) }
    }

    fn ctl_words(&self) -> Vec<u64> {
        (0..layout::C_WORDS)
            .map(|w| self.ctl(w).load(Ordering::Acquire))
            .collect()
    }

    fn alloc(&mut self, bytes: usize, what: &str) -> Result<u64, GpuError> {
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: the context is current; out-pointer valid.
        unsafe {
            ck(cu::cuMemAlloc_v2(&mut p, bytes.max(4)), what)?;
            self.allocs.push(p);
            ck(cu::cuMemsetD8_v2(p, 0, bytes.max(4)), what)?;
        }
        Ok(p)
    }

    fn upload<T: Copy>(&self, dst: u64, src: &[T], what: &str) -> Result<(), GpuError> {
        // SAFETY: `dst` was allocated with at least size_of_val(src) bytes (callers); `src` is
        // plain data.
        ck(
            unsafe { cu::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), size_of_val(src)) },
            what,
        )
    }

    /// A graph of one launch of `f` (`threads` threads, argument: the parameter block),
    /// instantiated for device launch and uploaded.
    fn kernel_graph(
        &mut self,
        f: cu::CUfunction,
        threads: u32,
        params: u64,
        what: &str,
    ) -> Result<cu::CUgraphExec, GpuError> {
        let mut g: cu::CUgraph = std::ptr::null_mut();
        let mut arg = params;
        let mut args = [(&mut arg as *mut u64).cast::<c_void>()];
        // SAFETY: `stream` is live in the current context; the kernel takes one pointer
        // argument, which `args` holds; capture ends before anything else uses the stream.
        unsafe {
            ck(
                cu::cuStreamBeginCapture_v2(
                    self.stream,
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                &format!("cuStreamBeginCapture ({what})"),
            )?;
            let launched = ck(
                cu::cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    self.stream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                &format!("cuLaunchKernel ({what})"),
            );
            let end = ck(
                cu::cuStreamEndCapture(self.stream, &mut g),
                &format!("cuStreamEndCapture ({what})"),
            );
            launched?;
            end?;
            self.graphs.push(g);
            let mut e: cu::CUgraphExec = std::ptr::null_mut();
            ck(
                cu::cuGraphInstantiateWithFlags(&mut e, g, DEVICE_LAUNCH_FLAG),
                &format!("cuGraphInstantiateWithFlags(DEVICE_LAUNCH) of {what}"),
            )?;
            self.execs.push(e);
            ck(
                cu::cuGraphUpload(e, self.stream),
                &format!("cuGraphUpload of {what}"),
            )?;
            Ok(e)
        }
    }

    /// A copy of the loop state, when the context still answers.
    fn read_state(&self) -> Option<Vec<u32>> {
        self.current().ok()?;
        let mut v = vec![0u32; self.state_bytes / 4];
        // SAFETY: `state_dev` holds `state_bytes` bytes; `v` as many.
        let r = unsafe { cu::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.state_dev, v.len() * 4) };
        (r == cu::CUresult::CUDA_SUCCESS).then_some(v)
    }

    /// Whether the launched work (the dispatcher and everything it tail-launched) ended.
    fn idle(&self) -> bool {
        // SAFETY: `stream` is live.
        unsafe { cu::cuStreamQuery(self.stream) != cu::CUresult::CUDA_ERROR_NOT_READY }
    }

    fn free(&mut self) {
        if self.current().is_err() {
            return;
        }
        // SAFETY: every handle below was created by this executor in this context and is
        // destroyed once (the vectors are drained); the device no longer runs the loop
        // (stopped, or the context failed).
        unsafe {
            for e in self.execs.drain(..) {
                let _ = cu::cuGraphExecDestroy(e);
            }
            for g in self.graphs.drain(..) {
                let _ = cu::cuGraphDestroy(g);
            }
            for p in self.allocs.drain(..) {
                let _ = cu::cuMemFree_v2(p);
            }
            if !self.ctl_host.is_null() {
                let _ = cu::cuMemFreeHost(self.ctl_host.cast());
                self.ctl_host = std::ptr::null_mut();
            }
            if !self.region_host.is_null() {
                let _ = cu::cuMemHostUnregister(self.region_host);
                self.region_host = std::ptr::null_mut();
            }
            if !self.module.is_null() {
                let _ = cu::cuModuleUnload(self.module);
                self.module = std::ptr::null_mut();
            }
            if !self.stream.is_null() {
                let _ = cu::cuStreamDestroy_v2(self.stream);
                self.stream = std::ptr::null_mut();
            }
        }
    }
}

/// Why the step loop could not start or failed; one line naming the problem.
#[derive(Debug, thiserror::Error)]
pub enum GpuGenError {
    /// The model or a CUDA call / library.
    #[error(transparent)]
    Model(#[from] GpuModelError),
    /// A CUDA call, library or the kernel build.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// Invalid settings.
    #[error("invalid step loop settings: {0}")]
    Config(String),
    /// The device loop failed while running.
    #[error("GPU step loop failed: {0}")]
    Failed(String),
}

struct Shared {
    dev: Device,
    region: Arc<RingRegion>,
    stop: AtomicBool,
    failed: std::sync::Mutex<Option<String>>,
    waker: Option<Arc<dyn Fn() + Send + Sync>>,
    poll: Duration,
    idle_poll: Duration,
    /// The monitor's looks at the control block.
    looks: AtomicU64,
}

/// The GPU-resident step loop over one ring region (see the module docs).
pub struct GpuGenExecutor {
    shared: Arc<Shared>,
    monitor: Option<std::thread::JoinHandle<()>>,
    model: Option<GpuModel>,
    done: bool,
}

impl std::fmt::Debug for GpuGenExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuGenExecutor")
            .field("stats", &self.stats())
            .field("error", &self.error())
            .finish()
    }
}

impl GpuGenExecutor {
    /// Compile and load the dispatcher into `model`'s context (built with
    /// `GpuModelOptions::device_launch`), lay out the loop state for `cfg`, register `region`,
    /// build the dispatcher and finish graphs, and launch the dispatcher. From then on the
    /// device serves `region`'s request ring alone; `waker` (the transport's, if it cannot be
    /// woken through the completion ring's futex) is called when frames were published.
    pub fn start(
        model: GpuModel,
        region: Arc<RingRegion>,
        cfg: &GenLoopConfig,
        waker: Option<Arc<dyn Fn() + Send + Sync>>,
    ) -> Result<GpuGenExecutor, GpuGenError> {
        let h = model.device_handles()?;
        let geo = h.geometry;
        let limits = gen_limits(
            cfg,
            &geo,
            bgs_llm::StepModel::vocab_size(&model),
            model.max_positions(),
            bgs_llm::StepModel::eos_ids(&model).len(),
        )
        .map_err(GpuGenError::Config)?;
        let core = CGenLoop::new(limits, bgs_llm::StepModel::eos_ids(&model))
            .map_err(GpuGenError::Config)?;
        let cgeo = crate::c_header::c_geometry(&geo).map_err(GpuGenError::Config)?;
        let (major, minor) = model.device().1;

        // nvJitLink and the device runtime (the model loaded NVRTC already).
        let env_home = std::env::var("CUDA_HOME").ok();
        let dirs = libs::search_dirs(cfg.cuda_home.as_deref(), env_home.as_deref());
        let nvjitlink = libs::load(&libs::NVJITLINK, &dirs)?;
        let cudadevrt = libs::find_cudadevrt(&dirs, "")?;
        let versions = format!(
            "nvrtc {} nvjitlink {nvjitlink} cudadevrt {}",
            compile::nvrtc_version()?,
            cudadevrt.display()
        );
        let key = dispatcher_cache_key(
            &compile::nvrtc_options(major, minor),
            model.device().0,
            &versions,
        );
        let dir = compile::cache_dir(cfg.cache_dir.as_deref());
        let cubin = match dir.as_deref().and_then(|d| compile::cache_read(d, &key)) {
            Some(c) => c,
            None => {
                let obj = compile_dispatcher(major, minor)?;
                let c = link_dispatcher(&nvjitlink, major, minor, &obj, &cudadevrt)?;
                if let Some(d) = dir.as_deref() {
                    compile::cache_write(d, &key, &c);
                }
                c
            }
        };

        let mut dev = Device {
            ctx: model.context(),
            module: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            allocs: Vec::new(),
            ctl_host: std::ptr::null_mut(),
            region_host: std::ptr::null_mut(),
            graphs: Vec::new(),
            execs: Vec::new(),
            state_dev: 0,
            state_bytes: core.state().len() * 4,
        };
        match Self::build(&mut dev, &h, &core, &cgeo, &limits, &region, cfg, &cubin) {
            Ok(()) => {}
            Err(e) => {
                dev.free();
                return Err(e);
            }
        }
        let shared = Arc::new(Shared {
            dev,
            region,
            stop: AtomicBool::new(false),
            failed: std::sync::Mutex::new(None),
            waker,
            poll: cfg.monitor_poll,
            idle_poll: cfg.monitor_idle_poll.max(cfg.monitor_poll),
            looks: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let monitor = std::thread::Builder::new()
            .name("bgs-gen-monitor".into())
            .spawn(move || monitor(&sh))
            .map_err(|e| GpuGenError::Failed(format!("spawning the monitor thread: {e}")))?;
        tracing::info!(
            slots = cfg.slots,
            max_seqs = limits.max_seqs,
            blocks = limits.num_blocks,
            "GPU-resident step loop started"
        );
        Ok(GpuGenExecutor {
            shared,
            monitor: Some(monitor),
            model: Some(model),
            done: false,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        d: &mut Device,
        h: &crate::model::DeviceHandles,
        core: &CGenLoop,
        cgeo: &bgs_llm::gen_loop::CStepGeometry,
        limits: &GlLimits,
        region: &Arc<RingRegion>,
        cfg: &GenLoopConfig,
        cubin: &[u8],
    ) -> Result<(), GpuGenError> {
        use layout::*;
        d.current()?;
        ck(
            // SAFETY: `cubin` is a complete linked cubin; out-pointer valid.
            unsafe { cu::cuModuleLoadData(&mut d.module, cubin.as_ptr().cast()) },
            "cuModuleLoadData(step loop)",
        )?;
        let f_dispatch = function(d.module, "bgs_gld_dispatch")?;
        let f_finish = function(d.module, "bgs_gld_finish")?;
        ck(
            // SAFETY: out-pointer valid; the context is current.
            unsafe { cu::cuStreamCreate(&mut d.stream, 1) },
            "cuStreamCreate(step loop)",
        )?;
        // The rings, mapped for the device.
        // SAFETY: the region is `len` bytes of page-aligned memory that `Shared` keeps alive
        // for the executor's lifetime; unregistered in `free`.
        unsafe {
            ck(
                cu::cuMemHostRegister_v2(region.as_ptr().cast(), region.len(), REGISTER_FLAGS),
                "cuMemHostRegister(ring region)",
            )?;
        }
        d.region_host = region.as_ptr().cast();
        let mut region_dev: u64 = 0;
        ck(
            // SAFETY: registered with DEVICEMAP above.
            unsafe { cu::cuMemHostGetDevicePointer_v2(&mut region_dev, d.region_host, 0) },
            "cuMemHostGetDevicePointer(ring region)",
        )?;
        let mut ctl: *mut c_void = std::ptr::null_mut();
        let mut ctl_dev: u64 = 0;
        // SAFETY: context current; out-pointers valid; zeroed before the device reads it.
        unsafe {
            ck(
                cu::cuMemHostAlloc(&mut ctl, C_WORDS * 8, HOST_FLAGS),
                "cuMemHostAlloc(step loop control)",
            )?;
            std::ptr::write_bytes(ctl.cast::<u8>(), 0, C_WORDS * 8);
            d.ctl_host = ctl.cast();
            ck(
                cu::cuMemHostGetDevicePointer_v2(&mut ctl_dev, ctl, 0),
                "cuMemHostGetDevicePointer(step loop control)",
            )?;
        }

        let max_seqs = limits.max_seqs as usize;
        let streams = bgs_ring::MAX_STREAMS;
        let nb = BUCKETS.len();
        d.state_dev = d.alloc(d.state_bytes, "cuMemAlloc(step loop state)")?;
        let params = d.alloc(P_WORDS * 8, "cuMemAlloc(step loop params)")?;
        let scratch = d.alloc(S_WORDS * 8, "cuMemAlloc(step loop words)")?;
        let geo_dev = d.alloc(size_of_val(cgeo), "cuMemAlloc(geometry)")?;
        let body = d.alloc(nb * 8, "cuMemAlloc(body graphs)")?;
        let head = d.alloc(nb * 8, "cuMemAlloc(head graphs)")?;
        let credit = d.alloc(max_seqs * 4, "cuMemAlloc(credit)")?;
        let published = d.alloc(streams * 4, "cuMemAlloc(published)")?;
        let stream_free = d.alloc(max_seqs * 4, "cuMemAlloc(free streams)")?;
        let stream_ns = d.alloc(streams * 8, "cuMemAlloc(stream publish_ns)")?;
        let frames = d.alloc(
            2 * max_seqs * size_of::<bgs_llm::gen_loop::GlFrame>(),
            "cuMemAlloc(frames)",
        )?;
        let next_by_item = d.alloc(max_seqs * 4, "cuMemAlloc(next by item)")?;
        let payload = d.alloc(bgs_ring::SLOT_WORDS * 4, "cuMemAlloc(payload)")?;
        let shadow = d.alloc(C_WORDS * 8, "cuMemAlloc(control shadow)")?;
        // The larger of the owed frames and the step-input words (the policy's decisions,
        // 4 words a sequence, are fewer than the owed frames' words).
        let check_words =
            (2 * max_seqs * size_of::<bgs_llm::gen_loop::GlFrame>() / 4).max(h.geometry.words());
        let check_scratch = d.alloc(check_words * 4, "cuMemAlloc(check scratch)")?;

        d.upload(d.state_dev, core.state(), "cuMemcpyHtoD(step loop state)")?;
        d.upload(
            geo_dev,
            std::slice::from_ref(cgeo),
            "cuMemcpyHtoD(geometry)",
        )?;
        let table = |list: &[(usize, u64)]| {
            BUCKETS
                .iter()
                .map(|b| list.iter().find(|(x, _)| x == b).map_or(0, |&(_, e)| e))
                .collect::<Vec<u64>>()
        };
        d.upload(body, &table(&h.body), "cuMemcpyHtoD(body graphs)")?;
        d.upload(head, &table(&h.head), "cuMemcpyHtoD(head graphs)")?;
        // A region used before has moved counters: start level with them (nothing in flight).
        let acks: Vec<u32> = region
            .stream_acks()
            .iter()
            .map(|a| a.load(Ordering::Acquire))
            .collect();
        d.upload(published, &acks, "cuMemcpyHtoD(published)")?;
        let free: Vec<u32> = (0..limits.max_seqs).rev().collect();
        d.upload(stream_free, &free, "cuMemcpyHtoD(free streams)")?;
        let hdr = region.as_ptr().cast::<bgs_ring::RegionHeader>();
        // SAFETY: the region starts with its header; the counters are only accessed
        // atomically by every party.
        let (req_head, comp_tail) = unsafe {
            (
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*hdr).request_head))
                    .load(Ordering::Acquire),
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*hdr).completion_tail))
                    .load(Ordering::Acquire),
            )
        };
        let mut s = [0u64; S_WORDS];
        s[S_TAIL] = comp_tail;
        s[S_REQ_POS] = req_head;
        s[S_STREAM_TOP] = u64::from(limits.max_seqs);
        d.upload(scratch, &s, "cuMemcpyHtoD(step loop words)")?;

        let mut p = [0u64; P_WORDS];
        p[P_RING] = region_dev;
        p[P_CTL] = ctl_dev;
        p[P_STATE] = d.state_dev;
        p[P_INPUTS] = h.inputs;
        p[P_NEXT] = h.next;
        p[P_GEO] = geo_dev;
        p[P_BODY] = body;
        p[P_HEAD] = head;
        p[P_CREDIT] = credit;
        p[P_PUBLISHED] = published;
        p[P_STREAM_FREE] = stream_free;
        p[P_STREAM_NS] = stream_ns;
        p[P_FRAMES] = frames;
        p[P_NEXT_BY_ITEM] = next_by_item;
        p[P_PAYLOAD] = payload;
        p[P_SCRATCH] = scratch;
        p[P_MAX_SEQS] = u64::from(limits.max_seqs);
        p[P_WINDOW] = u64::from(cfg.stream_window);
        p[P_IDLE_ROUNDS] = u64::from(cfg.idle_rounds);
        p[P_INTAKE] = u64::from(cfg.intake);
        p[P_CHECK] = u64::from(cfg.check);
        p[P_CTL_SHADOW] = shadow;
        p[P_CHECK_SCRATCH] = check_scratch;
        let e_dispatch = d.kernel_graph(f_dispatch, 32, params, "step loop dispatcher")?;
        let e_finish = d.kernel_graph(f_finish, 32, params, "step loop finish")?;
        p[P_SELF] = e_dispatch as u64;
        p[P_FINISH] = e_finish as u64;
        d.upload(params, &p, "cuMemcpyHtoD(step loop params)")?;
        // SAFETY: the context is current; everything the kernels read is in place.
        unsafe {
            ck(cu::cuCtxSynchronize(), "step loop set-up")?;
            // The one host launch: from here on the graphs launch one another.
            ck(
                cu::cuGraphLaunch(e_dispatch, d.stream),
                "cuGraphLaunch(step loop dispatcher)",
            )?;
        }
        Ok(())
    }

    /// The control block's counters now.
    pub fn stats(&self) -> GenLoopStats {
        GenLoopStats {
            monitor_looks: self.shared.looks.load(Ordering::Relaxed),
            ..GenLoopStats::from_ctl(&self.shared.dev.ctl_words())
        }
    }

    /// The failure, if the device loop failed.
    pub fn error(&self) -> Option<String> {
        self.shared.failed.lock().ok().and_then(|g| g.clone())
    }

    /// Stop the loop (it finishes the step in flight), give the model back, and return the
    /// final counters; an error when the device failed or did not stop within 5 s.
    pub fn shutdown(mut self) -> Result<(GpuModel, GenLoopStats), GpuGenError> {
        let r = self.stop();
        let model = self.model.take().expect("the model is held until shutdown");
        r.map(|s| (model, s))
    }

    fn stop(&mut self) -> Result<GenLoopStats, GpuGenError> {
        self.done = true;
        let sh = &self.shared;
        // The stream queries below need the context on this thread (it may not be the one
        // that started the executor).
        let _ = sh.dev.current();
        sh.dev.ctl(layout::C_STOP).store(1, Ordering::Release);
        let t0 = Instant::now();
        // `stopped`: the device work ended (asked to stop, or after a failure: every recorded
        // error ends the loop), so its memory can be freed.
        let mut stopped = false;
        while t0.elapsed() < Duration::from_secs(5) {
            let asked = sh.dev.ctl(layout::C_STOPPED).load(Ordering::Acquire) != 0;
            let failed = sh.failed.lock().map(|g| g.is_some()).unwrap_or(true);
            if (asked || failed) && sh.dev.idle() {
                stopped = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        sh.stop.store(true, Ordering::Release);
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        let stats = self.stats();
        let failed = self.error();
        if stopped {
            // The loop no longer runs: the resources can go.
            if let Some(sh) = Arc::get_mut(&mut self.shared) {
                sh.dev.free();
            }
        }
        match (failed, stopped) {
            (Some(e), _) => Err(GpuGenError::Failed(e)),
            (None, false) => Err(GpuGenError::Failed(
                "the device dispatcher did not stop within 5 s (resources left allocated)".into(),
            )),
            (None, true) => Ok(stats),
        }
    }
}

impl Drop for GpuGenExecutor {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.stop();
        }
    }
}

fn function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction, GpuError> {
    let c = CString::new(name).map_err(|e| GpuError::Compile(e.to_string()))?;
    let mut f: cu::CUfunction = std::ptr::null_mut();
    ck(
        // SAFETY: `module` is loaded; `c` is NUL-terminated; out-pointer valid.
        unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    Ok(f)
}

/// Watch the control block: wake the transport when frames went out; on a device error (a
/// recorded one, or the stream's), answer what is left with `Internal`.
/// How often the step loop's monitor asks the driver whether the loop's stream still runs
/// (a broken launch chain that recorded no error); the error word it reads on every look.
const STREAM_QUERY_PERIOD: Duration = Duration::from_millis(100);

/// How often the monitor logs the loop's counters at debug level.
const TIMELINE_PERIOD: Duration = Duration::from_millis(100);

fn monitor(sh: &Shared) {
    if let Err(e) = sh.dev.current() {
        tracing::error!(error = %e, "step loop monitor: no context");
    }
    let mut frames = 0u64;
    // The pacer's fine looks are 50 us apart: the default 50 us timer slack would double them.
    if let Err(e) = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(5_000)) {
        tracing::debug!(error = %e, "step loop monitor: timer slack left at its default");
    }
    let mut pacer = crate::pacer::StepPacer::new(sh.poll, sh.idle_poll);
    let mut last_query = Instant::now();
    let mut sleep = sh.poll;
    // A timeline of the loop's counters (debug level: how the table fills and drains under
    // load, which the shutdown totals average away).
    let timeline = tracing::enabled!(tracing::Level::DEBUG);
    let mut last_line = (Instant::now(), [0u64; 12]);
    while !sh.stop.load(Ordering::Acquire) {
        std::thread::sleep(sleep);
        sh.looks.fetch_add(1, Ordering::Relaxed);
        if timeline && last_line.0.elapsed() >= TIMELINE_PERIOD {
            let w = |i| sh.dev.ctl(i).load(Ordering::Acquire);
            let now = [
                w(layout::C_STEPS),
                w(layout::C_STEP_TOKENS),
                w(layout::C_ADMITTED),
                w(layout::C_REFUSED),
                w(layout::C_REFUSED_NO_STREAM),
                w(layout::C_FRAMES),
                w(layout::C_ROUND_NS),
                w(layout::C_PLAN_NS),
                w(layout::C_PACK_NS),
                w(layout::C_STEP_NS),
                w(layout::C_FINISH_NS),
                w(layout::C_PUBLISH_NS),
            ];
            let d: Vec<u64> = now.iter().zip(&last_line.1).map(|(a, b)| a - b).collect();
            // Each phase's mean over the period's steps, in microseconds.
            let us = |i: usize| d[i].checked_div(d[0] * 1000).unwrap_or(0);
            tracing::debug!(
                steps = d[0],
                tokens = d[1],
                admitted = d[2],
                refused = d[3],
                refused_no_stream = d[4],
                frames = d[5],
                round_us = us(6),
                plan_us = us(7),
                pack_us = us(8),
                graphs_us = us(9),
                finish_us = us(10),
                publish_us = us(11),
                live = w(layout::C_LIVE),
                free_blocks = w(layout::C_FREE_BLOCKS),
                "step loop timeline"
            );
            last_line = (Instant::now(), now);
        }
        let f = sh.dev.ctl(layout::C_FRAMES).load(Ordering::Acquire);
        let live = sh.dev.ctl(layout::C_LIVE).load(Ordering::Acquire) != 0;
        let now = Instant::now();
        sleep = pacer.after_look(now, f != frames, live);
        if f != frames {
            frames = f;
            sh.region.completions().notify();
            if let Some(w) = &sh.waker {
                w();
            }
        }
        let err = sh.dev.ctl(layout::C_ERROR).load(Ordering::Acquire);
        // The launched work ended without being asked to stop: a CUDA error, or a launch
        // chain that broke without recording one. Either way nothing serves the ring now.
        // The stream query is a driver call, far dearer than the loads above: once every
        // STREAM_QUERY_PERIOD, not on every look (1.76 looks per step on the H200).
        let query = err == 0 && now.duration_since(last_query) >= STREAM_QUERY_PERIOD;
        if query {
            last_query = now;
        }
        let ended = query
            && sh.dev.idle()
            && sh.dev.ctl(layout::C_STOPPED).load(Ordering::Acquire) == 0
            && sh.dev.ctl(layout::C_STOP).load(Ordering::Acquire) == 0;
        if err != 0 || ended {
            let at = sh.dev.ctl(layout::C_ERROR_WHERE).load(Ordering::Acquire);
            let msg = if err != 0 {
                describe_error(err, at)
            } else {
                // SAFETY: `stream` is live; the query only reports its status.
                let r = unsafe { cu::cuStreamQuery(sh.dev.stream) };
                format!("the device loop ended without being stopped (stream status {r:?})")
            };
            tracing::error!(error = %msg, "GPU step loop failed; answering Internal from now on");
            if let Ok(mut g) = sh.failed.lock() {
                *g = Some(msg);
            }
            fail(sh);
            return;
        }
    }
}

/// The failure path: every live stream gets its final `Internal` (when the state can still be
/// read), then every request left in the ring gets `Internal` until stop.
fn fail(sh: &Shared) {
    // Every recorded error ends the device loop; let its last kernel finish before the state
    // is read back.
    let t0 = Instant::now();
    while !sh.dev.idle() && t0.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let ring = sh.region.completions();
    let push = |conn, conn_seq, request_id, route, op, seq| loop {
        let r = ring.try_push(|c| {
            c.conn = conn;
            c.conn_seq = conn_seq;
            c.status = Status::Internal as u16;
            c.final_ = 1;
            c.request_id = request_id;
            c.words = 0;
            c.stream_seq = seq;
            c.route = route;
            c.stream = 0; // takes no credit: nothing follows it
            c.op = op;
            c.publish_ns = 0;
        });
        if r.is_ok() || sh.stop.load(Ordering::Acquire) {
            break;
        }
        std::thread::sleep(Duration::from_micros(50));
    };
    match sh.dev.read_state() {
        Some(state) => {
            for (conn, conn_seq, request_id, route, _, emitted) in live_sequences(&state) {
                push(
                    conn,
                    conn_seq,
                    request_id,
                    route,
                    u32::from(bgs_protocol::Op::Generate as u16),
                    emitted,
                );
            }
        }
        None => tracing::error!(
            "the step loop's state cannot be read: its live streams get no final frame"
        ),
    }
    ring.notify();
    while !sh.stop.load(Ordering::Acquire) {
        let mut meta = None;
        let popped = sh.region.requests().try_pop(|e| {
            if e.op != bgs_ring::OP_CANCEL {
                meta = Some((e.conn, e.conn_seq, e.request_id, e.route, e.op));
            }
        });
        match (popped, meta) {
            (None, _) => std::thread::sleep(sh.poll),
            (Some(()), Some((conn, conn_seq, request_id, route, op))) => {
                push(conn, conn_seq, request_id, route, u32::from(op), 0);
                ring.notify();
                if let Some(w) = &sh.waker {
                    w();
                }
            }
            (Some(()), None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> StepGeometry {
        StepGeometry {
            max_tokens: 512,
            max_samples: 64,
            max_seqs: 64,
            max_blocks_per_seq: 32,
            block_size: 16,
            num_blocks: 1024,
        }
    }

    #[test]
    fn word_indices_are_distinct_and_in_range() {
        use layout::*;
        for (list, words) in [(PARAMS, P_WORDS), (SCRATCH, S_WORDS), (CTL, C_WORDS)] {
            let mut seen = std::collections::HashSet::new();
            for (n, v) in list {
                assert!(*v < words, "{n} = {v} is past {words} words");
                assert!(seen.insert(*v), "{n} = {v} is used twice");
            }
        }
    }

    #[test]
    fn the_header_defines_every_word_the_source_uses() {
        let h = dispatch_header();
        assert!(h.contains("#define BGS_GLD_P_SCRATCH 17ull\n"));
        assert!(h.contains("#define BGS_GLD_C_FRAMES 14ull\n"));
        assert!(h.contains("#define BGS_GLD_E_POLICY 65538ull\n"));
        // Every BGS_GLD_* name the dispatcher source mentions is defined.
        let src = DISPATCH_SOURCE;
        let mut i = 0;
        while let Some(k) = src[i..].find("BGS_GLD_") {
            let start = i + k;
            let end = start
                + src[start..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap();
            let name = &src[start..end];
            assert!(
                h.contains(&format!("#define {name} ")),
                "{name} is used by gen_loop.cu but not generated"
            );
            i = end;
        }
    }

    #[test]
    fn limits_follow_the_config_and_refuse_what_does_not_fit() {
        let cfg = GenLoopConfig {
            slots: 32,
            max_waiting: 32,
            max_batched_tokens: 256,
            ..GenLoopConfig::default()
        };
        let l = gen_limits(&cfg, &geo(), 151_936, 32_768, 2).unwrap();
        assert_eq!(
            (l.max_seqs, l.max_running, l.max_batched_tokens),
            (64, 32, 256)
        );
        assert_eq!((l.block_size, l.num_blocks, l.max_eos), (16, 1024, 2));
        assert_eq!(l.max_prompt, MAX_PROMPT);
        let bad = |c: GenLoopConfig, needle: &str| {
            let e = gen_limits(&c, &geo(), 100, 100, 1).unwrap_err();
            assert!(e.contains(needle), "{e}");
        };
        bad(
            GenLoopConfig {
                slots: 128,
                ..cfg.clone()
            },
            "128 slots",
        );
        bad(
            GenLoopConfig {
                max_waiting: 500,
                ..cfg.clone()
            },
            "credit streams",
        );
        bad(
            GenLoopConfig {
                max_batched_tokens: 1024,
                ..cfg.clone()
            },
            "max_batched_tokens 1024",
        );
        bad(
            GenLoopConfig {
                stream_window: 1,
                ..cfg.clone()
            },
            "stream_window 1",
        );
        bad(
            GenLoopConfig {
                slots: 0,
                ..cfg.clone()
            },
            "slots is 0",
        );
        // More slots than the LM head's sampled rows: every step would fail to pack.
        let narrow = StepGeometry {
            max_samples: 16,
            ..geo()
        };
        let e = gen_limits(&cfg, &narrow, 100, 100, 1).unwrap_err();
        assert!(e.contains("samples 16 rows"), "{e}");
    }

    #[test]
    fn the_cache_key_follows_options_device_and_versions() {
        let o = compile::nvrtc_options(9, 0);
        let k = dispatcher_cache_key(&o, "NVIDIA H200", "nvrtc 13.0");
        assert!(k.starts_with("gld-") && k.len() == 36, "{k}");
        assert_eq!(k, dispatcher_cache_key(&o, "NVIDIA H200", "nvrtc 13.0"));
        assert_ne!(
            k,
            dispatcher_cache_key(&compile::nvrtc_options(8, 0), "NVIDIA H200", "nvrtc 13.0")
        );
        assert_ne!(k, dispatcher_cache_key(&o, "NVIDIA H100", "nvrtc 13.0"));
        assert_ne!(k, dispatcher_cache_key(&o, "NVIDIA H200", "nvrtc 13.1"));
    }

    #[test]
    fn credit_is_the_window_minus_frames_in_flight() {
        assert_eq!(credit(16, 0, 0), 16);
        assert_eq!(credit(16, 10, 4), 10);
        assert_eq!(credit(16, 20, 4), 0);
        assert_eq!(credit(16, 40, 4), 0);
        // Counters wrap.
        assert_eq!(credit(16, 3, u32::MAX - 1), 11);
        // More acks than frames: nothing in flight, not a stall of ~2^32 frames.
        assert_eq!(credit(16, 4, 10), 16);
    }

    #[test]
    fn stats_come_from_their_words() {
        let mut w = vec![0u64; layout::C_WORDS];
        w[layout::C_STEPS] = 4;
        w[layout::C_STEP_NS] = 1000;
        w[layout::C_FRAMES] = 9;
        w[layout::C_ADMITTED] = 3;
        let s = GenLoopStats::from_ctl(&w);
        assert_eq!(
            (s.steps, s.mean_step_ns, s.frames, s.admitted),
            (4, 250, 9, 3)
        );
        assert_eq!(
            GenLoopStats::from_ctl(&[0; layout::C_WORDS]).mean_step_ns,
            0
        );
    }

    #[test]
    fn errors_are_named() {
        assert_eq!(
            describe_error(layout::E_NO_GRAPH, layout::W_BUCKET),
            "step loop error NO_GRAPH at BUCKET"
        );
        assert_eq!(
            describe_error(1, layout::W_BODY),
            "device graph launch failed with cudaError 1 at BODY"
        );
        assert_eq!(layout::where_name(999), "unknown place");
    }

    /// The hand-kept word offsets of the failure path equal the header's.
    #[test]
    fn state_words_match_the_header() {
        let def = |name: &str| -> usize {
            let key = format!("#define {name} ");
            let line = GEN_LOOP_HEADER
                .lines()
                .find(|l| l.starts_with(&key))
                .unwrap_or_else(|| panic!("{name} not in bgs_gen_loop.h"));
            let v = line[key.len()..].split_whitespace().next().unwrap();
            let v = v.trim_end_matches('u');
            if let Some(h) = v.strip_prefix("0x") {
                usize::from_str_radix(h, 16).unwrap()
            } else {
                v.parse().unwrap()
            }
        };
        assert_eq!(def("BGS_GL_H_MAGIC"), gl::H_MAGIC);
        assert_eq!(def("BGS_GL_H_MAX_SEQS"), gl::H_MAX_SEQS);
        assert_eq!(def("BGS_GL_H_SEQ_WORDS"), gl::H_SEQ_WORDS);
        assert_eq!(def("BGS_GL_H_SEQ_AT"), gl::H_SEQ_AT);
        assert_eq!(def("BGS_GL_S_LIVE"), gl::S_LIVE);
        assert_eq!(def("BGS_GL_S_STREAM"), gl::S_STREAM);
        assert_eq!(def("BGS_GL_S_CONN_LO"), gl::S_CONN_LO);
        assert_eq!(def("BGS_GL_S_CONN_HI"), gl::S_CONN_HI);
        assert_eq!(def("BGS_GL_S_CONN_SEQ"), gl::S_CONN_SEQ);
        assert_eq!(def("BGS_GL_S_REQUEST_ID"), gl::S_REQUEST_ID);
        assert_eq!(def("BGS_GL_S_ROUTE"), gl::S_ROUTE);
        assert_eq!(def("BGS_GL_S_EMITTED"), gl::S_EMITTED);
        assert_eq!(def("BGS_GL_MAGIC") as u32, gl::MAGIC);
    }

    /// The failure path finds exactly the live sequences of a real loop state, with what
    /// their final frames need.
    #[test]
    fn live_sequences_of_a_state() {
        let cfg = GenLoopConfig {
            slots: 4,
            max_waiting: 4,
            max_batched_tokens: 64,
            ..GenLoopConfig::default()
        };
        let l = gen_limits(&cfg, &geo(), 1000, 4096, 1).unwrap();
        let mut core = CGenLoop::new(l, &[0]).unwrap();
        assert!(live_sequences(core.state()).is_empty());
        let prompt = [5u32, 6, 7];
        core.admit(3, 0x1234_5678_9abc, 8, 0, &prompt).unwrap();
        core.admit(5, 42, 8, 0, &prompt).unwrap();
        let live = live_sequences(core.state());
        assert_eq!(live.len(), 2);
        // (The host wrapper admits with conn_seq, request_id and route 0.)
        assert!(live.contains(&(0x1234_5678_9abc, 0, 0, 0, 3, 0)));
        assert!(live.contains(&(42, 0, 0, 0, 5, 0)));
        assert_eq!(core.cancel(42), 1);
        // A cancelled stream still owes its final frame: still live until delivered.
        assert_eq!(live_sequences(core.state()).len(), 2);
        assert!(live_sequences(&[0u32; 8]).is_empty());
    }
}
