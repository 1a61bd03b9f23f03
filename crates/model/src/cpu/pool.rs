//! A persistent pool of worker threads for the forward pass's parallel loops.
//!
//! `run(f)` calls `f(0)` on the caller's thread and `f(1)..f(threads-1)` on the workers, and
//! returns when all have returned. Workers sleep on a condition variable between dispatches;
//! no thread is spawned per call. What each index computes is decided by the caller's
//! partition, so results never depend on which thread ran which index.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// The job of one dispatch, with its lifetime erased (see `Pool::run` for why it is sound).
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync`, and `Pool::run` keeps it alive until every worker that
// received the pointer has finished calling it.
unsafe impl Send for JobPtr {}

struct State {
    /// Bumped once per dispatch; a worker runs the job when it sees a new value.
    generation: u64,
    job: Option<JobPtr>,
    /// Workers that have not finished the current dispatch.
    pending: usize,
    /// A worker's panic payload, re-raised on the caller's thread.
    panic: Option<Box<dyn Any + Send>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic inside a job is caught before the lock is taken, so poisoning cannot
        // leave the state half-updated; recover the guard either way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Worker threads plus the calling thread.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Pool {
    /// A pool of `threads` participants (the caller and `threads - 1` workers).
    pub(crate) fn new(threads: usize) -> Result<Pool, String> {
        if threads == 0 {
            return Err("threads must be at least 1".into());
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                job: None,
                pending: 0,
                panic: None,
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for index in 1..threads {
            let shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("bgs-cpu-{index}"))
                .spawn(move || worker(&shared, index))
                .map_err(|e| format!("cannot spawn forward-pass worker thread: {e}"))?;
            workers.push(handle);
        }
        Ok(Pool { shared, workers })
    }

    /// Participants in every dispatch.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Call `f(i)` for every `i in 0..threads()`, concurrently, and wait for all of them.
    /// A panic in any call is re-raised here after all calls have ended.
    ///
    /// `&mut self`: one dispatch at a time, since the shared state holds one job.
    pub(crate) fn run(&mut self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        // SAFETY: only the lifetime is erased. The pointer is used by workers only between
        // this publication and their `pending -= 1`, and `WaitGuard` below blocks this
        // function (also when `f(0)` unwinds) until `pending` is 0, so `f` outlives every use.
        let job: *const (dyn Fn(usize) + Sync + 'static) =
            unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), _>(f as *const _) };
        {
            let mut st = self.shared.lock();
            st.generation = st.generation.wrapping_add(1);
            st.job = Some(JobPtr(job));
            st.pending = self.workers.len();
            self.shared.work.notify_all();
        }
        struct WaitGuard<'a>(&'a Shared);
        impl Drop for WaitGuard<'_> {
            fn drop(&mut self) {
                let mut st = self.0.lock();
                while st.pending > 0 {
                    st = self.0.done.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
                st.job = None;
            }
        }
        let guard = WaitGuard(&self.shared);
        f(0);
        drop(guard);
        let panic = self.shared.lock().panic.take();
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let job = {
            let mut st = shared.lock();
            while !st.shutdown && st.generation == seen {
                st = shared.work.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.shutdown {
                return;
            }
            seen = st.generation;
            st.job
        };
        let result = match job {
            // SAFETY: `Pool::run` keeps the job alive until this worker decrements `pending`.
            Some(JobPtr(f)) => catch_unwind(AssertUnwindSafe(|| unsafe { (*f)(index) })),
            None => Ok(()),
        };
        let mut st = shared.lock();
        if let Err(p) = result {
            st.panic.get_or_insert(p);
        }
        st.pending -= 1;
        if st.pending == 0 {
            shared.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The `part`-th of `parts` contiguous, near-equal pieces of `0..n`.
pub(crate) fn split(n: usize, parts: usize, part: usize) -> std::ops::Range<usize> {
    let base = n / parts;
    let extra = n % parts;
    let start = part * base + part.min(extra);
    let len = base + usize::from(part < extra);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_index_runs_once_per_dispatch() {
        let mut pool = Pool::new(3).unwrap();
        let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..100 {
            pool.run(&|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), 100);
        }
    }

    #[test]
    fn worker_panic_reaches_the_caller_and_the_pool_survives() {
        let mut pool = Pool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn split_covers_everything() {
        for n in 0..20 {
            for parts in 1..5 {
                let mut next = 0;
                for p in 0..parts {
                    let r = split(n, parts, p);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
