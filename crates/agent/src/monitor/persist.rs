//! The kernel-log monitor's `True` conditions kept in the agent's state directory, keyed by the
//! boot id, so that an agent restart does not rewrite a real problem healthy: a filesystem
//! remounted read-only or a hung task stays so until the node reboots, while the log lines that
//! showed it fall out of the lookback window a restarted reader reads. On another boot the file
//! is ignored (and replaced at the next save).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::state::{ConditionStatus, ProblemState};

/// The file's name in the state directory.
pub const FILE_NAME: &str = "monitor-conditions.json";
/// Files larger than this are not read (a few conditions take a few KiB).
const MAX_FILE_BYTES: u64 = 256 * 1024;

/// Where the conditions are kept and for which boot.
#[derive(Clone, Debug)]
pub struct Persist {
    /// `<state dir>/monitor-conditions.json`.
    pub path: PathBuf,
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct File {
    version: u32,
    boot_id: String,
    conditions: Vec<Kept>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Kept {
    #[serde(rename = "type")]
    kind: String,
    reason: String,
    message: String,
    transition_unix_ms: u64,
}

/// The conditions to keep, taken by [`Persist::snapshot`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot(Vec<Kept>);

/// The host's boot id (not namespaced, so the container's `/proc` shows the host's).
pub fn boot_id() -> std::io::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_owned())
}

impl Persist {
    /// In `state_dir`, for the boot now running.
    pub fn new(state_dir: &Path, boot_id: String) -> Persist {
        Persist {
            path: state_dir.join(FILE_NAME),
            boot_id,
        }
    }

    /// Sets the kept conditions among `kinds` `True` again when the file is of this boot.
    /// Returns how many were restored; a missing, unreadable or foreign file restores none.
    pub fn restore(&self, kinds: &[String], state: &mut ProblemState) -> usize {
        let file = match self.read() {
            Ok(Some(f)) => f,
            Ok(None) => return 0,
            Err(error) => {
                tracing::warn!(%error, path = %self.path.display(), "read kept monitor conditions; starting without them");
                return 0;
            }
        };
        if file.boot_id != self.boot_id {
            return 0;
        }
        let mut restored = 0;
        for k in file.conditions.iter().filter(|k| kinds.contains(&k.kind)) {
            let at = SystemTime::UNIX_EPOCH + Duration::from_millis(k.transition_unix_ms);
            if state.restore_condition(&k.kind, &k.reason, &k.message, at) {
                restored += 1;
            }
        }
        restored
    }

    fn read(&self) -> std::io::Result<Option<File>> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if meta.len() > MAX_FILE_BYTES {
            return Err(std::io::Error::other(format!(
                "{} bytes is more than {MAX_FILE_BYTES}",
                meta.len()
            )));
        }
        let bytes = std::fs::read(&self.path)?;
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(std::io::Error::other)
    }

    /// The `True` conditions among `kinds`, as [`Self::save`] writes them; taken under the
    /// state lock, saved after it is released.
    pub fn snapshot(kinds: &[String], state: &ProblemState) -> Snapshot {
        Snapshot(
            kinds
                .iter()
                .filter_map(|kind| state.condition(kind))
                .filter(|c| c.status == ConditionStatus::True)
                .map(|c| Kept {
                    kind: c.kind.clone(),
                    reason: c.reason.clone(),
                    message: c.message.clone(),
                    transition_unix_ms: c
                        .transition
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                })
                .collect(),
        )
    }

    /// Saves a snapshot: written beside the file, synced, renamed over it, the directory synced
    /// (as the tunables' state file is written), so a crash leaves the old file or the new one.
    pub fn save(&self, snapshot: &Snapshot) -> std::io::Result<()> {
        let conditions = snapshot.0.clone();
        let file = File {
            version: 1,
            boot_id: self.boot_id.clone(),
            conditions,
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let bytes = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        let tmp = self.path.with_extension("json.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &self.path)?;
        std::fs::File::open(dir).and_then(|d| d.sync_all())
    }
}
