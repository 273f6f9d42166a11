//! The HTTP(S) probe: timed GETs of one URL over a fresh connection each, with certificate
//! verification against the Mozilla roots compiled into the agent (plus any configured extra roots).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::header::{CONNECTION, HOST, USER_AGENT};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{
    self, ClientConfig, RootCertStore, pki_types::CertificateDer, pki_types::ServerName,
};

use super::Tally;
use super::validate::Plan;

/// The TLS client configuration for HTTPS probes: verification always on.
pub(super) fn client_config(extra_roots: &[Vec<u8>]) -> Result<Arc<ClientConfig>, rustls::Error> {
    let mut roots = RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    for der in extra_roots {
        roots.add(CertificateDer::from(der.clone()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Runs `count` GETs; returns the tally and the last status code received (0 if none).
pub(super) async fn probe(url: &http::Uri, plan: &Plan, tls: Arc<ClientConfig>) -> (Tally, u16) {
    let mut tally = Tally::default();
    let mut last_status = 0;
    for i in 0..plan.count {
        let start = Instant::now();
        match tokio::time::timeout(plan.timeout, get(url, &tls)).await {
            Ok(Ok(status)) => {
                last_status = status;
                if accepted(status, &plan.expected_status) {
                    tally.success(start.elapsed());
                } else {
                    tally.failure(format!(
                        "GET {url}: status {status} is not an expected status ({})",
                        expected_words(&plan.expected_status)
                    ));
                }
            }
            Ok(Err(e)) => tally.failure(format!("GET {url}: {e}")),
            Err(_) => tally.failure(format!("GET {url}: no response within {:?}", plan.timeout)),
        }
        super::pause(plan, i).await;
    }
    (tally, last_status)
}

pub(super) fn accepted(status: u16, expected: &[u16]) -> bool {
    if expected.is_empty() {
        (200..=399).contains(&status)
    } else {
        expected.contains(&status)
    }
}

fn expected_words(expected: &[u16]) -> String {
    if expected.is_empty() {
        "200–399".into()
    } else {
        expected
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

async fn get(url: &http::Uri, tls: &Arc<ClientConfig>) -> Result<u16, String> {
    let authority = url.authority().ok_or("URL has no host")?;
    // `Uri::host` keeps the brackets of an IPv6 literal.
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let https = url.scheme_str() == Some("https");
    let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
    let addr = match host.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port),
        Err(_) => tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| format!("resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("resolve {host}: no addresses"))?,
    };
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let path = url.path_and_query().map_or("/", |p| p.as_str());
    let req = http::Request::get(path)
        .header(HOST, authority.as_str())
        .header(
            USER_AGENT,
            concat!("nodekeeper-agent/", env!("CARGO_PKG_VERSION")),
        )
        .header(CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("build request: {e}"))?;
    if https {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| format!("TLS server name {host:?}: {e}"))?;
        let stream = TlsConnector::from(Arc::clone(tls))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake with {host}: {e}"))?;
        send(TokioIo::new(stream), req).await
    } else {
        send(TokioIo::new(tcp), req).await
    }
}

/// Sends one request over an HTTP/1.1 connection and returns the response status. The body is not
/// read: the status is the answer, and the connection is dropped right after.
async fn send<T>(io: T, req: http::Request<Empty<Bytes>>) -> Result<u16, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    let mut conn = std::pin::pin!(conn);
    let mut response = std::pin::pin!(sender.send_request(req));
    let status = |r: Result<http::Response<hyper::body::Incoming>, hyper::Error>| {
        r.map(|r| r.status().as_u16())
            .map_err(|e| format!("request failed: {e}"))
    };
    // The connection task must run for the response to arrive. A server that answers and closes
    // at once finishes the connection in the same turn as the response: in that case the response
    // is already waiting, so it is taken before the connection's end is believed.
    tokio::select! {
        biased;
        resp = &mut response => status(resp),
        done = &mut conn => match done {
            Ok(()) => status(response.await),
            Err(e) => Err(format!("connection failed: {e}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_explicit_statuses() {
        assert!(accepted(200, &[]));
        assert!(accepted(302, &[]));
        assert!(!accepted(404, &[]));
        assert!(!accepted(199, &[]));
        assert!(accepted(404, &[404]));
        assert!(!accepted(200, &[204]));
    }

    #[test]
    fn tls_config_builds_and_rejects_bad_extra_roots() {
        assert!(client_config(&[]).is_ok());
        assert!(client_config(&[b"not a certificate".to_vec()]).is_err());
    }
}
