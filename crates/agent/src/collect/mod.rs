//! Node collectors: one module per source, each a function returning plain data or a
//! [`CollectError`], with the text parsing split out so it can be tested on fixture text.

pub mod disk;
pub mod gpu;
pub mod interfaces;
pub mod kernel;
pub mod load;
pub mod memory;
pub mod nvml;
pub mod nvsmi;
pub mod oca;
pub mod time;

use std::io;
use std::path::{Path, PathBuf};

/// Why one collector could not produce its figures. It is reported in the node report under
/// the collector's name; it never fails the call.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error("read {path}: {source}")]
    ReadFile { path: PathBuf, source: io::Error },
    #[error("parse {what}: {reason}")]
    Parse { what: String, reason: String },
    #[error("statvfs {path}: {source}")]
    Statvfs { path: PathBuf, source: nix::Error },
    #[error("adjtimex: {0}")]
    Adjtimex(io::Error),
    #[error("dump links and addresses over netlink: {0}")]
    Netlink(String),
    #[error("run {program}: {reason}")]
    RunCommand { program: String, reason: String },
}

impl CollectError {
    pub(crate) fn parse(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Parse {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// Unit of a measured value, as named in the proto's `Indicator.unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Percent,
    Ratio,
    Seconds,
    Bool,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Percent => "percent",
            Unit::Ratio => "ratio",
            Unit::Seconds => "seconds",
            Unit::Bool => "bool",
        }
    }
}

/// One raw figure before thresholds are applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub name: String,
    pub value: f64,
    pub unit: Unit,
}

impl Measurement {
    pub fn new(name: impl Into<String>, value: f64, unit: Unit) -> Self {
        Self {
            name: name.into(),
            value,
            unit,
        }
    }
}

/// Reads a small procfs/sysfs file whole.
pub(crate) fn read(path: &Path) -> Result<String, CollectError> {
    std::fs::read_to_string(path).map_err(|source| CollectError::ReadFile {
        path: path.to_path_buf(),
        source,
    })
}

/// Percentage of `part` in `whole`; `None` when `whole` is zero (nothing to measure against).
pub(crate) fn percent(part: f64, whole: f64) -> Option<f64> {
    (whole > 0.0).then(|| part / whole * 100.0)
}
