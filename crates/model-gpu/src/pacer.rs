//! When the step loop's host monitor looks at the control block next.
//!
//! The device loop publishes frames once per step, and a step of a busy loop takes about the
//! same time as the one before it (one decode token per live sequence; 1.5-2 ms for the
//! Qwen2.5-0.5B shape on the H200). Polling at a fixed 200 µs woke the monitor nine times per
//! step, and on the paper's workload that cost 185 µs of server CPU per request, a quarter of
//! the server's total. The pacer learns the step period from the frame counter's changes,
//! sleeps through most of the next step, and polls finely only around its expected end: about
//! three looks per step, and a frame reaches the transport sooner than with the fixed poll
//! (within `fine` of its publication instead of within 200 µs).
//!
//! Pure state machine (times in, sleep lengths out), unit-tested with a simulated step clock.

use std::time::{Duration, Instant};

/// Intervals between frame changes longer than this are gaps in the load, not steps: they
/// reset the learned period rather than feed it.
const MAX_PERIOD: Duration = Duration::from_millis(20);

#[derive(Debug, Clone)]
pub struct StepPacer {
    /// The longest sleep while sequences are live and no period is known (and the cap of the
    /// back-off when a step runs long).
    busy_poll: Duration,
    /// The sleep while nothing is live and no frame moved.
    idle_poll: Duration,
    /// The sleep between looks around a step's expected end.
    fine: Duration,
    /// Smoothed interval between observed frame changes (None until two changes were seen
    /// within `MAX_PERIOD`).
    period: Option<Duration>,
    last_change: Option<Instant>,
    /// Looks since the expected end of the step that brought no change.
    late: u32,
}

impl StepPacer {
    pub fn new(busy_poll: Duration, idle_poll: Duration) -> StepPacer {
        let busy_poll = busy_poll.max(Duration::from_micros(1));
        StepPacer {
            busy_poll,
            idle_poll: idle_poll.max(busy_poll),
            fine: (busy_poll / 4).max(Duration::from_micros(1)),
            period: None,
            last_change: None,
            late: 0,
        }
    }

    /// The learned step period, if any.
    #[cfg(test)]
    pub fn period(&self) -> Option<Duration> {
        self.period
    }

    /// One look at `now`: `changed` when frames were published since the last look, `live`
    /// when sequences are live on the device. Returns how long to sleep before the next look.
    pub fn after_look(&mut self, now: Instant, changed: bool, live: bool) -> Duration {
        if changed {
            if let Some(last) = self.last_change {
                let iv = now.saturating_duration_since(last);
                self.period = if iv > MAX_PERIOD {
                    None
                } else {
                    // Exponential average, weight 1/4 on the newest interval: follows a batch
                    // that grows or shrinks within a few steps, smooths the look granularity.
                    Some(self.period.map_or(iv, |p| (p * 3 + iv) / 4))
                };
            }
            self.last_change = Some(now);
            self.late = 0;
            return match self.period {
                // Wake a little before the expected end: a thirty-second of a step (jitter)
                // and half a fine look (the period is measured at look granularity).
                Some(p) => p
                    .saturating_sub(p / 32 + self.fine / 2)
                    .clamp(self.fine, MAX_PERIOD),
                None => self.busy_poll,
            };
        }
        if !live {
            return self.idle_poll;
        }
        let (Some(p), Some(last)) = (self.period, self.last_change) else {
            return self.busy_poll;
        };
        // Waiting for the step's frames: fine looks until a quarter step past the expected
        // end, then back off (a prefill or a larger batch runs long) up to `busy_poll`.
        if now.saturating_duration_since(last) <= p + p / 4 {
            return self.fine;
        }
        self.late = self.late.saturating_add(1);
        self.fine
            .saturating_mul(1u32 << self.late.min(16))
            .min(self.busy_poll)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated loop: steps of `step` length publish frames at their ends (with `jitter`
    /// alternating +/-), the monitor looks when the pacer says. Returns (looks per step, mean
    /// delay from publication to the look that saw it, max delay).
    fn simulate(step: Duration, jitter: Duration, steps: u32) -> (f64, Duration, Duration) {
        let mut p = StepPacer::new(Duration::from_micros(200), Duration::from_millis(1));
        let t0 = Instant::now();
        let mut ends = Vec::new();
        let mut at = t0;
        for i in 0..steps {
            at += step;
            at = if i % 2 == 0 { at + jitter } else { at - jitter };
            ends.push(at);
        }
        let mut now = t0;
        let mut seen = 0usize; // steps whose frames were seen
        let mut looks = 0u32;
        let (mut total, mut max) = (Duration::ZERO, Duration::ZERO);
        while seen < ends.len() {
            let published = ends.iter().take_while(|e| **e <= now).count();
            let changed = published > seen;
            if changed {
                let d = now - ends[published - 1];
                total += d;
                max = max.max(d);
                seen = published;
            }
            looks += 1;
            now += p.after_look(now, changed, true);
        }
        eprintln!(
            "step {step:?} jitter {jitter:?}: {} looks/step, mean {:?}, max {max:?}",
            f64::from(looks) / f64::from(steps),
            total / steps
        );
        (f64::from(looks) / f64::from(steps), total / steps, max)
    }

    #[test]
    fn a_steady_loop_is_looked_at_a_few_times_per_step_and_seen_soon() {
        let (per_step, mean, max) = simulate(Duration::from_micros(1800), Duration::ZERO, 400);
        // The fixed 200 us poll looks 9 times per 1.8 ms step, each frame 100 us late on average.
        assert!(per_step < 4.0, "{per_step} looks per step");
        assert!(mean <= Duration::from_micros(50), "mean delay {mean:?}");
        assert!(max <= Duration::from_micros(200), "max delay {max:?}");
    }

    #[test]
    fn jitter_and_short_steps_stay_bounded() {
        let (per_step, mean, max) =
            simulate(Duration::from_micros(1800), Duration::from_micros(100), 400);
        assert!(per_step < 6.0, "{per_step} looks per step");
        assert!(mean <= Duration::from_micros(60), "mean delay {mean:?}");
        assert!(max <= Duration::from_micros(250), "max delay {max:?}");
        // Steps shorter than the fine look: every look sees a change, nothing is lost.
        let (per_step, _, max) = simulate(Duration::from_micros(30), Duration::ZERO, 1000);
        assert!(per_step <= 1.0, "{per_step} looks per step");
        assert!(max <= Duration::from_micros(50), "max delay {max:?}");
    }

    #[test]
    fn a_long_step_backs_off_to_the_busy_poll_and_a_gap_forgets_the_period() {
        let mut p = StepPacer::new(Duration::from_micros(200), Duration::from_millis(1));
        let t0 = Instant::now();
        let us = |n: u64| t0 + Duration::from_micros(n);
        p.after_look(us(0), true, true);
        p.after_look(us(1000), true, true);
        assert_eq!(p.period(), Some(Duration::from_micros(1000)));
        // Within the expected end (+1/4): fine looks.
        assert_eq!(
            p.after_look(us(1900), false, true),
            Duration::from_micros(50)
        );
        // Past it: doubling, capped at the busy poll.
        let backoff: Vec<_> = (0..4)
            .map(|i| p.after_look(us(2300 + i * 200), false, true))
            .collect();
        assert_eq!(
            backoff,
            [100, 200, 200, 200].map(Duration::from_micros).to_vec()
        );
        // Nothing live and nothing moving: the idle poll.
        assert_eq!(
            p.after_look(us(3000), false, false),
            Duration::from_millis(1)
        );
        // A change after a gap longer than any step: no period, the busy poll again.
        assert_eq!(
            p.after_look(us(60_000), true, true),
            Duration::from_micros(200)
        );
        assert_eq!(p.period(), None);
    }
}
