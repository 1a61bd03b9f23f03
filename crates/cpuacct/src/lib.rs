//! CPU accounting from `/proc` (Linux only).
//!
//! Two scopes, because on loopback the receive softirq of one process runs in the context of
//! the *sending* process (see `docs/load.md`), so process CPU alone can flatter a transport:
//! - [`ProcessCpu::sample`]: one process, tick-based user/system time for the whole thread
//!   group (`/proc/PID/stat`, which includes exited threads) plus nanosecond run time from
//!   `/proc/PID/task/*/schedstat` (current threads only), with a per-thread breakdown so that
//!   kernel-side helper threads (io-wq, SQPOLL) are visible.
//! - [`HostSample::sample`]: the whole machine from `/proc/stat`, aggregate and per CPU.
//!
//! Take two samples and subtract them ([`ProcessSample::delta`], [`HostSample::delta`]). The
//! parsers are pure functions over text so that they can be tested on fixed inputs.

use std::fs;
use std::io;
use std::path::Path;

use serde::Serialize;

/// Clock ticks per second used by `/proc` (`sysconf(_SC_CLK_TCK)`, 100 on every Linux we run).
pub fn clock_ticks_per_second() -> u64 {
    // The kernel reports it in the aux vector; fall back to the universal value if absent.
    match rustix::param::clock_ticks_per_second() {
        0 => 100,
        t => t,
    }
}

fn ticks_to_ns(ticks: u64, hz: u64) -> u64 {
    // u128 so that long uptimes at any tick rate cannot overflow the product.
    (u128::from(ticks) * 1_000_000_000 / u128::from(hz.max(1))) as u64
}

/// CLOCK_MONOTONIC in nanoseconds: the time base of every sample.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

// ---------------------------------------------------------------------------------------------
// Process and thread samples
// ---------------------------------------------------------------------------------------------

/// Fields of a `/proc/PID/stat` or `/proc/PID/task/TID/stat` line that we use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StatFields {
    /// The pid or tid (field 1).
    pub pid: u32,
    /// The command name (field 2, without the parentheses; may contain spaces and `)`).
    pub comm: String,
    /// Field 14, in clock ticks.
    pub utime_ticks: u64,
    /// Field 15, in clock ticks.
    pub stime_ticks: u64,
    /// Field 20.
    pub num_threads: u64,
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Parse the text of a `/proc/PID/stat` (or task stat) file.
///
/// The comm field is delimited by the first `(` and the *last* `)`: a process may name itself
/// `a b) c` and only the last parenthesis is unambiguous.
pub fn parse_pid_stat(text: &str) -> io::Result<StatFields> {
    let open = text.find('(').ok_or_else(|| invalid("stat: no '('"))?;
    let close = text.rfind(')').ok_or_else(|| invalid("stat: no ')'"))?;
    if close < open {
        return Err(invalid("stat: ')' before '('"));
    }
    let pid = text[..open]
        .trim()
        .parse()
        .map_err(|_| invalid("stat: bad pid"))?;
    let comm = text[open + 1..close].to_string();
    // Fields after the comm, starting with field 3 (state) at index 0.
    let rest: Vec<&str> = text[close + 1..].split_ascii_whitespace().collect();
    let field = |n: usize| -> io::Result<u64> {
        rest.get(n - 3)
            .ok_or_else(|| invalid("stat: too few fields"))?
            .parse()
            .map_err(|_| invalid("stat: bad number"))
    };
    Ok(StatFields {
        pid,
        comm,
        utime_ticks: field(14)?,
        stime_ticks: field(15)?,
        num_threads: field(20)?,
    })
}

/// Parse `/proc/.../schedstat` (`run_ns wait_ns timeslices`) and return the run time in ns.
pub fn parse_schedstat(text: &str) -> io::Result<u64> {
    text.split_ascii_whitespace()
        .next()
        .ok_or_else(|| invalid("schedstat: empty"))?
        .parse()
        .map_err(|_| invalid("schedstat: bad number"))
}

/// One thread of a process at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ThreadSample {
    /// Thread id.
    pub tid: u32,
    /// Thread name (e.g. `iou-sqp-1234`, `iou-wrk-1234`).
    pub comm: String,
    /// User time (tick resolution).
    pub user_ns: u64,
    /// System time (tick resolution).
    pub system_ns: u64,
    /// Time on CPU from schedstat (ns resolution).
    pub run_ns: u64,
}

/// One process at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProcessSample {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub comm: String,
    /// CLOCK_MONOTONIC when the sample was taken.
    pub taken_ns: u64,
    /// User time of the thread group, including exited threads (tick resolution).
    pub user_ns: u64,
    /// System time of the thread group, including exited threads (tick resolution).
    pub system_ns: u64,
    /// Sum of schedstat run time over the threads alive at sampling time (ns resolution;
    /// exited threads are missing, unlike `user_ns`/`system_ns`).
    pub run_ns: u64,
    /// Number of threads read from `task/` (those that did not vanish while we read).
    pub thread_count: usize,
    /// Per-thread breakdown, sorted by tid.
    pub threads: Vec<ThreadSample>,
}

/// Samples processes (namespace for [`ProcessCpu::sample`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessCpu;

/// True for errors that mean "this thread or process is gone".
fn vanished(e: &io::Error) -> bool {
    // ESRCH shows up when a task exits between opening its directory and reading a file.
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(3)
}

impl ProcessCpu {
    /// Sample process `pid` and all of its current threads.
    pub fn sample(pid: u32) -> io::Result<ProcessSample> {
        Self::sample_at(Path::new("/proc"), pid)
    }

    /// Sample from another procfs mount (tests, containers).
    pub fn sample_at(proc_root: &Path, pid: u32) -> io::Result<ProcessSample> {
        let hz = clock_ticks_per_second();
        let base = proc_root.join(pid.to_string());
        let taken_ns = monotonic_ns();
        let stat = parse_pid_stat(&fs::read_to_string(base.join("stat"))?)?;
        let mut threads = Vec::new();
        for entry in fs::read_dir(base.join("task"))? {
            let entry = match entry {
                Ok(e) => e,
                Err(e) if vanished(&e) => continue,
                Err(e) => return Err(e),
            };
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            match read_thread(&entry.path(), tid, hz) {
                Ok(t) => threads.push(t),
                // A thread that exits while we iterate is simply not part of this sample.
                Err(e) if vanished(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        threads.sort_by_key(|t| t.tid);
        Ok(ProcessSample {
            pid,
            comm: stat.comm,
            taken_ns,
            user_ns: ticks_to_ns(stat.utime_ticks, hz),
            system_ns: ticks_to_ns(stat.stime_ticks, hz),
            run_ns: threads.iter().map(|t| t.run_ns).sum(),
            thread_count: threads.len(),
            threads,
        })
    }
}

fn read_thread(dir: &Path, tid: u32, hz: u64) -> io::Result<ThreadSample> {
    let stat = parse_pid_stat(&fs::read_to_string(dir.join("stat"))?)?;
    let run_ns = parse_schedstat(&fs::read_to_string(dir.join("schedstat"))?)?;
    Ok(ThreadSample {
        tid,
        comm: stat.comm,
        user_ns: ticks_to_ns(stat.utime_ticks, hz),
        system_ns: ticks_to_ns(stat.stime_ticks, hz),
        run_ns,
    })
}

/// CPU used by one thread between two samples (threads that appeared in between count whole).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ThreadDelta {
    /// Thread id.
    pub tid: u32,
    /// Thread name at the later sample.
    pub comm: String,
    /// User time used.
    pub user_ns: u64,
    /// System time used.
    pub system_ns: u64,
    /// schedstat run time used.
    pub run_ns: u64,
}

/// CPU used by a process between two samples (`after - before`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProcessDelta {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub comm: String,
    /// Wall time between the samples.
    pub wall_ns: u64,
    /// User time (tick resolution, includes threads that exited in between).
    pub user_ns: u64,
    /// System time (tick resolution, includes threads that exited in between).
    pub system_ns: u64,
    /// schedstat run time of the threads alive at the later sample (ns resolution).
    pub run_ns: u64,
    /// Threads at the later sample.
    pub thread_count: usize,
    /// Per-thread deltas, sorted by tid, threads with no run time in between left out.
    pub threads: Vec<ThreadDelta>,
    /// Threads present at the earlier sample and gone at the later one.
    pub exited_threads: usize,
}

/// Per-request averages of a [`ProcessDelta`], in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ProcessPerRequest {
    /// User time per request.
    pub user_us: f64,
    /// System time per request.
    pub system_us: f64,
    /// User + system per request.
    pub busy_us: f64,
    /// schedstat run time per request.
    pub run_us: f64,
}

fn per(ns: u64, n: u64) -> f64 {
    if n == 0 {
        f64::NAN
    } else {
        ns as f64 / 1000.0 / n as f64
    }
}

impl ProcessSample {
    /// `self - before`. Counters that went backwards (a different process reusing the pid)
    /// saturate at zero rather than wrapping.
    pub fn delta(&self, before: &ProcessSample) -> ProcessDelta {
        let threads = self
            .threads
            .iter()
            .filter_map(|t| {
                let b = before.threads.iter().find(|b| b.tid == t.tid);
                let d = ThreadDelta {
                    tid: t.tid,
                    comm: t.comm.clone(),
                    user_ns: t.user_ns.saturating_sub(b.map_or(0, |b| b.user_ns)),
                    system_ns: t.system_ns.saturating_sub(b.map_or(0, |b| b.system_ns)),
                    run_ns: t.run_ns.saturating_sub(b.map_or(0, |b| b.run_ns)),
                };
                (d.run_ns > 0 || d.user_ns > 0 || d.system_ns > 0).then_some(d)
            })
            .collect();
        // Run time per thread, summed: a thread that exited in between loses its share, one
        // that appeared counts whole. The sum of the two process totals would be wrong in both
        // cases, so this is the better estimate of "time on CPU during the interval".
        let run_ns = self
            .threads
            .iter()
            .map(|t| {
                let b = before.threads.iter().find(|b| b.tid == t.tid);
                t.run_ns.saturating_sub(b.map_or(0, |b| b.run_ns))
            })
            .sum();
        let exited_threads = before
            .threads
            .iter()
            .filter(|b| !self.threads.iter().any(|t| t.tid == b.tid))
            .count();
        ProcessDelta {
            pid: self.pid,
            exited_threads,
            comm: self.comm.clone(),
            wall_ns: self.taken_ns.saturating_sub(before.taken_ns),
            user_ns: self.user_ns.saturating_sub(before.user_ns),
            system_ns: self.system_ns.saturating_sub(before.system_ns),
            run_ns,
            thread_count: self.thread_count,
            threads,
        }
    }
}

impl std::ops::Sub<&ProcessSample> for &ProcessSample {
    type Output = ProcessDelta;
    fn sub(self, before: &ProcessSample) -> ProcessDelta {
        self.delta(before)
    }
}

impl ProcessDelta {
    /// User + system time (tick resolution).
    pub fn busy_ns(&self) -> u64 {
        self.user_ns + self.system_ns
    }

    /// Averages over `n` requests (NaN when `n` is 0).
    pub fn per_request(&self, n: u64) -> ProcessPerRequest {
        ProcessPerRequest {
            user_us: per(self.user_ns, n),
            system_us: per(self.system_ns, n),
            busy_us: per(self.busy_ns(), n),
            run_us: per(self.run_ns, n),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Per-thread attribution, grouped by thread name
// ---------------------------------------------------------------------------------------------

/// Name of the pseudo-group that holds CPU of threads that exited between the two samples.
pub const EXITED_THREADS: &str = "(exited threads)";

/// The group a thread name belongs to.
///
/// Names are kept as they are (so give long-lived threads distinct names), except the kernel's
/// io_uring helpers, which carry the owner's pid (`iou-sqp-1234`, `iou-wrk-1234`): those are
/// grouped as `iou-sqp` / `iou-wrk`, one group per kind, however many come and go.
pub fn thread_group_name(comm: &str) -> &str {
    for kind in ["iou-sqp", "iou-wrk"] {
        if let Some(rest) = comm.strip_prefix(kind)
            && let Some(digits) = rest.strip_prefix('-')
            && !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
        {
            return kind;
        }
    }
    comm
}

/// The CPU of threads that exited between two samples: what the process's user+system time
/// (`process_busy_ns`, which keeps exited threads' time) grew by beyond the live threads'
/// user+system (`live_busy_ns`). The kernel scales each thread's ticks and the group's
/// separately, so the two sums differ by up to about a tick per thread even when nothing
/// exited: unless threads are known to have exited (`exited_threads`, present at the earlier
/// sample and gone at the later), a remainder within one tick per live thread (and one more)
/// is that rounding and counts as zero. Threads that started and ended between the samples
/// are not known to either sample; only a remainder beyond the rounding reveals them.
pub fn exited_estimate(
    process_busy_ns: u64,
    live_busy_ns: u64,
    live_threads: usize,
    exited_threads: usize,
) -> u64 {
    let rest = process_busy_ns.saturating_sub(live_busy_ns);
    let tick = ticks_to_ns(1, clock_ticks_per_second());
    let rounding = tick.saturating_mul(live_threads as u64 + 1);
    if exited_threads > 0 || rest > rounding {
        rest
    } else {
        0
    }
}

/// CPU of one group of same-named threads between two samples.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ThreadGroupCpu {
    /// Thread name (see [`thread_group_name`]), or [`EXITED_THREADS`].
    pub name: String,
    /// Threads of this name seen at the later sample with CPU in the interval (0 for the
    /// exited-threads group, whose members are gone).
    pub threads: usize,
    /// Time on CPU in the interval: schedstat run time (ns resolution), except for the
    /// exited-threads group, which can only be estimated from tick-based user+system time.
    pub cpu_ns: u64,
    /// `cpu_ns` per request in microseconds (NaN when no request was counted).
    pub per_request_us: f64,
}

/// Per-thread CPU between two samples of one process, grouped by thread name, largest first.
///
/// - Threads alive at both samples count their difference; threads that appeared in between
///   count whole (they started at zero).
/// - Threads that exited in between are gone from `task/`, but their user+system time stays in
///   the process totals of `/proc/PID/stat`. What the totals grew by beyond the per-thread
///   user+system deltas is reported as one [`EXITED_THREADS`] group (tick resolution; see
///   [`exited_estimate`] for when it is left out as rounding): an estimate, not an exact
///   figure.
pub fn thread_groups(delta: &ProcessDelta, requests: u64) -> Vec<ThreadGroupCpu> {
    let mut groups: Vec<ThreadGroupCpu> = Vec::new();
    for t in &delta.threads {
        let name = thread_group_name(&t.comm);
        match groups.iter_mut().find(|g| g.name == name) {
            Some(g) => {
                g.threads += 1;
                g.cpu_ns += t.run_ns;
            }
            None => groups.push(ThreadGroupCpu {
                name: name.to_string(),
                threads: 1,
                cpu_ns: t.run_ns,
                per_request_us: 0.0,
            }),
        }
    }
    let live_ticks: u64 = delta.threads.iter().map(|t| t.user_ns + t.system_ns).sum();
    let exited = exited_estimate(
        delta.busy_ns(),
        live_ticks,
        delta.threads.len(),
        delta.exited_threads,
    );
    if exited > 0 {
        groups.push(ThreadGroupCpu {
            name: EXITED_THREADS.to_string(),
            threads: 0,
            cpu_ns: exited,
            per_request_us: 0.0,
        });
    }
    for g in &mut groups {
        g.per_request_us = per(g.cpu_ns, requests);
    }
    groups.sort_by(|a, b| b.cpu_ns.cmp(&a.cpu_ns).then_with(|| a.name.cmp(&b.name)));
    groups
}

// ---------------------------------------------------------------------------------------------
// Host samples
// ---------------------------------------------------------------------------------------------

/// The time categories of one `/proc/stat` cpu line, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CpuTimes {
    /// Normal user time.
    pub user: u64,
    /// Niced user time.
    pub nice: u64,
    /// Kernel time outside interrupts.
    pub system: u64,
    /// Idle.
    pub idle: u64,
    /// Idle while I/O was outstanding.
    pub iowait: u64,
    /// Hard interrupts.
    pub irq: u64,
    /// Soft interrupts (network receive processing lands here when not in a task's context).
    pub softirq: u64,
    /// Time stolen by the hypervisor.
    pub steal: u64,
}

impl CpuTimes {
    /// Time doing work: user + nice + system + irq + softirq (not idle, iowait or steal).
    pub fn busy_ns(&self) -> u64 {
        self.user + self.nice + self.system + self.irq + self.softirq
    }

    /// Every category.
    pub fn total_ns(&self) -> u64 {
        self.busy_ns() + self.idle + self.iowait + self.steal
    }

    fn sub(&self, b: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(b.user),
            nice: self.nice.saturating_sub(b.nice),
            system: self.system.saturating_sub(b.system),
            idle: self.idle.saturating_sub(b.idle),
            iowait: self.iowait.saturating_sub(b.iowait),
            irq: self.irq.saturating_sub(b.irq),
            softirq: self.softirq.saturating_sub(b.softirq),
            steal: self.steal.saturating_sub(b.steal),
        }
    }
}

/// One CPU's line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PerCpu {
    /// CPU number (`cpuN`).
    pub cpu: u32,
    /// Its times.
    pub times: CpuTimes,
}

/// The whole host at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HostSample {
    /// CLOCK_MONOTONIC when the sample was taken.
    pub taken_ns: u64,
    /// The aggregate `cpu` line.
    pub total: CpuTimes,
    /// The `cpuN` lines.
    pub cpus: Vec<PerCpu>,
}

/// Parse the text of `/proc/stat` (values in clock ticks, converted with `hz`).
pub fn parse_proc_stat(text: &str, hz: u64) -> io::Result<(CpuTimes, Vec<PerCpu>)> {
    let mut total = None;
    let mut cpus = Vec::new();
    for line in text.lines() {
        let mut it = line.split_ascii_whitespace();
        let Some(name) = it.next() else { continue };
        let Some(suffix) = name.strip_prefix("cpu") else {
            continue;
        };
        let mut v = [0u64; 8];
        for (i, slot) in v.iter_mut().enumerate() {
            match it.next() {
                Some(s) => *slot = s.parse().map_err(|_| invalid("/proc/stat: bad number"))?,
                // Old kernels have fewer columns; the first four always exist.
                None if i >= 4 => break,
                None => return Err(invalid("/proc/stat: short cpu line")),
            }
        }
        let t = CpuTimes {
            user: ticks_to_ns(v[0], hz),
            nice: ticks_to_ns(v[1], hz),
            system: ticks_to_ns(v[2], hz),
            idle: ticks_to_ns(v[3], hz),
            iowait: ticks_to_ns(v[4], hz),
            irq: ticks_to_ns(v[5], hz),
            softirq: ticks_to_ns(v[6], hz),
            steal: ticks_to_ns(v[7], hz),
        };
        if suffix.is_empty() {
            total = Some(t);
        } else {
            let cpu = suffix
                .parse()
                .map_err(|_| invalid("/proc/stat: bad cpu number"))?;
            cpus.push(PerCpu { cpu, times: t });
        }
    }
    let total = total.ok_or_else(|| invalid("/proc/stat: no cpu line"))?;
    Ok((total, cpus))
}

impl HostSample {
    /// Sample `/proc/stat`.
    pub fn sample() -> io::Result<HostSample> {
        let taken_ns = monotonic_ns();
        let text = fs::read_to_string("/proc/stat")?;
        let (total, cpus) = parse_proc_stat(&text, clock_ticks_per_second())?;
        Ok(HostSample {
            taken_ns,
            total,
            cpus,
        })
    }

    /// `self - before`.
    pub fn delta(&self, before: &HostSample) -> HostDelta {
        let cpus = self
            .cpus
            .iter()
            .map(|c| {
                let b = before
                    .cpus
                    .iter()
                    .find(|b| b.cpu == c.cpu)
                    .map_or_else(CpuTimes::default, |b| b.times);
                PerCpu {
                    cpu: c.cpu,
                    times: c.times.sub(&b),
                }
            })
            .collect();
        HostDelta {
            wall_ns: self.taken_ns.saturating_sub(before.taken_ns),
            total: self.total.sub(&before.total),
            cpus,
        }
    }
}

impl std::ops::Sub<&HostSample> for &HostSample {
    type Output = HostDelta;
    fn sub(self, before: &HostSample) -> HostDelta {
        self.delta(before)
    }
}

/// Host CPU used between two samples.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HostDelta {
    /// Wall time between the samples.
    pub wall_ns: u64,
    /// All CPUs together.
    pub total: CpuTimes,
    /// Each CPU.
    pub cpus: Vec<PerCpu>,
}

/// Per-request averages of a [`HostDelta`], in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HostPerRequest {
    /// user + nice.
    pub user_us: f64,
    /// system.
    pub system_us: f64,
    /// irq.
    pub irq_us: f64,
    /// softirq.
    pub softirq_us: f64,
    /// Busy time of all CPUs: CPUs x wall time minus idle, iowait and steal
    /// ([`HostDelta::busy_ns`]).
    pub busy_us: f64,
    /// The sum of the tick-sampled busy categories ([`CpuTimes::busy_ns`]), for comparison.
    pub busy_ticks_us: f64,
}

impl HostDelta {
    /// Busy time of all CPUs together: each CPU's wall time minus its idle, iowait and steal.
    ///
    /// Not the sum of the busy categories: with a tickless kernel, idle time in `/proc/stat`
    /// is measured precisely while user/system/softirq are sampled at timer ticks, and short
    /// bursts of work between ticks (a server at 1,000 requests/s) are largely missed — on
    /// the development VM the categories showed a tenth of the CPU the server's own schedstat
    /// reported. Idle is the precise quantity, so busy is derived from it.
    pub fn busy_ns(&self) -> u64 {
        let wall = self.wall_ns.saturating_mul(self.cpus.len().max(1) as u64);
        let t = &self.total;
        wall.saturating_sub(t.idle + t.iowait + t.steal)
    }

    /// Averages over `n` requests (NaN when `n` is 0).
    pub fn per_request(&self, n: u64) -> HostPerRequest {
        let t = &self.total;
        HostPerRequest {
            user_us: per(t.user + t.nice, n),
            system_us: per(t.system, n),
            irq_us: per(t.irq, n),
            softirq_us: per(t.softirq, n),
            busy_us: per(self.busy_ns(), n),
            busy_ticks_us: per(t.busy_ns(), n),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Softirq counts
// ---------------------------------------------------------------------------------------------

/// Network softirq counts from `/proc/softirqs` at one instant.
///
/// These are exact *event counts* (how many times NET_RX / NET_TX softirqs ran on each CPU),
/// not time: the only softirq *time* the kernel exposes without tracing is the tick-sampled
/// softirq column of `/proc/stat` ([`CpuTimes::softirq`]), which misses short bursts between
/// ticks. Report the counts as precise and the column as an estimate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SoftirqSample {
    /// CLOCK_MONOTONIC when the sample was taken.
    pub taken_ns: u64,
    /// NET_RX count per CPU (index = column = CPU number in `/proc/softirqs`).
    pub net_rx: Vec<u64>,
    /// NET_TX count per CPU.
    pub net_tx: Vec<u64>,
}

/// Parse the text of `/proc/softirqs` into (NET_RX, NET_TX) counts per CPU column.
pub fn parse_softirqs(text: &str) -> io::Result<(Vec<u64>, Vec<u64>)> {
    let row = |name: &str| -> io::Result<Vec<u64>> {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .ok_or_else(|| invalid("/proc/softirqs: missing row"))?;
        line.trim_start()[name.len()..]
            .split_ascii_whitespace()
            .map(|v| v.parse().map_err(|_| invalid("/proc/softirqs: bad number")))
            .collect()
    };
    Ok((row("NET_RX:")?, row("NET_TX:")?))
}

impl SoftirqSample {
    /// Sample `/proc/softirqs`.
    pub fn sample() -> io::Result<SoftirqSample> {
        let taken_ns = monotonic_ns();
        let (net_rx, net_tx) = parse_softirqs(&fs::read_to_string("/proc/softirqs")?)?;
        Ok(SoftirqSample {
            taken_ns,
            net_rx,
            net_tx,
        })
    }

    /// `self - before` (counters that went backwards saturate at zero).
    pub fn delta(&self, before: &SoftirqSample) -> SoftirqDelta {
        let sub = |a: &[u64], b: &[u64]| -> Vec<u64> {
            a.iter()
                .enumerate()
                .map(|(i, v)| v.saturating_sub(b.get(i).copied().unwrap_or(0)))
                .collect()
        };
        let net_rx_per_cpu = sub(&self.net_rx, &before.net_rx);
        let net_tx_per_cpu = sub(&self.net_tx, &before.net_tx);
        SoftirqDelta {
            wall_ns: self.taken_ns.saturating_sub(before.taken_ns),
            net_rx: net_rx_per_cpu.iter().sum(),
            net_tx: net_tx_per_cpu.iter().sum(),
            net_rx_per_cpu,
            net_tx_per_cpu,
        }
    }
}

/// Network softirqs that ran between two samples (exact counts, not time).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SoftirqDelta {
    /// Wall time between the samples.
    pub wall_ns: u64,
    /// NET_RX softirqs, all CPUs.
    pub net_rx: u64,
    /// NET_TX softirqs, all CPUs.
    pub net_tx: u64,
    /// NET_RX per CPU.
    pub net_rx_per_cpu: Vec<u64>,
    /// NET_TX per CPU.
    pub net_tx_per_cpu: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn parses_stat_with_hostile_comm() {
        let text = "4242 ((a b) c)) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 37 0 0 20 0 7 0 12345 1000000 500 18446744073709551615 1 1 0 0 0 0 0 \
                    0 0 0 0 0 17 1 0 0 0 0 0\n";
        let s = parse_pid_stat(text).unwrap();
        assert_eq!(s.pid, 4242);
        assert_eq!(s.comm, "(a b) c)");
        assert_eq!(s.utime_ticks, 250);
        assert_eq!(s.stime_ticks, 37);
        assert_eq!(s.num_threads, 7);
        assert!(parse_pid_stat("12 (x) S 1 2").is_err());
        assert!(parse_pid_stat("garbage").is_err());
    }

    #[test]
    fn parses_schedstat() {
        assert_eq!(parse_schedstat("123456789 5000 42\n").unwrap(), 123_456_789);
        assert!(parse_schedstat("").is_err());
    }

    #[test]
    fn parses_proc_stat() {
        let text = "cpu  100 2 30 4000 5 6 7 8 0 0\n\
                    cpu0 50 1 15 2000 2 3 4 4 0 0\n\
                    cpu1 50 1 15 2000 3 3 3 4 0 0\n\
                    intr 12345 0 0\n\
                    ctxt 999\n\
                    softirq 1 2 3\n";
        let (total, cpus) = parse_proc_stat(text, 100).unwrap();
        assert_eq!(total.user, 1_000_000_000);
        assert_eq!(total.nice, 20_000_000);
        assert_eq!(total.system, 300_000_000);
        assert_eq!(total.idle, 40_000_000_000);
        assert_eq!(total.iowait, 50_000_000);
        assert_eq!(total.irq, 60_000_000);
        assert_eq!(total.softirq, 70_000_000);
        assert_eq!(total.steal, 80_000_000);
        assert_eq!(cpus.len(), 2);
        assert_eq!(cpus[1].cpu, 1);
        assert_eq!(cpus[1].times.iowait, 30_000_000);
        assert_eq!(total.busy_ns(), (100 + 2 + 30 + 6 + 7) * 10_000_000);
        assert!(parse_proc_stat("intr 1\n", 100).is_err());
    }

    #[test]
    fn host_delta_and_per_request() {
        // Two CPUs over one second: 1.5 s idle in all, so 0.5 s busy, although the
        // tick-sampled categories only caught 0.04 s of it (tickless accounting).
        let t0 = "cpu 1 0 1 1 0 0 1 0\ncpu0 1 0 1 0 0 0 1 0\ncpu1 0 0 0 1 0 0 0 0\n";
        let t1 = "cpu 3 0 2 151 0 0 2 0\ncpu0 3 0 2 70 0 0 2 0\ncpu1 0 0 0 81 0 0 0 0\n";
        let (total0, cpus0) = parse_proc_stat(t0, 100).unwrap();
        let (total1, cpus1) = parse_proc_stat(t1, 100).unwrap();
        let before = HostSample {
            taken_ns: 0,
            total: total0,
            cpus: cpus0,
        };
        let after = HostSample {
            taken_ns: 1_000_000_000,
            total: total1,
            cpus: cpus1,
        };
        let d = &after - &before;
        assert_eq!(d.busy_ns(), 500_000_000);
        let p = d.per_request(1000);
        assert!((p.busy_us - 500.0).abs() < 1e-9);
        assert!((p.busy_ticks_us - 40.0).abs() < 1e-9);
        assert!((p.softirq_us - 10.0).abs() < 1e-9);
        assert!(d.per_request(0).busy_us.is_nan());
    }

    #[test]
    fn samples_this_process_and_sees_a_busy_thread() {
        let pid = std::process::id();
        let before = ProcessCpu::sample(pid).unwrap();
        assert!(before.thread_count >= 1);
        // The burner stops at 50 ms of its own CPU time (not wall time: on a loaded machine a
        // wall-clock burn can get a fraction of that), says so, and stays alive until the
        // second sample so that it is still in task/.
        let (burnt_tx, burnt_rx) = std::sync::mpsc::channel();
        let (sampled_tx, sampled_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("burner".into())
            .spawn(move || {
                let cpu = || {
                    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
                    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
                };
                let mut x = 0u64;
                while cpu() < Duration::from_millis(50) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
                burnt_tx.send(()).unwrap();
                let _ = sampled_rx.recv();
                x
            })
            .unwrap();
        let started = Instant::now();
        burnt_rx.recv().unwrap();
        // At least 90 ms of wall time between the samples (the wall_ns check below).
        std::thread::sleep(Duration::from_millis(100).saturating_sub(started.elapsed()));
        let after = ProcessCpu::sample(pid).unwrap();
        sampled_tx.send(()).unwrap();
        h.join().unwrap();
        let d = after.delta(&before);
        assert!(d.run_ns >= 20_000_000, "run_ns grew by only {}", d.run_ns);
        assert!(
            d.threads.iter().any(|t| t.comm == "burner"),
            "threads: {:?}",
            d.threads
        );
        assert!(after.threads.iter().any(|t| t.comm == "burner"));
        assert!(d.wall_ns >= 90_000_000);
        let host = HostSample::sample().unwrap();
        assert!(!host.cpus.is_empty());
        assert!(host.total.total_ns() > 0);
    }

    /// Write a fake `/proc/PID` with the given threads (tid, comm, utime, stime ticks, run ns)
    /// and process totals (utime, stime ticks).
    fn fake_proc(
        root: &Path,
        pid: u32,
        totals: (u64, u64),
        threads: &[(u32, &str, u64, u64, u64)],
    ) {
        let stat = |id: u32, comm: &str, u: u64, s: u64, n: usize| {
            format!(
                "{id} ({comm}) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 {u} {s} 0 0 20 0 {n} 0 1 1 1\n"
            )
        };
        let base = root.join(pid.to_string());
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(base.join("task")).unwrap();
        fs::write(
            base.join("stat"),
            stat(pid, "bgs", totals.0, totals.1, threads.len()),
        )
        .unwrap();
        for &(tid, comm, u, s, run) in threads {
            let d = base.join("task").join(tid.to_string());
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("stat"), stat(tid, comm, u, s, threads.len())).unwrap();
            fs::write(d.join("schedstat"), format!("{run} 777 12\n")).unwrap();
        }
    }

    #[test]
    fn groups_threads_by_name_from_fixture_proc() {
        let root = std::env::temp_dir().join(format!("bgs-cpuacct-{}", std::process::id()));
        let pid = 4242;
        // Before: main, two executor threads of the same name, an SQPOLL thread, and a
        // worker (5000) that exits before the second sample with 30 ticks (0.3 s) in all.
        fake_proc(
            &root,
            pid,
            (100, 50),
            &[
                (4242, "bgs", 10, 5, 100_000_000),
                (4243, "bgs-gpu-notify", 0, 1, 5_000_000),
                (4244, "bgs-cpu-exec", 20, 0, 150_000_000),
                (4245, "bgs-cpu-exec", 20, 0, 150_000_000),
                (4246, "iou-sqp-4242", 0, 10, 80_000_000),
                (5000, "io-burst", 15, 15, 300_000_000),
            ],
        );
        let before = ProcessCpu::sample_at(&root, pid).unwrap();
        assert_eq!(before.thread_count, 6);
        // After: 5000 is gone (it used 10 more ticks before exiting, which only the process
        // totals show); a new io-wq worker appeared.
        fake_proc(
            &root,
            pid,
            (100 + 10 + 30 + 20 + 10, 50 + 5 + 2 + 5 + 3),
            &[
                (4242, "bgs", 20, 10, 200_000_000),
                (4243, "bgs-gpu-notify", 0, 3, 25_000_000),
                (4244, "bgs-cpu-exec", 50, 0, 450_000_000),
                (4245, "bgs-cpu-exec", 40, 0, 350_000_000),
                (4246, "iou-sqp-4242", 0, 15, 130_000_000),
                (4247, "iou-wrk-4242", 0, 3, 30_000_000),
            ],
        );
        let after = ProcessCpu::sample_at(&root, pid).unwrap();
        let _ = fs::remove_dir_all(&root);
        let d = after.delta(&before);
        assert_eq!(d.exited_threads, 1);
        let g = thread_groups(&d, 1000);
        let find = |n: &str| {
            g.iter()
                .find(|x| x.name == n)
                .unwrap_or_else(|| panic!("{n}: {g:?}"))
        };
        // Same-named threads are summed (schedstat deltas 300 ms + 200 ms).
        let exec = find("bgs-cpu-exec");
        assert_eq!((exec.threads, exec.cpu_ns), (2, 500_000_000));
        assert!((exec.per_request_us - 500.0).abs() < 1e-9);
        assert_eq!(find("bgs").cpu_ns, 100_000_000);
        assert_eq!(find("bgs-gpu-notify").cpu_ns, 20_000_000);
        // The pid suffix of io_uring helpers is dropped; a new thread counts whole.
        assert_eq!(find("iou-sqp").cpu_ns, 50_000_000);
        assert_eq!(find("iou-wrk").cpu_ns, 30_000_000);
        // Process user+sys grew by 85 ticks, the live threads' by 75: the remaining 10 ticks
        // (100 ms at 100 Hz) are the exited thread's.
        let exited = find(EXITED_THREADS);
        assert_eq!(exited.cpu_ns, ticks_to_ns(10, clock_ticks_per_second()));
        assert_eq!(exited.threads, 0);
        // Largest first.
        assert!(g.windows(2).all(|w| w[0].cpu_ns >= w[1].cpu_ns), "{g:?}");
        assert_eq!(g[0].name, "bgs-cpu-exec");
        // Nothing exited and the totals differ from the threads' sum by a tick of rounding:
        // no exited-threads group. Two ticks beyond the rounding allowance: reported.
        let tick = ticks_to_ns(1, clock_ticks_per_second());
        assert_eq!(exited_estimate(10 * tick, 9 * tick, 3, 0), 0);
        assert_eq!(exited_estimate(10 * tick, 4 * tick, 3, 0), 6 * tick);
        assert_eq!(exited_estimate(10 * tick, 9 * tick, 3, 1), tick);
        // No requests: per-request values are NaN, not a division by zero.
        assert!(
            thread_groups(&d, 0)
                .iter()
                .all(|x| x.per_request_us.is_nan())
        );
    }

    #[test]
    fn group_names() {
        assert_eq!(thread_group_name("iou-sqp-1234"), "iou-sqp");
        assert_eq!(thread_group_name("iou-wrk-9"), "iou-wrk");
        assert_eq!(thread_group_name("iou-wrk-"), "iou-wrk-");
        assert_eq!(thread_group_name("iou-wrk-x1"), "iou-wrk-x1");
        assert_eq!(thread_group_name("bgs-cpu-exec-3"), "bgs-cpu-exec-3");
    }

    #[test]
    fn parses_softirqs_and_subtracts() {
        let t0 = "                    CPU0       CPU1\n          HI:          0          0\n      NET_TX:          4          0\n      NET_RX:    2453498    2778219\n";
        let t1 = "                    CPU0       CPU1\n          HI:          0          0\n      NET_TX:          6          1\n      NET_RX:    2453598    2778229\n";
        let (rx, tx) = parse_softirqs(t0).unwrap();
        assert_eq!(rx, vec![2_453_498, 2_778_219]);
        assert_eq!(tx, vec![4, 0]);
        let (rx1, tx1) = parse_softirqs(t1).unwrap();
        let a = SoftirqSample {
            taken_ns: 0,
            net_rx: rx,
            net_tx: tx,
        };
        let b = SoftirqSample {
            taken_ns: 5,
            net_rx: rx1,
            net_tx: tx1,
        };
        let d = b.delta(&a);
        assert_eq!((d.net_rx, d.net_tx, d.wall_ns), (110, 3, 5));
        assert_eq!(d.net_rx_per_cpu, vec![100, 10]);
        assert!(parse_softirqs("HI: 1 2\n").is_err());
        assert!(SoftirqSample::sample().is_ok());
    }
}
