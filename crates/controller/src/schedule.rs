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

/// First retry delay after a failed condition write; doubled per further failure, capped at
/// [`WRITE_RETRY_MAX`] and the interval. The retry is a read of the node that finds the same
/// difference and writes it again, so a write lost to a 504 lands within seconds instead of a
/// sweep interval later.
pub const WRITE_RETRY_BASE: Duration = Duration::from_secs(1);
pub const WRITE_RETRY_MAX: Duration = Duration::from_secs(30);

/// One node's schedule.
#[derive(Clone, Debug)]
pub struct NodeSchedule {
    pub next_due: Instant,
    /// Consecutive failed calls.
    pub failures: u32,
    /// Consecutive failed condition writes.
    pub write_failures: u32,
    pub last_success: Option<Instant>,
    /// When the controller first tried this node (the staleness clock for a node never read).
    pub first_attempt: Option<Instant>,
    /// For a node a previous leader was reading (its Node says `NodekeeperReachable=True`): the
    /// previous leader's last Lease renewal, the last moment the node is known to have been
    /// watched. The staleness clock of a node this replica has not read yet starts there, not at
    /// the takeover, so a failover does not add its gap to `staleAfter`.
    pub inherited_since: Option<Instant>,
    /// The previous leader had already found this node stale (its Node says
    /// `NodekeeperReachable=False`): until it answers, one failed call keeps it stale.
    pub inherited_stale: bool,
    pub in_flight: bool,
}

impl NodeSchedule {
    /// A node just discovered is due at once.
    pub fn new(now: Instant) -> Self {
        Self {
            next_due: now,
            failures: 0,
            write_failures: 0,
            last_success: None,
            first_attempt: None,
            inherited_since: None,
            inherited_stale: false,
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

    /// A condition write failed: read the node again soon (1 s, 2 s, 4 s, … up to 30 s and
    /// never later than it was due anyway), so the write is retried. Returns the delay.
    pub fn write_failed(&mut self, now: Instant, interval: Duration) -> Duration {
        self.write_failures = self.write_failures.saturating_add(1);
        let exp = self.write_failures.saturating_sub(1).min(16);
        let delay = WRITE_RETRY_BASE
            .saturating_mul(1 << exp)
            .min(WRITE_RETRY_MAX)
            .min(interval);
        self.next_due = self.next_due.min(now + delay);
        delay
    }

    /// A condition write landed.
    pub fn write_succeeded(&mut self) {
        self.write_failures = 0;
    }

    /// An agent is stale once it has failed and no good answer came for longer than
    /// `stale_after` — counted from the last success, or for a node never read since this
    /// controller started, from the first attempt (so a restart does not mark the fleet stale).
    /// For a node this replica has not read, the clock starts at the earlier of the first
    /// attempt and [`Self::inherited_since`], and a node the previous leader found stale is
    /// stale at its first failure.
    pub fn is_stale(&self, now: Instant, stale_after: Duration) -> bool {
        if self.failures == 0 {
            return false;
        }
        if self.last_success.is_none() && self.inherited_stale {
            return true;
        }
        let never_read = match (self.first_attempt, self.inherited_since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match self.last_success.or(never_read) {
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
    fn the_staleness_clock_does_not_restart_on_failover() {
        let stale_after = Duration::from_secs(900);
        // The previous leader renewed its Lease last at t0 and died; this replica took over
        // 600 s later (both replicas down meanwhile) and cannot reach the agent.
        let t0 = Instant::now();
        let takeover = t0 + Duration::from_secs(600);
        let mut s = NodeSchedule::new(takeover);
        s.inherited_since = Some(t0);
        s.start(takeover);
        s.failed(takeover, FIVE_MIN, 0.0);
        assert!(!s.is_stale(t0 + Duration::from_secs(899), stale_after));
        // 900 s after the last moment anyone watched it, not 900 s after the takeover.
        assert!(s.is_stale(t0 + Duration::from_secs(901), stale_after));
        // Without the inherited clock it would have waited until takeover + 900 s.
        let mut fresh = NodeSchedule::new(takeover);
        fresh.start(takeover);
        fresh.failed(takeover, FIVE_MIN, 0.0);
        assert!(!fresh.is_stale(t0 + Duration::from_secs(901), stale_after));

        // A node the previous leader had found stale stays stale at its first failure...
        let mut s = NodeSchedule::new(takeover);
        s.inherited_stale = true;
        s.start(takeover);
        assert!(
            !s.is_stale(takeover, stale_after),
            "no failure yet: no verdict"
        );
        s.failed(takeover, FIVE_MIN, 0.0);
        assert!(s.is_stale(takeover, stale_after));
        // ...and an answer ends both inheritances.
        s.start(takeover);
        s.succeeded(takeover, FIVE_MIN, 0.0);
        s.start(takeover + Duration::from_secs(10));
        s.failed(takeover + Duration::from_secs(10), FIVE_MIN, 0.0);
        assert!(!s.is_stale(takeover + Duration::from_secs(10), stale_after));
    }

    #[test]
    fn a_failed_write_is_retried_within_seconds_with_backoff() {
        let now = Instant::now();
        let mut s = NodeSchedule::new(now);
        s.start(now);
        s.succeeded(now, FIVE_MIN, 0.0);
        assert_eq!(s.next_due - now, FIVE_MIN);
        let mut delays = Vec::new();
        for _ in 0..7 {
            let d = s.write_failed(now, FIVE_MIN);
            assert_eq!(
                s.next_due - now,
                Duration::from_secs(1),
                "the earliest retry wins"
            );
            delays.push(d.as_secs());
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30]);
        s.write_succeeded();
        s.next_due = now + FIVE_MIN;
        assert_eq!(s.write_failed(now, FIVE_MIN), Duration::from_secs(1));
        // Never later than the interval, however short.
        let mut s = NodeSchedule::new(now);
        s.write_failures = 10;
        s.next_due = now + Duration::from_secs(10);
        assert_eq!(
            s.write_failed(now, Duration::from_secs(10)),
            Duration::from_secs(10)
        );
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
