//! netcheck's target words turned into NetworkTest targets. Which kinds take which targets is the
//! CRD's rule (checked by the API server when the test is created), not repeated here.

use std::net::IpAddr;

use nodekeeper_api::crd::network_test::{Peers, Target};

use crate::error::Error;

/// Peers each node probes when the word `peers` gives no number.
pub const DEFAULT_PEERS: u32 = 3;

/// Parses one target word:
/// - `peers` or `peers:N` — other nodes of the test (N per node);
/// - `apiserver`, `metadata` — the API server / the metadata service as the controller knows them;
/// - `http://…`, `https://…` — a URL;
/// - an IP address;
/// - `host:port` or `[v6]:port` — a TCP endpoint;
/// - anything else — a DNS name.
pub fn parse(word: &str) -> Result<Target, Error> {
    let invalid = |reason: &str| Error::InvalidTarget {
        target: word.to_owned(),
        reason: reason.to_owned(),
    };
    let w = word.trim();
    if w.is_empty() {
        return Err(invalid("empty target"));
    }
    if w == "peers" {
        return Ok(Target {
            peers: Some(Peers {
                per_node: DEFAULT_PEERS,
            }),
            ..Target::default()
        });
    }
    if let Some(n) = w.strip_prefix("peers:") {
        let per_node = n
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| invalid("write peers:N with N a positive number"))?;
        return Ok(Target {
            peers: Some(Peers { per_node }),
            ..Target::default()
        });
    }
    if w.eq_ignore_ascii_case("apiserver") {
        return Ok(Target {
            api_server: Some(true),
            ..Target::default()
        });
    }
    if w.eq_ignore_ascii_case("metadata") {
        return Ok(Target {
            metadata_service: Some(true),
            ..Target::default()
        });
    }
    if w.starts_with("http://") || w.starts_with("https://") {
        return Ok(Target {
            url: Some(w.to_owned()),
            ..Target::default()
        });
    }
    if w.contains("://") {
        return Err(invalid("only http:// and https:// URLs can be probed"));
    }
    if let Ok(ip) = w
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        return Ok(Target {
            address: Some(ip.to_string()),
            ..Target::default()
        });
    }
    if let Some((host, port)) = w.rsplit_once(':')
        && !host.is_empty()
        && (host.starts_with('[') || !host.contains(':'))
    {
        port.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| invalid("the port after ':' must be 1 to 65535"))?;
        return Ok(Target {
            host_port: Some(w.to_owned()),
            ..Target::default()
        });
    }
    Ok(Target {
        hostname: Some(w.to_owned()),
        ..Target::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_word_becomes_one_kind_of_target() {
        assert_eq!(parse("peers").unwrap().peers.unwrap().per_node, 3);
        assert_eq!(parse("peers:5").unwrap().peers.unwrap().per_node, 5);
        assert_eq!(parse("apiserver").unwrap().api_server, Some(true));
        assert_eq!(parse("metadata").unwrap().metadata_service, Some(true));
        assert_eq!(
            parse("10.0.0.1").unwrap().address.as_deref(),
            Some("10.0.0.1")
        );
        assert_eq!(
            parse("[fd00::1]").unwrap().address.as_deref(),
            Some("fd00::1")
        );
        assert_eq!(
            parse("db.internal:5432").unwrap().host_port.as_deref(),
            Some("db.internal:5432")
        );
        assert_eq!(
            parse("[fd00::1]:443").unwrap().host_port.as_deref(),
            Some("[fd00::1]:443")
        );
        assert_eq!(
            parse("https://x.example/").unwrap().url.as_deref(),
            Some("https://x.example/")
        );
        assert_eq!(
            parse("example.com").unwrap().hostname.as_deref(),
            Some("example.com")
        );
    }

    #[test]
    fn bad_words_say_why() {
        for (bad, needle) in [
            ("peers:0", "peers:N"),
            ("ftp://x", "only http"),
            ("host:99999", "1 to 65535"),
            (" ", "empty"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
