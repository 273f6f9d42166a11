//! The local control plane's certificates and keys: a CA, the serving certificate for
//! 127.0.0.1/localhost, one client certificate per component (so audit logs and request metrics
//! tell the clients apart), and the service-account signing key pair. Generated with rcgen.

use std::fs;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::Error;

/// A client identity: the user name (certificate CN) and groups (O) the apiserver sees.
#[derive(Debug, Clone, Copy)]
pub struct Identity {
    /// File stem for `<stem>.crt`, `<stem>.key` and `<stem>.kubeconfig`.
    pub stem: &'static str,
    pub user: &'static str,
    pub groups: &'static [&'static str],
}

/// The test and `kubectl` user: full access through `system:masters`.
pub const ADMIN: Identity = Identity {
    stem: "admin",
    user: "nodekeeper-admin",
    groups: &["system:masters"],
};
/// kube-controller-manager's bootstrap identity; with `--use-service-account-credentials` each
/// controller then acts as its own service account.
pub const CONTROLLER_MANAGER: Identity = Identity {
    stem: "kube-controller-manager",
    user: "system:kube-controller-manager",
    groups: &[],
};
/// kube-scheduler's identity, bound by the apiserver's bootstrap RBAC policy.
pub const SCHEDULER: Identity = Identity {
    stem: "kube-scheduler",
    user: "system:kube-scheduler",
    groups: &[],
};
/// kwok: writes node status, leases and pod status for every simulated node, so it gets full
/// access; its own user name keeps its (heartbeat) traffic countable apart from nodekeeper's.
pub const KWOK: Identity = Identity {
    stem: "kwok",
    user: "kwok",
    groups: &["system:masters"],
};

pub const CLIENTS: [Identity; 4] = [ADMIN, CONTROLLER_MANAGER, SCHEDULER, KWOK];

/// Paths of everything generated, under `<state>/pki/`.
#[derive(Debug, Clone)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    pub fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }
    pub fn serving_cert(&self) -> PathBuf {
        self.dir.join("serving.crt")
    }
    pub fn serving_key(&self) -> PathBuf {
        self.dir.join("serving.key")
    }
    pub fn sa_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }
    pub fn sa_pub(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }
    pub fn client_cert(&self, id: &Identity) -> PathBuf {
        self.dir.join(format!("{}.crt", id.stem))
    }
    pub fn client_key(&self, id: &Identity) -> PathBuf {
        self.dir.join(format!("{}.key", id.stem))
    }

    fn all_files(&self) -> Vec<PathBuf> {
        let mut files = vec![
            self.ca_cert(),
            self.ca_key(),
            self.serving_cert(),
            self.serving_key(),
            self.sa_key(),
            self.sa_pub(),
        ];
        for id in &CLIENTS {
            files.push(self.client_cert(id));
            files.push(self.client_key(id));
        }
        files
    }
}

/// Returns the PKI under `dir`, generating all of it unless every file is already there (a
/// restarted cluster keeps its CA, so existing kubeconfigs stay valid).
pub fn ensure(dir: &Path) -> Result<Pki, Error> {
    let pki = Pki {
        dir: dir.to_owned(),
    };
    if pki.all_files().iter().all(|f| f.is_file()) {
        return Ok(pki);
    }
    fs::create_dir_all(dir).map_err(|source| Error::Io {
        context: format!("create {}", dir.display()),
        source,
    })?;

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "nodekeeper local control plane CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    write(&pki.ca_cert(), &ca_cert.pem(), false)?;
    write(&pki.ca_key(), &ca_key.serialize_pem(), true)?;
    let issuer = Issuer::new(ca_params, ca_key);

    // Every component serves on 127.0.0.1; in-cluster clients would use the service names.
    let serving_key = KeyPair::generate()?;
    let mut serving = CertificateParams::new(vec![
        "localhost".to_owned(),
        "kubernetes".to_owned(),
        "kubernetes.default".to_owned(),
        "kubernetes.default.svc".to_owned(),
        "kubernetes.default.svc.cluster.local".to_owned(),
    ])?;
    serving
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    serving
        .subject_alt_names
        .push(SanType::IpAddress([10, 96, 0, 1].into()));
    serving
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    serving.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    write(
        &pki.serving_cert(),
        &serving.signed_by(&serving_key, &issuer)?.pem(),
        false,
    )?;
    write(&pki.serving_key(), &serving_key.serialize_pem(), true)?;

    for id in &CLIENTS {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, id.user);
        for group in id.groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        write(
            &pki.client_cert(id),
            &params.signed_by(&key, &issuer)?.pem(),
            false,
        )?;
        write(&pki.client_key(id), &key.serialize_pem(), true)?;
    }

    // ECDSA P-256 (ES256): kube-apiserver signs service-account tokens with it and
    // kube-controller-manager reads the same private key.
    let sa = KeyPair::generate()?;
    write(&pki.sa_key(), &sa.serialize_pem(), true)?;
    write(&pki.sa_pub(), &sa.public_key_pem(), false)?;
    Ok(pki)
}

fn write(path: &Path, contents: &str, private: bool) -> Result<(), Error> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut options = fs::OpenOptions::new();
    options
        .create(true)
        .truncate(true)
        .write(true)
        .mode(if private { 0o600 } else { 0o644 });
    let mut file = options.open(path).map_err(|source| Error::Io {
        context: format!("write {}", path.display()),
        source,
    })?;
    std::io::Write::write_all(&mut file, contents.as_bytes()).map_err(|source| Error::Io {
        context: format!("write {}", path.display()),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_every_file_once_and_keeps_them() {
        let dir = tempfile::tempdir().unwrap();
        let pki = ensure(dir.path()).unwrap();
        for file in pki.all_files() {
            assert!(file.is_file(), "{} missing", file.display());
        }
        let ca = fs::read_to_string(pki.ca_cert()).unwrap();
        assert!(ca.starts_with("-----BEGIN CERTIFICATE-----"));
        // A second call reuses what is there rather than minting a new CA.
        let again = ensure(dir.path()).unwrap();
        assert_eq!(fs::read_to_string(again.ca_cert()).unwrap(), ca);
        use std::os::unix::fs::PermissionsExt as _;
        let mode = fs::metadata(pki.ca_key()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn admin_certificate_names_user_and_group() {
        let dir = tempfile::tempdir().unwrap();
        let pki = ensure(dir.path()).unwrap();
        let pem = fs::read(pki.client_cert(&ADMIN)).unwrap();
        let (_, parsed) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
        let cert = parsed.parse_x509().unwrap();
        let subject = cert.subject().to_string();
        assert!(subject.contains("CN=nodekeeper-admin"), "{subject}");
        assert!(subject.contains("O=system:masters"), "{subject}");
    }
}
