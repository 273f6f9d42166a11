//! Mutual TLS for the gRPC server: the agent's identity, and the CA that client certificates
//! must chain to. Client certificates are required, not optional: a handshake without one, or
//! with one from another CA, fails before any request is read.

use std::path::Path;

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::Error;
use crate::config::Config;

fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::ReadTls {
        flag,
        path: path.to_path_buf(),
        source,
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(Error::InvalidConfig {
            flag,
            reason: format!("{} holds no PEM block; give a PEM file", path.display()),
        });
    }
    Ok(bytes)
}

/// Builds the server's TLS settings from `--tls-cert`, `--tls-key` and `--client-ca`.
pub fn server_config(config: &Config) -> Result<ServerTlsConfig, Error> {
    let cert = read_pem("--tls-cert", &config.tls_cert)?;
    let key = read_pem("--tls-key", &config.tls_key)?;
    let ca = read_pem("--client-ca", &config.client_ca)?;
    Ok(ServerTlsConfig::new()
        .identity(Identity::from_pem(cert, key))
        .client_ca_root(Certificate::from_pem(ca))
        // The default already, stated so that nobody relaxes it by accident.
        .client_auth_optional(false)
        .timeout(std::time::Duration::from_secs(10)))
}
