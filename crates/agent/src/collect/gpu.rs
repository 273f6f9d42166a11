//! GPU state from `nvidia-smi --query-gpu … --format=csv,noheader,nounits`. A node without the
//! tool, or where the tool finds no device, has no GPU: that is a normal answer, not an error.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::CollectError;

/// The fields asked of `nvidia-smi`, in the order the parser expects them.
pub const QUERY: &str = "index,uuid,name,memory.total,memory.used,temperature.gpu,utilization.gpu,ecc.errors.uncorrected.volatile.total";

/// How long `nvidia-smi` may take before it is killed and the collector reports a failure.
const TIMEOUT: Duration = Duration::from_secs(15);

/// One GPU's reading; fields the tool reports as `[N/A]` or `[Not Supported]` are zero.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub temperature_c: f64,
    pub utilization_percent: f64,
    pub ecc_uncorrected: u64,
}

/// What the GPU collector found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuReading {
    pub present: bool,
    /// `nvidia-smi`, or empty when no tool is installed.
    pub source: String,
    /// Set when the tool exists but failed.
    pub error: String,
    pub gpus: Vec<Gpu>,
}

fn field<'a>(
    line: usize,
    name: &str,
    value: Option<&'a str>,
) -> Result<Option<&'a str>, CollectError> {
    let value = value
        .ok_or_else(|| {
            CollectError::parse("nvidia-smi output", format!("line {line}: no {name} field"))
        })?
        .trim();
    // nvidia-smi's words for "this GPU does not report that".
    Ok(match value {
        "" | "[N/A]" | "N/A" | "[Not Supported]" | "Not Supported" | "[Unknown Error]" => None,
        v => Some(v),
    })
}

fn number<T: std::str::FromStr + Default>(
    line: usize,
    name: &str,
    value: Option<&str>,
) -> Result<T, CollectError> {
    match field(line, name, value)? {
        None => Ok(T::default()),
        Some(v) => v.parse().map_err(|_| {
            CollectError::parse(
                "nvidia-smi output",
                format!("line {line}: {name} {v:?} is not a number"),
            )
        }),
    }
}

/// Parses the CSV lines of [`QUERY`].
pub fn parse_csv(text: &str) -> Result<Vec<Gpu>, CollectError> {
    let mut gpus = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let n = i + 1;
        let mut f = line.split(',');
        gpus.push(Gpu {
            index: number(n, "index", f.next())?,
            uuid: field(n, "uuid", f.next())?.unwrap_or_default().to_string(),
            model: field(n, "name", f.next())?.unwrap_or_default().to_string(),
            memory_total_mib: number(n, "memory.total", f.next())?,
            memory_used_mib: number(n, "memory.used", f.next())?,
            temperature_c: number(n, "temperature.gpu", f.next())?,
            utilization_percent: number(n, "utilization.gpu", f.next())?,
            ecc_uncorrected: number(n, "ecc.errors.uncorrected.volatile.total", f.next())?,
        });
        if f.next().is_some() {
            return Err(CollectError::parse(
                "nvidia-smi output",
                format!("line {n}: more fields than asked for"),
            ));
        }
    }
    Ok(gpus)
}

/// Finds the program: a path is used as given, a bare name is looked up on PATH.
pub(crate) fn locate(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|candidate| candidate.is_file())
    })
}

/// Runs the tool and interprets the outcome. Failures land in `error`; this never fails.
pub async fn collect(program: &Path) -> GpuReading {
    let Some(path) = locate(program) else {
        return GpuReading::default();
    };
    let reading = |error: String, gpus: Vec<Gpu>| GpuReading {
        present: !gpus.is_empty(),
        source: "nvidia-smi".into(),
        error,
        gpus,
    };
    let child = tokio::process::Command::new(&path)
        .arg(format!("--query-gpu={QUERY}"))
        .arg("--format=csv,noheader,nounits")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = match tokio::time::timeout(TIMEOUT, child).await {
        Err(_) => {
            return reading(
                format!("{} did not answer within {TIMEOUT:?}", path.display()),
                vec![],
            );
        }
        Ok(Err(e)) => return reading(format!("run {}: {e}", path.display()), vec![]),
        Ok(Ok(output)) => output,
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    if stdout.contains("No devices were found") {
        return GpuReading {
            source: "nvidia-smi".into(),
            ..GpuReading::default()
        };
    }
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let said = stderr
            .lines()
            .chain(stdout.lines())
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return reading(
            format!("{} exited with {}: {said}", path.display(), output.status),
            vec![],
        );
    }
    match parse_csv(&stdout) {
        Ok(gpus) => reading(String::new(), gpus),
        Err(e) => reading(e.to_string(), vec![]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const TWO_GPUS: &str = "\
0, GPU-5a1c8c1e-0001-4e2a-9d43-8d2f6c1b7a10, NVIDIA A10, 23028, 1024, 41, 17, 0
1, GPU-5a1c8c1e-0002-4e2a-9d43-8d2f6c1b7a11, NVIDIA A10, 23028, [N/A], 88, [Not Supported], 3
";

    #[test]
    fn parses_fixture() {
        let gpus = parse_csv(TWO_GPUS).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].model, "NVIDIA A10");
        assert_eq!(gpus[0].memory_total_mib, 23028);
        assert_eq!(gpus[0].utilization_percent, 17.0);
        assert_eq!(gpus[1].memory_used_mib, 0);
        assert_eq!(gpus[1].utilization_percent, 0.0);
        assert_eq!(gpus[1].ecc_uncorrected, 3);
        assert_eq!(gpus[1].temperature_c, 88.0);
    }

    #[test]
    fn rejects_garbage() {
        assert!(
            parse_csv("0, GPU-x, A10, lots, 1, 1, 1, 0")
                .unwrap_err()
                .to_string()
                .contains("memory.total")
        );
        assert!(parse_csv("0, GPU-x").is_err());
        assert!(parse_csv("0, GPU-x, A10, 1, 1, 1, 1, 0, extra").is_err());
        assert!(parse_csv("").unwrap().is_empty());
    }

    #[tokio::test]
    async fn absent_tool_means_no_gpu() {
        let r = collect(Path::new("/nonexistent/nvidia-smi")).await;
        assert_eq!(r, GpuReading::default());
        let r = collect(Path::new("nodekeeper-no-such-nvidia-smi")).await;
        assert!(!r.present && r.error.is_empty());
    }

    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("nvidia-smi");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn runs_a_fake_tool() {
        let dir = tempfile::tempdir().unwrap();
        // The fake checks that it was asked for exactly the fields the parser expects.
        let path = script(
            dir.path(),
            &format!(
                "[ \"$1\" = \"--query-gpu={QUERY}\" ] || {{ echo bad query >&2; exit 2; }}\ncat <<'X'\n{TWO_GPUS}X"
            ),
        );
        let r = collect(&path).await;
        assert!(r.present, "{r:?}");
        assert_eq!(r.source, "nvidia-smi");
        assert_eq!(r.error, "");
        assert_eq!(r.gpus.len(), 2);

        let path = script(
            dir.path(),
            "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
        );
        let r = collect(&path).await;
        assert!(!r.present);
        assert!(r.error.contains("could not communicate"), "{r:?}");

        let path = script(dir.path(), "echo 'No devices were found'; exit 6");
        let r = collect(&path).await;
        assert!(!r.present && r.error.is_empty(), "{r:?}");
    }
}
