//! Our request signatures equal those of Oracle's own Python SDK (PyPI `oci`) for the same key,
//! method, URL, date and body: a table of requests (GET with a query, POST with JSON, an
//! empty-body POST, DELETE with a query, PUT, PATCH, a non-default port) is signed by both and the
//! `Authorization` parameters are compared parsed (the SDKs order them differently), byte for byte.
//! The throwaway RSA key is made by Python's `cryptography` for this run.
//!
//! Python with `oci` is looked for in `$NODEKEEPER_PYTHON_OCI`, then in the virtual environment
//! `cargo xtask test` installs (`${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/python-oci`), then as
//! `python3`. Without it the test fails under CI (`CI` set) and reports SKIPPED otherwise.
//!
//! Run: `cargo test -p nodekeeper-oci --test signer_python`.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::SystemTime;

use http::{HeaderMap, HeaderValue, Method, Uri};
use nodekeeper_oci::signer::{Credentials, PrivateKey, parse_authorization, sign_request};
use serde_json::{Value, json};

const DATE: &str = "Mon, 23 Nov 2026 06:30:00 GMT";
const TENANCY: &str = "ocid1.tenancy.oc1..aaaaaaaalocaltest";
const USER: &str = "ocid1.user.oc1..aaaaaaaalocaltest";

/// Generates a key, signs every request of the table read from stdin, prints one JSON document.
const SCRIPT: &str = r#"
import json, sys, os
import oci
from oci._vendor import requests
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives import serialization, hashes

table = json.load(sys.stdin)
key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption())
path = os.path.join(table["dir"], "key.pem")
with open(path, "wb") as f:
    f.write(pem)
der = key.public_key().public_bytes(serialization.Encoding.DER,
                                    serialization.PublicFormat.SubjectPublicKeyInfo)
h = hashes.Hash(hashes.MD5())
h.update(der)
fingerprint = ":".join("%02x" % b for b in h.finalize())
signer = oci.signer.Signer(table["tenancy"], table["user"], fingerprint, path)
out = []
for case in table["cases"]:
    body = case["body"].encode("utf-8") if case["body"] is not None else None
    r = requests.Request(case["method"], case["url"], data=body,
                         headers={"date": table["date"]}).prepare()
    signer(r)
    out.append({"path_url": r.path_url,
                "authorization": r.headers["authorization"],
                "x-content-sha256": r.headers.get("x-content-sha256"),
                "content-length": r.headers.get("content-length")})
print(json.dumps({"fingerprint": fingerprint, "oci": oci.__version__, "signed": out}))
"#;

fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("NODEKEEPER_PYTHON_OCI").filter(|p| !p.is_empty()) {
        out.push(PathBuf::from(p));
    }
    let cache = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/tmp"))
            .join(".cache"),
    };
    out.push(cache.join("nodekeeper/python-oci/bin/python3"));
    out.push(PathBuf::from("python3"));
    out
}

fn python_with_oci() -> Result<PathBuf, String> {
    for python in candidates() {
        let ok = Command::new(&python)
            .args(["-c", "import oci, cryptography"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(python);
        }
    }
    Err(format!(
        "no python3 with Oracle's `oci` package (looked at {:?}); `cargo xtask test` installs it, or run `python3 -m pip install oci`",
        candidates()
    ))
}

struct Case {
    method: Method,
    url: &'static str,
    body: Option<&'static str>,
}

fn table() -> Vec<Case> {
    let host = "https://iaas.us-phoenix-1.oraclecloud.com/20160918";
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    vec![
        Case {
            method: Method::GET,
            url: leak(format!(
                "{host}/vnicAttachments?compartmentId=ocid1.compartment.oc1..aaaa&availabilityDomain=Uocm%3APHX-AD-1%20x&instanceId=ocid1.instance.oc1.phx.abc&limit=100&page=AAAA%2Fnext"
            )),
            body: None,
        },
        Case {
            method: Method::POST,
            url: leak(format!("{host}/vnicAttachments")),
            body: Some(
                r#"{"instanceId":"ocid1.instance.oc1.phx.abc","createVnicDetails":{"subnetId":"ocid1.subnet.oc1.phx.s","skipSourceDestCheck":true,"nsgIds":["ocid1.nsg.oc1.phx.n"]},"displayName":"nk-pods-0"}"#,
            ),
        },
        Case {
            method: Method::POST,
            url: leak(format!(
                "{host}/instances/ocid1.instance.oc1.phx.abc?action=SOFTRESET"
            )),
            body: Some(""),
        },
        Case {
            method: Method::DELETE,
            url: leak(format!(
                "{host}/instances/ocid1.instance.oc1.phx.abc?preserveBootVolume=false"
            )),
            body: None,
        },
        Case {
            method: Method::PUT,
            url: leak(format!("{host}/vnics/ocid1.vnic.oc1.phx.v")),
            body: Some(r#"{"displayName":"renamed","skipSourceDestCheck":false}"#),
        },
        Case {
            method: Method::PATCH,
            url: leak(format!("{host}/instances/ocid1.instance.oc1.phx.abc")),
            body: Some("{\n  \"displayName\": \"ünïcode name\"\n}"),
        },
        Case {
            method: Method::GET,
            url: "https://iaas.us-phoenix-1.oraclecloud.com:8443/20160918/instances/ocid1.instance.oc1.phx.abc",
            body: None,
        },
    ]
}

#[test]
fn signatures_match_oracles_python_sdk() {
    let python = match python_with_oci() {
        Ok(p) => p,
        Err(reason) if std::env::var_os("CI").is_none() => {
            eprintln!("SKIPPED signatures_match_oracles_python_sdk: {reason}");
            return;
        }
        Err(reason) => panic!("{reason} (CI is set: this test must run there)"),
    };
    let dir = tempfile::tempdir().unwrap();
    let cases = table();
    let input = json!({
        "dir": dir.path(),
        "tenancy": TENANCY,
        "user": USER,
        "date": DATE,
        "cases": cases.iter().map(|c| json!({
            "method": c.method.as_str(),
            "url": c.url,
            "body": c.body,
        })).collect::<Vec<_>>(),
    });
    let mut child = Command::new(&python)
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "python signer failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer: Value = serde_json::from_slice(&output.stdout).unwrap();
    eprintln!(
        "comparing with oci {} ({})",
        answer["oci"],
        python.display()
    );

    let pem = std::fs::read_to_string(dir.path().join("key.pem")).unwrap();
    let key = PrivateKey::from_pem(&pem).unwrap();
    assert_eq!(
        key.fingerprint(),
        answer["fingerprint"].as_str().unwrap(),
        "MD5 fingerprint of the public key"
    );
    let credentials = Credentials {
        key_id: format!("{TENANCY}/{USER}/{}", key.fingerprint()),
        key,
    };

    let signed = answer["signed"].as_array().unwrap();
    assert_eq!(signed.len(), cases.len());
    for (case, theirs) in cases.iter().zip(signed) {
        let uri: Uri = case.url.parse().unwrap();
        // Both must sign the very bytes that go on the wire.
        assert_eq!(
            uri.path_and_query().unwrap().as_str(),
            theirs["path_url"].as_str().unwrap(),
            "{} {}: request target differs",
            case.method,
            case.url
        );
        let mut headers = HeaderMap::new();
        headers.insert(http::header::DATE, HeaderValue::from_static(DATE));
        let body = case.body.unwrap_or("").as_bytes();
        sign_request(
            &credentials,
            &case.method,
            &uri,
            &mut headers,
            body,
            SystemTime::now(),
        )
        .unwrap();
        let ours = parse_authorization(headers["authorization"].to_str().unwrap()).unwrap();
        let their_params = parse_authorization(theirs["authorization"].as_str().unwrap())
            .unwrap_or_else(|| panic!("unparsable python header {theirs}"));
        assert_eq!(
            ours, their_params,
            "{} {}: Authorization parameters differ",
            case.method, case.url
        );
        if let Some(sha) = theirs["x-content-sha256"].as_str() {
            assert_eq!(headers["x-content-sha256"], sha);
            assert_eq!(
                headers["content-length"],
                theirs["content-length"].as_str().unwrap()
            );
        } else {
            assert!(!headers.contains_key("x-content-sha256"));
        }
    }
}
