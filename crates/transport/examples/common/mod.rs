//! Shared by the transport's measurement examples (`stream_cost`, `oneshot_poll`): pinning a
//! thread to a CPU and reading a thread's CPU time.

/// Pin the calling thread to `cpu` (a warning, not a failure, where that is refused).
pub fn pin(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("pinning to CPU {cpu}: {e} (left unpinned)");
    }
}

/// CPU time (schedstat run time, ns) of thread `tid` of this process; 0 if unreadable.
pub fn thread_run_ns(tid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
