//! The controller's PKI, kept in Secrets in its namespace: a CA (`nodekeeper-ca`), the agents'
//! server certificate (`nodekeeper-agent-tls`, mounted by the agent DaemonSet) and the
//! controller's client certificate (`nodekeeper-controller-tls`). Each Secret holds `tls.crt`,
//! `tls.key` and (for the two leaves) `ca.crt`.
//!
//! * **Creation is idempotent and race-safe.** Every Secret is created only if absent; a 409
//!   from a concurrent creator means "someone else won" and that Secret is read back and used.
//!   Two replicas starting together therefore end with one CA, and both leaves chain to it.
//! * **One agent certificate for the fleet.** It carries the DNS name
//!   [`AGENT_SERVER_NAME`], which the controller uses
//!   as the TLS server name whatever the node's address, so the certificate needs no node IPs
//!   and survives nodes coming and going. The agent accepts only client certificates that chain
//!   to the CA; the controller's carries the name `controller.nodekeeper.internal`.
//! * **Renewal.** A leaf is reissued (same CA, new key) when less than a third of its validity
//!   remains, or when the current CA did not sign it; the check runs at start and every
//!   [`RENEW_CHECK`]. Leaves live one year, so renewal happens about four months before expiry.
//!   The agent reloads its files when they change (the kubelet refreshes a mounted Secret within
//!   about a minute, the agent looks every 30 s).
//! * **Trust.** Each leaf's `ca.crt` is the CA Secret's `ca.crt` when it has one (a bundle of CA
//!   certificates an operator put there), always with the signing CA `tls.crt` among them, and
//!   `tls.crt` alone otherwise. A leaf whose `ca.crt` differs only gets the new bundle; its
//!   certificate and key stay.
//! * **CA rotation** (the CA lives ten years) is a planned operation in three edits of the CA
//!   Secret, each picked up at the leader's next check (restart the leader to run it now), and
//!   no step leaves a pair of peers without a common trust anchor: (1) put the old and the new
//!   CA certificate in its `ca.crt`: both leaves' bundles follow, so agents and controller trust
//!   either; (2) once the agents have reloaded, make the new CA its `tls.crt`/`tls.key`: both
//!   leaves are reissued from it, and peers still on the old leaf are trusted through the bundle
//!   meanwhile; (3) once every agent serves the new leaf, drop the old CA from `ca.crt`.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use tracing::info;

/// The DNS name every agent certificate carries and the controller verifies, whatever the
/// node's address: one certificate serves the whole DaemonSet, and node IPs need not be known
/// when it is issued.
pub const AGENT_SERVER_NAME: &str = "agent.nodekeeper.internal";

pub const CA_SECRET: &str = "nodekeeper-ca";
pub const AGENT_SECRET: &str = "nodekeeper-agent-tls";
pub const CONTROLLER_SECRET: &str = "nodekeeper-controller-tls";
/// The name in the controller's client certificate.
pub const CONTROLLER_CLIENT_NAME: &str = "controller.nodekeeper.internal";

const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);
const LEAF_VALIDITY: Duration = Duration::from_secs(365 * 86_400);
/// How often the leader checks whether a leaf needs renewal.
pub const RENEW_CHECK: Duration = Duration::from_secs(6 * 3600);

/// Errors of certificate management.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("generate {what}: {source}")]
    Generate {
        what: &'static str,
        source: rcgen::Error,
    },
    #[error("read Secret {name}: {source}")]
    ReadSecret { name: String, source: kube::Error },
    #[error("write Secret {name}: {source}")]
    WriteSecret { name: String, source: kube::Error },
    #[error("Secret {name} is unusable: {problem}; delete it and the leader recreates it")]
    BadSecret { name: String, problem: String },
    #[error("the certificate Secrets: no answer from the API server within {after:?}")]
    TimedOut { after: Duration },
    /// The CA Secret cannot sign; nothing was issued or changed.
    #[error("Secret {name} field {field}: {problem}; {fix} (no certificate was issued or changed)")]
    BadCa {
        name: String,
        field: &'static str,
        problem: String,
        fix: String,
    },
}

impl CertError {
    /// Whether trying again may help: the API server's failures, not a Secret's content.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            CertError::ReadSecret { .. }
                | CertError::WriteSecret { .. }
                | CertError::TimedOut { .. }
        )
    }
}

/// PEM material.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pem {
    pub cert: String,
    pub key: String,
    pub ca: String,
}

/// A leaf's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    Agent,
    Controller,
}

impl Leaf {
    pub fn secret(self) -> &'static str {
        match self {
            Leaf::Agent => AGENT_SECRET,
            Leaf::Controller => CONTROLLER_SECRET,
        }
    }
}

fn unix_now() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = rcgen::date_time_ymd(1970, 1, 1)
        + Duration::from_secs(u64::try_from(unix_now()).unwrap_or(0));
    // Backdated a little so that a peer whose clock is slightly behind accepts it.
    params.not_before = now - Duration::from_secs(300);
    params.not_after = now + lifetime;
}

/// Generates a new CA: (certificate PEM, key PEM).
pub fn generate_ca() -> Result<(String, String), CertError> {
    let generate = |source| CertError::Generate { what: "CA", source };
    let key = KeyPair::generate().map_err(generate)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "nodekeeper CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_VALIDITY);
    let cert = params.self_signed(&key).map_err(generate)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A CA pair that [`check_ca`] found fit to sign with.
#[derive(Debug)]
pub struct SigningCa {
    /// The key as PKCS#8 (the only form rcgen's ring backend reads), whatever form the
    /// Secret holds it in.
    key: KeyPair,
    /// The end of the CA certificate's validity, in Unix seconds: no leaf outlives it.
    not_after: i64,
}

/// Checks the CA Secret's pair before anything is signed with it (rcgen checks nothing: a key
/// that is not the certificate's, or a certificate that is no CA or has expired, would sign
/// leaves no peer accepts, written over the good ones): `cert_pem` must be a CA certificate
/// valid at `now_unix`, and `key_pem` its key, as PKCS#8 (`PRIVATE KEY`), PKCS#1
/// (`RSA PRIVATE KEY`, from `openssl genrsa`) or SEC1 (`EC PRIVATE KEY`, from
/// `openssl ecparam -genkey`).
pub fn check_ca(cert_pem: &str, key_pem: &str, now_unix: i64) -> Result<SigningCa, CertError> {
    let bad = |field, problem: String, fix: &str| CertError::BadCa {
        name: CA_SECRET.to_owned(),
        field,
        problem,
        fix: fix.to_owned(),
    };
    let at = |unix: i64| {
        k8s_openapi::jiff::Timestamp::from_second(unix)
            .map_or_else(|_| unix.to_string(), |t| t.to_string())
    };
    let put_cert = "put the CA certificate (PEM) in tls.crt, or rotate the CA as the README's \
                    \"CA rotation\" describes";
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| bad("tls.crt", format!("is not PEM ({e})"), put_cert))?;
    let cert = pem.parse_x509().map_err(|e| {
        bad(
            "tls.crt",
            format!("is not an X.509 certificate ({e})"),
            put_cert,
        )
    })?;
    let subject = cert.subject().to_string();
    let is_ca = matches!(cert.basic_constraints(), Ok(Some(ext)) if ext.value.ca);
    if !is_ca {
        return Err(bad(
            "tls.crt",
            format!("the certificate \"{subject}\" is not a CA (no basicConstraints CA:TRUE)"),
            put_cert,
        ));
    }
    if matches!(cert.key_usage(), Ok(Some(ext)) if !ext.value.key_cert_sign()) {
        return Err(bad(
            "tls.crt",
            format!(
                "the CA certificate \"{subject}\" may not sign certificates (its keyUsage lacks keyCertSign)"
            ),
            put_cert,
        ));
    }
    let (not_before, not_after) = (
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    );
    if now_unix >= not_after {
        return Err(bad(
            "tls.crt",
            format!(
                "the CA certificate \"{subject}\" expired at {}",
                at(not_after)
            ),
            put_cert,
        ));
    }
    if now_unix < not_before {
        return Err(bad(
            "tls.crt",
            format!(
                "the CA certificate \"{subject}\" is valid only from {} (is this host's clock right?)",
                at(not_before)
            ),
            put_cert,
        ));
    }
    let key = signing_key(key_pem).map_err(|problem| {
        bad(
            "tls.key",
            problem,
            "put the CA's unencrypted key (PEM: PKCS#8, PKCS#1 RSA or SEC1 EC) in tls.key; \
             `openssl pkey -in key.pem -out tls.key` decrypts or converts one",
        )
    })?;
    if key.public_key_raw() != cert.public_key().subject_public_key.data.as_ref() {
        return Err(bad(
            "tls.key",
            format!("is not the key of the certificate \"{subject}\" in tls.crt"),
            "put the matching pair in tls.crt and tls.key (`openssl x509 -noout -pubkey -in \
             tls.crt` and `openssl pkey -pubout -in tls.key` print the same when they match)",
        ));
    }
    Ok(SigningCa { key, not_after })
}

/// The key in `key_pem` as rcgen can sign with it. PKCS#1 and SEC1 keys are wrapped into
/// PKCS#8 here (RFC 5208 `PrivateKeyInfo`; RFC 5915 for EC) because rcgen's ring backend reads
/// PKCS#8 only.
fn signing_key(key_pem: &str) -> Result<KeyPair, String> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject as _;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|_| {
        "holds no unencrypted PEM private key (PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY)"
            .to_owned()
    })?;
    key_pair(&key).ok_or_else(|| {
        "is a key this controller cannot sign with (RSA, ECDSA P-256 or P-384, or Ed25519 are \
         supported)"
            .to_owned()
    })
}

/// [`signing_key`] past the PEM.
fn key_pair(key: &rustls::pki_types::PrivateKeyDer<'_>) -> Option<KeyPair> {
    use rustls::pki_types::PrivateKeyDer;
    let pkcs8 = |algorithm: &[u8], inner: &[u8]| {
        der(
            0x30,
            &[&[0x02, 0x01, 0x00], algorithm, &der(0x04, inner)].concat(),
        )
    };
    let candidates = match key {
        PrivateKeyDer::Pkcs8(k) => vec![k.secret_pkcs8_der().to_vec()],
        // rsaEncryption (1.2.840.113549.1.1.1) with NULL parameters.
        PrivateKeyDer::Pkcs1(k) => vec![pkcs8(
            &der(
                0x30,
                &[
                    &[
                        0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01,
                    ][..],
                    &[0x05, 0x00],
                ]
                .concat(),
            ),
            k.secret_pkcs1_der(),
        )],
        PrivateKeyDer::Sec1(k) => {
            // id-ecPublicKey (1.2.840.10045.2.1) with the named curve: the one the key names
            // in its optional `parameters`, else each curve ring signs with.
            let ec_public_key = [0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
            let p256 = [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
            let p384 = [0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];
            let curves: Vec<Vec<u8>> = match sec1_curve(k.secret_sec1_der()) {
                Some(curve) => vec![curve],
                None => vec![p256.to_vec(), p384.to_vec()],
            };
            curves
                .iter()
                .map(|curve| {
                    pkcs8(
                        &der(0x30, &[&ec_public_key[..], curve].concat()),
                        k.secret_sec1_der(),
                    )
                })
                .collect()
        }
        _ => return None,
    };
    candidates
        .into_iter()
        .find_map(|der| KeyPair::try_from(der).ok())
}

/// A DER element: `tag`, definite length, `content`.
fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

/// Reads one DER element off `input`: (tag, content, rest).
fn der_next(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The named-curve OID element in a SEC1 `ECPrivateKey`'s `[0] parameters`, when present.
fn sec1_curve(sec1: &[u8]) -> Option<Vec<u8>> {
    let (0x30, mut body, _) = der_next(sec1)? else {
        return None;
    };
    while let Some((tag, content, rest)) = der_next(body) {
        if tag == 0xa0 {
            let (0x06, _, _) = der_next(content)? else {
                return None;
            };
            return Some(content.to_vec());
        }
        body = rest;
    }
    None
}

/// Issues a leaf from the CA (checked first: [`check_ca`]). Its validity ends no later than
/// the CA's.
pub fn issue(leaf: Leaf, ca_cert: &str, ca_key: &str) -> Result<Pem, CertError> {
    let what = match leaf {
        Leaf::Agent => "agent certificate",
        Leaf::Controller => "controller certificate",
    };
    let generate = |source| CertError::Generate { what, source };
    let ca = check_ca(ca_cert, ca_key, unix_now())?;
    let issuer = Issuer::from_ca_cert_pem(ca_cert, ca.key).map_err(generate)?;
    let (name, usage) = match leaf {
        Leaf::Agent => (AGENT_SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth),
        Leaf::Controller => (CONTROLLER_CLIENT_NAME, ExtendedKeyUsagePurpose::ClientAuth),
    };
    let mut params = CertificateParams::new(vec![name.to_owned()]).map_err(generate)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, LEAF_VALIDITY);
    let ca_end = rcgen::date_time_ymd(1970, 1, 1)
        + Duration::from_secs(u64::try_from(ca.not_after).unwrap_or(0));
    params.not_after = params.not_after.min(ca_end);
    let key = KeyPair::generate().map_err(generate)?;
    let cert = params.signed_by(&key, &issuer).map_err(generate)?;
    Ok(Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
        ca: ca_cert.to_owned(),
    })
}

/// The validity window of a PEM certificate, in Unix seconds.
pub fn validity_window(cert_pem: &str) -> Result<(i64, i64), String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| format!("not PEM: {e}"))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    Ok((
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    ))
}

/// True when a leaf must be reissued: less than a third of its validity remains (or it is
/// unreadable, or already expired).
pub fn needs_renewal(cert_pem: &str, now_unix: i64) -> bool {
    match validity_window(cert_pem) {
        Ok((not_before, not_after)) => {
            let lifetime = (not_after - not_before).max(1);
            not_after - now_unix < lifetime / 3
        }
        Err(_) => true,
    }
}

fn field(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()?
        .get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

fn secret(name: &str, pem: &BTreeMap<&str, &str>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                [(
                    "app.kubernetes.io/part-of".to_owned(),
                    "nodekeeper".to_owned(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(
            pem.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// Creates `name` from `make` unless it exists; on a concurrent create (409) reads the winner's.
async fn create_if_absent(
    api: &Api<Secret>,
    name: &str,
    make: impl FnOnce() -> Result<Secret, CertError>,
) -> Result<Secret, CertError> {
    let read = |source| CertError::ReadSecret {
        name: name.to_owned(),
        source,
    };
    if let Some(existing) = api.get_opt(name).await.map_err(read)? {
        return Ok(existing);
    }
    match api.create(&PostParams::default(), &make()?).await {
        Ok(created) => {
            info!(secret = %name, "created");
            Ok(created)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => api.get(name).await.map_err(read),
        Err(source) => Err(CertError::WriteSecret {
            name: name.to_owned(),
            source,
        }),
    }
}

/// Whether the certificate in `leaf_pem` was signed by the key of the certificate in `ca_pem`
/// (issuer name and signature; validity dates are [`needs_renewal`]'s). Unreadable input: no.
pub fn issued_by(leaf_pem: &str, ca_pem: &str) -> bool {
    let parse = |pem: &str| x509_parser::pem::parse_x509_pem(pem.as_bytes()).map(|(_, p)| p);
    let (Ok(leaf), Ok(ca)) = (parse(leaf_pem), parse(ca_pem)) else {
        return false;
    };
    let (Ok(leaf), Ok(ca)) = (leaf.parse_x509(), ca.parse_x509()) else {
        return false;
    };
    leaf.issuer() == ca.subject() && leaf.verify_signature(Some(ca.public_key())).is_ok()
}

/// The DER of every certificate in a PEM text, in order; what is not a certificate is skipped.
fn certificates(pem: &str) -> Vec<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .map(|c| c.as_ref().to_vec())
        .collect()
}

/// The CA certificates the leaves trust (their `ca.crt`): the CA Secret's `ca.crt` when it holds
/// any, with the signing CA `ca_cert` added when it is not among them (a leaf must always trust
/// its own issuer); `ca_cert` alone otherwise.
pub fn trust_bundle(bundle: Option<&str>, ca_cert: &str) -> String {
    let Some(bundle) = bundle.filter(|b| !certificates(b).is_empty()) else {
        return ca_cert.to_owned();
    };
    let mut out = bundle.trim_end().to_owned();
    out.push('\n');
    let signing = certificates(ca_cert);
    if !signing.iter().all(|c| certificates(bundle).contains(c)) {
        out.push_str(ca_cert.trim_end());
        out.push('\n');
    }
    out
}

/// Ensures the CA and both leaves exist and are current; returns the controller's client
/// material and whether any leaf was reissued.
pub async fn ensure(api: &Api<Secret>) -> Result<(Pem, bool), CertError> {
    ensure_all(api).await.map(|e| (e.controller, e.renewed))
}

/// What [`ensure_all`] found and did.
#[derive(Clone, Debug)]
pub struct Ensured {
    /// The controller's client material.
    pub controller: Pem,
    /// Whether any leaf was reissued.
    pub renewed: bool,
    /// When each Secret's `tls.crt` expires (Unix seconds): the CA's and both leaves'.
    pub expiry: Vec<(&'static str, i64)>,
}

/// [`ensure`], with the expiry of every certificate.
pub async fn ensure_all(api: &Api<Secret>) -> Result<Ensured, CertError> {
    let ca_secret = create_if_absent(api, CA_SECRET, || {
        let (cert, key) = generate_ca()?;
        Ok(secret(
            CA_SECRET,
            &[("tls.crt", cert.as_str()), ("tls.key", key.as_str())].into(),
        ))
    })
    .await?;
    let bad = |problem: &str| CertError::BadSecret {
        name: CA_SECRET.into(),
        problem: problem.into(),
    };
    let ca_cert = field(&ca_secret, "tls.crt").ok_or_else(|| bad("no tls.crt"))?;
    let ca_key = field(&ca_secret, "tls.key").ok_or_else(|| bad("no tls.key"))?;
    // Before any leaf is read or written: a pair that cannot sign must not replace good leaves.
    let signing = check_ca(&ca_cert, &ca_key, unix_now())?;
    let mut expiry = vec![(CA_SECRET, signing.not_after)];
    let trust = trust_bundle(field(&ca_secret, "ca.crt").as_deref(), &ca_cert);

    let mut renewed = false;
    let mut controller = None;
    for leaf in [Leaf::Agent, Leaf::Controller] {
        let name = leaf.secret();
        let make = || {
            let pem = issue(leaf, &ca_cert, &ca_key)?;
            Ok(secret(
                name,
                &[
                    ("tls.crt", pem.cert.as_str()),
                    ("tls.key", pem.key.as_str()),
                    ("ca.crt", trust.as_str()),
                ]
                .into(),
            ))
        };
        let mut current = create_if_absent(api, name, make).await?;
        let cert = field(&current, "tls.crt").unwrap_or_default();
        let foreign = !issued_by(&cert, &ca_cert);
        let expiring = needs_renewal(&cert, unix_now());
        let new_trust = field(&current, "ca.crt").as_deref() != Some(trust.as_str());
        if foreign || expiring || new_trust {
            let reason = if foreign {
                "not signed by the current CA"
            } else if expiring {
                "less than a third of its validity left"
            } else {
                "the CA Secret's trust bundle changed"
            };
            if foreign || expiring {
                let fresh = make()?;
                current.data = fresh.data;
                current.type_ = fresh.type_;
            } else {
                // Only the bundle: the certificate and key the agents serve stay.
                current
                    .data
                    .get_or_insert_default()
                    .insert("ca.crt".into(), ByteString(trust.clone().into_bytes()));
            }
            // replace() carries the resourceVersion read above: if another replica renewed
            // it meanwhile, ours fails with 409 and theirs is read back instead.
            current = match api.replace(name, &PostParams::default(), &current).await {
                Ok(replaced) => {
                    if foreign || expiring {
                        info!(secret = %name, reason, "reissued certificate");
                        renewed = true;
                    } else {
                        info!(secret = %name, reason, "updated the trusted CA certificates");
                    }
                    replaced
                }
                Err(kube::Error::Api(status)) if status.code == 409 => api
                    .get(name)
                    .await
                    .map_err(|source| CertError::ReadSecret {
                        name: name.into(),
                        source,
                    })?,
                Err(source) => {
                    return Err(CertError::WriteSecret {
                        name: name.into(),
                        source,
                    });
                }
            };
        }
        if let Ok((_, not_after)) = validity_window(&field(&current, "tls.crt").unwrap_or_default())
        {
            expiry.push((name, not_after));
        }
        if leaf == Leaf::Controller {
            let get = |k| {
                field(&current, k).ok_or_else(|| CertError::BadSecret {
                    name: name.into(),
                    problem: format!("no {k}"),
                })
            };
            controller = Some(Pem {
                cert: get("tls.crt")?,
                key: get("tls.key")?,
                ca: get("ca.crt")?,
            });
        }
    }
    Ok(Ensured {
        controller: controller.expect("the loop visits Leaf::Controller"),
        renewed,
        expiry,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test keys as `openssl genrsa -traditional 2048` and
    /// `openssl ecparam -name prime256v1 -genkey` write them (PKCS#1, SEC1 with its parameters).
    const RSA_PKCS1: &str = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA1PImAg3147LKW35BUTwDARyK321tRIGRYLJ1iDbhTJZQnKWh\nQIA/AG7Klycjq3BHxyRpUfUwODw49k1cx/PQsMGsqjwZd5LoP5tgXYGbYV+4G8kO\nbNmrFB01GiUy0RrSgXAdJ7c9tC3exwXCtAFhbXbJrmMPCE695G6w0fqVYLJrwWRb\naQ7ZAqVYtH20xEqQpa9WVecsMGJ0Z7ePC8BwZjNO7212rTmkp0IaIYl/xxMzFqui\nacWcf/C4mm/LJfgioQPQ3kIxQR+AvyMJmejVfKVKtKhUPH5hcHn7YecmjKJDbPC2\n9U2VVo+hnI0bqWy9hau5oPzILESd1Jv7IUfyZwIDAQABAoIBABK8M0fe/pFH+7HN\nC+Yfx4vjfPxnXkO2upmtWdXgLjZUy0bc87D/F4vsM3rVALhmqooE1BdX4SQxeDmD\nWPRmqSfEAnL/0qXIkRJ3kyTm8ErC5ynaqKA/DmQ4paFlQHFRUM/+kzIZVx5xIraT\n9SttK6s71ka3hG0QsHhWnMv8pgPZxZnS+P33boTQXoTp4P1SphVQf/lQpGKsOmrQ\n8U6wPpvLVh6Nxyp/QUMbj/JHFyjXpWVTJ7iRg/Aap/miNkY7FF1IsVGf0/CJwgCK\nmSekVDuWjJ7fTtj149CDa0zxeLcWw6D0VePOFCnrXOYvfMwwBhWGaa8QsVYCbthF\njpnWV7ECgYEA+7iHKpz5n88MhCvKme+wR5HUgegRAVWMYCUrqSI6rZqm78hf91ir\nLQ44cNsKw7nN7XsK4r1i/Yg8moQuPHWp6FT8znVkLDH7OiRujHIgAftyIsbSs6Ty\nIxlauvSOoVEoB/9gJ9f7sTca+wCZa9rlbu/vsTfGPSNUkqTHT6C5JUsCgYEA2JDf\n6DV3JPHv4Vo9zx9iovDukv6MH9/e0lOfsbdfV+HtbhNBdKma0hCy3EBpLponmnRE\nQ+dKiN/KfZ52IQFnxlAQqVUxPcimmtva3MdJJH2c/fQ7Ik/EgYqRt+5VKU2dc9OB\nKOdVREoZVO/CLvpEyVJQ5AcTih2jMmdPhoA/4dUCgYEA09JTRAO2d8l24d4r7l/p\nukA4UFzlunav2tRMqlYYhLBIXC0EvJML8K0vx6A7rbq0VGwfG/B81ZaIUQp8Efp9\n0Pl7h4z3j807eJDhyiPbVW+vex5OfkeGTwzt8bcMMymlAx3eX4j7zwPtG11EvaMF\nQNZ9oGar1hTd/UzWP+ajBoMCgYEAiDiAjqhqvBNuZtqDfG/qdEGGX3G7pCUGHFg7\nX+bPExFqbk2wY3h3iOC2ELJ3NrgCZzXw5qFqkbPqw59UAKjIpMYh5NFQeuNmYIwg\nG7VCvbBBesAQHiH8odsOk5pXePZ4Lq4AVUFFsgHF81YoV7JWaCfd98C3uq2vxHmV\nXS34gM0CgYBuQFJsotpnNtTLIv2jOiOu7VZKE9Clm1QMVhMsqVv8GgMKmzC9st9y\n2jrjo2W8Z+GtR1IZn5TfspfbwBv+h2HH+Gn5DxyYre5C+mcmPn3om1KlaLFIyF+G\nJEtFCgb/YbM7vvw3rQUZpMFSIp7pBpBafbzNzglRy7rAf3Qh7dIH9A==\n-----END RSA PRIVATE KEY-----\n";
    const EC_SEC1: &str = "-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIPMdiTim7T1YzdC8Smqs/OlBSaogm5bmBpCt6Gng9FrZoAoGCCqGSM49\nAwEHoUQDQgAEsi1HXeRiMCj9WxvSJjrQOYBIXo0bRfcNhqd7V5c8JapiaA3FgRbB\ntAiNhfBS16qhqIDrvcBRoK9hBLvYQtVR2Q==\n-----END EC PRIVATE KEY-----\n";

    /// A self-signed certificate over `key` (PKCS#8 PEM), CA or not, valid over `from..to`
    /// (Unix seconds).
    fn self_signed(key: &KeyPair, ca: bool, from: i64, to: i64) -> String {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "test CA");
        if ca {
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        }
        let epoch = rcgen::date_time_ymd(1970, 1, 1);
        params.not_before = epoch + Duration::from_secs(from as u64);
        params.not_after = epoch + Duration::from_secs(to as u64);
        params.self_signed(key).unwrap().pem()
    }

    fn field_of(error: CertError) -> &'static str {
        match error {
            CertError::BadCa { field, .. } => field,
            other => panic!("expected BadCa, got {other}"),
        }
    }

    #[test]
    fn a_ca_key_in_pkcs1_or_sec1_signs_like_pkcs8() {
        let now = unix_now();
        for key_pem in [RSA_PKCS1, EC_SEC1] {
            // rcgen alone refuses these: the test would pass vacuously otherwise.
            assert!(KeyPair::from_pem(key_pem).is_err());
            let key = signing_key(key_pem).unwrap();
            let ca_cert = self_signed(&key, true, now - 60, now + 86_400 * 400);
            let ca = check_ca(&ca_cert, key_pem, now).unwrap();
            assert_eq!(ca.key.public_key_raw(), key.public_key_raw());
            let leaf = issue(Leaf::Agent, &ca_cert, key_pem).unwrap();
            assert!(issued_by(&leaf.cert, &ca_cert));
        }
        // A SEC1 key without its curve (as PKCS#8 holds it inside) is read too.
        let p256 = KeyPair::generate().unwrap();
        let pkcs8 = p256.serialize_der();
        let (_, inner, _) = der_next(&pkcs8).unwrap();
        let (_, _, rest) = der_next(inner).unwrap(); // version
        let (_, _, rest) = der_next(rest).unwrap(); // algorithm
        let (_, sec1, _) = der_next(rest).unwrap(); // the ECPrivateKey
        assert_eq!(sec1_curve(sec1), None);
        let sec1 = rustls::pki_types::PrivateSec1KeyDer::from(sec1);
        let read = key_pair(&rustls::pki_types::PrivateKeyDer::Sec1(sec1)).unwrap();
        assert_eq!(read.public_key_raw(), p256.public_key_raw());
    }

    #[test]
    fn a_ca_pair_that_cannot_sign_is_refused_naming_the_field() {
        let now = unix_now();
        let (ca_cert, ca_key) = generate_ca().unwrap();
        let (other_cert, other_key) = generate_ca().unwrap();
        assert!(check_ca(&ca_cert, &ca_key, now).is_ok());
        // Rotation step 2 half done: the new certificate with the old key.
        let mismatched = check_ca(&other_cert, &ca_key, now).unwrap_err();
        assert!(
            mismatched.to_string().contains("nodekeeper-ca"),
            "{mismatched}"
        );
        assert!(mismatched.to_string().contains("openssl"), "{mismatched}");
        assert_eq!(field_of(mismatched), "tls.key");
        assert_eq!(
            field_of(issue(Leaf::Agent, &ca_cert, &other_key).unwrap_err()),
            "tls.key"
        );
        let key = KeyPair::from_pem(&ca_key).unwrap();
        let not_ca = self_signed(&key, false, now - 60, now + 86_400);
        assert_eq!(
            field_of(check_ca(&not_ca, &ca_key, now).unwrap_err()),
            "tls.crt"
        );
        let expired = self_signed(&key, true, now - 86_400, now - 60);
        let error = check_ca(&expired, &ca_key, now).unwrap_err();
        assert!(error.to_string().contains("expired"), "{error}");
        assert_eq!(field_of(error), "tls.crt");
        let future = self_signed(&key, true, now + 3600, now + 86_400);
        assert_eq!(
            field_of(check_ca(&future, &ca_key, now).unwrap_err()),
            "tls.crt"
        );
        assert_eq!(
            field_of(check_ca("garbage", &ca_key, now).unwrap_err()),
            "tls.crt"
        );
        assert_eq!(
            field_of(check_ca(&ca_cert, "garbage", now).unwrap_err()),
            "tls.key"
        );
    }

    #[test]
    fn a_leaf_never_outlives_its_ca() {
        let now = unix_now();
        let key = KeyPair::generate().unwrap();
        let ca_end = now + 30 * 86_400;
        let ca_cert = self_signed(&key, true, now - 60, ca_end);
        let leaf = issue(Leaf::Controller, &ca_cert, &key.serialize_pem()).unwrap();
        assert_eq!(validity_window(&leaf.cert).unwrap().1, ca_end);
    }

    #[test]
    fn a_leaf_is_issued_by_its_own_ca_only_even_under_the_same_name() {
        let (old_cert, old_key) = generate_ca().unwrap();
        let (new_cert, _) = generate_ca().unwrap();
        let leaf = issue(Leaf::Agent, &old_cert, &old_key).unwrap();
        assert!(issued_by(&leaf.cert, &old_cert));
        // Both CAs are named "nodekeeper CA": only the signature tells them apart.
        assert!(!issued_by(&leaf.cert, &new_cert));
        assert!(!issued_by("not a certificate", &old_cert));
        assert!(!issued_by(&leaf.cert, "not a certificate"));
    }

    #[test]
    fn the_trust_bundle_always_holds_the_signing_ca() {
        let (old, _) = generate_ca().unwrap();
        let (new, _) = generate_ca().unwrap();
        assert_eq!(trust_bundle(None, &old), old);
        assert_eq!(trust_bundle(Some(""), &old), old);
        assert_eq!(trust_bundle(Some("no PEM here"), &old), old);
        // Rotation step 1: both, the old one signing.
        let both = format!("{old}{new}");
        let bundle = trust_bundle(Some(&both), &old);
        assert_eq!(certificates(&bundle).len(), 2);
        assert_eq!(trust_bundle(Some(&bundle), &old), bundle, "stable");
        // A bundle that leaves out the signing CA gets it added.
        let bundle = trust_bundle(Some(&new), &old);
        assert_eq!(certificates(&bundle), certificates(&format!("{new}{old}")));
    }

    #[test]
    fn issues_leaves_that_chain_to_the_ca() {
        let (ca_cert, ca_key) = generate_ca().unwrap();
        let agent = issue(Leaf::Agent, &ca_cert, &ca_key).unwrap();
        assert_eq!(agent.ca, ca_cert);
        let (_, pem) = x509_parser::pem::parse_x509_pem(agent.cert.as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        let (_, ca_pem) = x509_parser::pem::parse_x509_pem(ca_cert.as_bytes()).unwrap();
        let ca = ca_pem.parse_x509().unwrap();
        assert_eq!(cert.issuer().to_string(), ca.subject().to_string());
        let sans = cert.subject_alternative_name().unwrap().unwrap();
        assert!(format!("{:?}", sans.value).contains(AGENT_SERVER_NAME));
    }

    #[test]
    fn renewal_when_a_third_of_the_validity_remains() {
        let (ca_cert, ca_key) = generate_ca().unwrap();
        let leaf = issue(Leaf::Controller, &ca_cert, &ca_key).unwrap();
        let (not_before, not_after) = validity_window(&leaf.cert).unwrap();
        let third = (not_after - not_before) / 3;
        assert!(!needs_renewal(&leaf.cert, unix_now()));
        assert!(!needs_renewal(&leaf.cert, not_after - third - 10));
        assert!(needs_renewal(&leaf.cert, not_after - third + 10));
        assert!(needs_renewal("garbage", 0));
    }
}
