//! Fan-out helpers of the object layer: grouping work per server, and running tasks on a bounded
//! number of scoped threads with the outcomes kept in task order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Add `item` to the group of `address` in `groups`, which keep the servers in the order they
/// were first seen: how a call gathers its keys, blocks or ranges per server.
pub(crate) fn push_grouped<'a, T>(groups: &mut Vec<(&'a str, Vec<T>)>, address: &'a str, item: T) {
    match groups.iter_mut().find(|(a, _)| *a == address) {
        Some((_, group)) => group.push(item),
        None => groups.push((address, vec![item])),
    }
}

/// Run `work` on every task, on up to `threads` threads (the calling one included); returns
/// each task's outcome in task order once all have finished.
pub(crate) fn run_parallel<T: Copy + Send + Sync, R: Send>(
    tasks: &[T],
    threads: usize,
    work: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    if tasks.len() <= 1 || threads <= 1 {
        return tasks.iter().map(|&task| work(task)).collect();
    }
    let next = AtomicUsize::new(0);
    let outcomes: Mutex<Vec<Option<R>>> =
        Mutex::new(std::iter::repeat_with(|| None).take(tasks.len()).collect());
    let drain = || loop {
        let index = next.fetch_add(1, Ordering::Relaxed);
        let Some(&task) = tasks.get(index) else {
            return;
        };
        let outcome = work(task);
        outcomes.lock().expect("never poisoned")[index] = Some(outcome);
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.min(tasks.len()) {
            scope.spawn(drain);
        }
        drain();
    });
    outcomes
        .into_inner()
        .expect("never poisoned")
        .into_iter()
        .map(|o| o.expect("every task ran"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_runs_every_task_once_in_order() {
        let tasks: Vec<usize> = (0..37).collect();
        let out = run_parallel(&tasks, 5, |t| t * 2);
        assert_eq!(out, tasks.iter().map(|t| t * 2).collect::<Vec<_>>());
        assert_eq!(run_parallel(&[3usize], 8, |t| t + 1), vec![4]);
        assert!(run_parallel(&[] as &[usize], 8, |t| t).is_empty());
    }
}
