//! Reading the controller's HTTP API and Prometheus metrics over plain HTTP/1.0 on loopback.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A plain HTTP/1.0 GET against `addr`; returns (status, body). Gives up after 10 s.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let io = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        anyhow::Ok(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(10), io)
        .await
        .with_context(|| format!("GET http://{addr}{path} timed out"))??;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET http://{addr}{path}: no HTTP header"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("GET http://{addr}{path}: no status"))?;
    Ok((status, body.to_owned()))
}

/// Sum of a metric's samples (from `GET /metrics`) whose line contains every one of `matchers`
/// (e.g. `result="ok"`).
pub async fn metric(addr: SocketAddr, name: &str, matchers: &[&str]) -> anyhow::Result<f64> {
    let (status, body) = http_get(addr, "/metrics").await?;
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    Ok(sum_metric(&body, name, matchers))
}

/// Sum of the samples of metric `name` in Prometheus text whose line contains every matcher.
pub fn sum_metric(text: &str, name: &str, matchers: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| matchers.iter().all(|m| l.contains(m)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        // An empty float sum is -0.0, which would print as "-0".
        .fold(0.0, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_by_name_and_matchers() {
        let text = "# HELP x_total x\nx_total{result=\"ok\"} 2\nx_total{result=\"error\"} 3\nx_total_other 7\n";
        assert_eq!(sum_metric(text, "x_total", &[]), 5.0);
        assert_eq!(sum_metric(text, "x_total", &["result=\"ok\""]), 2.0);
        assert_eq!(sum_metric(text, "missing", &[]).to_string(), "0");
    }
}
