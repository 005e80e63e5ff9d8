//! The threads a step computes on.
//!
//! A decode step is some thirty parallel products, each tens to hundreds of microseconds.
//! Run from a thread outside rayon's pool, each one injects a job, wakes the workers and
//! sleeps on a latch until they finish; between products the workers fall asleep again. On a
//! two-core virtual machine about 12% of a decode step's samples were in the scheduler
//! (`perf`, the llama.cpp comparison's model: futex waits, wake-ups, yields). So a step runs
//! *on* a pool of its own:
//! - the step's thread is one of the pool's workers, so each product forks and joins by work
//!   stealing, without a latch;
//! - for as long as the step runs, the pool's other workers stay awake looking for work
//!   ([`rayon::yield_now`]), so no fork waits for a sleeping thread (llama.cpp's threads spin
//!   between operations the same way). A worker that finds nothing for [`IDLE_LIMIT`] goes
//!   back to sleep: a step that waits for device slots, a GPU or a peer gives their cores back;
//! - nothing else runs there. A step may block its worker while it waits for a device actor,
//!   a GPU or a peer; those compute on their own threads or on the global pool, never on this
//!   one, so a blocked step cannot starve the work it waits for.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a worker keeps looking for work that does not come before it sleeps. Longer than
/// the serial parts of a step (norms, routing, one row's attention: microseconds), shorter
/// than a wait for other threads is worth spinning through.
const IDLE_LIMIT: Duration = Duration::from_micros(500);

fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        // As many threads as the global pool (RAYON_NUM_THREADS, else the CPUs).
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("step-{i}"))
            .build()
            .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
            .expect("a rayon pool of one thread")
    })
}

/// Runs `step` on the step pool, its other workers kept awake until it returns. It runs in
/// the caller's current span (a traced step's dispatches are recorded under it).
pub(crate) fn run<R: Send>(step: impl FnOnce() -> R + Send) -> R {
    let span = tracing::Span::current();
    let step = move || span.in_scope(step);
    pool().install(|| {
        let done = AtomicBool::new(false);
        let home = rayon::current_thread_index();
        let stay_awake = || {
            // The step's own thread can meet a helper while it waits in a join: it has
            // better things to do.
            if rayon::current_thread_index() == home {
                return;
            }
            let mut idle_since = Instant::now();
            while !done.load(Ordering::Acquire) {
                match rayon::yield_now() {
                    Some(rayon::Yield::Executed) => idle_since = Instant::now(),
                    _ if idle_since.elapsed() >= IDLE_LIMIT => return,
                    _ => std::hint::spin_loop(),
                }
            }
        };
        rayon::scope(|scope| {
            for _ in 1..rayon::current_num_threads() {
                scope.spawn(|_| stay_awake());
            }
            let result = step();
            done.store(true, Ordering::Release);
            result
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn a_step_runs_its_products_on_the_step_pool_and_returns_their_result() {
        let (sum, on_pool) = run(|| {
            let sum: u64 = (0..10_000u64).into_par_iter().map(|x| x * x).sum();
            (sum, rayon::current_thread_index().is_some())
        });
        assert_eq!(sum, (0..10_000u64).map(|x| x * x).sum::<u64>());
        assert!(on_pool);
    }

    #[test]
    fn a_step_that_waits_for_the_global_pool_is_not_in_its_way() {
        // The step waits for a thread of its own whose work needs every thread of the
        // global pool (a broadcast), as it waits for a device actor. Were the step's thread
        // one of the global pool's, the broadcast would never finish.
        for _ in 0..20 {
            let answer = run(|| {
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let threads = rayon::broadcast(|_| 1usize).len();
                    let _ = tx.send(threads);
                });
                rx.recv_timeout(Duration::from_secs(10))
            });
            assert_eq!(answer, Ok(rayon::current_num_threads()));
        }
    }

    #[test]
    fn steps_from_several_threads_each_get_their_answer() {
        let results: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4u64)
                .map(|i| s.spawn(move || run(|| (0..=i * 100).into_par_iter().sum::<u64>())))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected: Vec<u64> = (0..4u64).map(|i| (0..=i * 100).sum()).collect();
        assert_eq!(results, expected);
    }

    #[test]
    fn a_panicking_step_reaches_its_caller_and_the_pool_still_serves() {
        let caught = std::panic::catch_unwind(|| run(|| panic!("a step failed")));
        assert!(caught.is_err());
        assert_eq!(run(|| 7), 7);
    }
}
