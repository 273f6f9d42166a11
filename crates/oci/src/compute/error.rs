//! What a Compute API call can answer besides success, with OCI's `code`, `message` and
//! `opc-request-id` kept for the caller and its logs.

use crate::auth::AuthError;
use crate::signer::SignError;

/// A failed Compute API call.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    #[error("configure compute client for {endpoint:?}: {message}")]
    Configure { endpoint: String, message: String },
    #[error("{operation}: obtain credentials: {source}")]
    Authenticate {
        operation: &'static str,
        #[source]
        source: AuthError,
    },
    #[error("{operation}: {source}")]
    Sign {
        operation: &'static str,
        #[source]
        source: SignError,
    },
    #[error(
        "{operation}: out of host capacity ({message}; opc-request-id {request_id}): try another shape, fault domain or availability domain"
    )]
    OutOfCapacity {
        operation: &'static str,
        message: String,
        request_id: String,
    },
    #[error(
        "{operation}: 409 {code}: {message} (opc-request-id {request_id}): another change to this resource is in progress; retry after it completes"
    )]
    Conflict {
        operation: &'static str,
        code: String,
        message: String,
        request_id: String,
    },
    #[error(
        "{operation}: {status} {code}: {message} (opc-request-id {request_id}; {attempts} attempt(s))"
    )]
    Service {
        operation: &'static str,
        status: u16,
        code: String,
        message: String,
        request_id: String,
        attempts: u32,
    },
    #[error("{operation}: no answer after {attempts} attempt(s) in {elapsed_ms} ms: {message}")]
    Transport {
        operation: &'static str,
        attempts: u32,
        elapsed_ms: u64,
        message: String,
    },
    #[error("{operation}: decode answer: {message} (opc-request-id {request_id})")]
    Decode {
        operation: &'static str,
        message: String,
        request_id: String,
    },
    #[error("wait for vnic attachment {id}: {message}")]
    WaitAttachment { id: String, message: String },
}

impl ComputeError {
    /// OCI's error code (`NotAuthorizedOrNotFound`, `TooManyRequests`, …), when the service gave one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Service { code, .. } | Self::Conflict { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The HTTP status the service answered, when it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Service { status, .. } => Some(*status),
            Self::Conflict { .. } => Some(409),
            Self::OutOfCapacity { .. } => Some(500),
            _ => None,
        }
    }

    /// The `opc-request-id` to quote to Oracle support.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            Self::Service { request_id, .. }
            | Self::Conflict { request_id, .. }
            | Self::OutOfCapacity { request_id, .. }
            | Self::Decode { request_id, .. } => Some(request_id),
            _ => None,
        }
    }

    /// 404: the resource does not exist (or this principal may not see it).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }
}
