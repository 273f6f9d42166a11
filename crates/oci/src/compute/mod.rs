//! OCI Compute API client (API version 20160918): VNIC attachments, VNICs, instances and
//! shapes, every request signed ([`crate::signer`]), retried on 429 and 5xx within a bounded
//! budget ([`crate::retry`]), with one `opc-retry-token` per logical create so a retried POST never
//! creates twice. Errors keep OCI's `code`, `message` and `opc-request-id`.
//!
//! Two answers are not faults and are never retried: LaunchInstance's 500 "Out of host capacity"
//! ([`ComputeError::OutOfCapacity`]) and 409 Conflict ([`ComputeError::Conflict`]), which OCI gives
//! to a second concurrent attach on one instance; callers serialise with [`InstanceLocks`].

mod error;
mod locks;
pub mod model;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::Bytes;
use rand::Rng as _;
use rand::distr::Alphanumeric;
use serde::de::DeserializeOwned;

pub use error::ComputeError;
pub use locks::InstanceLocks;
pub use model::*;

use crate::auth::AuthProvider;
use crate::retry::{RetryPolicy, retryable_status};
use crate::signer;
use crate::transport::{Response, Transport};

const API_VERSION: &str = "/20160918";
const OPC_REQUEST_ID: HeaderName = HeaderName::from_static("opc-request-id");
const OPC_RETRY_TOKEN: HeaderName = HeaderName::from_static("opc-retry-token");
const OPC_NEXT_PAGE: &str = "opc-next-page";

/// Client settings.
#[derive(Clone, Debug)]
pub struct ComputeConfig {
    /// Scheme and authority of the service, e.g. `https://iaas.us-phoenix-1.oraclecloud.com`, or
    /// the local test endpoint's `http://127.0.0.1:<port>`. There is no default.
    pub endpoint: String,
    pub retry: RetryPolicy,
    /// Timeout of each attempt.
    pub timeout: Duration,
    /// `limit` asked for on list calls.
    pub page_size: u32,
}

impl ComputeConfig {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            retry: RetryPolicy::default(),
            timeout: Duration::from_secs(30),
            page_size: 100,
        }
    }

    /// The endpoint of `region` (e.g. `us-phoenix-1`) in a realm whose domain is `realm_domain`
    /// (`oraclecloud.com` for oc1; on an instance read IMDS `regionInfo.realmDomainComponent`).
    pub fn for_region(region: &str, realm_domain: &str) -> Self {
        Self::new(format!("https://iaas.{region}.{realm_domain}"))
    }
}

/// Filters of ListVnicAttachments beyond the compartment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListVnicAttachmentsFilter {
    pub instance_id: Option<String>,
    pub availability_domain: Option<String>,
    pub vnic_id: Option<String>,
}

/// Requests this client sent, by kind; attempts count every try, retries included.
#[derive(Debug, Default)]
pub struct CallCounts {
    pub calls: AtomicU64,
    pub attempts: AtomicU64,
}

/// The Compute API client; cheap to clone.
#[derive(Clone, Debug)]
pub struct ComputeClient {
    base: String,
    auth: Arc<dyn AuthProvider>,
    transport: Transport,
    retry: RetryPolicy,
    page_size: u32,
    counts: Arc<CallCounts>,
}

/// Percent-encodes a query value or path segment: RFC 3986 unreserved characters stay, every
/// other byte becomes `%XX`. OCI verifies the signature over the bytes sent, so any consistent
/// encoding works; this one never needs `+`.
pub fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn query(pairs: &[(&str, Option<&str>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={}", encode(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

fn random_token(len: usize) -> String {
    rand::rng()
        .sample_iter(&Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

fn header_str(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn instance_state_name(s: InstanceState) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

impl ComputeClient {
    pub fn new(cfg: ComputeConfig, auth: Arc<dyn AuthProvider>) -> Result<Self, ComputeError> {
        let base = cfg.endpoint.trim_end_matches('/').to_string();
        let uri: Uri =
            base.parse()
                .map_err(|e: http::uri::InvalidUri| ComputeError::Configure {
                    endpoint: base.clone(),
                    message: e.to_string(),
                })?;
        if !matches!(uri.scheme_str(), Some("https" | "http")) || uri.host().is_none() {
            return Err(ComputeError::Configure {
                endpoint: base,
                message: "expected https://host[:port] (http:// only for a local test endpoint)"
                    .into(),
            });
        }
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(ComputeError::Configure {
                endpoint: base,
                message: "give scheme and host only; the client adds /20160918/…".into(),
            });
        }
        Ok(Self {
            base,
            auth,
            transport: Transport::new(cfg.timeout),
            retry: cfg.retry,
            page_size: cfg.page_size.max(1),
            counts: Arc::default(),
        })
    }

    /// Requests sent so far (logical calls and attempts).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.counts.calls.load(Ordering::Relaxed),
            self.counts.attempts.load(Ordering::Relaxed),
        )
    }

    /// Sends one logical call, retrying within the policy; returns the successful response.
    async fn call(
        &self,
        operation: &'static str,
        method: Method,
        path_and_query: &str,
        body: Option<Vec<u8>>,
        extra: &[(HeaderName, String)],
    ) -> Result<Response, ComputeError> {
        self.counts.calls.fetch_add(1, Ordering::Relaxed);
        let url = format!("{}{API_VERSION}{path_and_query}", self.base);
        let uri: Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| ComputeError::Configure {
                endpoint: url.clone(),
                message: e.to_string(),
            })?;
        let body = Bytes::from(body.unwrap_or_default());
        // One token for every attempt of this call: that is what makes a retried create safe.
        let retry_token = (method == Method::POST).then(|| random_token(32));
        let request_id = random_token(32).to_ascii_uppercase();
        let started = Instant::now();
        let mut attempt = 0u32;
        let mut renewed_after_401 = false;
        loop {
            attempt += 1;
            self.counts.attempts.fetch_add(1, Ordering::Relaxed);
            let credentials = self
                .auth
                .credentials()
                .await
                .map_err(|source| ComputeError::Authenticate { operation, source })?;
            let mut headers = HeaderMap::new();
            headers.insert(
                http::header::ACCEPT,
                HeaderValue::from_static("application/json"),
            );
            if let Ok(v) = HeaderValue::from_str(&request_id) {
                headers.insert(OPC_REQUEST_ID, v);
            }
            if let Some(token) = &retry_token
                && let Ok(v) = HeaderValue::from_str(token)
            {
                headers.insert(OPC_RETRY_TOKEN, v);
            }
            for (name, value) in extra {
                let v = HeaderValue::from_str(value).map_err(|e| ComputeError::Configure {
                    endpoint: url.clone(),
                    message: format!("header {name}: {e}"),
                })?;
                headers.insert(name.clone(), v);
            }
            signer::sign_request(
                &credentials,
                &method,
                &uri,
                &mut headers,
                &body,
                SystemTime::now(),
            )
            .map_err(|source| ComputeError::Sign { operation, source })?;
            let mut request = Request::builder()
                .method(method.clone())
                .uri(uri.clone())
                .body(Full::new(body.clone()))
                .map_err(|e| ComputeError::Configure {
                    endpoint: url.clone(),
                    message: e.to_string(),
                })?;
            *request.headers_mut() = headers;

            let outcome = self.transport.send(request).await;
            let retry_in = |attempt: u32| {
                let delay = self.retry.delay(attempt);
                (attempt < self.retry.max_attempts
                    && started.elapsed() + delay <= self.retry.max_elapsed)
                    .then_some(delay)
            };
            let response = match outcome {
                Ok(r) => r,
                Err(message) => {
                    // A POST without a retry token cannot happen here; GET and DELETE are
                    // idempotent, so a transport failure is always safe to retry.
                    if let Some(delay) = retry_in(attempt) {
                        tracing::debug!(operation, attempt, error = %message, "oci call failed, retrying");
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                    return Err(ComputeError::Transport {
                        operation,
                        attempts: attempt,
                        elapsed_ms: started.elapsed().as_millis() as u64,
                        message,
                    });
                }
            };
            if response.status.is_success() {
                return Ok(response);
            }
            let error = ErrorBody::parse(&response.body);
            let answered_id = header_str(&response.headers, "opc-request-id")
                .unwrap_or_else(|| request_id.clone());
            if response.status == StatusCode::UNAUTHORIZED && !renewed_after_401 {
                // A security token may have been revoked or rotated early: renew once.
                renewed_after_401 = true;
                self.auth.invalidate();
                continue;
            }
            if operation == "LaunchInstance"
                && response.status == StatusCode::INTERNAL_SERVER_ERROR
                && error
                    .message
                    .to_ascii_lowercase()
                    .contains("out of host capacity")
            {
                return Err(ComputeError::OutOfCapacity {
                    operation,
                    message: error.message,
                    request_id: answered_id,
                });
            }
            if response.status == StatusCode::CONFLICT {
                return Err(ComputeError::Conflict {
                    operation,
                    code: error.code,
                    message: error.message,
                    request_id: answered_id,
                });
            }
            if retryable_status(response.status)
                && let Some(delay) = retry_in(attempt)
            {
                tracing::debug!(
                    operation,
                    attempt,
                    status = response.status.as_u16(),
                    code = %error.code,
                    opc_request_id = %answered_id,
                    "oci call refused, retrying"
                );
                tokio::time::sleep(delay).await;
                continue;
            }
            return Err(ComputeError::Service {
                operation,
                status: response.status.as_u16(),
                code: error.code,
                message: error.message,
                request_id: answered_id,
                attempts: attempt,
            });
        }
    }

    async fn call_json<T: DeserializeOwned>(
        &self,
        operation: &'static str,
        method: Method,
        path_and_query: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(T, HeaderMap), ComputeError> {
        let response = self
            .call(operation, method, path_and_query, body, &[])
            .await?;
        let value = serde_json::from_slice(&response.body).map_err(|e| ComputeError::Decode {
            operation,
            message: e.to_string(),
            request_id: header_str(&response.headers, "opc-request-id").unwrap_or_default(),
        })?;
        Ok((value, response.headers))
    }

    fn to_body<T: serde::Serialize>(
        operation: &'static str,
        value: &T,
    ) -> Result<Vec<u8>, ComputeError> {
        serde_json::to_vec(value).map_err(|e| ComputeError::Decode {
            operation,
            message: format!("encode request: {e}"),
            request_id: String::new(),
        })
    }

    /// Every page of a list call: `opc-next-page` goes back as `page` until it is absent.
    async fn list_all<T: DeserializeOwned>(
        &self,
        operation: &'static str,
        path: &str,
        pairs: &[(&str, Option<&str>)],
    ) -> Result<Vec<T>, ComputeError> {
        let limit = self.page_size.to_string();
        let mut page: Option<String> = None;
        let mut out = Vec::new();
        loop {
            let mut all: Vec<(&str, Option<&str>)> = pairs.to_vec();
            all.push(("limit", Some(&limit)));
            all.push(("page", page.as_deref()));
            let (items, headers): (Vec<T>, _) = self
                .call_json(
                    operation,
                    Method::GET,
                    &format!("{path}{}", query(&all)),
                    None,
                )
                .await?;
            out.extend(items);
            match header_str(&headers, OPC_NEXT_PAGE) {
                Some(next) if !next.is_empty() => page = Some(next),
                _ => return Ok(out),
            }
        }
    }

    /// AttachVnic: creates a VNIC and attaches it; the answer is ATTACHING.
    pub async fn attach_vnic(
        &self,
        details: &AttachVnicDetails,
    ) -> Result<VnicAttachment, ComputeError> {
        let body = Self::to_body("AttachVnic", details)?;
        let (a, _) = self
            .call_json("AttachVnic", Method::POST, "/vnicAttachments", Some(body))
            .await?;
        Ok(a)
    }

    /// GetVnicAttachment.
    pub async fn get_vnic_attachment(&self, id: &str) -> Result<VnicAttachment, ComputeError> {
        let (a, _) = self
            .call_json(
                "GetVnicAttachment",
                Method::GET,
                &format!("/vnicAttachments/{}", encode(id)),
                None,
            )
            .await?;
        Ok(a)
    }

    /// ListVnicAttachments, all pages.
    pub async fn list_vnic_attachments(
        &self,
        compartment_id: &str,
        filter: &ListVnicAttachmentsFilter,
    ) -> Result<Vec<VnicAttachment>, ComputeError> {
        self.list_all(
            "ListVnicAttachments",
            "/vnicAttachments",
            &[
                ("compartmentId", Some(compartment_id)),
                ("availabilityDomain", filter.availability_domain.as_deref()),
                ("instanceId", filter.instance_id.as_deref()),
                ("vnicId", filter.vnic_id.as_deref()),
            ],
        )
        .await
    }

    /// DetachVnic: a DELETE that detaches and deletes the VNIC (never the primary one).
    pub async fn detach_vnic(&self, id: &str, if_match: Option<&str>) -> Result<(), ComputeError> {
        let extra: Vec<(HeaderName, String)> = if_match
            .map(|e| (http::header::IF_MATCH, e.to_string()))
            .into_iter()
            .collect();
        self.call(
            "DetachVnic",
            Method::DELETE,
            &format!("/vnicAttachments/{}", encode(id)),
            None,
            &extra,
        )
        .await?;
        Ok(())
    }

    /// GetVnic (VirtualNetwork service, same host).
    pub async fn get_vnic(&self, id: &str) -> Result<Vnic, ComputeError> {
        let (v, _) = self
            .call_json(
                "GetVnic",
                Method::GET,
                &format!("/vnics/{}", encode(id)),
                None,
            )
            .await?;
        Ok(v)
    }

    /// LaunchInstance; "Out of host capacity" comes back as [`ComputeError::OutOfCapacity`].
    pub async fn launch_instance(
        &self,
        details: &LaunchInstanceDetails,
    ) -> Result<Instance, ComputeError> {
        let body = Self::to_body("LaunchInstance", details)?;
        let (i, _) = self
            .call_json("LaunchInstance", Method::POST, "/instances", Some(body))
            .await?;
        Ok(i)
    }

    /// GetInstance.
    pub async fn get_instance(&self, id: &str) -> Result<Instance, ComputeError> {
        let (i, _) = self
            .call_json(
                "GetInstance",
                Method::GET,
                &format!("/instances/{}", encode(id)),
                None,
            )
            .await?;
        Ok(i)
    }

    /// TerminateInstance (asynchronous: the instance goes TERMINATING, then TERMINATED).
    pub async fn terminate_instance(
        &self,
        id: &str,
        options: &TerminateOptions,
    ) -> Result<(), ComputeError> {
        let extra: Vec<(HeaderName, String)> = options
            .if_match
            .as_ref()
            .map(|e| (http::header::IF_MATCH, e.clone()))
            .into_iter()
            .collect();
        let preserve = options.preserve_boot_volume.to_string();
        self.call(
            "TerminateInstance",
            Method::DELETE,
            &format!(
                "/instances/{}{}",
                encode(id),
                query(&[("preserveBootVolume", Some(&preserve))])
            ),
            None,
            &extra,
        )
        .await?;
        Ok(())
    }

    /// ListInstances, all pages (TERMINATED instances stay listed for hours: filter them).
    pub async fn list_instances(
        &self,
        compartment_id: &str,
        filter: &ListInstancesFilter,
    ) -> Result<Vec<Instance>, ComputeError> {
        let state = filter.lifecycle_state.map(instance_state_name);
        self.list_all(
            "ListInstances",
            "/instances",
            &[
                ("compartmentId", Some(compartment_id)),
                ("availabilityDomain", filter.availability_domain.as_deref()),
                ("displayName", filter.display_name.as_deref()),
                ("lifecycleState", state.as_deref()),
            ],
        )
        .await
    }

    /// ListShapes, all pages: the shapes offered in a compartment, optionally in one
    /// availability domain and for one image.
    pub async fn list_shapes(
        &self,
        compartment_id: &str,
        availability_domain: Option<&str>,
        image_id: Option<&str>,
    ) -> Result<Vec<Shape>, ComputeError> {
        self.list_all(
            "ListShapes",
            "/shapes",
            &[
                ("compartmentId", Some(compartment_id)),
                ("availabilityDomain", availability_domain),
                ("imageId", image_id),
            ],
        )
        .await
    }

    /// The live (not DETACHING/DETACHED) attachment on `instance_id` named `display_name`, if
    /// any: how a caller that may have crashed after AttachVnic finds its own work instead of
    /// attaching twice.
    pub async fn find_vnic_attachment(
        &self,
        compartment_id: &str,
        instance_id: &str,
        display_name: &str,
    ) -> Result<Option<VnicAttachment>, ComputeError> {
        let all = self
            .list_vnic_attachments(
                compartment_id,
                &ListVnicAttachmentsFilter {
                    instance_id: Some(instance_id.to_string()),
                    ..Default::default()
                },
            )
            .await?;
        Ok(all.into_iter().find(|a| {
            !a.lifecycle_state.is_gone() && a.display_name.as_deref() == Some(display_name)
        }))
    }

    /// Polls GetVnicAttachment every `poll` until ATTACHED (with its `vnicId`), failing when the
    /// attachment goes DETACHING/DETACHED (the attach failed) or `timeout` passes.
    pub async fn wait_for_attached(
        &self,
        id: &str,
        poll: Duration,
        timeout: Duration,
    ) -> Result<VnicAttachment, ComputeError> {
        let started = Instant::now();
        loop {
            let a = self.get_vnic_attachment(id).await?;
            match a.lifecycle_state {
                VnicAttachmentState::Attached if a.vnic_id.is_some() => return Ok(a),
                s if s.is_gone() => {
                    return Err(ComputeError::WaitAttachment {
                        id: id.to_string(),
                        message: format!(
                            "attachment went {s:?} instead of ATTACHED: the attach failed; check the subnet, NSGs and the shape's VNIC limit"
                        ),
                    });
                }
                _ => {}
            }
            if started.elapsed() + poll > timeout {
                return Err(ComputeError::WaitAttachment {
                    id: id.to_string(),
                    message: format!(
                        "still {:?} after {} ms",
                        a.lifecycle_state,
                        started.elapsed().as_millis()
                    ),
                });
            }
            tokio::time::sleep(poll).await;
        }
    }
}

impl ErrorBody {
    /// OCI's `{"code","message"}`; a body that is not one (a proxy's HTML page) is kept as the
    /// message, shortened.
    pub fn parse(body: &[u8]) -> Self {
        serde_json::from_slice::<ErrorBody>(body).unwrap_or_else(|_| ErrorBody {
            code: String::new(),
            message: String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_keeps_unreserved_and_escapes_the_rest() {
        assert_eq!(encode("Uocm:PHX-AD-1 x"), "Uocm%3APHX-AD-1%20x");
        assert_eq!(
            encode("ocid1.instance.oc1..a_b~c"),
            "ocid1.instance.oc1..a_b~c"
        );
        assert_eq!(encode("a/b&c=d"), "a%2Fb%26c%3Dd");
    }

    #[test]
    fn query_skips_absent_values() {
        assert_eq!(
            query(&[("a", Some("1")), ("b", None), ("c", Some("x y"))]),
            "?a=1&c=x%20y"
        );
        assert_eq!(query(&[("a", None)]), "");
    }

    #[test]
    fn endpoint_must_be_scheme_and_host() {
        #[derive(Debug)]
        struct NoAuth;
        impl AuthProvider for NoAuth {
            fn credentials(
                &self,
            ) -> crate::auth::BoxFuture<'_, Result<signer::Credentials, crate::auth::AuthError>>
            {
                Box::pin(async { Err(crate::auth::AuthError::MakeSessionKey("none".into())) })
            }
        }
        let auth: Arc<dyn AuthProvider> = Arc::new(NoAuth);
        for bad in ["ftp://x", "iaas.example", "https://iaas.example/20160918"] {
            let err = ComputeClient::new(ComputeConfig::new(bad), auth.clone())
                .unwrap_err()
                .to_string();
            assert!(err.contains(bad), "{err}");
        }
        ComputeClient::new(
            ComputeConfig::for_region("us-phoenix-1", "oraclecloud.com"),
            auth,
        )
        .unwrap();
    }

    #[test]
    fn instance_state_names_are_the_api_ones() {
        assert_eq!(instance_state_name(InstanceState::Running), "RUNNING");
        assert_eq!(
            instance_state_name(InstanceState::CreatingImage),
            "CREATING_IMAGE"
        );
    }
}
