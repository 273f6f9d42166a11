//! Instance metadata service (IMDS v2) client: plain HTTP to a configured base URL, the
//! `Authorization: Bearer Oracle` header, a per-request timeout, and bounded retries with
//! exponential backoff for connection errors, timeouts and 5xx answers (never for 4xx).
//!
//! There is no default endpoint: the caller passes the base URL (in production
//! `http://169.254.169.254`), so tests and unconfigured agents never contact a cloud service.

use std::time::Duration;

use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::metadata::{Instance, ParseError, Vnic, parse_instance, parse_vnics};

/// Client settings.
#[derive(Clone, Debug)]
pub struct ImdsConfig {
    /// e.g. `http://169.254.169.254` (no trailing slash needed).
    pub base_url: String,
    /// Timeout of each attempt (connect, headers and body).
    pub timeout: Duration,
    /// Retries after the first attempt.
    pub retries: u32,
    /// Pause before the first retry; doubled for each further one.
    pub backoff: Duration,
    /// Largest accepted answer.
    pub max_body_bytes: usize,
}

impl ImdsConfig {
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            timeout: Duration::from_secs(3),
            retries: 3,
            backoff: Duration::from_millis(200),
            max_body_bytes: 1 << 20,
        }
    }
}

/// What went wrong talking to IMDS.
#[derive(Debug, thiserror::Error)]
pub enum ImdsError {
    #[error("imds base url {url:?} is not an http:// URL: {message}")]
    ConfigureEndpoint { url: String, message: String },
    #[error("request {url} failed after {attempts} attempt(s): {message}")]
    Request {
        url: String,
        attempts: u32,
        message: String,
    },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: StatusCode,
        body: String,
    },
    #[error("{url} gave a malformed answer: {source}")]
    Parse {
        url: String,
        #[source]
        source: ParseError,
    },
}

/// An IMDS v2 client.
#[derive(Clone)]
pub struct ImdsClient {
    cfg: ImdsConfig,
    client: Client<HttpConnector, Empty<Bytes>>,
}

enum Attempt {
    Retry(String),
    Fail(ImdsError),
}

impl ImdsClient {
    pub fn new(cfg: ImdsConfig) -> Result<Self, ImdsError> {
        let uri: Uri = cfg.base_url.parse().map_err(|e: http::uri::InvalidUri| {
            ImdsError::ConfigureEndpoint {
                url: cfg.base_url.clone(),
                message: e.to_string(),
            }
        })?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(ImdsError::ConfigureEndpoint {
                url: cfg.base_url.clone(),
                message: "expected http://host[:port][/prefix]".into(),
            });
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.timeout));
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Self { cfg, client })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.cfg.base_url.trim_end_matches('/'), path)
    }

    /// GETs `path` (e.g. `/opc/v2/vnics/`) and returns the body as text.
    pub async fn get(&self, path: &str) -> Result<String, ImdsError> {
        let url = self.url(path);
        let attempts = self.cfg.retries + 1;
        let mut last = String::new();
        for attempt in 1..=attempts {
            match self.try_once(&url).await {
                Ok(body) => return Ok(body),
                Err(Attempt::Fail(e)) => return Err(e),
                Err(Attempt::Retry(msg)) => {
                    tracing::debug!(%url, attempt, error = %msg, "imds request failed");
                    last = msg;
                    if attempt < attempts {
                        tokio::time::sleep(self.cfg.backoff * 2u32.saturating_pow(attempt - 1))
                            .await;
                    }
                }
            }
        }
        Err(ImdsError::Request {
            url,
            attempts,
            message: last,
        })
    }

    async fn try_once(&self, url: &str) -> Result<String, Attempt> {
        let req = Request::get(url)
            .header(http::header::AUTHORIZATION, "Bearer Oracle")
            .body(Empty::<Bytes>::new())
            .map_err(|e| {
                Attempt::Fail(ImdsError::Request {
                    url: url.into(),
                    attempts: 1,
                    message: e.to_string(),
                })
            })?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| Attempt::Retry(format!("{e:?}")))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| Attempt::Retry(e.to_string()))?
                .to_bytes();
            Ok::<_, Attempt>((status, body))
        };
        let (status, body) =
            tokio::time::timeout(self.cfg.timeout, fut)
                .await
                .map_err(|_| {
                    Attempt::Retry(format!(
                        "no answer within {} ms",
                        self.cfg.timeout.as_millis()
                    ))
                })??;
        let text =
            String::from_utf8_lossy(&body[..body.len().min(self.cfg.max_body_bytes)]).into_owned();
        if status.is_server_error() {
            return Err(Attempt::Retry(format!("status {status}")));
        }
        if !status.is_success() {
            return Err(Attempt::Fail(ImdsError::Status {
                url: url.into(),
                status,
                body: text.chars().take(200).collect(),
            }));
        }
        if body.len() > self.cfg.max_body_bytes {
            return Err(Attempt::Fail(ImdsError::Status {
                url: url.into(),
                status,
                body: format!("answer larger than {} bytes", self.cfg.max_body_bytes),
            }));
        }
        Ok(text)
    }

    /// `/opc/v2/vnics/`, parsed.
    pub async fn vnics(&self) -> Result<Vec<Vnic>, ImdsError> {
        let body = self.get("/opc/v2/vnics/").await?;
        parse_vnics(&body).map_err(|source| ImdsError::Parse {
            url: self.url("/opc/v2/vnics/"),
            source,
        })
    }

    /// `/opc/v2/instance/`, parsed.
    pub async fn instance(&self) -> Result<Instance, ImdsError> {
        let body = self.get("/opc/v2/instance/").await?;
        parse_instance(&body).map_err(|source| ImdsError::Parse {
            url: self.url("/opc/v2/instance/"),
            source,
        })
    }
}
