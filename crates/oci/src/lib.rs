//! Oracle Cloud clients and rules: the instance metadata service (IMDS v2) client, parsing of its
//! answers, the host-side layout of secondary VNICs derived from them, and the Compute API client
//! with its request signing, credentials and retry policy.

pub mod auth;
pub mod compute;
pub mod imds;
pub mod layout;
pub mod metadata;
pub mod retry;
pub mod signer;
pub mod transport;

pub use imds::{ImdsClient, ImdsConfig, ImdsError};
pub use layout::{HostInterface, Layout, LayoutError, LayoutOptions, secondary_vnics};
pub use metadata::{Instance, ParseError, Vnic, parse_instance, parse_vnics};
