//! Clock synchronisation state from the kernel's NTP variables, read with adjtimex(2) in
//! read-only mode (no capability needed).

use super::{CollectError, Measurement, Unit};

/// The kernel's view of clock synchronisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeSync {
    /// The kernel considers the clock synchronised (STA_UNSYNC clear and state not TIME_ERROR).
    pub synchronized: bool,
    /// The kernel's maximum error estimate, in seconds.
    pub max_error_seconds: f64,
}

/// Interprets adjtimex's return state, `status` bits and `maxerror` (microseconds).
pub fn interpret(state: i32, status: i32, max_error_us: i64) -> TimeSync {
    TimeSync {
        synchronized: state != libc::TIME_ERROR && status & libc::STA_UNSYNC == 0,
        max_error_seconds: max_error_us as f64 / 1e6,
    }
}

/// Asks the kernel.
#[allow(unsafe_code)]
pub fn read_kernel() -> Result<TimeSync, CollectError> {
    // SAFETY: `timex` is plain old data, so all-zeroes is a valid value; `modes == 0` makes
    // adjtimex read-only, and the kernel writes only into the struct we pass by pointer.
    let (state, tx) = unsafe {
        let mut tx: libc::timex = std::mem::zeroed();
        tx.modes = 0;
        let state = libc::adjtimex(&mut tx);
        (state, tx)
    };
    if state < 0 {
        return Err(CollectError::Adjtimex(std::io::Error::last_os_error()));
    }
    Ok(interpret(state, tx.status, tx.maxerror))
}

/// `time.synchronized` (1 or 0) and `time.max_error_seconds`.
pub fn collect() -> Result<Vec<Measurement>, CollectError> {
    let t = read_kernel()?;
    Ok(vec![
        Measurement::new(
            "time.synchronized",
            if t.synchronized { 1.0 } else { 0.0 },
            Unit::Bool,
        ),
        Measurement::new("time.max_error_seconds", t.max_error_seconds, Unit::Seconds),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interprets_status() {
        assert!(interpret(libc::TIME_OK, 0, 1500).synchronized);
        assert_eq!(interpret(libc::TIME_OK, 0, 1500).max_error_seconds, 0.0015);
        assert!(!interpret(libc::TIME_OK, libc::STA_UNSYNC, 0).synchronized);
        assert!(!interpret(libc::TIME_ERROR, 0, 0).synchronized);
    }

    #[test]
    fn reads_this_kernel() {
        // Whatever the clock's state, the read-only call succeeds and gives a sane error bound.
        let t = read_kernel().unwrap();
        assert!(t.max_error_seconds >= 0.0);
    }
}
