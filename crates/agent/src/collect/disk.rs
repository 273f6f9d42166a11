//! Disk space and inode use of the configured host mounts, through statvfs(2).

use std::path::Path;
use std::time::Duration;

use nix::sys::statvfs::statvfs;

use super::{CollectError, Measurement, Unit};

/// The statvfs figures the agent uses, in filesystem blocks and inodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsUsage {
    pub blocks: u64,
    pub blocks_free: u64,
    /// Free blocks available to unprivileged users (what `df` counts as available).
    pub blocks_available: u64,
    pub files: u64,
    pub files_free: u64,
}

/// `disk.<mount>.used_percent` (as `df` computes it: used / (used + available), so the root
/// reserve counts as used) and `disk.<mount>.inodes_used_percent` (left out on filesystems that
/// report no inode count, such as btrfs).
pub fn measurements(mount: &str, usage: FsUsage) -> Vec<Measurement> {
    let mut out = Vec::with_capacity(2);
    let used = usage.blocks.saturating_sub(usage.blocks_free);
    if let Some(p) = super::percent(used as f64, (used + usage.blocks_available) as f64) {
        out.push(Measurement::new(
            format!("disk.{mount}.used_percent"),
            p,
            Unit::Percent,
        ));
    }
    let inodes_used = usage.files.saturating_sub(usage.files_free);
    if let Some(p) = super::percent(inodes_used as f64, usage.files as f64) {
        out.push(Measurement::new(
            format!("disk.{mount}.inodes_used_percent"),
            p,
            Unit::Percent,
        ));
    }
    out
}

/// Longest wait for one mount's statvfs: a stale NFS (or hung FUSE) mount blocks it in the
/// kernel, and the report call (10 s by default) must still answer.
const STATVFS_WAIT: Duration = Duration::from_secs(2);

/// [`collect`] off the runtime thread, bounded by [`STATVFS_WAIT`]; a mount whose statvfs is
/// still blocked is reported as timed out without another try until it returns.
pub async fn collect_bounded(mount: &str, path: &Path) -> Result<Vec<Measurement>, CollectError> {
    let (m, p) = (mount.to_owned(), path.to_path_buf());
    super::bounded(
        &format!("statvfs:{}", path.display()),
        &format!("statvfs {}", path.display()),
        STATVFS_WAIT,
        move || collect(&m, &p),
    )
    .await
}

/// statvfs(2) of `path` off the runtime thread, bounded by [`STATVFS_WAIT`] under the same key
/// as [`collect_bounded`]: a mount the report found blocked is not tried again by a
/// diagnostics bundle, and the other way round.
pub async fn statvfs_bounded(path: &Path) -> Result<nix::sys::statvfs::Statvfs, CollectError> {
    let p = path.to_path_buf();
    super::bounded(
        &format!("statvfs:{}", path.display()),
        &format!("statvfs {}", path.display()),
        STATVFS_WAIT,
        move || statvfs(&p).map_err(|source| CollectError::Statvfs { path: p, source }),
    )
    .await
}

/// Measures one mount; `path` is where the agent sees it, `mount` the host path it reports.
pub fn collect(mount: &str, path: &Path) -> Result<Vec<Measurement>, CollectError> {
    let s = statvfs(path).map_err(|source| CollectError::Statvfs {
        path: path.to_path_buf(),
        source,
    })?;
    #[allow(clippy::useless_conversion)] // the field types differ between libc targets
    let usage = FsUsage {
        blocks: u64::from(s.blocks()),
        blocks_free: u64::from(s.blocks_free()),
        blocks_available: u64::from(s.blocks_available()),
        files: u64::from(s.files()),
        files_free: u64::from(s.files_free()),
    };
    Ok(measurements(mount, usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn computes_like_df() {
        let m = measurements(
            "/var/lib",
            FsUsage {
                blocks: 1000,
                blocks_free: 150,
                blocks_available: 100,
                files: 200,
                files_free: 50,
            },
        );
        assert_eq!(m[0].name, "disk./var/lib.used_percent");
        assert!((m[0].value - 850.0 / 950.0 * 100.0).abs() < 1e-9);
        assert_eq!(m[1].name, "disk./var/lib.inodes_used_percent");
        assert_eq!(m[1].value, 75.0);
    }

    #[test]
    fn no_inode_figure_without_inodes() {
        let m = measurements(
            "/",
            FsUsage {
                blocks: 10,
                blocks_free: 5,
                blocks_available: 5,
                files: 0,
                files_free: 0,
            },
        );
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn measures_a_real_directory() {
        let dir = tempfile::tempdir().unwrap();
        let m = collect("/tmp", dir.path()).unwrap();
        assert!(m[0].value >= 0.0 && m[0].value <= 100.0);
        assert!(collect("/nope", Path::new("/nonexistent/nodekeeper")).is_err());
    }

    #[tokio::test]
    async fn measures_off_the_runtime_thread() {
        let dir = tempfile::tempdir().unwrap();
        let m = collect_bounded("/tmp", dir.path()).await.unwrap();
        assert!(m[0].value >= 0.0 && m[0].value <= 100.0);
        let e = collect_bounded("/nope", Path::new("/nonexistent/nodekeeper")).await;
        assert!(matches!(e, Err(CollectError::Statvfs { .. })), "{e:?}");
        let s = statvfs_bounded(dir.path()).await.unwrap();
        assert!(s.blocks() > 0);
        let e = statvfs_bounded(Path::new("/nonexistent/nodekeeper")).await;
        assert!(matches!(e, Err(CollectError::Statvfs { .. })), "{e:?}");
    }
}
