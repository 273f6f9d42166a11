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

use nodekeeper_model::address_policy::{Cidr, agent_permits};

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
        match tokio::time::timeout(plan.timeout, get(url, &tls, &plan.allowed)).await {
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

async fn get(url: &http::Uri, tls: &Arc<ClientConfig>, allowed: &[Cidr]) -> Result<u16, String> {
    let authority = url.authority().ok_or("URL has no host")?;
    // `Uri::host` keeps the brackets of an IPv6 literal.
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let https = url.scheme_str() == Some("https");
    let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
    // A literal address was checked against the policy in the plan. A name is resolved here, on
    // the node, and may give other addresses than the controller saw when it planned (split-horizon
    // DNS, or a name rebound to the metadata service or loopback): each address is checked again,
    // and only permitted ones are ever connected to.
    let addrs = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => {
            let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
                .await
                .map_err(|e| format!("resolve {host}: {e}"))?
                .collect();
            permitted(host, resolved, allowed)?
        }
    };
    let tcp = connect(&addrs).await?;
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

/// The resolved addresses of `host` that the address policy permits, in resolver order; an error
/// naming the addresses when there are none (then nothing is sent).
fn permitted(
    host: &str,
    resolved: Vec<SocketAddr>,
    allowed: &[Cidr],
) -> Result<Vec<SocketAddr>, String> {
    if resolved.is_empty() {
        return Err(format!("resolve {host}: no addresses"));
    }
    let (ok, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
        .into_iter()
        .partition(|a| agent_permits(allowed, a.ip()));
    if ok.is_empty() {
        let refused: Vec<String> = refused.iter().map(|a| a.ip().to_string()).collect();
        return Err(format!(
            "{host} resolved to {}, outside the address policy sent in allowed_cidrs; not probed",
            refused.join(", ")
        ));
    }
    Ok(ok)
}

/// Connects to the first of `addrs` that accepts, in order; the last error if none does.
async fn connect(addrs: &[SocketAddr]) -> Result<TcpStream, String> {
    let mut last = String::from("no address to connect to");
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(tcp) => return Ok(tcp),
            Err(e) => last = format!("connect to {addr}: {e}"),
        }
    }
    Err(last)
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
    fn resolved_addresses_outside_the_policy_are_dropped() {
        let allowed: Vec<Cidr> = vec!["10.0.0.0/24".parse().unwrap()];
        let sa = |s: &str| s.parse::<SocketAddr>().unwrap();
        // Only the permitted address is kept, whatever its position.
        assert_eq!(
            permitted(
                "svc.example",
                vec![
                    sa("169.254.169.254:80"),
                    sa("10.0.0.7:80"),
                    sa("127.0.0.1:80")
                ],
                &allowed
            ),
            Ok(vec![sa("10.0.0.7:80")])
        );
        // None left: the probe fails and names what the name resolved to.
        let e = permitted(
            "svc.example",
            vec![sa("169.254.169.254:80"), sa("[::ffff:127.0.0.1]:80")],
            &allowed,
        )
        .unwrap_err();
        assert!(
            e.contains("svc.example resolved to 169.254.169.254, ::ffff:127.0.0.1, outside the address policy"),
            "{e}"
        );
        assert!(permitted("svc.example", vec![], &allowed).is_err());
    }

    #[test]
    fn tls_config_builds_and_rejects_bad_extra_roots() {
        assert!(client_config(&[]).is_ok());
        assert!(client_config(&[b"not a certificate".to_vec()]).is_err());
    }
}
