//! The step policy: a safe wrapper over the portable C in `include/bgs_step_policy.h`.
//!
//! The C is the single definition of the policy (the GPU's step loop will compile the same
//! file with NVRTC). It sees only plain arrays of `#[repr(C)]` structs copied for the call, so
//! no pointer into an engine's data outlives the call. The policy itself is documented in the
//! header and in `docs/generation.md`.

use std::fmt;

/// Layout version the Rust structs below mirror (`BGS_SP_ABI_VERSION`).
const ABI_VERSION: u32 = 1;

/// Where a sequence stands (`BGS_SP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum SeqState {
    /// Admitted by the engine, not yet running; holds no blocks.
    Waiting = 0,
    /// Running; prompt tokens are left to process.
    Prefill = 1,
    /// Running; feeds back its last sampled token.
    Decode = 2,
}

/// Engine-wide limits of one step (`struct bgs_sp_limits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Limits {
    /// Tokens per KV block (>= 1).
    pub block_size: u32,
    /// Blocks free in the allocator now.
    pub free_blocks: u32,
    /// Token budget of one step (>= 1).
    pub max_batched_tokens: u32,
    /// Most sequences running at once (>= 1).
    pub max_running: u32,
}

/// One live sequence as the policy sees it (`struct bgs_sp_seq`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct SeqView {
    state: u32,
    /// Prompt tokens not yet processed (waiting: the whole prompt).
    pub prompt_left: u32,
    /// Tokens already in the KV cache (the next position).
    pub pos: u32,
    /// Blocks in its block table now.
    pub blocks_held: u32,
    /// Most tokens it will ever hold in the KV cache (prompt + max generated - 1).
    pub reserve_tokens: u32,
    ready: u32,
}

impl SeqView {
    /// A sequence in `state`; `ready` = it may take tokens this step.
    pub fn new(
        state: SeqState,
        prompt_left: u32,
        pos: u32,
        blocks_held: u32,
        reserve_tokens: u32,
        ready: bool,
    ) -> SeqView {
        SeqView {
            state: state as u32,
            prompt_left,
            pos,
            blocks_held,
            reserve_tokens,
            ready: ready as u32,
        }
    }

    /// The sequence's state.
    pub fn state(&self) -> SeqState {
        match self.state {
            0 => SeqState::Waiting,
            1 => SeqState::Prefill,
            _ => SeqState::Decode,
        }
    }

    /// It may take tokens this step.
    pub fn ready(&self) -> bool {
        self.ready != 0
    }
}

/// The policy's decision for one sequence (`struct bgs_sp_out`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Decision {
    admit: u32,
    /// Tokens it processes this step (0: sits out).
    pub tokens: u32,
    /// Blocks to allocate before the step.
    pub new_blocks: u32,
    reserved: u32,
}

impl Decision {
    /// A waiting sequence starts running this step.
    pub fn admit(&self) -> bool {
        self.admit != 0
    }
}

/// The C policy rejected its inputs (an engine bug: the engine keeps these invariants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// block_size, max_batched_tokens or max_running is 0.
    Limits,
    /// A sequence's state is unknown.
    State,
    /// A sequence holds more blocks than its reservation, or a decoder is past it.
    Reserve,
    /// The running sequences' reservations exceed the free blocks.
    Overcommit,
    /// The output slice is shorter than the input.
    OutputLength,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PolicyError::Limits => {
                "step policy: block_size, max_batched_tokens or max_running is 0"
            }
            PolicyError::State => "step policy: a sequence has an unknown state",
            PolicyError::Reserve => {
                "step policy: a sequence holds or needs more than its KV reservation"
            }
            PolicyError::Overcommit => {
                "step policy: running reservations exceed the free KV blocks"
            }
            PolicyError::OutputLength => "step policy: output slice shorter than the sequences",
        })
    }
}

impl std::error::Error for PolicyError {}

unsafe extern "C" {
    fn bgs_step_plan(
        limits: *const Limits,
        seqs: *const SeqView,
        n: u32,
        out: *mut Decision,
    ) -> i32;
    fn bgs_sp_blocks_for(tokens: u64, block_size: u32) -> u32;
    fn bgs_sp_abi(limits_size: *mut u32, seq_size: *mut u32, out_size: *mut u32) -> u32;
}

/// Check that the compiled C agrees with these struct layouts (run once by the engine's
/// constructor and by the tests). The message names the mismatch.
pub fn check_abi() -> Result<(), String> {
    let (mut l, mut s, mut o) = (0u32, 0u32, 0u32);
    // SAFETY: the C writes one u32 through each pointer, all three point at live locals.
    let version = unsafe { bgs_sp_abi(&mut l, &mut s, &mut o) };
    let want = (
        ABI_VERSION,
        size_of::<Limits>() as u32,
        size_of::<SeqView>() as u32,
        size_of::<Decision>() as u32,
    );
    if (version, l, s, o) != want {
        return Err(format!(
            "bgs_step_policy.h ABI mismatch: C has version {version} sizes {l}/{s}/{o}, \
             Rust expects {want:?}"
        ));
    }
    Ok(())
}

/// Blocks needed to hold `tokens` tokens with `block_size` tokens a block (0 when
/// `block_size` is 0).
pub fn blocks_for(tokens: u64, block_size: u32) -> u32 {
    // SAFETY: a pure function of two integers.
    unsafe { bgs_sp_blocks_for(tokens, block_size) }
}

/// Plan one step: fill `out[..seqs.len()]` and return the total tokens scheduled.
pub fn plan(limits: &Limits, seqs: &[SeqView], out: &mut [Decision]) -> Result<u32, PolicyError> {
    if out.len() < seqs.len() {
        return Err(PolicyError::OutputLength);
    }
    let n = u32::try_from(seqs.len()).map_err(|_| PolicyError::Limits)?;
    // SAFETY: `limits` is a valid struct; `seqs` holds `n` structs and `out` at least `n`
    // (checked above), with the layouts of the header (checked by `check_abi`); the C reads
    // and writes only those and keeps no pointer after returning.
    let r = unsafe { bgs_step_plan(limits, seqs.as_ptr(), n, out.as_mut_ptr()) };
    match r {
        0.. => Ok(r as u32),
        -1 => Err(PolicyError::Limits),
        -2 => Err(PolicyError::State),
        -3 => Err(PolicyError::Reserve),
        _ => Err(PolicyError::Overcommit),
    }
}
