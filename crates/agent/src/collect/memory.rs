//! Memory use and pressure stall information, from `/proc/meminfo` and `/proc/pressure/*`.

use std::path::Path;

use super::{CollectError, Measurement, Unit, read};

/// The `/proc/meminfo` figures the agent uses, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

/// One PSI file's 60-second averages (percent of wall time stalled).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Psi {
    pub some_avg60: f64,
    /// Absent for `cpu` on older kernels.
    pub full_avg60: Option<f64>,
}

/// Parses `/proc/meminfo` (`MemTotal`, `MemAvailable`, in kB).
pub fn parse_meminfo(text: &str) -> Result<MemInfo, CollectError> {
    let field = |key: &str| -> Result<u64, CollectError> {
        let line = text
            .lines()
            .find(|l| l.split(':').next() == Some(key))
            .ok_or_else(|| CollectError::parse("/proc/meminfo", format!("no {key} line")))?;
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                CollectError::parse("/proc/meminfo", format!("{key} is not a number"))
            })?;
        Ok(kb * 1024)
    };
    Ok(MemInfo {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
    })
}

/// Parses a `/proc/pressure/<resource>` file.
pub fn parse_psi(what: &str, text: &str) -> Result<Psi, CollectError> {
    let avg60 = |kind: &str| -> Result<Option<f64>, CollectError> {
        let Some(line) = text.lines().find(|l| l.starts_with(kind)) else {
            return Ok(None);
        };
        let value = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("avg60="))
            .ok_or_else(|| CollectError::parse(what, format!("{kind} line has no avg60")))?;
        value
            .parse()
            .map(Some)
            .map_err(|_| CollectError::parse(what, format!("avg60={value} is not a number")))
    };
    Ok(Psi {
        some_avg60: avg60("some ")?.ok_or_else(|| CollectError::parse(what, "no `some` line"))?,
        full_avg60: avg60("full ")?,
    })
}

/// `memory.available_percent` and the memory facts for `SystemInfo`.
pub fn collect_memory(proc_root: &Path) -> Result<(MemInfo, Vec<Measurement>), CollectError> {
    let info = parse_meminfo(&read(&proc_root.join("meminfo"))?)?;
    let available = super::percent(info.available as f64, info.total as f64)
        .ok_or_else(|| CollectError::parse("/proc/meminfo", "MemTotal is 0"))?;
    Ok((
        info,
        vec![Measurement::new(
            "memory.available_percent",
            available,
            Unit::Percent,
        )],
    ))
}

/// `psi.<resource>.some_avg60` and `.full_avg60` for cpu, memory and io. The kernel reports a
/// meaningless `full` line for cpu at the system level, so it is left out.
pub fn collect_psi(proc_root: &Path, resource: &str) -> Result<Vec<Measurement>, CollectError> {
    let path = proc_root.join("pressure").join(resource);
    let psi = parse_psi(&path.display().to_string(), &read(&path)?)?;
    let mut out = vec![Measurement::new(
        format!("psi.{resource}.some_avg60"),
        psi.some_avg60,
        Unit::Percent,
    )];
    if let (Some(full), true) = (psi.full_avg60, resource != "cpu") {
        out.push(Measurement::new(
            format!("psi.{resource}.full_avg60"),
            full,
            Unit::Percent,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo() {
        let m = parse_meminfo(
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n",
        )
        .unwrap();
        assert_eq!(m.total, 24_000_000 * 1024);
        assert_eq!(m.available, 12_000_000 * 1024);
        assert!(
            parse_meminfo("MemTotal: 1 kB\n")
                .unwrap_err()
                .to_string()
                .contains("MemAvailable")
        );
    }

    #[test]
    fn parses_psi() {
        let p = parse_psi(
            "memory",
            "some avg10=1.50 avg60=2.25 avg300=0.10 total=123\nfull avg10=0.00 avg60=0.75 avg300=0.00 total=4\n",
        )
        .unwrap();
        assert_eq!(p.some_avg60, 2.25);
        assert_eq!(p.full_avg60, Some(0.75));
        let cpu = parse_psi("cpu", "some avg10=0.00 avg60=9.00 avg300=0.00 total=0\n").unwrap();
        assert_eq!(cpu.full_avg60, None);
        assert!(parse_psi("io", "some avg10=1\n").is_err());
        assert!(parse_psi("io", "").is_err());
    }
}
