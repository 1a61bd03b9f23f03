//! Host-side logic shared by both dispatchers and mirrored in the kernels: the reply plan of a
//! request, the repeat decomposition, free-slot bookkeeping and the scheduler's launch budget.

use bgs_protocol::ops;
use bgs_protocol::{Op, Status};
use bgs_ring::{OP_CANCEL, OP_REJECT};

use crate::layout::{FUSED_NONE, REPEAT_BITS};

/// Device-side launch limit: fire-and-forget launches per execution of a graph.
pub const DEVICE_LAUNCH_LIMIT: u32 = 120;
/// The scheduler tail-relaunches itself after this many launches (a margin below the limit).
pub const LAUNCH_BUDGET: u32 = 112;

/// Which compute a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compute {
    /// cuBLAS 8x8 sgemm.
    Gemm,
    /// cuFFT 32-point C2C forward.
    Fft,
}

impl Compute {
    /// Index in `GpuSlot::chain`.
    pub fn index(self) -> usize {
        match self {
            Compute::Gemm => 0,
            Compute::Fft => 1,
        }
    }
}

/// What the executor answers for one request (same rules as the CPU executor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Reply status.
    pub status: u16,
    /// Reply words.
    pub out_words: u32,
    /// Compute and repeat count (1..=256), if any.
    pub compute: Option<(Compute, u32)>,
}

/// The reply plan for a request-ring entry's op, param and payload words; `None` for an
/// [`OP_CANCEL`] entry, which the dispatchers consume without answering (a completion for it
/// would be a stray reply: it has no `conn_seq` of its own). The kernels' `plan` mirrors this.
///
/// The op rules come from the op table ([`bgs_protocol::ops`]); the GPU serves echo, gemm8 and
/// fft32, and answers generate (it has no model) and unknown ops with `UnknownOp`.
pub fn plan(op: u16, param: u32, words: u32) -> Option<Plan> {
    let none = |status: Status, out_words: u32| Plan {
        status: status as u16,
        out_words,
        compute: None,
    };
    if op == OP_CANCEL {
        return None;
    }
    if op == OP_REJECT {
        let status = u16::try_from(param)
            .ok()
            .and_then(Status::from_u16)
            .unwrap_or(Status::Internal);
        return Some(none(status, 0));
    }
    let Some(spec) = ops::spec_of(op) else {
        return Some(none(Status::UnknownOp, 0));
    };
    let compute = match spec.op {
        Op::Echo => None,
        Op::Gemm8 => Some(Compute::Gemm),
        Op::Fft32 => Some(Compute::Fft),
        Op::Generate => return Some(none(Status::UnknownOp, 0)),
    };
    // The framer checked these; re-checked so that a producer bypassing it gets an error frame.
    if let Err(status) = ops::check(spec, words, param, 0) {
        return Some(none(status, 0));
    }
    let out_words = spec
        .reply
        .final_words(words)
        .min(bgs_ring::SLOT_WORDS as u32);
    Some(Plan {
        status: Status::Ok as u16,
        out_words,
        compute: compute.map(|c| (c, spec.param_value(param))),
    })
}

/// The graphs (powers of two, ascending) whose repeats add up to exactly `r`.
pub fn repeat_chain(r: u32) -> impl Iterator<Item = usize> {
    (0..REPEAT_BITS).filter(move |k| (r >> k) & 1 == 1)
}

/// Index of the fused work graph (start → 2^k library calls → publish) that answers a request
/// with this plan in one launch: `FUSED_NONE` without compute, `compute * REPEAT_BITS + k` for
/// r = 2^k; `None` for other repeat counts (start graph + exact repeat chain + publish). The
/// device scheduler makes the same choice.
pub fn fused_index(p: &Plan) -> Option<usize> {
    match p.compute {
        None => Some(FUSED_NONE),
        Some((c, r)) if r.is_power_of_two() => {
            Some(c.index() * REPEAT_BITS + r.trailing_zeros() as usize)
        }
        Some(_) => None,
    }
}

/// Bit `s` set when status `s` (< 32) is known: the kernels' copy of `Status::from_u16`.
pub fn valid_status_mask() -> u32 {
    let mut mask = 0u32;
    for v in 0..=u16::MAX {
        if Status::from_u16(v).is_some() {
            assert!(v < 32, "status {v} does not fit the kernels' 32-bit mask");
            mask |= 1 << v;
        }
    }
    mask
}

/// Free-slot bookkeeping of the host-launch dispatcher (the device scheduler keeps the same
/// state in `busy` words): round-robin over free slots.
#[derive(Debug, Clone)]
pub struct SlotTable {
    busy: Vec<bool>,
    next: usize,
}

impl SlotTable {
    /// `n` free slots.
    pub fn new(n: usize) -> Self {
        SlotTable {
            busy: vec![false; n],
            next: 0,
        }
    }

    /// The next free slot at or after the cursor, marked busy; `is_busy` refreshes a slot's
    /// state from the device first (a slot the device freed is reused).
    pub fn acquire(&mut self, mut is_busy: impl FnMut(usize) -> bool) -> Option<usize> {
        let n = self.busy.len();
        for i in 0..n {
            let j = (self.next + i) % n;
            if self.busy[j] {
                self.busy[j] = is_busy(j);
            }
            if !self.busy[j] {
                self.busy[j] = true;
                self.next = (j + 1) % n;
                return Some(j);
            }
        }
        None
    }

    /// Undo an `acquire` that found no work.
    pub fn release(&mut self, j: usize) {
        self.busy[j] = false;
        self.next = j;
    }

    /// Slots currently marked busy.
    pub fn busy_count(&self) -> usize {
        self.busy.iter().filter(|b| **b).count()
    }
}

/// A host model of the scheduler's launch accounting: each execution launches at most
/// `LAUNCH_BUDGET` work graphs fire-and-forget and then tail-relaunches itself.
#[derive(Debug, Default, Clone)]
pub struct LaunchCounter {
    in_execution: u32,
    /// Executions so far (the first launch counts as one).
    pub executions: u64,
}

impl LaunchCounter {
    /// Account one fire-and-forget launch; returns true when the scheduler must relaunch
    /// before taking another request.
    pub fn launch(&mut self) -> bool {
        if self.executions == 0 {
            self.executions = 1;
        }
        self.in_execution += 1;
        assert!(self.in_execution <= DEVICE_LAUNCH_LIMIT);
        self.in_execution >= LAUNCH_BUDGET
    }

    /// Tail relaunch: a new execution starts with a fresh count.
    pub fn relaunch(&mut self) {
        self.in_execution = 0;
        self.executions += 1;
    }
}

/// Device schedulers for `slots` slots when the configuration says 0: one per 8 slots, at
/// most 2 (measured on the H200: 2 beat 1 at 16 and 32 slots; 4 lost to head-CAS contention).
pub fn auto_schedulers(slots: usize) -> usize {
    (slots / 8).clamp(1, 2)
}

/// The scheduler count actually used: `requested` (0: [`auto_schedulers`]), at least 1 and
/// at most one per slot (a scheduler owns a contiguous, non-empty share of the slots).
pub fn scheduler_count(requested: usize, slots: usize) -> usize {
    let k = if requested == 0 {
        auto_schedulers(slots)
    } else {
        requested
    };
    k.clamp(1, slots.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::FUSED;

    fn p(op: u16, param: u32, words: u32) -> Plan {
        plan(op, param, words).expect("answered")
    }

    #[test]
    fn plans_match_the_cpu_executor() {
        assert_eq!(p(Op::Echo as u16, 7, 3).out_words, 3);
        assert_eq!(p(Op::Echo as u16, 7, 3).compute, None);
        assert_eq!(p(Op::Echo as u16, 0, 0).out_words, 0);
        let g = p(Op::Gemm8 as u16, 0, 64);
        assert_eq!(g.compute, Some((Compute::Gemm, 1)));
        assert_eq!(g.out_words, 64);
        assert_eq!(
            p(Op::Fft32 as u16, 256, 64).compute,
            Some((Compute::Fft, 256))
        );
        assert_eq!(p(Op::Fft32 as u16, 257, 64).status, Status::BadParam as u16);
        assert_eq!(p(Op::Gemm8 as u16, 1, 3).status, Status::BadParam as u16);
        assert_eq!(p(99, 1, 0).status, Status::UnknownOp as u16);
        assert_eq!(
            p(OP_REJECT, Status::Busy as u32, 0).status,
            Status::Busy as u16
        );
        assert_eq!(p(OP_REJECT, 999, 0).status, Status::Internal as u16);
        assert_eq!(p(OP_REJECT, 70_000, 0).status, Status::Internal as u16);
    }

    #[test]
    fn generate_is_answered_unknown_op_without_compute() {
        // Valid generate requests (as the framer now passes them) and invalid ones alike: the
        // GPU has no model, so one final UnknownOp frame with no words.
        for (param, words) in [(1, 1), (4096, 64), (0, 0), (5000, 3)] {
            let g = p(Op::Generate as u16, param, words);
            assert_eq!(g.status, Status::UnknownOp as u16);
            assert_eq!((g.out_words, g.compute), (0, None));
            assert_eq!(fused_index(&g), Some(FUSED_NONE));
        }
    }

    #[test]
    fn cancel_entries_are_never_answered() {
        for (param, words) in [(0, 0), (1, 64), (u32::MAX, u32::MAX)] {
            assert_eq!(plan(OP_CANCEL, param, words), None);
        }
        // Every other op value is answered with some known status.
        for op in (0..=u16::MAX).filter(|&o| o != OP_CANCEL) {
            let pl = plan(op, 1, 64).expect("answered");
            assert!(Status::from_u16(pl.status).is_some(), "op {op}");
        }
    }

    #[test]
    fn plans_follow_the_op_table() {
        // Every op the GPU serves: in-range requests succeed with the table's reply size,
        // out-of-range ones are BadParam, exactly where the table's bounds are.
        for spec in bgs_protocol::OPS.iter().filter(|s| s.op != Op::Generate) {
            let op = spec.wire();
            for words in [0, 1, 63, 64, 65, 256] {
                for param in [0, 1, 255, 256, 257, u32::MAX] {
                    let pl = p(op, param, words);
                    match ops::check(spec, words, param, 0) {
                        Ok(()) => {
                            assert_eq!(pl.status, Status::Ok as u16);
                            assert_eq!(pl.out_words, spec.reply.final_words(words));
                            if let Some((_, r)) = pl.compute {
                                assert_eq!(r, param.max(1));
                            }
                        }
                        Err(s) => assert_eq!(pl.status, s as u16, "{op} {words} {param}"),
                    }
                }
            }
        }
    }

    #[test]
    fn repeat_chains_sum_exactly() {
        for r in 1..=bgs_protocol::MAX_REPEAT {
            let s: u32 = repeat_chain(r).map(|k| 1u32 << k).sum();
            assert_eq!(s, r);
            assert!(repeat_chain(r).count() <= REPEAT_BITS);
        }
        assert_eq!(repeat_chain(1).collect::<Vec<_>>(), vec![0]);
        assert_eq!(repeat_chain(16).collect::<Vec<_>>(), vec![4]);
        assert_eq!(repeat_chain(256).collect::<Vec<_>>(), vec![8]);
    }

    #[test]
    fn fused_graphs_cover_powers_of_two_and_no_compute() {
        let mut seen = std::collections::HashSet::new();
        for op in [Op::Gemm8, Op::Fft32] {
            for r in 0..=bgs_protocol::MAX_REPEAT {
                let pl = p(op as u16, r, bgs_protocol::wire::ONE_SHOT_WORDS);
                let reps = r.max(1);
                match fused_index(&pl) {
                    Some(f) => {
                        assert!(reps.is_power_of_two(), "{r}");
                        assert!(f < FUSED && f != FUSED_NONE);
                        let c = if op == Op::Gemm8 { 0 } else { 1 };
                        assert_eq!(f, c * REPEAT_BITS + reps.trailing_zeros() as usize);
                        seen.insert(f);
                    }
                    None => assert!(!reps.is_power_of_two(), "{r}"),
                }
            }
        }
        assert_eq!(seen.len(), FUSED - 1);
        for pl in [
            p(Op::Echo as u16, 0, 7),
            p(OP_REJECT, 1, 0),
            p(99, 0, 0),
            p(Op::Gemm8 as u16, 300, 64),
        ] {
            assert_eq!(fused_index(&pl), Some(FUSED_NONE));
        }
    }

    #[test]
    fn status_mask_covers_known_statuses() {
        let m = valid_status_mask();
        for s in [0u32, 1, 2, 16, 17, 18, 19, 20, 21, 22, 23] {
            assert!(m & (1 << s) != 0, "{s}");
        }
        assert_eq!(m & (1 << 3), 0);
    }

    #[test]
    fn slot_table_round_robin_and_reuse() {
        let mut t = SlotTable::new(3);
        assert_eq!(t.acquire(|_| true), Some(0));
        assert_eq!(t.acquire(|_| true), Some(1));
        assert_eq!(t.acquire(|_| true), Some(2));
        assert_eq!(t.busy_count(), 3);
        // All busy per the device.
        assert_eq!(t.acquire(|_| true), None);
        // Slot 1 finished.
        assert_eq!(t.acquire(|j| j != 1), Some(1));
        assert_eq!(t.acquire(|_| false), Some(2));
        assert_eq!(t.busy_count(), 3);
    }

    #[test]
    fn scheduler_relaunches_before_the_limit() {
        let mut c = LaunchCounter::default();
        let mut max_in_exec = 0;
        let mut n = 0;
        for _ in 0..10_000 {
            n += 1;
            max_in_exec = max_in_exec.max(n);
            if c.launch() {
                c.relaunch();
                n = 0;
            }
        }
        assert!(max_in_exec <= DEVICE_LAUNCH_LIMIT);
        assert_eq!(max_in_exec, LAUNCH_BUDGET);
        assert_eq!(c.executions, 1 + 10_000 / u64::from(LAUNCH_BUDGET));
    }

    #[test]
    fn scheduler_counts() {
        assert_eq!(scheduler_count(0, 1), 1);
        assert_eq!(scheduler_count(0, 8), 1);
        assert_eq!(scheduler_count(0, 16), 2);
        assert_eq!(scheduler_count(0, 64), 2);
        assert_eq!(scheduler_count(4, 16), 4);
        assert_eq!(scheduler_count(8, 3), 3, "never more schedulers than slots");
        // Every scheduler's share [k*n/K, (k+1)*n/K) is non-empty and they tile the slots.
        for n in 1..=64 {
            for req in 0..=70 {
                let k = scheduler_count(req, n);
                let mut covered = 0;
                for i in 0..k {
                    let (a, b) = (i * n / k, (i + 1) * n / k);
                    assert!(b > a, "empty share: n={n} k={k}");
                    assert_eq!(a, covered);
                    covered = b;
                }
                assert_eq!(covered, n);
            }
        }
    }
}
