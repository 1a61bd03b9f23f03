//! CPU accounting against a process that burns a known amount of user and system time in
//! several threads. The child is this test binary re-executed (`burn_child`); each of its
//! threads stops when its own thread CPU clock reaches the target, so the CPU used is known
//! however loaded the machine is. Tolerances are generous (2-core CI machine, shared): the
//! schedstat total within -20%/+30% of the target, and each tick-based part at least half of
//! what it should be.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use bgs_cpuacct::ProcessCpu;

const USER_THREADS: u64 = 2;
const SYS_THREADS: u64 = 1;
const TARGET: Duration = Duration::from_millis(300);

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn burn_user() {
    let mut x = 1u64;
    while thread_cpu() < TARGET {
        for _ in 0..10_000 {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
        }
    }
}

fn burn_system() {
    // Reading /dev/zero is a kernel memset into our buffer: nearly all system time.
    let mut f = std::fs::File::open("/dev/zero").unwrap();
    let mut buf = vec![0u8; 1 << 20];
    while thread_cpu() < TARGET {
        f.read_exact(&mut buf).unwrap();
    }
}

/// The child: burns on "go", reports "BURN-DONE", keeps its threads alive until stdin closes
/// (schedstat only covers threads alive at the sample).
#[test]
fn burn_child() {
    if std::env::var_os("BGS_LAB_BURN").is_none() {
        return;
    }
    println!("BURN-READY");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let hold = std::sync::Arc::new(std::sync::Mutex::new(hold_rx));
    let mut hs = Vec::new();
    for i in 0..USER_THREADS + SYS_THREADS {
        let done = done_tx.clone();
        let hold = hold.clone();
        hs.push(std::thread::spawn(move || {
            if i < USER_THREADS {
                burn_user()
            } else {
                burn_system()
            }
            done.send(()).unwrap();
            let _ = hold.lock().unwrap().recv();
        }));
    }
    for _ in 0..USER_THREADS + SYS_THREADS {
        done_rx.recv().unwrap();
    }
    println!("BURN-DONE");
    std::io::stdout().flush().unwrap();
    let mut rest = String::new();
    let _ = std::io::stdin().read_to_string(&mut rest);
    drop(hold_tx);
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn measures_known_user_and_system_time() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["burn_child", "--exact", "--nocapture", "--test-threads=1"])
        .env("BGS_LAB_BURN", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let wait_for = |out: &mut BufReader<_>, what: &str| {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "child ended before {what}"
            );
            if line.trim().ends_with(what) {
                return;
            }
        }
    };
    wait_for(&mut out, "BURN-READY");
    let before = ProcessCpu::sample(pid).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    wait_for(&mut out, "BURN-DONE");
    let after = ProcessCpu::sample(pid).unwrap();
    drop(stdin);
    assert!(child.wait().unwrap().success());

    let d = after.delta(&before);
    let ms = |ns: u64| ns as f64 / 1e6;
    let target = TARGET.as_secs_f64() * 1e3;
    let want_user = target * USER_THREADS as f64;
    let want_sys = target * SYS_THREADS as f64;
    let want = want_user + want_sys;
    eprintln!(
        "measured: schedstat {:.1} ms (want {want:.0}), user {:.1} ms (want ~{want_user:.0}), system {:.1} ms (want ~{want_sys:.0}), {} threads",
        ms(d.run_ns),
        ms(d.user_ns),
        ms(d.system_ns),
        d.thread_count
    );
    assert!(d.thread_count > (USER_THREADS + SYS_THREADS) as usize);
    assert!(
        ms(d.run_ns) >= 0.8 * want && ms(d.run_ns) <= 1.3 * want,
        "schedstat total {:.1} ms, want {want:.0} ms -20%/+30%",
        ms(d.run_ns)
    );
    assert!(
        ms(d.user_ns) >= 0.5 * want_user,
        "user {:.1} ms",
        ms(d.user_ns)
    );
    assert!(
        ms(d.system_ns) >= 0.5 * want_sys,
        "system {:.1} ms",
        ms(d.system_ns)
    );
    assert!(
        ms(d.user_ns + d.system_ns) <= 1.3 * want + 30.0,
        "user+system {:.1} ms",
        ms(d.user_ns + d.system_ns)
    );
    // The burners show up in the per-thread breakdown, each with about its target.
    let busy: Vec<_> = d
        .threads
        .iter()
        .filter(|t| ms(t.run_ns) >= 0.8 * target)
        .collect();
    assert_eq!(
        busy.len() as u64,
        USER_THREADS + SYS_THREADS,
        "{:?}",
        d.threads
    );
}
