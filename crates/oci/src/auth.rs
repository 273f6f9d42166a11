//! Credentials for signing OCI API calls: an API key read from files (a mounted Secret), and
//! security-token sessions (instance principals through the X.509 federation endpoint) with a
//! fresh session key per token, renewed before the token expires and after a 401.
//!
//! Facts: `shared/oci/compute-api.md` §1 (keyId forms) and §2 (the federation flow, refresh).
//! Nothing here logs a key, a token or a passphrase; `Debug` impls redact them.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use http::{Method, Request, Uri};
use http_body_util::Full;
use hyper::body::Bytes;
use sha2::{Digest as _, Sha256};

use crate::imds::{ImdsClient, ImdsError};
use crate::signer::{self, Credentials, PrivateKey, SignError};
use crate::transport::Transport;

/// A boxed future, so providers can be used as `dyn AuthProvider`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What went wrong obtaining credentials.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("read credential file {path}: {message}")]
    ReadFile { path: PathBuf, message: String },
    #[error("credential file {path} is empty: put the {what} there")]
    EmptyFile { path: PathBuf, what: &'static str },
    #[error("load private key {path}: {source}")]
    LoadKey {
        path: PathBuf,
        #[source]
        source: SignError,
    },
    #[error(
        "fingerprint in {path} is {configured} but the key's is {actual}: mount the fingerprint of this key (openssl rsa -pubout -outform DER -in key.pem | openssl md5 -c)"
    )]
    MismatchFingerprint {
        path: PathBuf,
        configured: String,
        actual: String,
    },
    #[error("make session key: {0}")]
    MakeSessionKey(String),
    #[error("read instance identity from imds: {0}")]
    ReadIdentity(#[source] ImdsError),
    #[error("parse instance identity certificate: {0}")]
    ParseCertificate(String),
    #[error("request security token from {url}: {message}")]
    RequestToken { url: String, message: String },
    #[error(
        "security token from {url} is unusable: {message}; check the dynamic group and policy for this instance"
    )]
    ParseToken { url: String, message: String },
    #[error("sign federation request: {0}")]
    Sign(#[from] SignError),
}

/// Something that hands out signing credentials. Token-based providers renew on their own before
/// expiry; `invalidate` makes them renew now (after the service answered 401).
pub trait AuthProvider: Send + Sync + fmt::Debug {
    fn credentials(&self) -> BoxFuture<'_, Result<Credentials, AuthError>>;
    fn invalidate(&self) {}
}

/// The file names of an API-key Secret mounted as a directory.
pub mod api_key_files {
    pub const TENANCY: &str = "tenancy";
    pub const USER: &str = "user";
    pub const FINGERPRINT: &str = "fingerprint";
    pub const REGION: &str = "region";
    pub const PRIVATE_KEY: &str = "key.pem";
}

/// A user's API signing key: keyId `<tenancy>/<user>/<fingerprint>`.
#[derive(Clone)]
pub struct ApiKeyProvider {
    credentials: Credentials,
    region: Option<String>,
}

impl fmt::Debug for ApiKeyProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKeyProvider")
            .field("credentials", &self.credentials)
            .field("region", &self.region)
            .finish()
    }
}

fn read_trimmed(dir: &Path, name: &str, what: &'static str) -> Result<String, AuthError> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).map_err(|e| AuthError::ReadFile {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let text = text.trim().to_string();
    if text.is_empty() {
        return Err(AuthError::EmptyFile { path, what });
    }
    Ok(text)
}

impl ApiKeyProvider {
    pub fn new(tenancy: &str, user: &str, key: PrivateKey) -> Self {
        Self {
            credentials: Credentials {
                key_id: format!("{tenancy}/{user}/{}", key.fingerprint()),
                key,
            },
            region: None,
        }
    }

    /// Reads `tenancy`, `user`, `fingerprint`, `key.pem` and (optional) `region` from `dir`, as a
    /// mounted Secret lays them out. The fingerprint must be the key's: a mismatch would only show
    /// later as a 401 from the service.
    pub fn from_dir(dir: &Path) -> Result<Self, AuthError> {
        use api_key_files::*;
        let tenancy = read_trimmed(dir, TENANCY, "tenancy OCID")?;
        let user = read_trimmed(dir, USER, "user OCID")?;
        let fingerprint = read_trimmed(dir, FINGERPRINT, "API key fingerprint")?;
        let key_path = dir.join(PRIVATE_KEY);
        let pem = std::fs::read_to_string(&key_path).map_err(|e| AuthError::ReadFile {
            path: key_path.clone(),
            message: e.to_string(),
        })?;
        let key = PrivateKey::from_pem(&pem).map_err(|source| AuthError::LoadKey {
            path: key_path,
            source,
        })?;
        if !fingerprint.eq_ignore_ascii_case(key.fingerprint()) {
            return Err(AuthError::MismatchFingerprint {
                path: dir.join(FINGERPRINT),
                configured: fingerprint,
                actual: key.fingerprint().to_string(),
            });
        }
        let region = match std::fs::read_to_string(dir.join(REGION)) {
            Ok(r) if !r.trim().is_empty() => Some(r.trim().to_string()),
            _ => None,
        };
        let mut provider = Self::new(&tenancy, &user, key);
        provider.region = region;
        Ok(provider)
    }

    /// The region from the Secret, when it has one.
    pub fn region(&self) -> Option<&str> {
        self.region.as_deref()
    }
}

impl AuthProvider for ApiKeyProvider {
    fn credentials(&self) -> BoxFuture<'_, Result<Credentials, AuthError>> {
        Box::pin(async move { Ok(self.credentials.clone()) })
    }
}

/// Where security tokens come from: given the session key, returns a JWT bound to its public half.
pub trait TokenSource: Send + Sync + fmt::Debug {
    fn fetch<'a>(&'a self, session_key: &'a PrivateKey)
    -> BoxFuture<'a, Result<String, AuthError>>;
}

/// Makes session keys; RSA-2048 generation by default.
pub type KeyFactory = Arc<dyn Fn() -> Result<PrivateKey, SignError> + Send + Sync>;

struct Session {
    token: String,
    key: PrivateKey,
    expires_at: SystemTime,
}

/// Credentials `ST$<token>` signed with a session key, renewed `renew_before` ahead of the
/// token's `exp` (Oracle's Go SDK uses 5 minutes, Python 60 s) or after `invalidate`.
pub struct SessionTokenProvider {
    source: Box<dyn TokenSource>,
    key_factory: KeyFactory,
    renew_before: Duration,
    session: Mutex<Option<Session>>,
    renewing: tokio::sync::Mutex<()>,
}

impl fmt::Debug for SessionTokenProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let expires = self
            .session
            .lock()
            .ok()
            .and_then(|s| s.as_ref().map(|s| httpdate::fmt_http_date(s.expires_at)));
        f.debug_struct("SessionTokenProvider")
            .field("source", &self.source)
            .field("renew_before", &self.renew_before)
            .field("token_expires", &expires)
            .finish()
    }
}

impl SessionTokenProvider {
    pub fn new(source: impl TokenSource + 'static) -> Self {
        Self {
            source: Box::new(source),
            key_factory: Arc::new(PrivateKey::generate),
            renew_before: Duration::from_secs(300),
            session: Mutex::new(None),
            renewing: tokio::sync::Mutex::new(()),
        }
    }

    pub fn with_renew_before(mut self, renew_before: Duration) -> Self {
        self.renew_before = renew_before;
        self
    }

    /// Replaces session-key generation (tests use pre-made keys: RSA generation is slow in
    /// unoptimised builds).
    pub fn with_key_factory(mut self, factory: KeyFactory) -> Self {
        self.key_factory = factory;
        self
    }

    fn current(&self) -> Option<Credentials> {
        let guard = self.session.lock().ok()?;
        let s = guard.as_ref()?;
        let fresh = SystemTime::now() + self.renew_before < s.expires_at;
        fresh.then(|| Credentials {
            key_id: format!("ST${}", s.token),
            key: s.key.clone(),
        })
    }

    async fn renew(&self) -> Result<Credentials, AuthError> {
        let _one_at_a_time = self.renewing.lock().await;
        // Another caller may have renewed while this one waited.
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let factory = self.key_factory.clone();
        let key = tokio::task::spawn_blocking(move || factory())
            .await
            .map_err(|e| AuthError::MakeSessionKey(e.to_string()))?
            .map_err(|e| AuthError::MakeSessionKey(e.to_string()))?;
        let token = self.source.fetch(&key).await?;
        let expires_at = jwt_expiry(&token).map_err(|message| AuthError::ParseToken {
            url: format!("{:?}", self.source),
            message,
        })?;
        tracing::info!(
            expires = %httpdate::fmt_http_date(expires_at),
            "obtained oci security token"
        );
        let credentials = Credentials {
            key_id: format!("ST${token}"),
            key: key.clone(),
        };
        if let Ok(mut s) = self.session.lock() {
            *s = Some(Session {
                token,
                key,
                expires_at,
            });
        }
        Ok(credentials)
    }
}

impl AuthProvider for SessionTokenProvider {
    fn credentials(&self) -> BoxFuture<'_, Result<Credentials, AuthError>> {
        Box::pin(async move {
            match self.current() {
                Some(c) => Ok(c),
                None => self.renew().await,
            }
        })
    }

    fn invalidate(&self) {
        if let Ok(mut s) = self.session.lock() {
            *s = None;
        }
    }
}

/// The `exp` claim of a JWT (seconds since the epoch), read without verifying the token: the
/// service that issued it verifies it; we only need to know when to renew.
pub fn jwt_expiry(token: &str) -> Result<SystemTime, String> {
    let payload = token
        .split('.')
        .nth(1)
        .ok_or("not a JWT (no payload segment)")?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|e| format!("JWT payload is not base64url: {e}"))?;
    let claims: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("JWT payload is not JSON: {e}"))?;
    let exp = claims
        .get("exp")
        .and_then(serde_json::Value::as_u64)
        .ok_or("JWT has no numeric exp claim")?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(exp))
}

/// Instance principals: the instance's identity certificate from IMDS, exchanged at
/// `https://auth.<region>.<realm domain>/v1/x509` for a token bound to the session key.
pub struct X509FederationSource {
    imds: ImdsClient,
    federation_url: String,
    transport: Transport,
}

impl fmt::Debug for X509FederationSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("X509FederationSource")
            .field("federation_url", &self.federation_url)
            .finish()
    }
}

impl X509FederationSource {
    /// `federation_url` is the full URL of the x509 endpoint (for the real service
    /// `https://auth.<region>.<realm domain>/v1/x509`); there is no default, so nothing contacts a
    /// cloud endpoint unless configured to.
    pub fn new(imds: ImdsClient, federation_url: impl Into<String>, timeout: Duration) -> Self {
        Self {
            imds,
            federation_url: federation_url.into(),
            transport: Transport::new(timeout),
        }
    }
}

/// The X.509 federation endpoint of `region` in the realm whose domain is `realm_domain`
/// (`oraclecloud.com` for oc1; on an instance, IMDS `regionInfo.realmDomainComponent`).
pub fn federation_url(region: &str, realm_domain: &str) -> String {
    format!("https://auth.{region}.{realm_domain}/v1/x509")
}

/// PEM body without armour lines or newlines, as the federation API wants certificates and keys.
fn strip_pem(pem: &str) -> String {
    pem.lines()
        .filter(|l| !l.starts_with("-----"))
        .map(str::trim)
        .collect()
}

/// The tenancy OCID from the leaf certificate's subject (`opc-tenant:<ocid>`, older ones
/// `opc-identity:<ocid>`), and the SHA-256 of its DER.
pub fn identity_certificate_facts(cert_pem: &str) -> Result<(String, String), AuthError> {
    let der = base64::engine::general_purpose::STANDARD
        .decode(strip_pem(cert_pem))
        .map_err(|e| AuthError::ParseCertificate(format!("not PEM: {e}")))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| AuthError::ParseCertificate(e.to_string()))?;
    let mut tenancy = None;
    for attr in cert.subject().iter_attributes() {
        if let Ok(value) = attr.as_str() {
            for prefix in ["opc-tenant:", "opc-identity:"] {
                if let Some(ocid) = value.strip_prefix(prefix) {
                    tenancy.get_or_insert_with(|| ocid.to_string());
                }
            }
        }
    }
    let tenancy = tenancy.ok_or_else(|| {
        AuthError::ParseCertificate(
            "subject has no opc-tenant: attribute; is this an OCI instance identity certificate?"
                .into(),
        )
    })?;
    let fingerprint = signer::colon_hex(&Sha256::digest(&der), false);
    Ok((tenancy, fingerprint))
}

impl TokenSource for X509FederationSource {
    fn fetch<'a>(
        &'a self,
        session_key: &'a PrivateKey,
    ) -> BoxFuture<'a, Result<String, AuthError>> {
        Box::pin(async move {
            // Oracle rotates the identity certificate: read it afresh for every token.
            let leaf = self
                .imds
                .get("/opc/v2/identity/cert.pem")
                .await
                .map_err(AuthError::ReadIdentity)?;
            let leaf_key = self
                .imds
                .get("/opc/v2/identity/key.pem")
                .await
                .map_err(AuthError::ReadIdentity)?;
            let intermediate = self
                .imds
                .get("/opc/v2/identity/intermediate.pem")
                .await
                .map_err(AuthError::ReadIdentity)?;
            let (tenancy, cert_fingerprint) = identity_certificate_facts(&leaf)?;
            let leaf_key = PrivateKey::from_pem(&leaf_key)?;
            let body = serde_json::json!({
                "certificate": strip_pem(&leaf),
                "publicKey": strip_pem(&session_key.public_key_pem()?),
                "intermediateCertificates": [strip_pem(&intermediate)],
                "fingerprintAlgorithm": "SHA256",
            })
            .to_string();
            let url = &self.federation_url;
            let uri: Uri =
                url.parse()
                    .map_err(|e: http::uri::InvalidUri| AuthError::RequestToken {
                        url: url.clone(),
                        message: e.to_string(),
                    })?;
            let credentials = Credentials {
                key_id: format!("{tenancy}/fed-x509-sha256/{cert_fingerprint}"),
                key: leaf_key,
            };
            let mut headers = http::HeaderMap::new();
            signer::sign_with(
                &credentials,
                signer::FEDERATION_HEADERS,
                &Method::POST,
                &uri,
                &mut headers,
                body.as_bytes(),
                SystemTime::now(),
            )?;
            let mut request = Request::post(uri.clone())
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| AuthError::RequestToken {
                    url: url.clone(),
                    message: e.to_string(),
                })?;
            *request.headers_mut() = headers;
            let response =
                self.transport
                    .send(request)
                    .await
                    .map_err(|message| AuthError::RequestToken {
                        url: url.clone(),
                        message,
                    })?;
            if !response.status.is_success() {
                return Err(AuthError::RequestToken {
                    url: url.clone(),
                    message: format!(
                        "status {}: {}",
                        response.status,
                        String::from_utf8_lossy(&response.body[..response.body.len().min(300)])
                    ),
                });
            }
            let answer: serde_json::Value =
                serde_json::from_slice(&response.body).map_err(|e| AuthError::ParseToken {
                    url: url.clone(),
                    message: e.to_string(),
                })?;
            answer
                .get("token")
                .and_then(serde_json::Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| AuthError::ParseToken {
                    url: url.clone(),
                    message: "answer has no token field".into(),
                })
        })
    }
}

/// OKE workload identity (enhanced clusters): the pod's service-account token exchanged at the
/// cluster's proxy, `https://$KUBERNETES_SERVICE_HOST:12250/resourcePrincipalSessionTokens`, for a
/// resource-principal token bound to the session key (`shared/oci/compute-api.md` §2).
pub struct OkeWorkloadIdentitySource {
    url: String,
    service_account_token: PathBuf,
    transport: Transport,
}

impl fmt::Debug for OkeWorkloadIdentitySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OkeWorkloadIdentitySource")
            .field("url", &self.url)
            .field("service_account_token", &self.service_account_token)
            .finish()
    }
}

/// Where a pod finds its service account.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

impl OkeWorkloadIdentitySource {
    /// `url` is the token endpoint; `ca_pem` the CA that signs its certificate (the cluster CA),
    /// or `None` for a plain `http://` test endpoint. The token file is re-read for every
    /// exchange: projected tokens rotate.
    pub fn new(
        url: impl Into<String>,
        service_account_token: impl Into<PathBuf>,
        ca_pem: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, AuthError> {
        let url = url.into();
        let transport = match ca_pem {
            Some(pem) => {
                Transport::with_ca(pem, timeout).map_err(|message| AuthError::RequestToken {
                    url: url.clone(),
                    message,
                })?
            }
            None => Transport::new(timeout),
        };
        Ok(Self {
            url,
            service_account_token: service_account_token.into(),
            transport,
        })
    }

    /// The in-cluster configuration: `KUBERNETES_SERVICE_HOST`, the service account's token and
    /// CA (`OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH` overrides the CA path, as in Oracle's SDKs).
    pub fn from_env(timeout: Duration) -> Result<Self, AuthError> {
        let host =
            std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| AuthError::RequestToken {
                url: "https://$KUBERNETES_SERVICE_HOST:12250".into(),
                message:
                    "KUBERNETES_SERVICE_HOST is not set: workload identity works only in a pod"
                        .into(),
            })?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        let ca_path = std::env::var_os("OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| dir.join("ca.crt"));
        let ca = std::fs::read_to_string(&ca_path).map_err(|e| AuthError::ReadFile {
            path: ca_path.clone(),
            message: e.to_string(),
        })?;
        Self::new(
            format!("https://{host}:12250/resourcePrincipalSessionTokens"),
            dir.join("token"),
            Some(&ca),
            timeout,
        )
    }
}

impl TokenSource for OkeWorkloadIdentitySource {
    fn fetch<'a>(
        &'a self,
        session_key: &'a PrivateKey,
    ) -> BoxFuture<'a, Result<String, AuthError>> {
        Box::pin(async move {
            let url = &self.url;
            let request_error = |message: String| AuthError::RequestToken {
                url: url.clone(),
                message,
            };
            let sa_token = read_trimmed(
                self.service_account_token
                    .parent()
                    .unwrap_or(Path::new("/")),
                &self
                    .service_account_token
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                "service account token",
            )?;
            let body = serde_json::json!({ "podKey": strip_pem(&session_key.public_key_pem()?) })
                .to_string();
            let request_id = format!("{:032X}", rand::random::<u128>());
            let request = Request::post(url.as_str())
                .header(http::header::AUTHORIZATION, format!("Bearer {sa_token}"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .header("opc-request-id", request_id)
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| request_error(e.to_string()))?;
            let response = self.transport.send(request).await.map_err(request_error)?;
            if response.status == http::StatusCode::FORBIDDEN {
                return Err(request_error(
                    "403: workload identity needs an enhanced OKE cluster and a policy for this service account".into(),
                ));
            }
            if !response.status.is_success() {
                return Err(request_error(format!(
                    "status {}: {}",
                    response.status,
                    String::from_utf8_lossy(&response.body[..response.body.len().min(300)])
                )));
            }
            let parse_error = |message: String| AuthError::ParseToken {
                url: url.clone(),
                message,
            };
            // The answer is a JSON string holding base64 of `{"token":"ST$<JWT>"}`.
            let wrapped: String = serde_json::from_slice(&response.body)
                .map_err(|e| parse_error(format!("not a JSON string: {e}")))?;
            let inner = base64::engine::general_purpose::STANDARD
                .decode(wrapped.trim())
                .map_err(|e| parse_error(format!("not base64: {e}")))?;
            let inner: serde_json::Value = serde_json::from_slice(&inner)
                .map_err(|e| parse_error(format!("decoded answer is not JSON: {e}")))?;
            let token = inner
                .get("token")
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| parse_error("decoded answer has no token".into()))?;
            Ok(token.strip_prefix("ST$").unwrap_or(token).to_string())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(exp: u64) -> String {
        let enc = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "{}.{}.sig",
            enc.encode(br#"{"alg":"RS256"}"#),
            enc.encode(format!(r#"{{"exp":{exp},"sub":"x"}}"#))
        )
    }

    #[test]
    fn federation_url_follows_region_and_realm() {
        assert_eq!(
            federation_url("us-phoenix-1", "oraclecloud.com"),
            "https://auth.us-phoenix-1.oraclecloud.com/v1/x509"
        );
    }

    #[test]
    fn a_ca_bundle_without_certificates_is_refused() {
        let err = Transport::with_ca("not pem", Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("no certificate"), "{err}");
    }

    #[test]
    fn jwt_expiry_reads_exp_and_refuses_garbage() {
        assert_eq!(
            jwt_expiry(&jwt(1_700_000_000)).unwrap(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
        );
        assert!(jwt_expiry("abc").unwrap_err().contains("not a JWT"));
        let no_exp = format!(
            "a.{}.c",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("{}")
        );
        assert!(jwt_expiry(&no_exp).unwrap_err().contains("exp"));
    }

    #[derive(Debug)]
    struct CountingSource {
        calls: std::sync::atomic::AtomicU32,
        lifetime: Duration,
    }

    impl TokenSource for CountingSource {
        fn fetch<'a>(&'a self, _: &'a PrivateKey) -> BoxFuture<'a, Result<String, AuthError>> {
            Box::pin(async move {
                self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let exp = (SystemTime::now() + self.lifetime)
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap()
                    .as_secs();
                Ok(jwt(exp))
            })
        }
    }

    const TEST_KEY: &str = include_str!("../tests/fixtures/test-key-2048.pem");

    fn provider(lifetime: Duration) -> (Arc<SessionTokenProvider>, Arc<CountingSource>) {
        let source = Arc::new(CountingSource {
            calls: Default::default(),
            lifetime,
        });
        #[derive(Debug)]
        struct Shared(Arc<CountingSource>);
        impl TokenSource for Shared {
            fn fetch<'a>(
                &'a self,
                key: &'a PrivateKey,
            ) -> BoxFuture<'a, Result<String, AuthError>> {
                self.0.fetch(key)
            }
        }
        let p = SessionTokenProvider::new(Shared(source.clone()))
            .with_renew_before(Duration::from_secs(300))
            .with_key_factory(Arc::new(|| PrivateKey::from_pem(TEST_KEY)));
        (Arc::new(p), source)
    }

    #[tokio::test]
    async fn token_is_reused_until_close_to_expiry_then_renewed() {
        let (p, source) = provider(Duration::from_secs(3600));
        let a = p.credentials().await.unwrap();
        let b = p.credentials().await.unwrap();
        assert!(a.key_id.starts_with("ST$"));
        assert_eq!(a.key_id, b.key_id);
        assert_eq!(source.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        p.invalidate();
        p.credentials().await.unwrap();
        assert_eq!(source.calls.load(std::sync::atomic::Ordering::SeqCst), 2);

        // A token that expires inside the renewal window is renewed on every use.
        let (p, source) = provider(Duration::from_secs(200));
        p.credentials().await.unwrap();
        p.credentials().await.unwrap();
        assert_eq!(source.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn concurrent_callers_share_one_renewal() {
        let (p, source) = provider(Duration::from_secs(3600));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let p = p.clone();
                tokio::spawn(async move { p.credentials().await.map(|c| c.key_id) })
            })
            .collect();
        for h in handles {
            h.await.unwrap().unwrap();
        }
        assert_eq!(source.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn api_key_from_dir_checks_the_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let key = PrivateKey::from_pem(TEST_KEY).unwrap();
        std::fs::write(dir.path().join("tenancy"), "ocid1.tenancy.oc1..t\n").unwrap();
        std::fs::write(dir.path().join("user"), "ocid1.user.oc1..u\n").unwrap();
        std::fs::write(dir.path().join("key.pem"), TEST_KEY).unwrap();
        std::fs::write(dir.path().join("region"), "us-phoenix-1\n").unwrap();
        std::fs::write(dir.path().join("fingerprint"), "00:11").unwrap();
        let err = ApiKeyProvider::from_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fingerprint") && err.contains(key.fingerprint()),
            "{err}"
        );

        std::fs::write(dir.path().join("fingerprint"), key.fingerprint()).unwrap();
        let p = ApiKeyProvider::from_dir(dir.path()).unwrap();
        assert_eq!(p.region(), Some("us-phoenix-1"));
        assert_eq!(
            p.credentials.key_id,
            format!(
                "ocid1.tenancy.oc1..t/ocid1.user.oc1..u/{}",
                key.fingerprint()
            )
        );
        let shown = format!("{p:?}");
        assert!(!shown.contains("MII"), "{shown}");

        std::fs::write(dir.path().join("user"), "  \n").unwrap();
        let err = ApiKeyProvider::from_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("user") && err.contains("empty"), "{err}");
    }
}
