//! The redaction filter every text part of a diagnostics bundle passes through before it is
//! written: PEM private keys, `Authorization:` headers, bearer tokens, `password=` / `token=` /
//! `secret=`-style values and `auth` keys (also as JSON, YAML or TOML keys, with quoted values),
//! AWS access key ids and OCI API key ids.
//!
//! It errs on the side of removing: a bundle leaves the node and may be attached to a ticket, so a
//! false positive (a harmless value hidden) is cheap and a false negative is not.

use std::sync::LazyLock;

use regex::{Captures, Regex};

/// What replaces a secret.
pub const MARK: &str = "[REDACTED]";

struct Rule {
    re: Regex,
    replace: fn(&Captures<'_>) -> String,
}

static RULES: LazyLock<Vec<Rule>> = LazyLock::new(|| {
    let rule = |pattern: &str, replace: fn(&Captures<'_>) -> String| Rule {
        re: Regex::new(pattern).expect("redaction patterns are valid"),
        replace,
    };
    vec![
        // A PEM private key block, including one cut off by a size cap (no END line).
        rule(
            r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----(?s:.*?)(-----END [A-Z0-9 ]*PRIVATE KEY-----|\z)",
            |c| {
                format!(
                    "-----BEGIN {}PRIVATE KEY----- {MARK} -----END {}PRIVATE KEY-----",
                    &c[1], &c[1]
                )
            },
        ),
        // HTTP authorization headers, whatever the scheme (Basic, Bearer, OCI's Signature).
        rule(r"(?i)\b((?:proxy-)?authorization\s*:\s*)[^\r\n]*", |c| {
            format!("{}{MARK}", &c[1])
        }),
        // A bearer token anywhere else (command lines, JSON values, log lines).
        rule(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]+=*", |c| {
            format!("{}{MARK}", &c[1])
        }),
        // key=value, key: value, "key": "value", key = 'value' where the key names a secret: a
        // word containing password, token, secret and the like, or `auth` as a whole word at the
        // end of the key (containerd's and Docker's base64 `user:password`; `author` and `oauth`
        // are not keys to hide). A quoted value is removed up to its closing quote, spaces and
        // all (escaped double quotes included); an unquoted one up to the first delimiter.
        //
        // Inside a JSON string (a log line or plugin message in report.json, an `ip -j` alias)
        // the text's double quotes arrive escaped: `password=\"a b\"` and `{\"token\": \"a b\"}`.
        // The escaped quote is a quote too, and the value runs to the next escaped quote (or to
        // the end of the JSON string, which ends at the first unescaped one), so the JSON
        // stays valid and nothing of the value is left. An unquoted value stops before an
        // escaped quote for the same reason.
        rule(
            r#"(?i)((?:[A-Za-z0-9_.\-]*(?:password|passwd|pwd|token|secret|api[_\-]?key|access[_\-]?key|private[_\-]?key|credentials?)[A-Za-z0-9_.\-]*|\b(?:[A-Za-z0-9_.\-]*[_.\-])?auth)(?:\\?["'])?\s*[=:]\s*)(?:"((?:[^"\\\r\n]|\\.)*)("?)|\\"((?:[^"\\\r\n]|\\[^"\r\n])*)((?:\\")?)|'([^'\r\n]*)('?)|((?:[^\s"',;&}\\]|\\[^"\s])+))"#,
            |c| match (c.get(2), c.get(4), c.get(6)) {
                (Some(_), _, _) => format!("{}\"{MARK}{}", &c[1], &c[3]),
                (None, Some(_), _) => format!("{}\\\"{MARK}{}", &c[1], &c[5]),
                (None, None, Some(_)) => format!("{}'{MARK}{}", &c[1], &c[7]),
                (None, None, None) => format!("{}{MARK}", &c[1]),
            },
        ),
        // AWS access key ids (long-term AKIA…, temporary ASIA…).
        rule(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b", |_| MARK.to_owned()),
        // OCI API signing key ids: tenancy OCID / user OCID / key fingerprint.
        rule(
            r"ocid1\.tenancy\.[A-Za-z0-9._\-]+/ocid1\.user\.[A-Za-z0-9._\-]+/(?:[0-9a-fA-F]{2}:){15}[0-9a-fA-F]{2}",
            |_| MARK.to_owned(),
        ),
    ]
});

/// `text` with every secret replaced by [`MARK`], and how many replacements were made.
pub fn redact(text: &str) -> (String, usize) {
    let mut out = text.to_owned();
    let mut count = 0;
    for rule in RULES.iter() {
        let mut n = 0;
        let replaced = rule.re.replace_all(&out, |c: &Captures<'_>| {
            n += 1;
            (rule.replace)(c)
        });
        if n > 0 {
            out = replaced.into_owned();
            count += n;
        }
    }
    (out, count)
}

/// [`redact`] over bytes that may not be UTF-8 (invalid sequences become U+FFFD first, so no
/// secret hides behind a stray byte).
pub fn redact_bytes(data: &[u8]) -> (Vec<u8>, usize) {
    let (text, n) = redact(&String::from_utf8_lossy(data));
    (text.into_bytes(), n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(text: &str) -> String {
        redact(text).0
    }

    #[test]
    fn removes_pem_private_keys_whole_and_cut() {
        let text = "before\n-----BEGIN RSA PRIVATE KEY-----\nMIIEsecretbase64\nmore\n-----END RSA PRIVATE KEY-----\nafter";
        let out = clean(text);
        assert!(!out.contains("MIIEsecretbase64"), "{out}");
        assert!(out.contains("before") && out.contains("after"), "{out}");
        let cut = clean("-----BEGIN PRIVATE KEY-----\nMIIEsecret");
        assert!(!cut.contains("MIIEsecret"), "{cut}");
        // Certificates are not secrets and stay.
        let cert = "-----BEGIN CERTIFICATE-----\nMIIBcert\n-----END CERTIFICATE-----";
        assert_eq!(clean(cert), cert);
    }

    #[test]
    fn removes_authorization_headers_and_bearer_tokens() {
        let out = clean("GET / HTTP/1.1\nAuthorization: Basic dXNlcjpwYXNz\nHost: x\n");
        assert!(!out.contains("dXNlcjpwYXNz"), "{out}");
        assert!(
            out.contains("Authorization: [REDACTED]") && out.contains("Host: x"),
            "{out}"
        );
        let out = clean("kubelet[12]: curl -H 'authorization: Signature keyId=\"k\"' https://h");
        assert!(!out.contains("keyId"), "{out}");
        let out = clean(r#"{"header": "Bearer eyJhbGciOi.J9eyJzdWIi.abc-_"}"#);
        assert!(!out.contains("eyJhbGciOi"), "{out}");
    }

    #[test]
    fn removes_secret_values_in_every_spelling() {
        for text in [
            "KUBELET_TOKEN=s3cr3t-value",
            "db_password: s3cr3t-value",
            r#"{"clientSecret": "s3cr3t-value", "name": "ok"}"#,
            "--bootstrap-token=s3cr3t-value --v=2",
            "export AWS_SECRET_ACCESS_KEY=s3cr3t-value",
            "url?user=a&token=s3cr3t-value&x=1",
            "api-key = s3cr3t-value",
            // TOML literal strings and YAML single quotes.
            "password = 's3cr3t-value'",
            "  db_password: 's3cr3t-value'",
            // containerd registry auth and Docker's config.json: base64 user:password.
            "auth = \"s3cr3t-value\"",
            r#"{"auths": {"r.example": {"auth": "s3cr3t-value"}}}"#,
            "registry_auth: s3cr3t-value",
            // Quoted values are removed whole, spaces and escaped quotes included.
            "password = \"hunter2 s3cr3t-value\"",
            r#"{"password": "a\"b s3cr3t-value"}"#,
            "password = 'hunter2 s3cr3t-value'",
            // A value cut off by a size cap, with no closing quote.
            "token: \"hunter2 s3cr3t-value",
        ] {
            let (out, n) = redact(text);
            assert!(!out.contains("s3cr3t-value"), "{text} -> {out}");
            assert!(n >= 1, "{text}");
        }
        // The key names stay, so a reader knows what was there.
        assert_eq!(clean("KUBELET_TOKEN=abc"), "KUBELET_TOKEN=[REDACTED]");
        assert!(clean(r#"{"clientSecret": "x", "name": "ok"}"#).contains(r#""name": "ok""#));
        // Quotes stay around the mark, and what follows the closing quote stays.
        assert_eq!(
            clean("password = 'hunter2' # old"),
            "password = '[REDACTED]' # old"
        );
        assert_eq!(clean(r#"auth = "dXNlcjpwYXNz""#), r#"auth = "[REDACTED]""#);
        // `auth` is a whole word: these are not secrets.
        for text in [
            "author = someone",
            "oauth: enabled",
            "authors: [a, b]",
            "auth_mode = none",
        ] {
            assert_eq!(redact(text), (text.to_owned(), 0), "{text}");
        }
    }

    /// JSON parts carry log lines and messages as strings, where the text's quotes are escaped:
    /// the value inside `password=\"…\"` is removed whole, and the part stays valid JSON.
    #[test]
    fn removes_quoted_values_inside_json_strings() {
        for message in [
            "login password=\"a s3cr3t-value\"",
            "plugin said: password=\"hunter2 s3cr3t-value\" and more",
            "registry token=\"s3cr3t-value\"",
            "config {\"token\": \"a s3cr3t-value\"} loaded",
            "pwd=\"a \\ s3cr3t-value\"",
            "url?token=s3cr3t-value",
            "KUBELET_TOKEN=s3cr3t-value\nnext",
            // Cut off inside the inner value: removed to the end of the JSON string.
            "token=\"a s3cr3t-value",
        ] {
            let text = serde_json::json!({"message": message, "name": "ok"}).to_string();
            let (out, n) = redact(&text);
            assert!(!out.contains("s3cr3t-value"), "{text} -> {out}");
            assert!(n >= 1, "{text}");
            let parsed: serde_json::Value = serde_json::from_str(&out)
                .unwrap_or_else(|e| panic!("{text} -> {out}: not JSON: {e}"));
            assert_eq!(parsed["name"], "ok", "{out}");
            assert!(parsed["message"].as_str().unwrap().contains(MARK), "{out}");
        }
        assert_eq!(
            clean(r#"{"m":"login password=\"a b\" ok"}"#),
            r#"{"m":"login password=\"[REDACTED]\" ok"}"#
        );
    }

    #[test]
    fn removes_cloud_key_ids() {
        let out = clean("aws AKIAIOSFODNN7EXAMPLE and ASIAABCDEFGHIJKLMNOP");
        assert!(
            !out.contains("AKIAIOSFODNN7EXAMPLE") && !out.contains("ASIAABCD"),
            "{out}"
        );
        let oci = "keyId=ocid1.tenancy.oc1..aaaa/ocid1.user.oc1..bbbb/20:3b:97:13:55:1c:5b:0d:d3:37:d8:50:4e:c5:3a:34";
        let out = clean(&format!("signing with {}", &oci[6..]));
        assert!(!out.contains("ocid1.user"), "{out}");
    }

    #[test]
    fn leaves_ordinary_text_alone() {
        for text in [
            "net.core.somaxconn = 4096",
            "[   12.345] eth0: link up, 1000Mbps",
            r#"{"ifname": "eth0", "mtu": 9000}"#,
            "Nov 23 06:00:00 node kubelet[1]: Successfully registered node n1",
        ] {
            assert_eq!(redact(text), (text.to_owned(), 0), "{text}");
        }
    }

    #[test]
    fn invalid_utf8_does_not_hide_a_secret() {
        let mut data = b"\xff\xfetoken=s3cr3t".to_vec();
        data.push(b'\n');
        let (out, n) = redact_bytes(&data);
        assert_eq!(n, 1);
        assert!(!String::from_utf8(out).unwrap().contains("s3cr3t"));
    }
}
