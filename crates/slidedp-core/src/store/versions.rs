//! Per-layer version gates shared across processes.
//!
//! Each group has a `u32` version counter in the shared region (one per cache line). The process
//! that finishes a layer's update publishes the new version; any process waits for a version with
//! a futex on the counter itself: the futex is not process-private, so the kernel keys it by the
//! shared page and a wake in one process releases waiters in all of them. A poison flag, checked
//! by every waiter, turns a dead or failed peer into an error instead of a hang.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The poison word's bits: waiters fail once it is non-zero.
const POISONED: u32 = 1;
/// A failure (not a reaction to one) has claimed the store: its process reports it.
const CLAIMED: u32 = 2;

/// Views of the counters inside the mapping; borrowed from the store that owns the mapping.
#[derive(Debug)]
pub struct VersionGates<'a> {
    counters: Vec<&'a AtomicU32>,
    poison: &'a AtomicU32,
}

impl<'a> VersionGates<'a> {
    pub fn new(counters: Vec<&'a AtomicU32>, poison: &'a AtomicU32) -> Self {
        Self { counters, poison }
    }

    fn counter(&self, layer: usize) -> Result<&'a AtomicU32> {
        self.counters
            .get(layer)
            .copied()
            .ok_or(Error::LayerOutOfRange {
                layer,
                layers: self.counters.len(),
            })
    }

    /// The layer's current version.
    pub fn get(&self, layer: usize) -> Result<u32> {
        Ok(self.counter(layer)?.load(Ordering::Acquire))
    }

    /// Sets the layer's version and wakes every waiter in every process. The release store
    /// orders all writes made to the layer's state before it ahead of the new version.
    pub fn publish(&self, layer: usize, version: u32) -> Result<()> {
        let counter = self.counter(layer)?;
        counter.store(version, Ordering::Release);
        futex_wake_all(counter);
        Ok(())
    }

    /// Blocks until the layer's version is at least `version`; returns the version seen.
    pub fn wait(&self, layer: usize, version: u32, timeout: Duration) -> Result<u32> {
        let counter = self.counter(layer)?;
        let deadline = Instant::now() + timeout;
        loop {
            let seen = counter.load(Ordering::Acquire);
            if seen >= version {
                return Ok(seen);
            }
            if self.poison.load(Ordering::Acquire) != 0 {
                return Err(Error::StorePoisoned { layer });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::VersionTimeout {
                    layer,
                    expected: version,
                    got: seen,
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            futex_wait(counter, seen, deadline - now);
        }
    }

    /// Marks the store failed and wakes every waiter, so that peers stop instead of hanging.
    /// With `claim` (a failure of the caller's own, not a reaction to a peer's), returns
    /// whether it is the first failure claimed on the store, in any process: the one
    /// reported where several ranks fail at once. A reaction only wakes (and returns false),
    /// so it never hides a real failure that comes after it.
    pub fn poison(&self, claim: bool) -> bool {
        let bits = if claim { POISONED | CLAIMED } else { POISONED };
        let before = self.poison.fetch_or(bits, Ordering::AcqRel);
        for counter in &self.counters {
            futex_wake_all(counter);
        }
        claim && before & CLAIMED == 0
    }

    pub fn is_poisoned(&self) -> bool {
        self.poison.load(Ordering::Acquire) != 0
    }
}

/// Sleeps while `*word == expected`, at most `timeout`; spurious wake-ups are fine (callers loop).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` points into a live shared mapping for the duration of the call; FUTEX_WAIT
    // only reads it. Shared (non-private) futex so that other processes' wakes reach us.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` points into a live shared mapping; FUTEX_WAKE does not access it.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_waiter_wakes_on_publish_and_times_out_otherwise() {
        let words: Arc<Vec<AtomicU32>> = Arc::new((0..3).map(|_| AtomicU32::new(0)).collect());
        let poison = Arc::new(AtomicU32::new(0));
        let (w, p) = (words.clone(), poison.clone());
        let waiter = std::thread::spawn(move || {
            let gates = VersionGates::new(w.iter().collect(), &p);
            gates.wait(1, 2, Duration::from_secs(10))
        });
        std::thread::sleep(Duration::from_millis(20));
        let gates = VersionGates::new(words.iter().collect(), &poison);
        gates.publish(1, 1).unwrap();
        gates.publish(1, 2).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), 2);
        let err = gates.wait(0, 1, Duration::from_millis(30)).unwrap_err();
        assert!(matches!(
            err,
            Error::VersionTimeout {
                layer: 0,
                expected: 1,
                got: 0,
                ..
            }
        ));
        assert!(matches!(
            gates.get(3),
            Err(Error::LayerOutOfRange { layer: 3, .. })
        ));
    }

    #[test]
    fn poison_releases_waiters_with_an_error() {
        let words: Arc<Vec<AtomicU32>> = Arc::new((0..2).map(|_| AtomicU32::new(0)).collect());
        let poison = Arc::new(AtomicU32::new(0));
        let (w, p) = (words.clone(), poison.clone());
        let waiter = std::thread::spawn(move || {
            let gates = VersionGates::new(w.iter().collect(), &p);
            gates.wait(0, 1, Duration::from_secs(30))
        });
        std::thread::sleep(Duration::from_millis(20));
        let started = Instant::now();
        VersionGates::new(words.iter().collect(), &poison).poison(true);
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::StorePoisoned { layer: 0 }));
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
