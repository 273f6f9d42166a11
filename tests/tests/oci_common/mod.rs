//! What the tests that drive the controller against the local OCI endpoint share. Kept apart
//! from `controller_common` because that module is also compiled into the kubectl plugin's tests,
//! which do not link the OCI crate.

/// An API key as the controller mounts it (the tenancy, user, fingerprint and private key files
/// in a temporary directory, for `--oci-credentials-dir`), trusted by `endpoint`.
#[allow(dead_code)]
pub fn api_key_for(
    endpoint: &nodekeeper_e2e::oci_endpoint::OciEndpoint,
    tenancy: &str,
    user: &str,
) -> anyhow::Result<tempfile::TempDir> {
    use nodekeeper_oci::auth::api_key_files;
    let pem = nodekeeper_e2e::oci_endpoint::test_key_pem()?;
    let key = nodekeeper_oci::signer::PrivateKey::from_pem(&pem)?;
    let credentials = tempfile::tempdir()?;
    for (file, content) in [
        (api_key_files::TENANCY, tenancy.to_owned()),
        (api_key_files::USER, user.to_owned()),
        (api_key_files::FINGERPRINT, key.fingerprint().to_owned()),
        (api_key_files::PRIVATE_KEY, pem),
    ] {
        std::fs::write(credentials.path().join(file), content)?;
    }
    endpoint.register_key(
        &format!("{tenancy}/{user}/{}", key.fingerprint()),
        &key.public_key_pem()?,
    )?;
    Ok(credentials)
}
