//! Retry policy for OCI API calls: exponential backoff with jitter, bounded both in attempts and
//! in total time. Oracle's SDKs default to 8 attempts, `min(2^n, 30)` s plus jitter, and retry
//! 429 and 5xx except 501 (`shared/oci/compute-api.md` §4); the bounds here are the same by
//! default and configurable, so tests can run them in milliseconds.

use std::time::Duration;

use http::StatusCode;
use rand::Rng as _;

/// How many times, and how long, a call is retried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 = never retry).
    pub max_attempts: u32,
    /// Pause before the first retry; doubled for each further one.
    pub base: Duration,
    /// Largest pause between two attempts.
    pub cap: Duration,
    /// No retry starts once this much time has passed since the first attempt.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(30),
            max_elapsed: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// The pause after failed attempt number `attempt` (1-based): half of the exponential step
    /// fixed, half random ("equal jitter"), so concurrent callers spread out but never retry
    /// immediately.
    pub fn delay(&self, attempt: u32) -> Duration {
        let exp = self
            .base
            .saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)));
        let step = exp.min(self.cap);
        let half = step / 2;
        let jitter = if half.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(rand::rng().random_range(0..=half.as_nanos() as u64))
        };
        half + jitter
    }
}

/// Whether an answer with `status` is worth another attempt: throttling (429) and server faults
/// (5xx) except 501 Not Implemented, which will not change.
pub fn retryable_status(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        || (status.is_server_error() && status != StatusCode::NOT_IMPLEMENTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_are_capped_and_jittered_within_bounds() {
        let p = RetryPolicy {
            max_attempts: 8,
            base: Duration::from_millis(100),
            cap: Duration::from_millis(1000),
            max_elapsed: Duration::from_secs(5),
        };
        for _ in 0..50 {
            let d1 = p.delay(1);
            assert!(d1 >= Duration::from_millis(50) && d1 <= Duration::from_millis(100));
            let d3 = p.delay(3);
            assert!(d3 >= Duration::from_millis(200) && d3 <= Duration::from_millis(400));
            let d10 = p.delay(10);
            assert!(d10 >= Duration::from_millis(500) && d10 <= Duration::from_millis(1000));
        }
        let spread: std::collections::BTreeSet<_> = (0..20).map(|_| p.delay(4)).collect();
        assert!(spread.len() > 1, "jitter must vary the delay");
    }

    #[test]
    fn retryable_statuses() {
        assert!(retryable_status(StatusCode::TOO_MANY_REQUESTS));
        assert!(retryable_status(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(retryable_status(StatusCode::SERVICE_UNAVAILABLE));
        assert!(!retryable_status(StatusCode::NOT_IMPLEMENTED));
        assert!(!retryable_status(StatusCode::CONFLICT));
        assert!(!retryable_status(StatusCode::NOT_FOUND));
        assert!(!retryable_status(StatusCode::BAD_REQUEST));
    }
}
