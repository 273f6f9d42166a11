//! When each node's agent is read next: jittered due times that keep every node within the sweep
//! interval, exponential backoff after failures, and the staleness rule. Plain data and
//! arithmetic over `Instant`s; the randomness comes in as a number so tests can pin it.

use std::time::{Duration, Instant};

/// Fraction of the interval by which a regular due time is pulled earlier at random, so that
/// reads spread out instead of arriving in lockstep.
pub const JITTER: f64 = 0.2;
/// After the first read of a node, its next read lands anywhere in the second half of the
/// interval: the burst of a controller start spreads over the interval within one round.
pub const FIRST_SPREAD: f64 = 0.5;
/// First retry delay after a failure; doubled per further failure, capped at the interval.
pub const BACKOFF_BASE: Duration = Duration::from_secs(5);

/// One node's schedule.
#[derive(Clone, Debug)]
pub struct NodeSchedule {
    pub next_due: Instant,
    /// Consecutive failed calls.
    pub failures: u32,
    pub last_success: Option<Instant>,
    /// When the controller first tried this node (the staleness clock for a node never read).
    pub first_attempt: Option<Instant>,
    pub in_flight: bool,
}

impl NodeSchedule {
    /// A node just discovered is due at once.
    pub fn new(now: Instant) -> Self {
        Self {
            next_due: now,
            failures: 0,
            last_success: None,
            first_attempt: None,
            in_flight: false,
        }
    }

    /// True when a call should start now.
    pub fn is_due(&self, now: Instant) -> bool {
        !self.in_flight && self.next_due <= now
    }

    pub fn start(&mut self, now: Instant) {
        self.in_flight = true;
        self.first_attempt.get_or_insert(now);
    }

    /// A successful read. `unit` is a random number in [0, 1).
    pub fn succeeded(&mut self, now: Instant, interval: Duration, unit: f64) {
        let spread = if self.last_success.is_none() {
            FIRST_SPREAD
        } else {
            JITTER
        };
        self.in_flight = false;
        self.failures = 0;
        self.last_success = Some(now);
        self.next_due = now + interval.mul_f64(1.0 - spread * unit.clamp(0.0, 1.0));
    }

    /// A failed read: back off exponentially, never beyond the interval. `unit` in [0, 1).
    pub fn failed(&mut self, now: Instant, interval: Duration, unit: f64) {
        self.in_flight = false;
        self.failures = self.failures.saturating_add(1);
        let exp = self.failures.saturating_sub(1).min(16);
        let delay = BACKOFF_BASE.saturating_mul(1 << exp).min(interval);
        self.next_due = now + delay.mul_f64(1.0 - JITTER * unit.clamp(0.0, 1.0));
    }

    /// An agent is stale once it has failed and no good answer came for longer than
    /// `stale_after` — counted from the last success, or for a node never read since this
    /// controller started, from the first attempt (so a restart does not mark the fleet stale).
    pub fn is_stale(&self, now: Instant, stale_after: Duration) -> bool {
        if self.failures == 0 {
            return false;
        }
        match self.last_success.or(self.first_attempt) {
            Some(since) => now.saturating_duration_since(since) > stale_after,
            None => false,
        }
    }

    /// When the configuration changes the interval, pull far-off due times in so that no node
    /// waits longer than the new interval.
    pub fn clamp_to(&mut self, now: Instant, interval: Duration) {
        if self.next_due > now + interval {
            self.next_due = now + interval;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIVE_MIN: Duration = Duration::from_secs(300);

    #[test]
    fn new_nodes_are_due_at_once_and_not_twice_in_parallel() {
        let now = Instant::now();
        let mut s = NodeSchedule::new(now);
        assert!(s.is_due(now));
        s.start(now);
        assert!(!s.is_due(now + FIVE_MIN * 2));
    }

    #[test]
    fn every_read_is_within_the_interval() {
        let now = Instant::now();
        for unit in [0.0, 0.5, 0.999] {
            let mut s = NodeSchedule::new(now);
            s.start(now);
            s.succeeded(now, FIVE_MIN, unit);
            let first = s.next_due - now;
            assert!(first <= FIVE_MIN && first >= FIVE_MIN / 2, "{first:?}");
            s.start(now);
            s.succeeded(now, FIVE_MIN, unit);
            let regular = s.next_due - now;
            assert!(
                regular <= FIVE_MIN && regular >= FIVE_MIN.mul_f64(0.8),
                "{regular:?}"
            );
        }
    }

    #[test]
    fn backoff_doubles_and_is_capped_by_the_interval() {
        let now = Instant::now();
        let mut s = NodeSchedule::new(now);
        let mut delays = Vec::new();
        for _ in 0..10 {
            s.start(now);
            s.failed(now, FIVE_MIN, 0.0);
            delays.push((s.next_due - now).as_secs());
        }
        assert_eq!(delays, vec![5, 10, 20, 40, 80, 160, 300, 300, 300, 300]);
        s.start(now);
        s.succeeded(now, FIVE_MIN, 0.0);
        assert_eq!(s.failures, 0);
    }

    #[test]
    fn staleness_counts_from_last_success_or_first_attempt() {
        let t0 = Instant::now();
        let stale_after = Duration::from_secs(900);
        let mut s = NodeSchedule::new(t0);
        s.start(t0);
        s.failed(t0, FIVE_MIN, 0.0);
        assert!(!s.is_stale(t0 + Duration::from_secs(899), stale_after));
        assert!(s.is_stale(t0 + Duration::from_secs(901), stale_after));

        let mut s = NodeSchedule::new(t0);
        s.start(t0);
        s.succeeded(t0 + Duration::from_secs(600), FIVE_MIN, 0.0);
        // A node whose agent answers is never stale, however long ago the answer was.
        assert!(!s.is_stale(t0 + Duration::from_secs(5000), stale_after));
        s.start(t0 + Duration::from_secs(1000));
        s.failed(t0 + Duration::from_secs(1000), FIVE_MIN, 0.0);
        assert!(!s.is_stale(t0 + Duration::from_secs(1400), stale_after));
        assert!(s.is_stale(t0 + Duration::from_secs(1501), stale_after));
    }

    #[test]
    fn a_shorter_interval_pulls_due_times_in() {
        let now = Instant::now();
        let mut s = NodeSchedule::new(now);
        s.start(now);
        s.succeeded(now, FIVE_MIN, 0.0);
        s.clamp_to(now, Duration::from_secs(30));
        assert_eq!(s.next_due - now, Duration::from_secs(30));
    }
}
