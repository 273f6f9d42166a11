//! Built-in kubelet and container-runtime health checks, with the condition types, reasons and
//! polarity of node-problem-detector's `health-checker-kubelet.json` and
//! `health-checker-containerd.json` (`KubeletUnhealthy`, `ContainerRuntimeUnhealthy`; True = the
//! problem is present): the kubelet answers `ok` on its `/healthz` (plain HTTP on loopback), and
//! the runtime answers `crictl version` over its CRI socket, or, without `crictl`, accepts a
//! connection on the socket. Messages name what failed, never a changing figure.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;

use super::plugin::{self, Outcome};
use super::state::{ConditionDefault, ConditionStatus, SharedState, lock};

/// The `source` the conditions are listed under (NPD's health checker's).
pub const SOURCE: &str = "health-checker";
/// Answers are read up to this many bytes.
const MAX_ANSWER: usize = 4096;

/// What to check.
#[derive(Clone, Debug)]
pub struct HealthConfig {
    /// `host:port` and path of the kubelet's healthz endpoint; `None` skips the kubelet check.
    pub kubelet: Option<(String, String)>,
    /// The CRI socket; `None` skips the runtime check.
    pub cri_socket: Option<PathBuf>,
    /// `crictl`, when present on this node.
    pub crictl: Option<PathBuf>,
    pub interval: Duration,
    pub timeout: Duration,
}

/// Splits `http://host:port/path` into its address and path; only plain HTTP is accepted (the
/// kubelet serves /healthz without TLS on loopback).
pub fn parse_healthz_url(url: &str) -> Result<(String, String), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "{url:?}: use an http:// URL (the kubelet's healthz port serves plain HTTP)"
        ));
    }
    let host = uri.host().ok_or_else(|| format!("{url:?} has no host"))?;
    let port = uri.port_u16().unwrap_or(80);
    Ok((format!("{host}:{port}"), uri.path().to_owned()))
}

fn kubelet_condition() -> ConditionDefault {
    ConditionDefault {
        kind: "KubeletUnhealthy".into(),
        reason: "KubeletIsHealthy".into(),
        message: "kubelet on the node is functioning properly".into(),
    }
}

fn runtime_condition() -> ConditionDefault {
    ConditionDefault {
        kind: "ContainerRuntimeUnhealthy".into(),
        reason: "ContainerRuntimeIsHealthy".into(),
        message: "Container runtime on the node is functioning properly".into(),
    }
}

/// Asks the kubelet's healthz; `Err` says why it is unhealthy.
pub async fn check_kubelet(addr: &str, path: &str, timeout: Duration) -> Result<(), String> {
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect to {addr}: {}", e.kind()))?;
        let request =
            format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nUser-Agent: nodekeeper-agent\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send to {addr}: {}", e.kind()))?;
        let mut answer = Vec::with_capacity(256);
        let _ = (&mut stream)
            .take(MAX_ANSWER as u64)
            .read_to_end(&mut answer)
            .await;
        Ok::<_, String>(answer)
    };
    let answer = tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| format!("no answer from {addr}{path} within {timeout:?}"))??;
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok());
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").trim();
    match status {
        Some(200) if body == "ok" => Ok(()),
        Some(code) => Err(format!("{path} answered HTTP {code}")),
        None => Err(format!("{path} answered something that is not HTTP")),
    }
}

/// Checks the container runtime; `Err` says why it is unhealthy.
pub async fn check_runtime(
    socket: &std::path::Path,
    crictl: Option<&std::path::Path>,
    timeout: Duration,
) -> Result<(), String> {
    if let Some(crictl) = crictl {
        let args = [
            format!("--runtime-endpoint=unix://{}", socket.display()),
            format!("--timeout={}s", timeout.as_secs().max(1)),
            "version".to_owned(),
        ];
        let result = plugin::exec(crictl, &args, timeout + Duration::from_secs(1), 200).await;
        return match result.outcome {
            Outcome::Ok => Ok(()),
            _ if result.timed_out => {
                Err(format!("crictl version gave no answer within {timeout:?}"))
            }
            _ => Err("crictl version failed".to_owned()),
        };
    }
    match tokio::time::timeout(timeout, tokio::net::UnixStream::connect(socket)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("connect to {}: {}", socket.display(), e.kind())),
        Err(_) => Err(format!("connect to {} timed out", socket.display())),
    }
}

/// Declares the conditions checked, then checks every `interval` until `shutdown`.
pub async fn run(config: HealthConfig, state: SharedState, shutdown: CancellationToken) {
    {
        let mut s = lock(&state);
        if config.kubelet.is_some() {
            s.declare(SOURCE, &kubelet_condition(), SystemTime::now());
        }
        if config.cri_socket.is_some() {
            s.declare(SOURCE, &runtime_condition(), SystemTime::now());
        }
    }
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let kubelet = async {
            match &config.kubelet {
                Some((addr, path)) => Some(check_kubelet(addr, path, config.timeout).await),
                None => None,
            }
        };
        let runtime = async {
            match &config.cri_socket {
                Some(socket) => {
                    Some(check_runtime(socket, config.crictl.as_deref(), config.timeout).await)
                }
                None => None,
            }
        };
        let (kubelet, runtime) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = async { tokio::join!(kubelet, runtime) } => r,
        };
        let now = SystemTime::now();
        let mut s = lock(&state);
        // NPD's reason for containerd; other runtimes get a reason that does not name one.
        let runtime_reason = match &config.cri_socket {
            Some(p) if p.to_string_lossy().contains("containerd") => "ContainerdUnhealthy",
            _ => "ContainerRuntimeUnhealthy",
        };
        for (result, default, bad_reason) in [
            (kubelet, kubelet_condition(), "KubeletUnhealthy"),
            (runtime, runtime_condition(), runtime_reason),
        ] {
            match result {
                None => {}
                Some(Ok(())) => {
                    s.set_condition(
                        &default.kind,
                        ConditionStatus::False,
                        &default.reason,
                        &default.message,
                        now,
                    );
                }
                Some(Err(why)) => {
                    s.set_condition(&default.kind, ConditionStatus::True, bad_reason, &why, now);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_urls() {
        assert_eq!(
            parse_healthz_url("http://127.0.0.1:10248/healthz"),
            Ok(("127.0.0.1:10248".into(), "/healthz".into()))
        );
        assert!(
            parse_healthz_url("https://127.0.0.1:10250/healthz")
                .unwrap_err()
                .contains("http://")
        );
        assert!(parse_healthz_url("not a url").is_err());
    }
}
