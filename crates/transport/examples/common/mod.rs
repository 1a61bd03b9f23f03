//! Shared by the transport's measurement examples (`stream_cost`, `oneshot_poll`): pinning a
//! thread to a CPU and reading a thread's CPU time (or a transport's, helper threads included).

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

/// CPU time (schedstat, ns) and voluntary context switches (sleeps) of the transport: thread
/// `tid` and this process's threads that serve it (the executor-sqe stage, io_uring's SQPOLL
/// and worker threads).
pub fn transport_usage(tid: i32) -> (u64, u64) {
    let sleeps = |id: i32| {
        std::fs::read_to_string(format!("/proc/self/task/{id}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (mut ns, mut n) = (thread_run_ns(tid), sleeps(tid));
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if ["bgs-exec-sqe", "iou-sqp", "iou-wrk"]
            .iter()
            .any(|p| comm.starts_with(p))
            && let Some(id) = t.file_name().to_str().and_then(|n| n.parse().ok())
        {
            ns += thread_run_ns(id);
            n += sleeps(id);
        }
    }
    (ns, n)
}
