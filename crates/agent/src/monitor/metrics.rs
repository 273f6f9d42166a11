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

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::state::{ConditionStatus, ProblemState, SharedState, lock};

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
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept on the metrics listener");
                    continue;
                }
            },
        };
        let state = state.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
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
}
