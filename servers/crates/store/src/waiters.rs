//! Readers parked on absent keys, woken only by the inserts they wait for.
//!
//! A parked reader (the `wait` action) watches a set of keys of one bucket. An insert of a
//! block-0 record wakes the readers watching exactly that key, so the cost of an insert does not
//! grow with the number of parked readers of other keys (a shuffle's reducers each wait for their
//! own partitions). Removing a bucket or a job wakes every parked reader, which re-checks and
//! fails or goes on waiting.
//!
//! No wake-up is lost: a reader watches its keys before it checks them, and a wake-up that comes
//! while it is not awaiting is kept as the permit of its [`Notify`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// One watched key: job, bucket, key.
type WatchKey = (String, String, String);
/// The readers watching one key: their ids and wake-ups.
type Watchers = Vec<(u64, Arc<Notify>)>;

/// The parked readers of a store, by watched key.
#[derive(Default)]
pub(crate) struct Waiters {
    watched: Mutex<HashMap<WatchKey, Watchers>>,
    /// Watched keys, so an insert with no reader parked skips the lock.
    watched_count: AtomicUsize,
    next_id: AtomicU64,
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, HashMap<WatchKey, Watchers>> {
        self.watched.lock().expect("waiters lock poisoned")
    }

    /// Wake the readers watching `key` of `bucket` of `job`; they stop watching it.
    pub(crate) fn inserted(&self, job: &str, bucket: &str, key: &str) {
        if self.watched_count.load(Ordering::Acquire) == 0 {
            return;
        }
        let woken = {
            let mut watched = self.lock();
            let woken = watched.remove(&(job.to_string(), bucket.to_string(), key.to_string()));
            if let Some(woken) = &woken {
                self.watched_count.fetch_sub(woken.len(), Ordering::AcqRel);
            }
            woken
        };
        for (_, notify) in woken.into_iter().flatten() {
            notify.notify_one();
        }
    }

    /// Wake every parked reader (a bucket or job went away); they keep watching their keys.
    pub(crate) fn wake_all(&self) {
        let notifies: Vec<Arc<Notify>> = {
            let watched = self.lock();
            let mut seen = HashSet::new();
            watched
                .values()
                .flatten()
                .filter(|(id, _)| seen.insert(*id))
                .map(|(_, notify)| notify.clone())
                .collect()
        };
        for notify in notifies {
            notify.notify_one();
        }
    }

    /// Keys watched by all parked readers together (each reader counts once per key).
    pub(crate) fn watched_keys(&self) -> usize {
        self.watched_count.load(Ordering::Acquire)
    }
}

/// One parked reader: watches keys of one bucket until dropped.
pub struct Waiter {
    waiters: Arc<Waiters>,
    id: u64,
    job: String,
    bucket: String,
    notify: Arc<Notify>,
    /// Keys this reader may still be registered for (an insert removes a key's registrations).
    registered: HashSet<String>,
}

impl Waiter {
    pub(crate) fn new(waiters: Arc<Waiters>, job: &str, bucket: &str) -> Self {
        let id = waiters.next_id.fetch_add(1, Ordering::Relaxed);
        Self {
            waiters,
            id,
            job: job.to_string(),
            bucket: bucket.to_string(),
            notify: Arc::new(Notify::new()),
            registered: HashSet::new(),
        }
    }

    /// Watch `keys` (and stop watching keys not among them). Call it before checking whether the
    /// keys exist, so an insert between the check and [`Waiter::notified`] is not missed.
    pub fn watch(&mut self, keys: &[String]) {
        let wanted: HashSet<&str> = keys.iter().map(String::as_str).collect();
        let mut watched = self.waiters.lock();
        let mut added = 0usize;
        for key in &wanted {
            let entry = watched
                .entry((self.job.clone(), self.bucket.clone(), (*key).to_string()))
                .or_default();
            if !entry.iter().any(|(id, _)| *id == self.id) {
                entry.push((self.id, self.notify.clone()));
                added += 1;
            }
        }
        let dropped: Vec<String> = self
            .registered
            .iter()
            .filter(|key| !wanted.contains(key.as_str()))
            .cloned()
            .collect();
        let removed = self.unregister(&mut watched, &dropped);
        self.waiters
            .watched_count
            .fetch_add(added, Ordering::AcqRel);
        self.waiters
            .watched_count
            .fetch_sub(removed, Ordering::AcqRel);
        self.registered = wanted.into_iter().map(str::to_string).collect();
    }

    /// Resolves when a watched key was inserted, or everyone was woken, since the last time it
    /// resolved (or since the first [`Waiter::watch`]).
    pub async fn notified(&self) {
        self.notify.notified().await;
    }

    /// Whether a wake-up is pending, without waiting (it is consumed).
    #[cfg(test)]
    pub(crate) fn try_notified(&self) -> bool {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        let mut future = std::pin::pin!(self.notify.notified());
        let mut cx = Context::from_waker(Waker::noop());
        matches!(future.as_mut().poll(&mut cx), Poll::Ready(()))
    }

    /// Remove this reader's registrations for `keys`; returns how many there were.
    fn unregister(&self, watched: &mut HashMap<WatchKey, Watchers>, keys: &[String]) -> usize {
        let mut removed = 0;
        for key in keys {
            let map_key = (self.job.clone(), self.bucket.clone(), key.clone());
            if let Some(entry) = watched.get_mut(&map_key) {
                let before = entry.len();
                entry.retain(|(id, _)| *id != self.id);
                removed += before - entry.len();
                if entry.is_empty() {
                    watched.remove(&map_key);
                }
            }
        }
        removed
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let keys: Vec<String> = self.registered.drain().collect();
        let mut watched = self.waiters.lock();
        let removed = self.unregister(&mut watched, &keys);
        self.waiters
            .watched_count
            .fetch_sub(removed, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn woken(waiter: &Waiter) -> bool {
        waiter.try_notified()
    }

    #[test]
    fn an_insert_wakes_only_the_readers_of_its_key() {
        let waiters = Arc::new(Waiters::default());
        let mut a = Waiter::new(waiters.clone(), "j", "b");
        let mut b = Waiter::new(waiters.clone(), "j", "b");
        a.watch(&keys(&["k1", "k2"]));
        b.watch(&keys(&["k3"]));
        waiters.inserted("j", "b", "k3");
        assert!(!woken(&a));
        assert!(woken(&b));
        // Same key name in another bucket or job: nobody.
        waiters.inserted("j", "other", "k1");
        waiters.inserted("other", "b", "k1");
        assert!(!woken(&a));
        waiters.inserted("j", "b", "k2");
        assert!(woken(&a));
        assert!(!woken(&a), "one insert, one wake-up");
    }

    #[test]
    fn a_wake_up_before_the_reader_awaits_is_kept() {
        let waiters = Arc::new(Waiters::default());
        let mut a = Waiter::new(waiters.clone(), "j", "b");
        a.watch(&keys(&["k"]));
        waiters.inserted("j", "b", "k"); // Between the reader's check and its await.
        assert!(woken(&a));
    }

    #[test]
    fn wake_all_wakes_each_reader_once_and_they_keep_watching() {
        let waiters = Arc::new(Waiters::default());
        let mut a = Waiter::new(waiters.clone(), "j", "b");
        let mut b = Waiter::new(waiters.clone(), "j2", "b");
        a.watch(&keys(&["k1", "k2"]));
        b.watch(&keys(&["k1"]));
        waiters.wake_all();
        assert!(woken(&a));
        assert!(!woken(&a));
        assert!(woken(&b));
        waiters.inserted("j", "b", "k1");
        assert!(woken(&a));
    }

    #[test]
    fn registrations_are_counted_and_gone_with_the_reader() {
        let waiters = Arc::new(Waiters::default());
        let mut a = Waiter::new(waiters.clone(), "j", "b");
        a.watch(&keys(&["k1", "k2", "k3"]));
        a.watch(&keys(&["k1", "k2", "k3"])); // Watching again registers nothing twice.
        assert_eq!(waiters.watched_keys(), 3);
        waiters.inserted("j", "b", "k1");
        assert_eq!(waiters.watched_keys(), 2);
        a.watch(&keys(&["k2"])); // k3 arrived some other way: no longer watched.
        assert_eq!(waiters.watched_keys(), 1);
        let mut b = Waiter::new(waiters.clone(), "j", "b");
        b.watch(&keys(&["k2"]));
        assert_eq!(waiters.watched_keys(), 2);
        drop(a);
        assert_eq!(waiters.watched_keys(), 1);
        drop(b);
        assert_eq!(waiters.watched_keys(), 0);
        assert!(waiters.lock().is_empty());
    }
}
