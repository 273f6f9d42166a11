//! The agent's `/metrics` endpoint with node-problem-detector's problem metrics under NPD's
//! names and labels, so its alert rules keep working: `problem_counter{reason}` and
//! `problem_gauge{type,reason}` (1 while the condition is True). Labels are bounded: reasons and
//! types come from rule files, and the state caps their number.
//!
//! The text is written here rather than through prometheus-client because that crate always
//! names a counter `…_total`, while NPD's series (and the rules written for them) are
//! `problem_counter`.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::state::{ConditionStatus, ProblemState, SharedState, lock};

/// A client must send a request's headers within this time, or its connection is closed (also
/// a keep-alive connection that sends nothing more). hyper enforces it only with a timer set.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; further ones wait in the listen backlog. A scraper needs one.
pub const MAX_CONNECTIONS: usize = 16;
/// Read buffer per connection: a `GET /metrics` fits many times over (hyper's minimum).
const MAX_BUF_BYTES: usize = 8 * 1024;
/// Pause after a failed accept (e.g. out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(500);

/// Escapes a label value for the Prometheus text format.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The problem metrics in the Prometheus text format.
pub fn render(state: &ProblemState) -> String {
    let mut out = String::with_capacity(1024);
    let _ = writeln!(
        out,
        "# HELP problem_counter Number of times a specific type of problem have occurred."
    );
    let _ = writeln!(out, "# TYPE problem_counter counter");
    for (reason, n) in state.counters() {
        let _ = writeln!(out, "problem_counter{{reason=\"{}\"}} {n}", label(reason));
    }
    let _ = writeln!(
        out,
        "# HELP problem_gauge Whether a specific type of problem is affecting the node or not."
    );
    let _ = writeln!(out, "# TYPE problem_gauge gauge");
    for c in state.conditions() {
        let value = u8::from(c.status == ConditionStatus::True);
        let _ = writeln!(
            out,
            "problem_gauge{{reason=\"{}\",type=\"{}\"}} {value}",
            label(&c.reason),
            label(&c.kind)
        );
    }
    let _ = writeln!(
        out,
        "# HELP nodekeeper_kmsg_lost_records Kernel log records overwritten before they were read."
    );
    let _ = writeln!(out, "# TYPE nodekeeper_kmsg_lost_records counter");
    let _ = writeln!(out, "nodekeeper_kmsg_lost_records {}", state.lost_records());
    out
}

/// Binds `addr` (errors are the caller's to report).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves `GET /metrics` (plain HTTP, as NPD's exporter) until `shutdown`.
pub async fn serve(listener: TcpListener, state: SharedState, shutdown: CancellationToken) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => return,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept on the metrics listener; retrying shortly");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                    continue;
                }
            },
        };
        let state = state.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let state = state.clone();
                    async move {
                        let (code, body) = if req.uri().path() == "/metrics"
                            && req.method() == hyper::Method::GET
                        {
                            (200, render(&lock(&state)))
                        } else {
                            (404, "not found; see /metrics\n".to_owned())
                        };
                        hyper::Response::builder()
                            .status(code)
                            .header("content-type", "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(body)))
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_BUF_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                () = stop.cancelled() => {}
                _ = conn => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::state::ConditionDefault;
    use std::time::SystemTime;

    #[test]
    fn npd_names_and_labels() {
        let mut s = ProblemState::default();
        let t = SystemTime::UNIX_EPOCH;
        s.declare(
            "kernel-monitor",
            &ConditionDefault {
                kind: "KernelDeadlock".into(),
                reason: "KernelHasNoDeadlock".into(),
                message: "kernel has no deadlock".into(),
            },
            t,
        );
        s.init_counter("TaskHung");
        s.record("kernel-monitor", "OOMKilling", "Killed process 1", t);
        s.record("kernel-monitor", "OOMKilling", "Killed process 2", t);
        s.set_condition(
            "KernelDeadlock",
            ConditionStatus::True,
            "DockerHung",
            "task docker:7 blocked",
            t,
        );
        s.record("x", "Odd\"Reason\\", "m", t);
        let text = render(&s);
        for line in [
            "# TYPE problem_counter counter",
            "problem_counter{reason=\"OOMKilling\"} 2",
            "problem_counter{reason=\"TaskHung\"} 0",
            "problem_counter{reason=\"DockerHung\"} 1",
            "problem_counter{reason=\"Odd\\\"Reason\\\\\"} 1",
            "# TYPE problem_gauge gauge",
            "problem_gauge{reason=\"DockerHung\",type=\"KernelDeadlock\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing from\n{text}"
            );
        }
    }

    /// A client that starts a request and never finishes its headers is cut off at
    /// [`HEADER_READ_TIMEOUT`] rather than holding its connection (and a slot) forever; while
    /// [`MAX_CONNECTIONS`] are open, the next one waits.
    #[tokio::test]
    async fn unfinished_requests_are_closed_at_the_header_timeout_and_capped() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            ProblemState::new_shared(),
            shutdown.clone(),
        ));
        let mut stalled = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
            stalled.push(s);
        }
        let started = std::time::Instant::now();
        // One more, complete: it waits for a slot.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        let early = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out)).await;
        assert!(early.is_err(), "served beyond the cap: {out}");
        for mut c in stalled {
            let mut buf = Vec::new();
            let read = tokio::time::timeout(HEADER_READ_TIMEOUT * 3, c.read_to_end(&mut buf)).await;
            assert!(read.is_ok(), "still open after {:?}", started.elapsed());
        }
        let took = started.elapsed();
        assert!(
            took >= HEADER_READ_TIMEOUT - Duration::from_millis(500),
            "closed after {took:?}, before the timeout"
        );
        // The waiting request is served once slots are free.
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
            .await
            .expect("served once the stalled connections were closed")
            .unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        shutdown.cancel();
    }
}
