//! Load average and CPU busy time, from `/proc/loadavg` and `/proc/stat`.

use std::path::Path;

use super::{CollectError, Measurement, Unit, read};

/// Cumulative CPU time counters (in USER_HZ ticks) summed over all CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

/// What `/proc/stat` tells the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub cpu: CpuTimes,
    /// Online CPUs (the `cpuN` lines).
    pub cpus: u32,
    /// Boot time, seconds since the Unix epoch.
    pub btime: i64,
}

/// Parses `/proc/loadavg` into the 1, 5 and 15 minute averages.
pub fn parse_loadavg(text: &str) -> Result<[f64; 3], CollectError> {
    let mut fields = text.split_whitespace();
    let mut out = [0.0; 3];
    for (i, slot) in out.iter_mut().enumerate() {
        let field = fields.next().ok_or_else(|| {
            CollectError::parse("/proc/loadavg", format!("field {} missing", i + 1))
        })?;
        *slot = field.parse().map_err(|_| {
            CollectError::parse("/proc/loadavg", format!("{field:?} is not a number"))
        })?;
    }
    Ok(out)
}

/// Parses `/proc/stat`: the aggregate `cpu` line, the number of `cpuN` lines and `btime`.
pub fn parse_stat(text: &str) -> Result<ProcStat, CollectError> {
    let mut cpu = None;
    let mut cpus = 0;
    let mut btime = None;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        match fields.next() {
            Some("cpu") => {
                let ticks: Vec<u64> = fields
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .map_err(|_| CollectError::parse("/proc/stat", "cpu line has a non-number"))?;
                if ticks.len() < 4 {
                    return Err(CollectError::parse(
                        "/proc/stat",
                        "cpu line has fewer than 4 fields",
                    ));
                }
                // user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is
                // already counted in user/nice, so only the first eight are summed.
                let total: u64 = ticks.iter().take(8).sum();
                let idle = ticks[3] + ticks.get(4).copied().unwrap_or(0);
                cpu = Some(CpuTimes {
                    busy: total - idle,
                    total,
                });
            }
            Some(name) if name.starts_with("cpu") => cpus += 1,
            Some("btime") => {
                btime = fields.next().and_then(|v| v.parse().ok());
            }
            _ => {}
        }
    }
    Ok(ProcStat {
        cpu: cpu.ok_or_else(|| CollectError::parse("/proc/stat", "no cpu line"))?,
        cpus,
        btime: btime.ok_or_else(|| CollectError::parse("/proc/stat", "no btime line"))?,
    })
}

/// Share of CPU time that was busy between two samples; `None` when no time passed.
pub fn busy_percent(before: CpuTimes, after: CpuTimes) -> Option<f64> {
    let total = after.total.checked_sub(before.total)?;
    let busy = after.busy.checked_sub(before.busy)?;
    super::percent(busy as f64, total as f64)
}

/// Reads `/proc/stat`.
pub fn read_stat(proc_root: &Path) -> Result<ProcStat, CollectError> {
    parse_stat(&read(&proc_root.join("stat"))?)
}

/// Load averages divided by the CPU count, so one threshold fits every shape.
pub fn collect_load(proc_root: &Path, cpus: u32) -> Result<Vec<Measurement>, CollectError> {
    let [one, five, fifteen] = parse_loadavg(&read(&proc_root.join("loadavg"))?)?;
    let cpus = f64::from(cpus.max(1));
    Ok(vec![
        Measurement::new("load.avg1_per_cpu", one / cpus, Unit::Ratio),
        Measurement::new("load.avg5_per_cpu", five / cpus, Unit::Ratio),
        Measurement::new("load.avg15_per_cpu", fifteen / cpus, Unit::Ratio),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  39619 2721 5912 27473 335 0 229 903 0 0
cpu0 19578 1603 2828 13829 203 0 79 461 0 0
cpu1 20040 1117 3083 13644 132 0 150 441 0 0
intr 1 2 3
ctxt 123
btime 1795280706
processes 12000
";

    #[test]
    fn parses_stat() {
        let s = parse_stat(STAT).unwrap();
        assert_eq!(s.cpus, 2);
        assert_eq!(s.btime, 1_795_280_706);
        let total = 39619 + 2721 + 5912 + 27473 + 335 + 229 + 903;
        assert_eq!(s.cpu.total, total);
        assert_eq!(s.cpu.busy, total - 27473 - 335);
    }

    #[test]
    fn busy_between_samples() {
        let a = CpuTimes {
            busy: 100,
            total: 1000,
        };
        let b = CpuTimes {
            busy: 150,
            total: 1100,
        };
        assert_eq!(busy_percent(a, b), Some(50.0));
        assert_eq!(busy_percent(a, a), None);
    }

    #[test]
    fn parses_loadavg() {
        assert_eq!(
            parse_loadavg("7.31 3.07 1.21 14/160 12802\n").unwrap(),
            [7.31, 3.07, 1.21]
        );
        assert!(parse_loadavg("7.31 x").is_err());
        assert!(parse_loadavg("").is_err());
    }

    #[test]
    fn stat_without_cpu_line_is_an_error() {
        assert!(parse_stat("btime 1\n").is_err());
    }
}
