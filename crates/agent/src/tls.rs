//! Mutual TLS for the gRPC server: the agent's identity, and the CA that client certificates
//! must chain to. Client certificates are required, not optional: a handshake without one, or
//! with one from another CA, fails before any request is read. The reload (a server generation
//! per set of files, on one listener) is in the crate root.

use std::path::Path;

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::config::Config;
use crate::error::Error;

/// How long a client has to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

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
        .timeout(HANDSHAKE_TIMEOUT))
}

/// A digest of the three TLS files, to notice when they change; `None` while one is unreadable.
pub fn fingerprint(config: &Config) -> Option<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for path in [&config.tls_cert, &config.tls_key, &config.client_ca] {
        h.update(std::fs::read(path).ok()?);
        h.update([0]);
    }
    Some(h.finalize().into())
}
