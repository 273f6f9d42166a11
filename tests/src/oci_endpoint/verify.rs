//! Signature verification as OCI's service does it, written from Oracle's documentation
//! (`signingrequests.htm`, facts in `shared/oci/compute-api.md` §1), independent of the client
//! crate: the endpoint must catch a client that signs wrongly, so it shares no code with it.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use http::{HeaderMap, Method, Uri};
use rsa::pkcs8::DecodePublicKey as _;
use rsa::{Pkcs1v15Sign, RsaPublicKey};
use sha2::{Digest as _, Sha256};

/// Largest accepted difference between the request's `date` and the endpoint's clock.
pub const MAX_SKEW: Duration = Duration::from_secs(300);

/// Public keys by keyId (`tenancy/user/fingerprint`, or `ST$<token>` for sessions).
#[derive(Default)]
pub struct Keys {
    keys: HashMap<String, RsaPublicKey>,
}

impl Keys {
    pub fn insert_pem(&mut self, key_id: &str, public_key_pem: &str) -> anyhow::Result<()> {
        let key = RsaPublicKey::from_public_key_pem(public_key_pem.trim())?;
        self.keys.insert(key_id.to_string(), key);
        Ok(())
    }

    pub fn insert(&mut self, key_id: String, key: RsaPublicKey) {
        self.keys.insert(key_id, key);
    }

    /// Forgets every security-token session (`ST$…` keyIds).
    pub fn revoke_sessions(&mut self) {
        self.keys.retain(|id, _| !id.starts_with("ST$"));
    }
}

/// Signed on GET, HEAD and DELETE.
pub const GENERIC: &[&str] = &["date", "(request-target)", "host"];
/// Signed on POST, PUT and PATCH.
pub const BODY: &[&str] = &[
    "date",
    "(request-target)",
    "host",
    "content-length",
    "content-type",
    "x-content-sha256",
];
/// Signed on the X.509 federation call (Oracle's auth service does not want `host` there).
pub const FEDERATION: &[&str] = &[
    "date",
    "(request-target)",
    "content-length",
    "content-type",
    "x-content-sha256",
];

fn parse_params(value: &str) -> Option<BTreeMap<String, String>> {
    let mut rest = value.strip_prefix("Signature ")?.trim();
    let mut out = BTreeMap::new();
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let (val, after) = after.split_once('"')?;
        out.insert(key.trim().to_string(), val.to_string());
        rest = after.trim_start_matches(',').trim();
    }
    Some(out)
}

/// Checks one request, which must sign at least `required`; `Err` carries the reason (for the
/// test log; the client only sees 401).
pub fn verify(
    keys: &Keys,
    required: &[&str],
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
) -> Result<String, String> {
    let auth = headers
        .get(http::header::AUTHORIZATION)
        .ok_or("no authorization header")?
        .to_str()
        .map_err(|_| "authorization header is not text")?;
    let params = parse_params(auth).ok_or("authorization is not `Signature k=\"v\",…`")?;
    let get = |k: &str| params.get(k).ok_or(format!("authorization has no {k}"));
    if get("version")? != "1" {
        return Err("version is not 1".into());
    }
    if get("algorithm")? != "rsa-sha256" {
        return Err("algorithm is not rsa-sha256".into());
    }
    let key_id = get("keyId")?;
    let key = keys
        .keys
        .get(key_id)
        .ok_or_else(|| format!("unknown keyId {key_id}"))?;
    let names: Vec<&str> = get("headers")?.split(' ').collect();
    let body_method = matches!(*method, Method::POST | Method::PUT | Method::PATCH);
    for r in required {
        if !names.contains(r) {
            return Err(format!(
                "header {r} is required for {method} but not signed"
            ));
        }
    }
    let header = |name: &str| -> Result<&str, String> {
        headers
            .get(name)
            .ok_or(format!("signed header {name} is missing"))?
            .to_str()
            .map_err(|_| format!("header {name} is not text"))
    };
    let date = httpdate::parse_http_date(header("date")?).map_err(|e| format!("date: {e}"))?;
    let skew = now
        .duration_since(date)
        .or_else(|_| date.duration_since(now))
        .unwrap_or_default();
    if skew > MAX_SKEW {
        return Err(format!("date is {} s off", skew.as_secs()));
    }
    if body_method {
        let expected = BASE64.encode(Sha256::digest(body));
        if header("x-content-sha256")? != expected {
            return Err("x-content-sha256 does not match the body".into());
        }
        if header("content-length")? != body.len().to_string() {
            return Err("content-length does not match the body".into());
        }
    }
    let mut lines = Vec::new();
    for name in &names {
        let value = if *name == "(request-target)" {
            let target = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
            format!("{} {target}", method.as_str().to_lowercase())
        } else {
            header(name)?.to_string()
        };
        lines.push(format!("{name}: {value}"));
    }
    let signing_string = lines.join("\n");
    let signature = BASE64
        .decode(get("signature")?)
        .map_err(|e| format!("signature is not base64: {e}"))?;
    key.verify(
        Pkcs1v15Sign::new::<Sha256>(),
        &Sha256::digest(signing_string.as_bytes()),
        &signature,
    )
    .map_err(|_| "signature does not verify".to_string())?;
    Ok(key_id.clone())
}
