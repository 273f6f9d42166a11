//! Diagnostics bundles: the part names, the size and node limits, and the checks on them, written
//! once for the `NodeDiagnostic` CRD, the tuning ConfigMap, the controller and the agent.

use std::fmt;

/// Every part an agent can put in a bundle, in the order it gathers them. A request naming none
/// gathers all.
pub const PARTS: &[&str] = &[
    "report",
    "kernel-log",
    "journal",
    "network",
    "nodekeeper-network",
    "sysctl",
    "sockets",
    "disk",
    "oca",
    "gpu",
    "node-files",
];

/// Default cap on a bundle's uncompressed content.
pub const DEFAULT_MAX_BUNDLE_BYTES: u64 = 32 * 1024 * 1024;
/// Smallest accepted bundle cap: room for the manifest and a little of each part.
pub const MIN_BUNDLE_BYTES: u64 = 64 * 1024;
/// Largest accepted bundle cap: the controller keeps bundles on its own disk, not in memory, but
/// a node's troubleshooting data is still expected to be megabytes, not gigabytes.
pub const MAX_BUNDLE_BYTES: u64 = 512 * 1024 * 1024;
/// Default cap on one part's uncompressed size.
pub const DEFAULT_MAX_PART_BYTES: u64 = 4 * 1024 * 1024;
/// Default time cap of one part.
pub const DEFAULT_PART_TIMEOUT_MS: u32 = 10_000;
/// A `NodeDiagnostic` names at most this many nodes (directly or through its selector); a selector
/// matching more is refused, not cut, so the user chooses which nodes.
pub const MAX_NODES: usize = 50;

/// A part name that is not in [`PARTS`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPart(pub String);

impl fmt::Display for UnknownPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown part {:?}; known parts are {}",
            self.0,
            PARTS.join(", ")
        )
    }
}

/// Checks every name is a known part; returns the first unknown one.
pub fn check_parts<S: AsRef<str>>(parts: &[S]) -> Result<(), UnknownPart> {
    match parts.iter().find(|p| !PARTS.contains(&p.as_ref())) {
        Some(p) => Err(UnknownPart(p.as_ref().to_owned())),
        None => Ok(()),
    }
}

/// The parts to gather: `asked` in [`PARTS`] order without repeats, or all when empty.
pub fn select_parts<S: AsRef<str>>(asked: &[S]) -> Result<Vec<&'static str>, UnknownPart> {
    check_parts(asked)?;
    Ok(PARTS
        .iter()
        .copied()
        .filter(|p| asked.is_empty() || asked.iter().any(|a| a.as_ref() == *p))
        .collect())
}

/// Checks a bundle cap against [`MIN_BUNDLE_BYTES`]..=[`MAX_BUNDLE_BYTES`].
pub fn check_bundle_bytes(bytes: u64) -> Result<(), String> {
    if (MIN_BUNDLE_BYTES..=MAX_BUNDLE_BYTES).contains(&bytes) {
        Ok(())
    } else {
        Err(format!(
            "{bytes} is out of range; use a byte count from {MIN_BUNDLE_BYTES} to {MAX_BUNDLE_BYTES}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_in_gathering_order_and_all_when_empty() {
        assert_eq!(select_parts::<&str>(&[]).unwrap().len(), PARTS.len());
        assert_eq!(
            select_parts(&["sysctl", "report", "sysctl"]).unwrap(),
            vec!["report", "sysctl"]
        );
    }

    #[test]
    fn unknown_part_is_named() {
        let err = select_parts(&["report", "dmesg"]).unwrap_err();
        assert_eq!(err.0, "dmesg");
        assert!(err.to_string().contains("known parts are report,"), "{err}");
    }

    #[test]
    fn bundle_cap_range() {
        assert!(check_bundle_bytes(DEFAULT_MAX_BUNDLE_BYTES).is_ok());
        assert!(check_bundle_bytes(1).unwrap_err().contains("out of range"));
        assert!(check_bundle_bytes(MAX_BUNDLE_BYTES + 1).is_err());
    }
}
