//! The steady-state claim of `--transport kernel --reply executor-sqe --sqpoll-above 0`: over a run of more
//! than 10,000 requests the server process makes no read/recv/send/write-family system call
//! at all (counted with the kernel's syscall tracepoints through `perf stat`), while every
//! reply arrives. Receive is done by BPF, replies by SQEs the executor writes and the SQPOLL
//! kernel thread submits.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use bgs_protocol::Op;
use common::{Server, load_config};

const SYSCALLS: [&str; 10] = [
    "read", "write", "readv", "writev", "recvfrom", "sendto", "recvmsg", "sendmsg", "recvmmsg",
    "sendmmsg",
];

fn ensure_tracefs() {
    if std::path::Path::new("/sys/kernel/tracing/events/syscalls").exists() {
        return;
    }
    let _ = Command::new("mount")
        .args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"])
        .status();
}

/// A FIFO opened read-write, so that opening it blocks on nobody (as `exec {fd}<>fifo`).
fn fifo(path: &std::path::Path) -> File {
    let _ = std::fs::remove_file(path);
    let ok = Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "mkfifo {}", path.display());
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap()
}

/// Tell perf (started with `--delay=-1 --control fifo:CTL,ACK`) to enable its counters, and
/// wait for its acknowledgement: from then on it is counting. A fixed sleep instead could end
/// before perf had attached on a loaded machine, and then the test proved nothing.
fn enable_perf(ctl: &mut File, ack: &mut File, perf: &mut std::process::Child) {
    ctl.write_all(b"enable\n").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    // perf writes "ack\n" and the string's terminating NUL.
    while !got.contains(&b'\n') {
        assert!(
            perf.try_wait().unwrap().is_none(),
            "perf exited before it started counting"
        );
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "perf did not acknowledge 'enable' in 30 s");
        let mut fds = [rustix::event::PollFd::new(
            &*ack,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        if rustix::event::poll(&mut fds, Some(&ts)).unwrap() > 0 {
            let mut b = [0u8; 16];
            let n = ack.read(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
        }
    }
    assert!(
        got.starts_with(b"ack\n"),
        "perf's answer to 'enable': {:?}",
        String::from_utf8_lossy(&got)
    );
}

#[test]
fn executor_sqe_makes_no_socket_io_syscalls() {
    ensure_tracefs();
    assert!(
        Command::new("perf").arg("--version").output().is_ok(),
        "perf is needed for this test (apt-get install linux-perf)"
    );
    let mut server = Server::start(&[
        "--transport",
        "kernel",
        "--reply",
        "executor-sqe",
        // The SQPOLL ring for every reply at any rate: the paper's claim. (The default,
        // adaptive submission, sends with system calls at this rate while the SQPOLL thread
        // sleeps: see `adaptive_submission_sends_itself_at_low_load` below.)
        "--sqpoll-above",
        "0",
        "--slots",
        "1",
    ]);
    let mut events: Vec<String> = SYSCALLS
        .iter()
        .map(|s| format!("syscalls:sys_enter_{s}"))
        .collect();
    // Submissions are not system calls either: only the watchdog's SQPOLL wake-ups enter.
    events.push("syscalls:sys_enter_io_uring_enter".into());
    // Every system call: proof that perf traced the server at all (the watchdog alone makes
    // thousands a second), so that zeros above mean "none made", not "nothing seen".
    events.push("raw_syscalls:sys_enter".into());
    let tmp = std::env::temp_dir();
    let out = tmp.join(format!("bgs-perf-{}.csv", server.pid()));
    let ctl_path = tmp.join(format!("bgs-perf-{}.ctl", server.pid()));
    let ack_path = tmp.join(format!("bgs-perf-{}.ack", server.pid()));
    let (mut ctl, mut ack) = (fifo(&ctl_path), fifo(&ack_path));
    let mut perf = Command::new("perf")
        .args(["stat", "-x", ",", "--delay=-1", "--control"])
        .arg(format!(
            "fifo:{},{}",
            ctl_path.display(),
            ack_path.display()
        ))
        .arg("-o")
        .arg(&out)
        .args(["-e", &events.join(","), "-p", &server.pid().to_string()])
        .spawn()
        .expect("start perf");
    enable_perf(&mut ctl, &mut ack, &mut perf);

    let mut cfg = load_config(server.addr, Op::Gemm8);
    cfg.requests = Some(12_000);
    cfg.rate = 6000.0;
    cfg.connections = 32;
    let report = bgs_load::run(&cfg).expect("load run");
    assert_eq!(report.failures + report.warmup_failures, 0, "{report}");
    assert_eq!(report.counts.ok, 12_000, "{report}");

    // perf prints its counts on SIGINT.
    let _ = Command::new("kill")
        .args(["-INT", &perf.id().to_string()])
        .status();
    perf.wait().unwrap();
    let text = std::fs::read_to_string(&out).expect("perf output");
    for p in [&out, &ctl_path, &ack_path] {
        let _ = std::fs::remove_file(p);
    }
    let mut seen = 0;
    let mut enters = None;
    let mut all = None;
    for line in text.lines().filter(|l| l.contains("sys_enter")) {
        let fields: Vec<&str> = line.split(',').collect();
        let count: u64 = fields[0].trim().parse().unwrap_or_else(|_| {
            panic!("perf could not count ({line}); is tracefs mounted and perf permitted?")
        });
        if line.contains("raw_syscalls:sys_enter") {
            all = Some(count);
            continue;
        }
        if line.contains("io_uring_enter") {
            enters = Some(count);
            continue;
        }
        assert_eq!(count, 0, "the server made socket I/O system calls: {line}");
        seen += 1;
    }
    assert_eq!(seen, SYSCALLS.len(), "perf output:\n{text}");
    let all = all.expect("raw_syscalls:sys_enter count");
    assert!(
        all > 0,
        "perf counted no system call of the server at all: it traced nothing\n{text}"
    );
    println!("system calls of the server while counted: {all}");
    let enters = enters.expect("io_uring_enter count");
    println!(
        "io_uring_enter calls during {} requests: {enters}",
        report.scheduled
    );
    // Every io_uring_enter must be one of the watchdog's SQPOLL wake-ups (which the server
    // counts): the executor's submissions themselves make none. How many wake-ups there are
    // depends on how often the SQPOLL thread went to sleep, i.e. on the machine's load.
    let (ok, stderr) = server.stop();
    assert!(ok, "{stderr}");
    let wakeups: u64 = stderr
        .split("wake-ups: ")
        .nth(1)
        // "wake-ups: N (M at the completion-wake safety timeout); ...": the first number.
        .and_then(|s| s.split([';', ' ']).next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no wake-up count in {stderr}"));
    println!("watchdog wake-ups over the whole run: {wakeups}");
    assert!(
        enters <= wakeups,
        "io_uring_enter was called {enters} times but the watchdog woke SQPOLL only {wakeups} \
         times: something else enters the ring"
    );
}

/// The number after `key` in the server's "adaptive submission: ..." stats line.
fn adaptive_count(stderr: &str, key: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("adaptive submission: "))
        .unwrap_or_else(|| panic!("no adaptive submission line in {stderr}"));
    let words: Vec<&str> = line
        .split([' ', '(', ','])
        .filter(|w| !w.is_empty())
        .collect();
    let at = words
        .windows(key.split(' ').count())
        .position(|w| w.join(" ") == key)
        .unwrap_or_else(|| panic!("no '{key}' in {line}"));
    words[at - 1].parse().unwrap()
}

/// The default `--reply executor-sqe` (adaptive submission): the stage sends with system
/// calls while replies come slower than `--sqpoll-above` and hands them to the SQPOLL thread
/// above it, waking that thread when it sleeps. Here the threshold is low (1,000/s) and the
/// load fast (20,000/s) so that one run crosses between the two ways; every reply must
/// arrive, in order, checked by the load generator.
#[test]
fn adaptive_submission_switches_between_system_calls_and_the_sqpoll_ring() {
    let mut server = Server::start(&[
        "--transport",
        "kernel",
        "--reply",
        "executor-sqe",
        "--sqpoll-above",
        "1000",
        "--slots",
        "1",
    ]);
    // Let the SQPOLL thread go to sleep after start-up (2 ms, then its idle time, 10 ms), so
    // that switching to the ring has to wake it.
    std::thread::sleep(Duration::from_millis(200));
    let mut slow = load_config(server.addr, Op::Gemm8);
    slow.requests = Some(200);
    slow.rate = 400.0;
    slow.connections = 4;
    let report = bgs_load::run(&slow).expect("slow load run");
    assert_eq!(report.failures + report.warmup_failures, 0, "{report}");
    std::thread::sleep(Duration::from_millis(200));
    let mut fast = load_config(server.addr, Op::Gemm8);
    fast.requests = Some(10_000);
    fast.rate = 20_000.0;
    fast.connections = 32;
    let report = bgs_load::run(&fast).expect("fast load run");
    assert_eq!(report.failures + report.warmup_failures, 0, "{report}");
    assert_eq!(report.counts.ok, 10_000, "{report}");
    let (ok, stderr) = server.stop();
    assert!(ok, "{stderr}");
    let direct = adaptive_count(&stderr, "sends made by the stage itself");
    let ring = adaptive_count(&stderr, "sends through the SQPOLL ring");
    let wakes = adaptive_count(&stderr, "SQPOLL wake-ups by the stage");
    println!(
        "adaptive submission: {direct} direct sends, {ring} through the ring, {wakes} SQPOLL wake-ups"
    );
    // The slow run's replies (400/s, under the threshold) go out as system calls; at least
    // its first one always does (empty rate window, empty queue). Not all of them for sure:
    // a client stalled on a loaded machine may send a burst that crosses the threshold.
    assert!(direct >= 1, "no direct sends:\n{stderr}");
    // The fast one's (20 times the threshold) went to the ring, and the SQPOLL thread,
    // asleep since the slow phase, sent them: so the stage woke it at least once (at
    // start-up it may or may not have had to).
    assert!(ring > 0, "no send went through the SQPOLL ring:\n{stderr}");
    assert!(
        wakes >= 1,
        "the stage never woke the SQPOLL thread:\n{stderr}"
    );
}
