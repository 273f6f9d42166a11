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

/// Issues a leaf from the CA.
pub fn issue(leaf: Leaf, ca_cert: &str, ca_key: &str) -> Result<Pem, CertError> {
    let what = match leaf {
        Leaf::Agent => "agent certificate",
        Leaf::Controller => "controller certificate",
    };
    let generate = |source| CertError::Generate { what, source };
    let ca_key_pair = KeyPair::from_pem(ca_key).map_err(generate)?;
    let issuer = Issuer::from_ca_cert_pem(ca_cert, ca_key_pair).map_err(generate)?;
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
    Ok((
        controller.expect("the loop visits Leaf::Controller"),
        renewed,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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
