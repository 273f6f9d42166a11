//! Oracle Cloud clients and rules: the instance metadata service (IMDS v2) client, parsing of its
//! answers, and the host-side layout of secondary VNICs derived from them.

pub mod imds;
pub mod layout;
pub mod metadata;

pub use imds::{ImdsClient, ImdsConfig, ImdsError};
pub use layout::{HostInterface, Layout, LayoutError, LayoutOptions, secondary_vnics};
pub use metadata::{Instance, ParseError, Vnic, parse_instance, parse_vnics};
