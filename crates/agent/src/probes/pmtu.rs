//! Path-MTU discovery to one address: don't-fragment ICMP echoes whose size is bisected between the
//! protocol minimum and `max_mtu`, taking the kernel's own path-MTU knowledge (EMSGSIZE) as a bound.

use std::collections::BTreeMap;
use std::net::IpAddr;

use nodekeeper_model::probe::{MIN_MTU_V4, MIN_MTU_V6};

use super::icmp::{EchoError, EchoSocket, IcmpSocketPolicy};
use super::validate::Plan;
use super::{Tally, micros};

/// Echoes tried per size before the size counts as not getting through. More than a few only
/// multiplies the time a silently dropped size costs.
const MAX_ATTEMPTS_PER_SIZE: u32 = 3;
/// Bisection of 68..=65535 needs 16 steps; the bound only guards against a logic error.
const MAX_STEPS: u32 = 40;

/// What trying one size showed.
enum SizeOutcome {
    /// An echo of this size was answered.
    Through,
    /// No answer, or the kernel refused; `bound` is the kernel's path MTU when it told us one.
    Blocked { bound: Option<u32> },
}

/// Discovers the largest packet size (IP header included) that reaches `target` and is answered.
/// Returns the tally of the echoes of the final size (the size found, or the minimum when none got
/// through) and that size (0 when none got through). Echoes of larger sizes go unanswered by
/// design: counted, they would read as packet loss on a healthy path.
pub(super) async fn probe(target: IpAddr, plan: &Plan, policy: IcmpSocketPolicy) -> (Tally, u32) {
    let mut sock =
        match EchoSocket::open(target, policy).and_then(|s| s.set_dont_fragment().map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                let tally = Tally {
                    error: Some(e),
                    ..Tally::default()
                };
                return (tally, 0);
            }
        };
    let mut by_size = BTreeMap::<u32, Tally>::new();
    let min = if target.is_ipv4() {
        MIN_MTU_V4
    } else {
        MIN_MTU_V6
    };
    let max = plan.max_mtu;
    let attempts = plan.count.clamp(1, MAX_ATTEMPTS_PER_SIZE);
    let mut search = Search::new(min, max);
    let mut last_error = None;
    let mut steps = 0;
    while let Some(size) = search.next() {
        steps += 1;
        if steps > MAX_STEPS {
            break;
        }
        let mut outcome = SizeOutcome::Blocked { bound: None };
        let tally = by_size.entry(size).or_default();
        for attempt in 0..attempts {
            let payload = (size as usize).saturating_sub(sock.overhead());
            match sock.echo(payload, plan.timeout).await {
                Ok(rtt) => {
                    tally.sent += 1;
                    tally.received += 1;
                    tally.rtt_us.push(micros(rtt));
                    outcome = SizeOutcome::Through;
                    break;
                }
                // The kernel knows the path is narrower: repeating the same size cannot help.
                Err(EchoError::TooBig { kernel_mtu }) => {
                    outcome = SizeOutcome::Blocked { bound: kernel_mtu };
                    break;
                }
                Err(e @ EchoError::Timeout) => {
                    tally.sent += 1;
                    last_error = Some(format!("size {size}: {e}"));
                }
                Err(EchoError::Failed(e)) => {
                    last_error = Some(format!("size {size}: {e}"));
                    break;
                }
            }
            if attempt + 1 < attempts {
                tokio::time::sleep(plan.interval).await;
            }
        }
        search.record(size, outcome);
    }
    let mtu = search.good;
    let mut tally = final_size_tally(by_size, mtu, min);
    if mtu == 0 {
        tally.error =
            Some(last_error.unwrap_or_else(|| format!("no answer at any size down to {min}")));
    }
    (tally, mtu)
}

/// The tally of the final size's echoes: the size found (`mtu`), or `min` when none got through.
fn final_size_tally(mut by_size: BTreeMap<u32, Tally>, mtu: u32, min: u32) -> Tally {
    let size = if mtu == 0 { min } else { mtu };
    by_size.remove(&size).unwrap_or_default()
}

/// The bisection state: `good` is the largest size answered (0 = none yet), `bad` the smallest that
/// was not (`max + 1` = none yet). Kept apart from the sockets so it can be tested as plain data.
struct Search {
    min: u32,
    max: u32,
    good: u32,
    bad: u32,
    hint: Option<u32>,
}

impl Search {
    fn new(min: u32, max: u32) -> Self {
        Self {
            min,
            max,
            good: 0,
            bad: max + 1,
            hint: None,
        }
    }

    /// The next size to try: the maximum first (the common answer), then the minimum (is the
    /// target reachable at all?), then the kernel's hint, then the midpoint.
    fn next(&mut self) -> Option<u32> {
        if self.good == self.max || self.bad <= self.min || self.bad - self.good <= 1 {
            return None;
        }
        if self.bad == self.max + 1 {
            return Some(self.max);
        }
        if self.good == 0 {
            if let Some(h) = self.hint.take().filter(|h| *h >= self.min && *h < self.bad) {
                return Some(h);
            }
            return Some(self.min);
        }
        if let Some(h) = self.hint.take().filter(|h| *h > self.good && *h < self.bad) {
            return Some(h);
        }
        Some(self.good + (self.bad - self.good) / 2)
    }

    fn record(&mut self, size: u32, outcome: SizeOutcome) {
        match outcome {
            SizeOutcome::Through => self.good = self.good.max(size),
            SizeOutcome::Blocked { bound } => {
                self.bad = self.bad.min(size);
                // EMSGSIZE with a known path MTU rules out every size above it at once.
                if let Some(b) = bound {
                    self.bad = self.bad.min(b.saturating_add(1));
                    self.hint = Some(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the search against a path that passes sizes up to `mtu`, optionally reporting the
    /// kernel's bound as EMSGSIZE would; returns the result and the sizes tried.
    fn simulate(min: u32, max: u32, mtu: u32, kernel_knows: bool) -> (u32, Vec<u32>) {
        let mut s = Search::new(min, max);
        let mut tried = Vec::new();
        while let Some(size) = s.next() {
            assert!(tried.len() < 40, "search does not terminate: {tried:?}");
            tried.push(size);
            let outcome = if size <= mtu {
                SizeOutcome::Through
            } else {
                SizeOutcome::Blocked {
                    bound: kernel_knows.then_some(mtu),
                }
            };
            s.record(size, outcome);
        }
        (s.good, tried)
    }

    #[test]
    fn finds_the_mtu_by_bisection_when_large_packets_vanish() {
        for mtu in [68, 69, 576, 1280, 1400, 1499, 1500, 8999, 9000] {
            let (found, tried) = simulate(68, 9000, mtu, false);
            assert_eq!(found, mtu, "tried {tried:?}");
            assert!(
                tried.len() <= 16,
                "{} steps for {mtu}: {tried:?}",
                tried.len()
            );
        }
    }

    #[test]
    fn uses_the_kernel_bound_to_finish_quickly() {
        let (found, tried) = simulate(68, 9000, 1400, true);
        assert_eq!(found, 1400);
        assert_eq!(tried, vec![9000, 1400]);
    }

    #[test]
    fn unreachable_target_gives_zero() {
        let (found, tried) = simulate(68, 9000, 0, false);
        assert_eq!(found, 0);
        assert_eq!(tried, vec![9000, 68]);
    }

    #[test]
    fn only_the_final_size_is_tallied() {
        let tally = |sent, received| Tally {
            sent,
            received,
            ..Tally::default()
        };
        let by_size =
            || BTreeMap::from([(9000, tally(3, 0)), (68, tally(1, 1)), (1500, tally(2, 1))]);
        let t = final_size_tally(by_size(), 1500, 68);
        assert_eq!((t.sent, t.received), (2, 1));
        // Nothing through: the minimum size's echoes.
        let t = final_size_tally(
            BTreeMap::from([(9000, tally(3, 0)), (68, tally(3, 0))]),
            0,
            68,
        );
        assert_eq!((t.sent, t.received), (3, 0));
        assert_eq!(final_size_tally(BTreeMap::new(), 0, 68).sent, 0);
    }

    #[test]
    fn max_getting_through_ends_at_once() {
        let (found, tried) = simulate(1280, 1500, 9000, false);
        assert_eq!((found, tried), (1500, vec![1500]));
    }
}
