//! How nodekeeper's own command-line and test clients talk to the API server: kubectl's retry
//! rule instead of kube's default one.
//!
//! kube's default retry layer retries every 429, 503 and 504, up to 15 times with a backoff that
//! grows to minutes. For a command line (and a test) that hides what the server answered: a PDB
//! refusing an eviction is a 429, the Service proxy with no endpoint behind it is a 503. kubectl
//! (client-go) retries a response only when the API server asks for it, a 429 or 5xx carrying
//! `Retry-After` in seconds — as it does while the storage for a just-(re)defined custom resource
//! is being initialised ("storage is (re)initializing", `Retry-After: 1`) or when API priority and
//! fairness sheds load. [`server_asked_retry`] builds a client with that rule, bounded.

use std::time::Duration;

use http::{HeaderMap, Request, Response, StatusCode, header::RETRY_AFTER};
use kube::client::{Body, ClientBuilder};
use tower::{BoxError, buffer::BufferLayer, retry::Policy, retry::RetryLayer};

/// A client for `config` that retries only what the API server asks to be retried (see the
/// module documentation); kube's own retry layer is turned off.
pub fn server_asked_retry(mut config: kube::Config) -> Result<kube::Client, kube::Error> {
    config.default_retry = false;
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&BufferLayer::new(1024))
        .with_layer(&RetryLayer::new(ServerAskedRetry::default()))
        .build())
}

/// At most this many retries of one request, each after the server's `Retry-After`.
const MAX_RETRIES: u32 = 5;
/// A `Retry-After` longer than this is shortened to it: a CLI user is waiting.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(5);

/// The retry rule of kubectl (client-go): a response is retried only when the API server asks
/// for it, a 429 or 5xx with a `Retry-After` in seconds.
#[derive(Clone)]
struct ServerAskedRetry {
    retries_left: u32,
}

impl Default for ServerAskedRetry {
    fn default() -> Self {
        Self {
            retries_left: MAX_RETRIES,
        }
    }
}

/// How long to wait before retrying a response with this status and headers; `None` when it is
/// not to be retried.
fn server_asked_wait(status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
    if status != StatusCode::TOO_MANY_REQUESTS && !status.is_server_error() {
        return None;
    }
    let seconds: u64 = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds.max(1)).min(MAX_RETRY_WAIT))
}

impl<Res> Policy<Request<Body>, Response<Res>, BoxError> for ServerAskedRetry {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _request: &mut Request<Body>,
        result: &mut Result<Response<Res>, BoxError>,
    ) -> Option<Self::Future> {
        let response = result.as_ref().ok()?;
        let wait = server_asked_wait(response.status(), response.headers())?;
        self.retries_left = self.retries_left.checked_sub(1)?;
        Some(tokio::time::sleep(wait))
    }

    fn clone_request(&mut self, request: &Request<Body>) -> Option<Request<Body>> {
        // A streamed body cannot be replayed; such a request is simply not retried.
        let body = request.body().try_clone()?;
        let mut copy = Request::new(body);
        *copy.method_mut() = request.method().clone();
        *copy.uri_mut() = request.uri().clone();
        *copy.version_mut() = request.version();
        *copy.headers_mut() = request.headers().clone();
        *copy.extensions_mut() = request.extensions().clone();
        Some(copy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(retry_after: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = retry_after {
            headers.insert(RETRY_AFTER, value.parse().unwrap());
        }
        headers
    }

    #[test]
    fn only_what_the_server_asks_to_retry_is_retried() {
        let wait = |status: u16, value| {
            server_asked_wait(StatusCode::from_u16(status).unwrap(), &headers(value))
        };
        // The API server's "storage is (re)initializing" and priority-and-fairness answers.
        assert_eq!(wait(429, Some("1")), Some(Duration::from_secs(1)));
        assert_eq!(wait(503, Some("2")), Some(Duration::from_secs(2)));
        // The Service proxy's "no endpoints available": the controller is down, say so now.
        assert_eq!(wait(503, None), None);
        assert_eq!(wait(429, None), None);
        // Not an overload answer, whatever the header says.
        assert_eq!(wait(404, Some("1")), None);
        assert_eq!(wait(200, Some("1")), None);
        // Bounded, never busy-looping, and an HTTP date (not seconds) is not trusted.
        assert_eq!(wait(429, Some("3600")), Some(MAX_RETRY_WAIT));
        assert_eq!(wait(429, Some("0")), Some(Duration::from_secs(1)));
        assert_eq!(wait(429, Some("Wed, 21 Oct 2026 07:28:00 GMT")), None);
    }

    #[tokio::test]
    async fn the_retries_of_one_request_are_bounded() {
        let mut policy = ServerAskedRetry::default();
        let mut request = Request::new(Body::empty());
        let busy = || {
            let mut response = Response::new(());
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
                .headers_mut()
                .insert(RETRY_AFTER, "1".parse().unwrap());
            Ok::<_, BoxError>(response)
        };
        for _ in 0..MAX_RETRIES {
            assert!(policy.retry(&mut request, &mut busy()).is_some());
        }
        assert!(policy.retry(&mut request, &mut busy()).is_none());
        assert!(
            <ServerAskedRetry as Policy<_, Response<()>, BoxError>>::clone_request(
                &mut policy,
                &request
            )
            .is_some()
        );
    }
}
