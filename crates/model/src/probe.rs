//! The limits and name rules of network probes, written once: the `NetworkTest` CRD schema, the
//! controller's plan and the agent's request validation all use these, so a test the schema admits
//! is one the controller plans and the agent runs.

/// Most entries in `NetworkTest.spec.targets`, and most targets in one `RunProbes` call.
pub const MAX_TARGETS: usize = 1_000;
/// Most source nodes one test may use (`spec.maxNodes`).
pub const MAX_SOURCE_NODES: u32 = 10_000;
/// Most peers each node probes for a `peers` target.
pub const MAX_PEERS_PER_NODE: u32 = 16;
/// Probes per target, 1 to this.
pub const MAX_COUNT: u32 = 100;
/// A single probe's timeout, 1 to this many milliseconds.
pub const MAX_TIMEOUT_MS: u32 = 30_000;
/// Longest pause between probes of one target; a longer one would outlive any caller's deadline.
pub const MAX_INTERVAL_MS: u32 = 60_000;
/// Targets one agent probes at once. More would only queue in the kernel and distort latency.
pub const MAX_CONCURRENCY: u32 = 256;
/// Pause between probes when the request leaves it unset.
pub const DEFAULT_INTERVAL_MS: u32 = 200;
/// Targets probed at once when the request leaves it unset.
pub const DEFAULT_CONCURRENCY: u32 = 16;
/// The largest path MTU tried when the request leaves it unset.
pub const DEFAULT_MAX_MTU: u32 = 9_000;
/// The smallest MTU IPv4 allows (RFC 791).
pub const MIN_MTU_V4: u32 = 68;
/// The smallest MTU IPv6 allows (RFC 8200).
pub const MIN_MTU_V6: u32 = 1_280;
/// The largest MTU an IP packet can claim.
pub const MAX_MTU: u32 = 65_535;
/// Longest DNS name in presentation form, without the trailing dot.
pub const MAX_HOSTNAME_LEN: usize = 253;
/// Longest URL an `http` probe accepts.
pub const MAX_URL_LEN: usize = 2_048;

/// Checks a DNS name in presentation form: dot-separated labels of 1–63 letters, digits, hyphens
/// or underscores, at most 253 characters, optionally ending in a dot. The reason names what is
/// wrong.
pub fn check_hostname(name: &str) -> Result<(), String> {
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if trimmed.is_empty() {
        return Err("must be set to a DNS name".into());
    }
    if trimmed.len() > MAX_HOSTNAME_LEN {
        return Err(format!(
            "{} characters long; a DNS name has at most {MAX_HOSTNAME_LEN}",
            trimmed.len()
        ));
    }
    for label in trimmed.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(format!(
                "{name:?} has an empty label or one longer than 63 characters"
            ));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(format!(
                "{name:?} contains {c:?}; only letters, digits, '-' and '_' are allowed"
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("{name:?} has a label that starts or ends with '-'"));
        }
    }
    Ok(())
}

/// Checks the shape of an `http://` or `https://` URL with a host and no user information. The
/// agent parses the URL fully before it connects; this is the rule both sides agree on.
pub fn check_url(u: &str) -> Result<(), String> {
    if u.is_empty() {
        return Err("must be set to an http:// or https:// URL".into());
    }
    if u.len() > MAX_URL_LEN {
        return Err(format!(
            "{} characters long; at most {MAX_URL_LEN}",
            u.len()
        ));
    }
    let Some((scheme, rest)) = u.split_once("://") else {
        return Err(format!("{u:?} has no scheme; use http:// or https://"));
    };
    if scheme != "http" && scheme != "https" {
        return Err(format!(
            "scheme {scheme:?} is not supported; use http or https"
        ));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.is_empty() {
        return Err(format!("{u:?} has no host"));
    }
    if authority.contains('@') {
        return Err("user information in URLs is not supported".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames() {
        for ok in ["example.com", "a", "svc_1.cluster.local.", "x-y.z"] {
            assert_eq!(check_hostname(ok), Ok(()), "{ok}");
        }
        for bad in ["", ".", "a..b", "-a.b", "a-.b", "a b", "ä.com"] {
            assert!(check_hostname(bad).is_err(), "{bad}");
        }
        assert!(check_hostname(&"a".repeat(64)).is_err());
        assert!(check_hostname(&["a"; 128].join(".")).is_err());
    }

    #[test]
    fn urls() {
        assert_eq!(check_url("https://example.com/x?y"), Ok(()));
        assert_eq!(check_url("http://127.0.0.1:8080"), Ok(()));
        for bad in ["", "ftp://x", "example.com", "http://", "http://u:p@h/"] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
        assert!(check_url(&format!("http://h/{}", "x".repeat(MAX_URL_LEN))).is_err());
    }
}
