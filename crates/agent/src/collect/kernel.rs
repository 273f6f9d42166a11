//! Kernel facts and kernel-table use: release, boot id, conntrack entries vs max, and open file
//! handles vs max, all read from procfs.

use std::path::Path;

use super::{CollectError, Measurement, Unit, read};

/// `kernel.osrelease` and `kernel.random.boot_id`.
pub fn release_and_boot_id(proc_root: &Path) -> Result<(String, String), CollectError> {
    let release = read(&proc_root.join("sys/kernel/osrelease"))?
        .trim()
        .to_string();
    let boot_id = read(&proc_root.join("sys/kernel/random/boot_id"))?
        .trim()
        .to_string();
    Ok((release, boot_id))
}

/// Parses `/proc/sys/fs/file-nr` (allocated, free, max) into (in use, max).
pub fn parse_file_nr(text: &str) -> Result<(u64, u64), CollectError> {
    let f: Vec<u64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| {
            CollectError::parse(
                "fs/file-nr",
                format!("{:?} is not three numbers", text.trim()),
            )
        })?;
    match f[..] {
        [allocated, free, max] => Ok((allocated.saturating_sub(free), max)),
        _ => Err(CollectError::parse(
            "fs/file-nr",
            format!("{:?} is not three numbers", text.trim()),
        )),
    }
}

/// `files.used_percent`: open file handles against `fs.file-max`.
pub fn collect_files(proc_root: &Path) -> Result<Vec<Measurement>, CollectError> {
    let (used, max) = parse_file_nr(&read(&proc_root.join("sys/fs/file-nr"))?)?;
    Ok(super::percent(used as f64, max as f64)
        .map(|p| Measurement::new("files.used_percent", p, Unit::Percent))
        .into_iter()
        .collect())
}

fn parse_count(what: &str, text: &str) -> Result<u64, CollectError> {
    text.trim()
        .parse()
        .map_err(|_| CollectError::parse(what, format!("{:?} is not a number", text.trim())))
}

/// `conntrack.used_percent`. Without the nf_conntrack module there is no table to fill, so no
/// figure and no error. The files are per network namespace: with hostNetwork they are the host's.
pub fn collect_conntrack(proc_root: &Path) -> Result<Vec<Measurement>, CollectError> {
    let count_path = proc_root.join("sys/net/netfilter/nf_conntrack_count");
    if !count_path.exists() {
        return Ok(Vec::new());
    }
    let count = parse_count("nf_conntrack_count", &read(&count_path)?)?;
    let max = parse_count(
        "nf_conntrack_max",
        &read(&proc_root.join("sys/net/netfilter/nf_conntrack_max"))?,
    )?;
    Ok(super::percent(count as f64, max as f64)
        .map(|p| Measurement::new("conntrack.used_percent", p, Unit::Percent))
        .into_iter()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_nr() {
        assert_eq!(
            parse_file_nr("1322\t0\t2465610\n").unwrap(),
            (1322, 2_465_610)
        );
        assert!(parse_file_nr("1 2").is_err());
        assert!(parse_file_nr("a b c").is_err());
    }

    #[test]
    fn conntrack_from_a_fake_proc() {
        let dir = tempfile::tempdir().unwrap();
        assert!(collect_conntrack(dir.path()).unwrap().is_empty());
        let nf = dir.path().join("sys/net/netfilter");
        std::fs::create_dir_all(&nf).unwrap();
        std::fs::write(nf.join("nf_conntrack_count"), "750\n").unwrap();
        std::fs::write(nf.join("nf_conntrack_max"), "1000\n").unwrap();
        let m = collect_conntrack(dir.path()).unwrap();
        assert_eq!(m[0].name, "conntrack.used_percent");
        assert_eq!(m[0].value, 75.0);
        std::fs::write(nf.join("nf_conntrack_max"), "lots\n").unwrap();
        assert!(collect_conntrack(dir.path()).is_err());
    }
}
