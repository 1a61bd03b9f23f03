//! The steady-state claim of `--transport kernel --reply executor-sqe`: over a run of more
//! than 10,000 requests the server process makes no read/recv/send/write-family system call
//! at all (counted with the kernel's syscall tracepoints through `perf stat`), while every
//! reply arrives. Receive is done by BPF, replies by SQEs the executor writes and the SQPOLL
//! kernel thread submits.

mod common;

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
        "--slots",
        "1",
    ]);
    let mut events: Vec<String> = SYSCALLS
        .iter()
        .map(|s| format!("syscalls:sys_enter_{s}"))
        .collect();
    // Submissions are not system calls either: only the watchdog's SQPOLL wake-ups enter.
    events.push("syscalls:sys_enter_io_uring_enter".into());
    let out = std::env::temp_dir().join(format!("bgs-perf-{}.csv", server.pid()));
    let mut perf = Command::new("perf")
        .args(["stat", "-x", ",", "-o"])
        .arg(&out)
        .args(["-e", &events.join(","), "-p", &server.pid().to_string()])
        .spawn()
        .expect("start perf");
    std::thread::sleep(Duration::from_millis(500));

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
    let _ = std::fs::remove_file(&out);
    let mut seen = 0;
    let mut enters = None;
    for line in text.lines().filter(|l| l.contains("syscalls:sys_enter_")) {
        let fields: Vec<&str> = line.split(',').collect();
        let count: u64 = fields[0].trim().parse().unwrap_or_else(|_| {
            panic!("perf could not count ({line}); is tracefs mounted and perf permitted?")
        });
        if line.contains("io_uring_enter") {
            enters = Some(count);
            continue;
        }
        assert_eq!(count, 0, "the server made socket I/O system calls: {line}");
        seen += 1;
    }
    assert_eq!(seen, SYSCALLS.len(), "perf output:\n{text}");
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
        .and_then(|s| s.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no wake-up count in {stderr}"));
    println!("watchdog wake-ups over the whole run: {wakeups}");
    assert!(
        enters <= wakeups,
        "io_uring_enter was called {enters} times but the watchdog woke SQPOLL only {wakeups} \
         times: something else enters the ring"
    );
}
