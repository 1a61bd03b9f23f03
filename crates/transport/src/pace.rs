//! When the native transport looks at the completion ring while an executor that cannot wake
//! it (the one-shot GPU executor in poll mode) has requests: at the time each request is
//! expected to be done, learned from the completions themselves.
//!
//! The fixed `poll_interval` (100 µs) found a GPU completion 100-150 µs after the request was
//! published although the GPU answered in ~25 µs (H200, gemm8 ×1: p50 226 µs over TCP against
//! the floor's 65; docs/cost.md). The pacer keeps the publish instant of each outstanding
//! request, learns the service time (`completed`) and wakes the transport when the oldest
//! request is expected; a completion that is late is looked for again after `fine`, doubling
//! up to `poll`. About one and a half looks per request; the wait shrinks to the service time.
//!
//! Pure state machine (instants in, waits out), unit-tested with a simulated executor.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Publish instants kept at most (beyond that, later requests are covered by the back-off).
const MAX_TRACKED: usize = 4096;

/// Pace only while at most this many requests are outstanding. Above it requests arrive faster
/// than the poll, and a look per expected completion costs more than the poll's batches
/// (emulated at ~55,000 req/s: 12.4 against 10.6 µs of transport CPU per request); latency is
/// what pacing is for, and at low load.
const MAX_PACED: usize = 2;

#[derive(Debug, Clone)]
pub struct CompletionPacer {
    poll: Duration,
    fine: Duration,
    /// Smoothed publish-to-reap time (None before the first completion).
    service: Option<Duration>,
    /// Publish instants of requests whose expected completion has not passed, oldest first.
    due: VecDeque<Instant>,
    /// Looks since an expected completion passed without the request done.
    late: u32,
}

impl CompletionPacer {
    /// `poll`: the longest wait while requests are outstanding (`NativeConfig::poll_interval`).
    pub fn new(poll: Duration) -> CompletionPacer {
        let poll = poll.max(Duration::from_micros(1));
        CompletionPacer {
            poll,
            fine: (poll / 10).max(Duration::from_micros(1)),
            service: None,
            due: VecDeque::new(),
            late: 0,
        }
    }

    /// The learned service time, if any.
    #[cfg(test)]
    pub fn service(&self) -> Option<Duration> {
        self.service
    }

    /// `n` requests were just published into the ring; `now` reads the clock (only when
    /// `n > 0`).
    pub fn published(&mut self, n: usize, now: impl FnOnce() -> Instant) {
        if n == 0 {
            return;
        }
        let at = now();
        let room = MAX_TRACKED.saturating_sub(self.due.len());
        self.due.extend(std::iter::repeat_n(at, n.min(room)));
    }

    /// A completion was reaped `took` after its request was published.
    ///
    /// `took` is only an upper bound of the executor's time (the look that found it came
    /// later), and a look at the expected time learns nothing about how much earlier the
    /// completion landed. So: found by the look at its expected time, the estimate shrinks by
    /// an eighth (look sooner next time); found by a later look, it moves a quarter of the
    /// way to `took`. It settles where about half the looks come just too early, one fine
    /// step before the completion.
    pub fn completed(&mut self, took: Duration) {
        let took = took.min(self.poll * 4);
        self.service = Some(match self.service {
            None => took,
            Some(s) if self.late == 0 => s - s / 8,
            Some(s) => (s * 3 + took) / 4,
        });
        self.late = 0;
    }

    /// After a reap at `now` with `outstanding` requests left: how long to wait (None: nothing
    /// is outstanding, wait for input).
    pub fn wait(&mut self, now: Instant, outstanding: usize) -> Option<Duration> {
        if outstanding == 0 {
            self.due.clear();
            self.late = 0;
            return None;
        }
        let Some(s) = self.service else {
            return Some(self.poll);
        };
        // Requests whose expected completion has passed leave `due`; outstanding requests
        // not in it are overdue (an approximation: a request done early leaves its entry
        // until its time, which only delays the look for an overdue one, within `poll`).
        while self.due.front().is_some_and(|&t| t + s <= now) {
            self.due.pop_front();
        }
        if outstanding > MAX_PACED {
            self.late = 0;
            return Some(self.poll);
        }
        let to_due = self
            .due
            .front()
            .map(|&t| (t + s).saturating_duration_since(now));
        let wait = if outstanding > self.due.len() {
            // Overdue: look again after `fine`, doubling, but never past the next expected.
            let back = self.fine.saturating_mul(1u32 << self.late.min(16));
            self.late = self.late.saturating_add(1);
            to_due.map_or(back, |d| d.min(back))
        } else {
            self.late = 0;
            to_due.unwrap_or(self.poll)
        };
        Some(wait.clamp(Duration::from_micros(1), self.poll))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An executor that answers each request `service` after it was published, without
    /// waking anyone; requests arrive every `gap`. Returns (looks per request, mean delay from
    /// completion to the look that found it, max delay).
    fn simulate(service: Duration, gap: Duration, n: usize) -> (f64, Duration, Duration) {
        let poll = Duration::from_micros(100);
        let mut p = CompletionPacer::new(poll);
        let t0 = Instant::now();
        let arrivals: Vec<Instant> = (0..n).map(|i| t0 + gap * i as u32).collect();
        let mut now = t0;
        let (mut next_arrival, mut done) = (0usize, 0usize);
        let mut pending: VecDeque<Instant> = VecDeque::new(); // publish instants
        let (mut looks, mut total, mut max) = (0u32, Duration::ZERO, Duration::ZERO);
        while done < n {
            // Arrivals up to now are published (the transport wakes for input).
            while next_arrival < n && arrivals[next_arrival] <= now {
                pending.push_back(arrivals[next_arrival]);
                p.published(1, || arrivals[next_arrival]);
                next_arrival += 1;
            }
            // Reap what is done.
            while pending.front().is_some_and(|&t| t + service <= now) {
                let t = pending.pop_front().unwrap();
                let d = now - (t + service);
                total += d;
                max = max.max(d);
                p.completed(now - t);
                done += 1;
            }
            looks += 1;
            let wait = p.wait(now, pending.len());
            // The next wake: the timer, or the next arrival (input), whichever comes first.
            let input = arrivals.get(next_arrival).copied();
            now = match (wait, input) {
                (Some(w), Some(i)) => (now + w).min(i),
                (Some(w), None) => now + w,
                (None, Some(i)) => i,
                (None, None) => break,
            };
        }
        // Looks that were input wake-ups are not the pacer's: count per request anyway.
        (f64::from(looks) / n as f64, total / n as u32, max)
    }

    #[test]
    fn completions_are_found_soon_after_they_land() {
        // 25 us of service, a request every 1 ms (the H200's gemm8 at 1,000 req/s).
        let (looks, mean, max) = simulate(Duration::from_micros(25), Duration::from_millis(1), 500);
        eprintln!("25 us service, 1 ms gap: {looks} looks/request, mean {mean:?}, max {max:?}");
        // A fixed 100 us poll: each completion found ~75 us late, 2 looks per request (the
        // input's and the poll's).
        assert!(mean <= Duration::from_micros(15), "mean delay {mean:?}");
        assert!(max <= Duration::from_micros(100), "max delay {max:?}");
        assert!(looks <= 3.0, "{looks} looks per request");
    }

    #[test]
    fn a_slow_executor_is_polled_with_back_off_up_to_the_poll() {
        // Service 400 us, above the poll: the estimate follows it (a fixed 100 us poll needs 5
        // looks per request here, the input's included, and finds each ~50 us late).
        let (looks, mean, max) =
            simulate(Duration::from_micros(400), Duration::from_millis(2), 200);
        eprintln!("400 us service: {looks} looks/request, mean {mean:?}, max {max:?}");
        assert!(max <= Duration::from_micros(110), "max delay {max:?}");
        assert!(mean <= Duration::from_micros(30), "mean delay {mean:?}");
        assert!(looks <= 7.0, "{looks} looks per request");
    }

    #[test]
    fn back_off_doubles_from_fine_to_the_poll_and_nothing_outstanding_waits_for_input() {
        let poll = Duration::from_micros(100);
        let mut p = CompletionPacer::new(poll);
        let t0 = Instant::now();
        let us = |n: u64| t0 + Duration::from_micros(n);
        // No completion seen yet: the poll.
        p.published(1, || us(0));
        assert_eq!(p.wait(us(0), 1), Some(poll));
        p.completed(Duration::from_micros(40));
        assert_eq!(p.service(), Some(Duration::from_micros(40)));
        assert_eq!(p.wait(us(40), 0), None);
        // A request published at 100 is expected at 140: the transport sleeps until then.
        p.published(1, || us(100));
        assert_eq!(p.wait(us(100), 1), Some(Duration::from_micros(40)));
        // Past it and still outstanding: 10, 20, 40, 80, 100, 100 us.
        let waits: Vec<u64> = (0..6)
            .map(|i| p.wait(us(150 + i * 200), 1).unwrap().as_micros() as u64)
            .collect();
        assert_eq!(waits, [10, 20, 40, 80, 100, 100]);
        // A completion resets the back-off; nothing outstanding waits for input.
        p.completed(Duration::from_micros(40));
        assert_eq!(p.wait(us(2000), 0), None);
    }
}
