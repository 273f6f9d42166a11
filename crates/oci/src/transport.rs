//! The one HTTP client the OCI API callers share: HTTP/1.1 over rustls (webpki roots) for the
//! real service, plain `http://` for the local test endpoint, a timeout per attempt.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A response read whole (OCI answers are small JSON documents).
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Shared HTTP client; cheap to clone.
#[derive(Clone, Debug)]
pub struct Transport {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
    max_body_bytes: usize,
}

impl Transport {
    /// Trusts the public web PKI (what OCI's service endpoints use).
    pub fn new(timeout: Duration) -> Self {
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
            .expect("ring provider supports the default TLS versions");
        Self::build(builder, timeout)
    }

    /// Trusts only the certificates in `ca_pem` (the cluster CA, for OKE's in-cluster token
    /// endpoint).
    pub fn with_ca(ca_pem: &str, timeout: Duration) -> Result<Self, String> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
            let cert = cert.map_err(|e| format!("read CA certificate: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("add CA certificate: {e}"))?;
        }
        if roots.is_empty() {
            return Err("no certificate in the CA bundle".into());
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config);
        Ok(Self::build(builder, timeout))
    }

    fn build(
        builder: hyper_rustls::HttpsConnectorBuilder<hyper_rustls::builderstates::WantsSchemes>,
        timeout: Duration,
    ) -> Self {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(timeout));
        let connector = builder.https_or_http().enable_http1().wrap_connector(http);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Self {
            client,
            timeout,
            max_body_bytes: 8 << 20,
        }
    }

    /// Sends one request; an `Err` is a transport failure (connect, timeout, reset), worth a
    /// retry when the request is idempotent or carries a retry token.
    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Response, String> {
        let max = self.max_body_bytes;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| format!("{e:?}"))?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
            if body.len() > max {
                return Err(format!("answer larger than {max} bytes"));
            }
            Ok(Response {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {} ms", self.timeout.as_millis()))?
    }
}
