//! Oracle Cloud Agent plugin state, read from a directory of JSON files (one per plugin).
//!
//! The format is nodekeeper's own (see the crate README): Oracle Cloud Agent keeps its plugin
//! state internally, so a small exporter on the node, or the image build, writes one file per
//! plugin named `<anything>.json`:
//!
//! ```json
//! { "name": "Compute Instance Monitoring", "state": "RUNNING",
//!   "message": "", "updatedAt": "2026-11-21T17:00:00Z" }
//! ```
//!
//! `name` and `state` are required; `message` and `updatedAt` are optional; unknown fields are
//! ignored. Only regular files directly in the directory are read: symbolic links, files over
//! 64 KiB and more than 256 files are refused, so the directory cannot point the agent elsewhere.

use std::path::Path;

use serde::Deserialize;

use nodekeeper_model::indicators::Verdict;

/// Largest plugin file read.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// Most plugin files read.
pub const MAX_FILES: usize = 256;

/// One plugin as written by the exporter.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PluginFile {
    pub name: String,
    pub state: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub updated_at: Option<String>,
}

/// One plugin with its verdict.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plugin {
    pub name: String,
    pub state: String,
    pub message: String,
    pub verdict: Verdict,
}

/// Judges a plugin's state word. A disabled plugin was turned off on purpose, so it is fine;
/// a stopped one may be restarting; invalid or failed ones need attention.
pub fn judge(state: &str) -> (Verdict, Option<String>) {
    match state.to_ascii_uppercase().as_str() {
        "RUNNING" | "DISABLED" => (Verdict::Ok, None),
        "STOPPED" | "STARTING" | "STOPPING" => {
            (Verdict::Warning, Some(format!("plugin is {state}")))
        }
        "INVALID" | "FAILED" | "ERROR" | "CRASHED" => {
            (Verdict::Critical, Some(format!("plugin is {state}")))
        }
        _ => (
            Verdict::Warning,
            Some(format!("unknown plugin state {state:?}")),
        ),
    }
}

/// Parses one plugin file.
pub fn parse(text: &str) -> Result<Plugin, String> {
    let file: PluginFile =
        serde_json::from_str(text).map_err(|e| format!("not a plugin state object: {e}"))?;
    if file.name.trim().is_empty() {
        return Err("field `name` is empty".into());
    }
    if file.state.trim().is_empty() {
        return Err("field `state` is empty".into());
    }
    let (verdict, why) = judge(file.state.trim());
    let message = match (why, file.message.trim()) {
        (None, m) => m.to_string(),
        (Some(w), "") => w,
        (Some(w), m) => format!("{w}: {m}"),
    };
    Ok(Plugin {
        name: file.name.trim().to_string(),
        state: file.state.trim().to_string(),
        message,
        verdict,
    })
}

/// Per-file failures: (file name, reason).
pub type FileErrors = Vec<(String, String)>;

/// Reads the directory: plugins sorted by name, and per-file failures.
pub fn collect(dir: &Path) -> Result<(Vec<Plugin>, FileErrors), std::io::Error> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .collect();
    entries.sort_by_key(std::fs::DirEntry::file_name);
    let mut plugins = Vec::new();
    let mut errors = Vec::new();
    if entries.len() > MAX_FILES {
        errors.push((
            dir.display().to_string(),
            format!(
                "{} plugin files; only the first {MAX_FILES} are read",
                entries.len()
            ),
        ));
        entries.truncate(MAX_FILES);
    }
    for entry in entries {
        let file = entry.file_name().to_string_lossy().into_owned();
        let outcome = (|| {
            // symlink_metadata: a link is refused rather than followed.
            let meta = std::fs::symlink_metadata(entry.path()).map_err(|e| e.to_string())?;
            if !meta.file_type().is_file() {
                return Err("not a regular file (symbolic links are not followed)".to_string());
            }
            if meta.len() > MAX_FILE_BYTES {
                return Err(format!(
                    "{} bytes; at most {MAX_FILE_BYTES} are read",
                    meta.len()
                ));
            }
            parse(&std::fs::read_to_string(entry.path()).map_err(|e| e.to_string())?)
        })();
        match outcome {
            Ok(p) => plugins.push(p),
            Err(e) => errors.push((file, e)),
        }
    }
    plugins.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((plugins, errors))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oca")
    }

    #[test]
    fn reads_shipped_fixtures() {
        let (plugins, errors) = collect(&fixtures()).unwrap();
        let names: Vec<_> = plugins
            .iter()
            .map(|p| (p.name.as_str(), p.verdict))
            .collect();
        assert_eq!(
            names,
            vec![
                ("Compute Instance Monitoring", Verdict::Ok),
                ("Compute Instance Run Command", Verdict::Ok),
                ("Custom Logs Monitoring", Verdict::Warning),
                ("OS Management Service Agent", Verdict::Critical),
            ]
        );
        assert_eq!(
            plugins[3].message,
            "plugin is INVALID: unable to reach the service endpoint"
        );
        // The fixture set includes one broken file, reported by name, not failing the rest.
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, "zz-broken.json");
        assert!(errors[0].1.contains("state"), "{errors:?}");
    }

    #[test]
    fn refuses_links_and_large_files() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("link.json")).unwrap();
        std::fs::write(
            dir.path().join("big.json"),
            vec![b' '; MAX_FILE_BYTES as usize + 1],
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let (plugins, errors) = collect(dir.path()).unwrap();
        assert!(plugins.is_empty());
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors
                .iter()
                .any(|(f, e)| f == "link.json" && e.contains("symbolic"))
        );
        assert!(
            errors
                .iter()
                .any(|(f, e)| f == "big.json" && e.contains("bytes"))
        );
    }

    #[test]
    fn judges_states() {
        assert_eq!(judge("RUNNING").0, Verdict::Ok);
        assert_eq!(judge("disabled").0, Verdict::Ok);
        assert_eq!(judge("STOPPED").0, Verdict::Warning);
        assert_eq!(judge("INVALID").0, Verdict::Critical);
        assert_eq!(judge("SLEEPING").0, Verdict::Warning);
        assert!(
            parse(r#"{"name":"","state":"RUNNING"}"#)
                .unwrap_err()
                .contains("name")
        );
        assert!(parse("[]").is_err());
    }
}
