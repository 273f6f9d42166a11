//! GPU state: NVIDIA's NVML first (loaded at run time, see [`super::nvml`]), `nvidia-smi -q -x`
//! where NVML cannot be loaded (see [`super::nvsmi`]), PCIe AER counts from sysfs, and the
//! judgement of what was read. A node without either source, or where they find no device, has
//! no GPU: a normal answer, not an error — unless the node is expected to have GPUs
//! (`--expected-gpus`), when fewer than expected is a problem (a GPU that fell off the bus is
//! gone from both NVML's and nvidia-smi's lists). A field the source could not read
//! (`[Unknown Error]`, an NVML error, `N/A` where a value is required) makes the GPU's verdict
//! Unknown, never healthy.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nodekeeper_model::indicators::Verdict;

use super::nvml::{self, Answer, NvmlGpu};
use super::nvsmi::{self, Element, Field};

/// How long `nvidia-smi` may take before it is killed and the collector reports a failure.
const TIMEOUT: Duration = Duration::from_secs(15);
/// Largest `nvidia-smi -q -x` answer read (one GPU is about 27 KiB; eight with processes fit).
const MAX_XML_BYTES: usize = 4 << 20;
/// XID codes that mean the hardware (or its driver state) failed, not an application: double-bit
/// ECC (48), internal micro-controller halt/breakpoint (61, 62), row-remapping events (63, 64),
/// NVLink error (74), fallen off the bus (79), high single-bit ECC rate (92), contained and
/// uncontained ECC (94, 95), GSP errors (119, 120), unrecovered ECC (140). NVIDIA's XID catalog
/// (docs.nvidia.com/deploy/xid-errors) lists them as needing a reset or service.
pub const HARDWARE_XIDS: &[u64] = &[48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140];
/// XIDs older than this no longer set the verdict (their count stays in the report).
pub const XID_WINDOW: Duration = Duration::from_secs(3600);
/// Clock-event reasons that mean the GPU is being held down by a fault, not by policy or idling.
/// `hw_slowdown` alone is not one: nvml.h says it "may also be reported during PState or clock
/// change", so it comes and goes on a healthy GPU; with a fault behind it, the thermal or
/// power-brake reason is set beside it. A hot GPU (`sw_thermal_slowdown`) is judged by the
/// temperature threshold instead.
const BAD_THROTTLE: &[&str] = &["hw_thermal_slowdown", "hw_power_brake_slowdown"];

/// Where the GPU facts come from.
#[derive(Clone, Debug)]
pub struct GpuConfig {
    /// The NVML library to load (`libnvidia-ml.so.1`); `None`: NVML is not used.
    pub nvml_library: Option<String>,
    /// The `nvidia-smi` program: a bare name is looked up on PATH.
    pub nvidia_smi: PathBuf,
    /// GPUs this node must have; fewer found is a problem. `None`: any number is fine.
    pub expected: Option<u32>,
    /// `/sys/bus/pci/devices` (PCIe AER counters per GPU).
    pub pci_devices: PathBuf,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            nvml_library: Some("libnvidia-ml.so.1".into()),
            nvidia_smi: "nvidia-smi".into(),
            expected: None,
            pci_devices: "/sys/bus/pci/devices".into(),
        }
    }
}

/// One GPU's reading. Optional fields are `None` where the GPU does not report them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    /// PCI address (`0000:00:06.0`).
    pub bus_id: String,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub temperature_c: f64,
    pub utilization_percent: f64,
    /// Volatile uncorrected ECC errors (since the driver loaded).
    pub ecc_uncorrected: u64,
    /// XID critical errors NVML delivered since the agent started, and the latest code.
    pub xid_events: u64,
    pub last_xid: u64,
    /// When the latest XID arrived.
    pub last_xid_at: Option<SystemTime>,
    /// The latest hardware XID ([`HARDWARE_XIDS`]) and when it arrived: a later application
    /// XID must not hide it.
    pub last_hardware_xid: u64,
    pub last_hardware_xid_at: Option<SystemTime>,
    pub retired_pages_sbe: Option<u64>,
    pub retired_pages_dbe: Option<u64>,
    pub retired_pages_pending: Option<bool>,
    pub remapped_rows_correctable: Option<u64>,
    pub remapped_rows_uncorrectable: Option<u64>,
    pub remapped_rows_pending: Option<bool>,
    pub remapped_rows_failure: Option<bool>,
    /// NVLink links and how many are down; `None` where the source does not say (nvidia-smi -q).
    pub nvlinks: Option<(u32, u32)>,
    pub pcie_link_width: Option<u32>,
    pub pcie_link_width_max: Option<u32>,
    pub pcie_link_gen: Option<u32>,
    pub pcie_link_gen_max: Option<u32>,
    pub pcie_replays: Option<u64>,
    /// PCIe AER totals since boot from sysfs (correctable, non-fatal, fatal).
    pub aer: Option<(u64, u64, u64)>,
    /// Active clock-event (throttle) reasons, by `nvidia-smi`'s names.
    pub throttle_reasons: Vec<String>,
    pub power_draw_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    /// Fields that could not be read; any makes the verdict Unknown (unless worse is known).
    pub unknown_fields: Vec<String>,
    /// The driver lost this GPU (NVML_ERROR_GPU_IS_LOST): it fell off the bus.
    pub lost: bool,
}

/// What the GPU collector found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuReading {
    pub present: bool,
    /// `nvml`, `nvidia-smi`, or empty when neither is on this node.
    pub source: String,
    /// Set when a source exists but failed.
    pub error: String,
    pub gpus: Vec<Gpu>,
    /// `--expected-gpus`.
    pub expected: Option<u32>,
    /// Why XID events are not watched (no event API, not supported): a note beside the
    /// reading (the agent lists it among collector errors), never a failure of the GPUs' own
    /// verdicts. A GPU whose registration failed has `xid_events` among its unknown fields.
    pub xid_error: String,
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

/// What NVML could not answer for one GPU.
#[derive(Default)]
struct Unanswered {
    fields: Vec<String>,
    /// Some field answered `NVML_ERROR_GPU_IS_LOST`: a GPU can fall off the bus after its
    /// handle was had, and then every later call says so.
    lost: bool,
}

/// Records `name` as unreadable and returns the value, if any.
fn take<T>(unknown: &mut Unanswered, name: &str, answer: Answer<T>) -> Option<T> {
    match answer {
        Answer::Value(v) => Some(v),
        Answer::NotSupported => None,
        Answer::Failed(code) => {
            unknown.fields.push(name.to_owned());
            unknown.lost |= code == nvml::ERROR_GPU_IS_LOST;
            None
        }
    }
}

/// Turns NVML's answers into a [`Gpu`]. `xid` is this GPU's XID events.
pub fn from_nvml(n: NvmlGpu, xid: Option<nvml::XidTally>) -> Gpu {
    let mut u = Unanswered::default();
    let (memory_total_mib, memory_used_mib) = take(&mut u, "memory", n.memory).unwrap_or_default();
    let remapped = take(&mut u, "remapped_rows", n.remapped);
    let throttle = take(&mut u, "clocks_event_reasons", n.throttle);
    let mut g = Gpu {
        index: n.index,
        uuid: take(&mut u, "uuid", n.uuid).unwrap_or_default(),
        model: take(&mut u, "name", n.name).unwrap_or_default(),
        bus_id: take(&mut u, "pci", n.bus_id).unwrap_or_default(),
        memory_total_mib,
        memory_used_mib,
        temperature_c: take(&mut u, "temperature", n.temperature_c).map_or(0.0, f64::from),
        utilization_percent: take(&mut u, "utilization", n.utilization).map_or(0.0, f64::from),
        ecc_uncorrected: take(&mut u, "ecc_errors", n.ecc_uncorrected).unwrap_or_default(),
        retired_pages_sbe: take(&mut u, "retired_pages", n.retired_sbe),
        retired_pages_dbe: take(&mut u, "retired_pages", n.retired_dbe),
        retired_pages_pending: take(&mut u, "retired_pages_pending", n.retired_pending),
        remapped_rows_correctable: remapped.map(|r| u64::from(r.0)),
        remapped_rows_uncorrectable: remapped.map(|r| u64::from(r.1)),
        remapped_rows_pending: remapped.map(|r| r.2),
        remapped_rows_failure: remapped.map(|r| r.3),
        nvlinks: take(&mut u, "nvlink", n.nvlinks),
        pcie_link_width: take(&mut u, "pcie_link_width", n.pcie_width),
        pcie_link_width_max: take(&mut u, "pcie_link_width_max", n.pcie_width_max),
        pcie_link_gen: take(&mut u, "pcie_link_gen", n.pcie_gen),
        pcie_link_gen_max: take(&mut u, "pcie_link_gen_max", n.pcie_gen_max),
        pcie_replays: take(&mut u, "pcie_replays", n.pcie_replays).map(u64::from),
        throttle_reasons: throttle.map_or_else(Vec::new, |mask| {
            nvml::THROTTLE_REASONS
                .iter()
                .filter(|(bit, _)| mask & bit != 0)
                .map(|(_, name)| (*name).to_owned())
                .collect()
        }),
        power_draw_w: take(&mut u, "power_draw", n.power_mw).map(|mw| f64::from(mw) / 1000.0),
        power_limit_w: take(&mut u, "power_limit", n.power_limit_mw)
            .map(|mw| f64::from(mw) / 1000.0),
        ..Gpu::default()
    };
    if let Some(x) = xid
        && x.count > 0
    {
        (g.xid_events, g.last_xid, g.last_xid_at) = (x.count, x.last, x.last_at);
        (g.last_hardware_xid, g.last_hardware_xid_at) = (x.last_hardware, x.last_hardware_at);
    }
    u.fields.dedup();
    g.unknown_fields = u.fields;
    g.lost = u.lost;
    g
}

/// Field readers over one `<gpu>` element that note what could not be read.
struct XmlGpu<'a> {
    gpu: &'a Element,
    unknown: Vec<String>,
}

impl XmlGpu<'_> {
    fn value<T>(&mut self, path: &[&str], field: Field<T>, required: bool) -> Option<T> {
        match field {
            Field::Value(v) => Some(v),
            Field::NotReported if !required => None,
            _ => {
                self.unknown.push(path.join("."));
                None
            }
        }
    }
    fn number<T: std::str::FromStr>(&mut self, path: &[&str], required: bool) -> Option<T> {
        let f = nvsmi::number(self.gpu.text_at(path));
        self.value(path, f, required)
    }
    fn flag(&mut self, path: &[&str]) -> Option<bool> {
        let f = nvsmi::flag(self.gpu.text_at(path));
        self.value(path, f, false)
    }
    /// The first of several spellings (DTD versions differ) that is present.
    fn first_number<T: std::str::FromStr>(&mut self, paths: &[&[&str]]) -> Option<T> {
        let path = paths
            .iter()
            .find(|p| self.gpu.text_at(p).is_some())
            .unwrap_or(&paths[0]);
        self.number(path, false)
    }
}

/// Turns one `<gpu>` element of `nvidia-smi -q -x` into a [`Gpu`].
pub fn from_xml(index: u32, gpu: &Element) -> Gpu {
    let mut x = XmlGpu {
        gpu,
        unknown: Vec::new(),
    };
    let ecc_enabled = nvsmi::flag(gpu.text_at(&["ecc_mode", "current_ecc"])) == Field::Value(true);
    // DTD v12 on splits volatile uncorrectable errors into SRAM and DRAM; v13 (drivers from
    // R560, Ampere on) splits SRAM further into parity and SEC-DED, while v12 and pre-Ampere
    // GPUs keep one `sram_uncorrectable`. Older DTDs give a double-bit total.
    let volatile = |f: &str| gpu.text_at(&["ecc_errors", "volatile", f]).is_some();
    let ecc_uncorrected = if volatile("dram_uncorrectable") {
        let sram: &[&str] =
            if volatile("sram_uncorrectable_parity") || volatile("sram_uncorrectable_secded") {
                &["sram_uncorrectable_parity", "sram_uncorrectable_secded"]
            } else {
                &["sram_uncorrectable"]
            };
        sram.iter()
            .chain(&["dram_uncorrectable"])
            .filter_map(|f| x.number::<u64>(&["ecc_errors", "volatile", f], ecc_enabled))
            .sum()
    } else {
        x.number::<u64>(
            &["ecc_errors", "volatile", "double_bit", "total"],
            ecc_enabled,
        )
        .unwrap_or(0)
    };
    let link = ["pci", "pci_gpu_link_info"];
    let reasons = ["clocks_event_reasons", "clocks_throttle_reasons"]
        .iter()
        .find_map(|name| gpu.child(name))
        .map(|r| {
            r.children
                .iter()
                .filter(|c| nvsmi::flag(Some(&c.text)) == Field::Value(true))
                .map(|c| {
                    c.name
                        .trim_start_matches("clocks_event_reason_")
                        .trim_start_matches("clocks_throttle_reason_")
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default();
    let bus_id = gpu
        .attribute("id")
        .or_else(|| gpu.text_at(&["pci", "pci_bus_id"]))
        .map(sysfs_bus_id)
        .unwrap_or_default();
    let mut g = Gpu {
        index,
        uuid: gpu.text_at(&["uuid"]).unwrap_or("").to_owned(),
        model: gpu.text_at(&["product_name"]).unwrap_or("").to_owned(),
        bus_id,
        memory_total_mib: x.number(&["fb_memory_usage", "total"], true).unwrap_or(0),
        memory_used_mib: x.number(&["fb_memory_usage", "used"], false).unwrap_or(0),
        temperature_c: x.number(&["temperature", "gpu_temp"], true).unwrap_or(0.0),
        utilization_percent: x.number(&["utilization", "gpu_util"], false).unwrap_or(0.0),
        ecc_uncorrected,
        retired_pages_sbe: x.number(
            &[
                "retired_pages",
                "multiple_single_bit_retirement",
                "retired_count",
            ],
            false,
        ),
        retired_pages_dbe: x.number(
            &["retired_pages", "double_bit_retirement", "retired_count"],
            false,
        ),
        retired_pages_pending: x.flag(&["retired_pages", "pending_retirement"]),
        remapped_rows_correctable: x.number(&["remapped_rows", "remapped_row_corr"], false),
        remapped_rows_uncorrectable: x.number(&["remapped_rows", "remapped_row_unc"], false),
        remapped_rows_pending: x.flag(&["remapped_rows", "remapped_row_pending"]),
        remapped_rows_failure: x.flag(&["remapped_rows", "remapped_row_failure"]),
        nvlinks: None,
        pcie_link_width: x.number(
            &[link[0], link[1], "link_widths", "current_link_width"],
            false,
        ),
        pcie_link_width_max: x.number(&[link[0], link[1], "link_widths", "max_link_width"], false),
        pcie_link_gen: x.number(&[link[0], link[1], "pcie_gen", "current_link_gen"], false),
        pcie_link_gen_max: x.number(&[link[0], link[1], "pcie_gen", "max_link_gen"], false),
        pcie_replays: x.number(&["pci", "replay_counter"], false),
        throttle_reasons: reasons,
        power_draw_w: x.first_number(&[
            &["gpu_power_readings", "instant_power_draw"],
            &["gpu_power_readings", "power_draw"],
            &["power_readings", "power_draw"],
        ]),
        power_limit_w: x.first_number(&[
            &["gpu_power_readings", "current_power_limit"],
            &["power_readings", "power_limit"],
        ]),
        ..Gpu::default()
    };
    g.unknown_fields = x.unknown;
    g
}

/// `nvidia-smi`'s `00000000:00:06.0` as sysfs names it (`0000:00:06.0`).
pub fn sysfs_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

/// Parses a whole `nvidia-smi -q -x` answer.
pub fn parse_xml(xml: &str) -> Result<Vec<Gpu>, String> {
    let root = nvsmi::parse(xml)?;
    if root.name != "nvidia_smi_log" {
        return Err(format!(
            "root element <{}> is not <nvidia_smi_log>",
            root.name
        ));
    }
    Ok(root
        .children
        .iter()
        .filter(|c| c.name == "gpu")
        .zip(0..)
        .map(|(g, i)| from_xml(i, g))
        .collect())
}

/// The `TOTAL_ERR_*` line of one sysfs AER file.
fn aer_total(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find(|l| l.starts_with("TOTAL_ERR_"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
}

/// Reads the PCIe AER totals of the device at `bus_id`, where the kernel exposes them.
pub fn read_aer(pci_devices: &Path, bus_id: &str) -> Option<(u64, u64, u64)> {
    if bus_id.is_empty() {
        return None;
    }
    let dir = pci_devices.join(bus_id);
    Some((
        aer_total(&dir.join("aer_dev_correctable"))?,
        aer_total(&dir.join("aer_dev_nonfatal"))?,
        aer_total(&dir.join("aer_dev_fatal"))?,
    ))
}

/// The health facts of one GPU beyond the temperature/ECC thresholds: the verdict and why.
/// Unknown (`Verdict::Unspecified`) when something could not be read and nothing worse is known.
pub fn health(g: &Gpu, now: SystemTime) -> (Verdict, Vec<String>) {
    let mut verdict = Verdict::Ok;
    let mut why = Vec::new();
    let mut raise = |v: Verdict, text: String| {
        verdict = verdict.max(v);
        why.push(text);
    };
    if g.lost {
        raise(
            Verdict::Critical,
            "the driver lost this GPU (fell off the bus)".into(),
        );
    }
    if g.remapped_rows_failure == Some(true) {
        raise(Verdict::Critical, "row remapping failed".into());
    }
    if g.remapped_rows_pending == Some(true) {
        raise(
            Verdict::Warning,
            "row remapping pending (reset the GPU)".into(),
        );
    }
    if g.retired_pages_pending == Some(true) {
        raise(
            Verdict::Warning,
            "page retirement pending (reset the GPU)".into(),
        );
    }
    if let Some((total, down)) = g.nvlinks
        && down > 0
    {
        raise(Verdict::Critical, format!("{down} of {total} NVLinks down"));
    }
    // An idle GPU may train its link down to save power; only a narrow link under load is one.
    if let (Some(now_w), Some(max_w)) = (g.pcie_link_width, g.pcie_link_width_max)
        && now_w < max_w
        && g.utilization_percent > 0.0
    {
        raise(Verdict::Warning, format!("PCIe link x{now_w} of x{max_w}"));
    }
    if let Some((_, nonfatal, fatal)) = g.aer {
        if fatal > 0 {
            raise(Verdict::Critical, "fatal PCIe AER errors since boot".into());
        } else if nonfatal > 0 {
            raise(
                Verdict::Warning,
                "non-fatal PCIe AER errors since boot".into(),
            );
        }
    }
    let held: Vec<&str> = g
        .throttle_reasons
        .iter()
        .map(String::as_str)
        .filter(|r| BAD_THROTTLE.contains(r))
        .collect();
    if !held.is_empty() {
        raise(
            Verdict::Warning,
            format!("clocks held down: {}", held.join(", ")),
        );
    }
    let recent = |at: Option<SystemTime>| {
        at.is_some_and(|at| now.duration_since(at).unwrap_or_default() < XID_WINDOW)
    };
    // The latest hardware XID counts on its own: an application's XID after it (13, 31, 43
    // follow a GPU fault often) must not turn a broken GPU into a warning.
    let hardware = g.xid_events > 0 && recent(g.last_hardware_xid_at);
    if hardware {
        raise(
            Verdict::Critical,
            format!("XID {} within the last hour", g.last_hardware_xid),
        );
    }
    if g.xid_events > 0 && recent(g.last_xid_at) && !(hardware && g.last_xid == g.last_hardware_xid)
    {
        let v = if HARDWARE_XIDS.contains(&g.last_xid) {
            Verdict::Critical
        } else {
            Verdict::Warning
        };
        raise(v, format!("XID {} within the last hour", g.last_xid));
    }
    if !g.unknown_fields.is_empty() {
        why.push(format!("could not read {}", g.unknown_fields.join(", ")));
        if verdict == Verdict::Ok {
            verdict = Verdict::Unspecified;
        }
    }
    (verdict, why)
}

/// The verdict over all GPUs: the worst GPU's, and fewer GPUs than expected is Critical.
pub fn judge_reading(r: &GpuReading, per_gpu: &[Verdict]) -> (Verdict, String) {
    let found = r.gpus.len() as u32;
    if let Some(expected) = r.expected
        && found < expected
    {
        let why = if r.source.is_empty() {
            " (neither NVML nor nvidia-smi is on this node)".to_owned()
        } else if !r.error.is_empty() {
            format!(" ({})", r.error)
        } else {
            String::new()
        };
        return (
            Verdict::Critical,
            format!("expected {expected} GPUs, found {found}{why}"),
        );
    }
    if r.gpus.is_empty() && !r.error.is_empty() {
        return (Verdict::Unspecified, r.error.clone());
    }
    let worst = per_gpu.iter().copied().max().unwrap_or(Verdict::Ok);
    // An unknown GPU among healthy ones keeps the whole reading unknown.
    let verdict = if worst == Verdict::Ok && per_gpu.contains(&Verdict::Unspecified) {
        Verdict::Unspecified
    } else {
        worst
    };
    (verdict, String::new())
}

/// Reads through NVML; `None` when NVML is not available (then nvidia-smi is tried).
fn collect_nvml(config: &GpuConfig) -> Option<GpuReading> {
    let library = config.nvml_library.as_deref()?;
    let loaded = match nvml::loaded(library) {
        Ok(loaded) => loaded,
        Err(nvml::Unavailable::NoLibrary(_)) => return None,
        // The library is there but found no driver or device: nvidia-smi would say the same,
        // so say it once, with NVML's words, when GPUs are expected.
        Err(nvml::Unavailable::InitFailed(why)) => {
            return Some(GpuReading {
                source: "nvml".into(),
                error: if config.expected.is_some() {
                    format!("nvmlInit: {why}")
                } else {
                    String::new()
                },
                expected: config.expected,
                ..GpuReading::default()
            });
        }
    };
    let mut reading = GpuReading {
        source: "nvml".into(),
        expected: config.expected,
        ..GpuReading::default()
    };
    let nvml = loaded.nvml;
    let xids = loaded
        .xid
        .counts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    match nvml::read_all(nvml) {
        Err(e) => reading.error = e,
        Ok(gpus) => {
            for g in gpus {
                match g {
                    Ok(n) => {
                        let uuid = match &n.uuid {
                            Answer::Value(u) => u.clone(),
                            _ => String::new(),
                        };
                        let xid = xids.get(&uuid).copied();
                        reading.gpus.push(from_nvml(n, xid));
                    }
                    Err((index, why)) => reading.gpus.push(Gpu {
                        index,
                        lost: why.contains("fell off the bus"),
                        unknown_fields: vec![format!("device handle: {why}")],
                        ..Gpu::default()
                    }),
                }
            }
        }
    }
    note_xid_watch(&mut reading, &loaded.xid);
    Some(reading)
}

/// Adds what the XID watcher could not do to the reading without failing it: a GPU whose
/// registration failed has its XID count unknown; anything else is a note.
fn note_xid_watch(reading: &mut GpuReading, watcher: &nvml::XidWatcher) {
    for g in &mut reading.gpus {
        if watcher.unregistered.contains_key(&g.uuid) {
            g.unknown_fields.push("xid_events".into());
        }
    }
    if let Some(e) = &watcher.error {
        reading.xid_error = format!("XID events: {e}");
    }
}

/// Runs `nvidia-smi -q -x`. Failures land in `error`.
async fn collect_nvidia_smi(config: &GpuConfig) -> GpuReading {
    let Some(path) = locate(&config.nvidia_smi) else {
        return GpuReading {
            expected: config.expected,
            ..GpuReading::default()
        };
    };
    let reading = |error: String, gpus: Vec<Gpu>| GpuReading {
        present: !gpus.is_empty(),
        source: "nvidia-smi".into(),
        error,
        gpus,
        expected: config.expected,
        xid_error: String::new(),
    };
    let child = tokio::process::Command::new(&path)
        .args(["-q", "-x"])
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
    let stdout = String::from_utf8_lossy(&output.stdout[..output.stdout.len().min(MAX_XML_BYTES)]);
    if stdout.contains("No devices were found") {
        return reading(String::new(), vec![]);
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
    match parse_xml(&stdout) {
        Ok(gpus) => reading(String::new(), gpus),
        Err(e) => reading(format!("parse nvidia-smi -q -x: {e}"), vec![]),
    }
}

/// The facts of one GPU as the report sends them (verdict and message are the caller's).
pub fn to_proto(g: &Gpu) -> nodekeeper_proto::agent::v1::Gpu {
    nodekeeper_proto::agent::v1::Gpu {
        index: g.index,
        uuid: g.uuid.clone(),
        model: g.model.clone(),
        memory_total_mib: g.memory_total_mib,
        memory_used_mib: g.memory_used_mib,
        temperature_c: g.temperature_c,
        utilization_percent: g.utilization_percent,
        ecc_uncorrected: g.ecc_uncorrected,
        xid_events: g.xid_events,
        bus_id: g.bus_id.clone(),
        last_xid: g.last_xid,
        last_xid_unix_ms: g.last_xid_at.map(crate::monitor::unix_ms),
        retired_pages_sbe: g.retired_pages_sbe,
        retired_pages_dbe: g.retired_pages_dbe,
        retired_pages_pending: g.retired_pages_pending,
        remapped_rows_correctable: g.remapped_rows_correctable,
        remapped_rows_uncorrectable: g.remapped_rows_uncorrectable,
        remapped_rows_pending: g.remapped_rows_pending,
        remapped_rows_failure: g.remapped_rows_failure,
        nvlinks: g.nvlinks.map(|n| n.0),
        nvlinks_down: g.nvlinks.map(|n| n.1),
        pcie_link_width: g.pcie_link_width,
        pcie_link_width_max: g.pcie_link_width_max,
        pcie_link_gen: g.pcie_link_gen,
        pcie_link_gen_max: g.pcie_link_gen_max,
        pcie_replays: g.pcie_replays,
        aer_correctable: g.aer.map(|a| a.0),
        aer_nonfatal: g.aer.map(|a| a.1),
        aer_fatal: g.aer.map(|a| a.2),
        throttle_reasons: g.throttle_reasons.clone(),
        power_draw_w: g.power_draw_w,
        power_limit_w: g.power_limit_w,
        unknown_fields: g.unknown_fields.clone(),
        lost: g.lost,
        verdict: 0,
        message: String::new(),
    }
}

/// Reads the GPUs: NVML, else nvidia-smi; then AER counts from sysfs. Never fails.
pub async fn collect(config: &GpuConfig) -> GpuReading {
    // NVML calls block (a GPU that is resetting answers slowly): off the runtime's workers.
    let nvml_config = config.clone();
    let nvml = tokio::task::spawn_blocking(move || collect_nvml(&nvml_config))
        .await
        .unwrap_or_else(|e| {
            Some(GpuReading {
                source: "nvml".into(),
                error: format!("NVML read panicked: {e}"),
                expected: config.expected,
                ..GpuReading::default()
            })
        });
    let mut reading = match nvml {
        Some(r) => r,
        None => collect_nvidia_smi(config).await,
    };
    for g in &mut reading.gpus {
        g.aer = read_aer(&config.pci_devices, &g.bus_id);
    }
    reading.present = !reading.gpus.is_empty();
    reading
}

/// How long a report waits for a GPU read it started or found running. Below the
/// controller's default call timeout (10 s), with the other collectors' time to spare.
const READ_WAIT: Duration = Duration::from_secs(5);
/// How long a GPU read may run before the reading says it failed. NVML calls cannot be
/// interrupted, so a wedged driver holds its read for good; `nvidia-smi` is killed after its
/// own [`TIMEOUT`], well within this.
const READ_LIMIT: Duration = Duration::from_secs(30);

/// One GPU read in flight, and the last one that finished.
#[derive(Default)]
struct ReaderState {
    in_flight: Option<(std::time::Instant, tokio::sync::watch::Receiver<bool>)>,
    last: Option<GpuReading>,
}

/// Runs [`collect`] as a task of its own, at most one at a time, so that neither a wedged
/// driver nor a report call that gives up (its future dropped at the caller's deadline) leaves
/// the agent without an answer: the read goes on to its end, and its reading is the next
/// call's. A caller waits for the read at most until [`READ_WAIT`] after it started; past that
/// it gets the last finished reading, and once the read has run [`READ_LIMIT`], that
/// reading's GPUs with an error saying the read did not finish.
pub struct Reader {
    state: std::sync::Arc<std::sync::Mutex<ReaderState>>,
    wait: Duration,
    limit: Duration,
}

impl Default for Reader {
    fn default() -> Self {
        Reader::with_limits(READ_WAIT, READ_LIMIT)
    }
}

impl Reader {
    fn with_limits(wait: Duration, limit: Duration) -> Self {
        Reader {
            state: std::sync::Arc::default(),
            wait,
            limit,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReaderState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A reading of the GPUs; see [`Reader`] for how long it waits.
    pub async fn read(&self, config: &GpuConfig) -> GpuReading {
        let (started, mut done) = {
            let mut state = self.lock();
            match &state.in_flight {
                Some((started, done)) => (*started, done.clone()),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(false);
                    let started = std::time::Instant::now();
                    state.in_flight = Some((started, rx.clone()));
                    let (shared, config) = (self.state.clone(), config.clone());
                    tokio::spawn(async move {
                        let reading = collect(&config).await;
                        let mut state = shared
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        state.last = Some(reading);
                        state.in_flight = None;
                        drop(state);
                        let _ = tx.send(true);
                    });
                    (started, rx)
                }
            }
        };
        let deadline = tokio::time::Instant::from_std(started + self.wait);
        let finished = tokio::time::timeout_at(deadline, done.wait_for(|d| *d)).await;
        let mut state = self.lock();
        if matches!(finished, Ok(Err(_))) {
            // The task ended without a reading (the runtime is shutting down): start afresh.
            state.in_flight = None;
        }
        match (&state.in_flight, &state.last) {
            (None, Some(last)) => last.clone(),
            (Some((started, _)), Some(last)) if started.elapsed() < self.limit => last.clone(),
            (_, last) => {
                let mut r = last.clone().unwrap_or_else(|| GpuReading {
                    source: if config.nvml_library.is_some() {
                        "nvml".into()
                    } else {
                        "nvidia-smi".into()
                    },
                    expected: config.expected,
                    ..GpuReading::default()
                });
                let after = if last.is_some() {
                    self.limit
                } else {
                    self.wait
                };
                r.error = format!(
                    "the GPU read did not finish within {after:?} (a driver not answering?); \
                     a new read starts when it does"
                );
                r
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real answer of `nvidia-smi -q -x` on an H100 80GB HBM3 (driver 580.159.04, DTD
    /// nvsmi_device_v13), copied unedited from the project's shared GPU facts.
    pub(crate) const H100_XML: &str =
        include_str!("../../tests/fixtures/gpu/nvidia-smi-q-h100.xml");

    #[test]
    fn parses_the_real_h100_answer() {
        let gpus = parse_xml(H100_XML).unwrap();
        assert_eq!(gpus.len(), 1);
        let g = &gpus[0];
        assert_eq!(g.uuid, "GPU-751505f1-c74f-b84b-5ac0-cbba72cccc7b");
        assert_eq!(g.model, "NVIDIA H100 80GB HBM3");
        assert_eq!(g.bus_id, "0000:00:06.0");
        assert_eq!((g.memory_total_mib, g.memory_used_mib), (81559, 0));
        assert_eq!(g.temperature_c, 52.0);
        assert_eq!(g.utilization_percent, 0.0);
        assert_eq!(g.ecc_uncorrected, 0);
        // Hopper remaps rows instead of retiring pages: retired pages are N/A, not unknown.
        assert_eq!(
            (
                g.retired_pages_sbe,
                g.retired_pages_dbe,
                g.retired_pages_pending
            ),
            (None, None, None)
        );
        assert_eq!(
            (
                g.remapped_rows_correctable,
                g.remapped_rows_uncorrectable,
                g.remapped_rows_pending,
                g.remapped_rows_failure
            ),
            (Some(0), Some(0), Some(false), Some(false))
        );
        assert_eq!(
            (g.pcie_link_width, g.pcie_link_width_max),
            (Some(16), Some(16))
        );
        assert_eq!((g.pcie_link_gen, g.pcie_link_gen_max), (Some(5), Some(5)));
        assert_eq!(g.pcie_replays, Some(0));
        assert_eq!(g.throttle_reasons, ["gpu_idle"]);
        assert_eq!(
            (g.power_draw_w, g.power_limit_w),
            (Some(78.45), Some(700.0))
        );
        assert_eq!(g.nvlinks, None);
        assert!(g.unknown_fields.is_empty(), "{:?}", g.unknown_fields);
        assert_eq!(health(g, SystemTime::now()), (Verdict::Ok, vec![]));
    }

    #[test]
    fn reads_the_combined_sram_count_of_dtd_v12() {
        // DTD v12 (drivers before R560) and pre-Ampere GPUs: one SRAM uncorrectable count.
        let split = "<sram_uncorrectable_parity>0</sram_uncorrectable_parity>\n\t\t\t\t\
                     <sram_uncorrectable_secded>0</sram_uncorrectable_secded>";
        assert_eq!(H100_XML.matches(split).count(), 2, "the fixture changed");
        let v12 = H100_XML
            .replacen(split, "<sram_uncorrectable>2</sram_uncorrectable>", 1)
            .replace(split, "<sram_uncorrectable>0</sram_uncorrectable>")
            .replacen(
                "<dram_uncorrectable>0</dram_uncorrectable>",
                "<dram_uncorrectable>1</dram_uncorrectable>",
                1,
            );
        let g = &parse_xml(&v12).unwrap()[0];
        assert!(g.unknown_fields.is_empty(), "{:?}", g.unknown_fields);
        assert_eq!(g.ecc_uncorrected, 3);
    }

    #[test]
    fn an_unknown_error_is_unknown_never_healthy() {
        let broken = H100_XML
            .replace(
                "<gpu_temp>52 C</gpu_temp>",
                "<gpu_temp>[Unknown Error]</gpu_temp>",
            )
            .replace(
                "<dram_uncorrectable>0</dram_uncorrectable>",
                "<dram_uncorrectable>N/A</dram_uncorrectable>",
            );
        let g = &parse_xml(&broken).unwrap()[0];
        // ECC is enabled, so N/A where the count belongs is as unknown as the error text.
        assert_eq!(
            g.unknown_fields,
            [
                "ecc_errors.volatile.dram_uncorrectable",
                "temperature.gpu_temp",
            ]
        );
        let (v, why) = health(g, SystemTime::now());
        assert_eq!(v, Verdict::Unspecified);
        assert!(why[0].contains("temperature.gpu_temp"), "{why:?}");
        let reading = GpuReading {
            gpus: vec![g.clone(), g.clone()],
            ..GpuReading::default()
        };
        assert_eq!(
            judge_reading(&reading, &[Verdict::Ok, v]).0,
            Verdict::Unspecified
        );
    }

    #[test]
    fn health_facts_raise_the_verdict() {
        let now = SystemTime::now();
        let ok = parse_xml(H100_XML).unwrap().remove(0);
        let cases: Vec<(Gpu, Verdict, &str)> = vec![
            (
                Gpu {
                    remapped_rows_failure: Some(true),
                    ..ok.clone()
                },
                Verdict::Critical,
                "row remapping failed",
            ),
            (
                Gpu {
                    remapped_rows_pending: Some(true),
                    ..ok.clone()
                },
                Verdict::Warning,
                "row remapping pending",
            ),
            (
                Gpu {
                    nvlinks: Some((18, 2)),
                    ..ok.clone()
                },
                Verdict::Critical,
                "2 of 18 NVLinks down",
            ),
            (
                Gpu {
                    pcie_link_width: Some(8),
                    utilization_percent: 35.0,
                    ..ok.clone()
                },
                Verdict::Warning,
                "PCIe link x8 of x16",
            ),
            (
                Gpu {
                    aer: Some((12, 0, 1)),
                    ..ok.clone()
                },
                Verdict::Critical,
                "fatal PCIe AER",
            ),
            (
                Gpu {
                    throttle_reasons: vec!["hw_thermal_slowdown".into()],
                    ..ok.clone()
                },
                Verdict::Warning,
                "clocks held down: hw_thermal_slowdown",
            ),
            (
                Gpu {
                    xid_events: 1,
                    last_xid: 79,
                    last_xid_at: Some(now),
                    ..ok.clone()
                },
                Verdict::Critical,
                "XID 79",
            ),
            (
                Gpu {
                    xid_events: 3,
                    last_xid: 13,
                    last_xid_at: Some(now),
                    ..ok.clone()
                },
                Verdict::Warning,
                "XID 13",
            ),
            (
                Gpu {
                    lost: true,
                    ..ok.clone()
                },
                Verdict::Critical,
                "fell off the bus",
            ),
        ];
        for (g, verdict, text) in cases {
            let (v, why) = health(&g, now);
            assert_eq!(v, verdict, "{why:?}");
            assert!(why.iter().any(|w| w.contains(text)), "{why:?} lacks {text}");
        }
        // Correctable AER errors, power capping and an old XID are facts, not problems.
        let fine = Gpu {
            aer: Some((40, 0, 0)),
            throttle_reasons: vec!["sw_power_cap".into()],
            xid_events: 1,
            last_xid: 79,
            last_xid_at: Some(now - XID_WINDOW - Duration::from_secs(1)),
            ..ok
        };
        assert_eq!(health(&fine, now).0, Verdict::Ok);
    }

    #[test]
    fn momentary_states_of_a_healthy_gpu_are_no_warning() {
        let now = SystemTime::now();
        let ok = parse_xml(H100_XML).unwrap().remove(0);
        // nvml.h: hw_slowdown "may also be reported during PState or clock change".
        let clock_change = Gpu {
            throttle_reasons: vec!["hw_slowdown".into()],
            ..ok.clone()
        };
        assert_eq!(health(&clock_change, now), (Verdict::Ok, vec![]));
        let braked = Gpu {
            throttle_reasons: vec!["hw_slowdown".into(), "hw_power_brake_slowdown".into()],
            ..ok.clone()
        };
        let (v, why) = health(&braked, now);
        assert_eq!(v, Verdict::Warning);
        assert_eq!(why, ["clocks held down: hw_power_brake_slowdown"]);
        // An idle GPU's link trained down to save power.
        let idle_narrow = Gpu {
            pcie_link_width: Some(2),
            utilization_percent: 0.0,
            ..ok.clone()
        };
        assert_eq!(health(&idle_narrow, now), (Verdict::Ok, vec![]));
        let busy_narrow = Gpu {
            utilization_percent: 1.0,
            ..idle_narrow
        };
        assert_eq!(health(&busy_narrow, now).0, Verdict::Warning);
    }

    #[test]
    fn an_application_xid_does_not_hide_a_hardware_xid() {
        let now = SystemTime::now();
        let mut xid = nvml::XidTally::default();
        xid.record(79, now - Duration::from_secs(60));
        xid.record(13, now);
        let n = NvmlGpu {
            uuid: Answer::Value("GPU-x".into()),
            ..NvmlGpu::default()
        };
        let g = from_nvml(n, Some(xid));
        assert_eq!((g.xid_events, g.last_xid), (2, 13));
        let (v, why) = health(&g, now);
        assert_eq!(v, Verdict::Critical, "{why:?}");
        assert!(why.iter().any(|w| w.contains("XID 79")), "{why:?}");
        assert!(why.iter().any(|w| w.contains("XID 13")), "{why:?}");
        // Once the hardware XID is older than the window, the application's is a warning.
        let (v, why) = health(&g, now + XID_WINDOW - Duration::from_secs(30));
        assert_eq!(v, Verdict::Warning, "{why:?}");
        assert!(!why.iter().any(|w| w.contains("XID 79")), "{why:?}");
    }

    #[test]
    fn an_xid_watch_problem_leaves_the_gpus_judged() {
        let ok = parse_xml(H100_XML).unwrap().remove(0);
        let broken = Gpu {
            index: 1,
            uuid: "GPU-broken".into(),
            remapped_rows_failure: Some(true),
            ..ok.clone()
        };
        let mut reading = GpuReading {
            present: true,
            source: "nvml".into(),
            gpus: vec![ok.clone(), broken],
            ..GpuReading::default()
        };
        let watcher = nvml::XidWatcher {
            error: Some("XID events not supported on GPU 2".into()),
            unregistered: [("GPU-broken".to_owned(), "Unknown Error".to_owned())].into(),
            ..nvml::XidWatcher::default()
        };
        note_xid_watch(&mut reading, &watcher);
        assert_eq!(reading.error, "", "{reading:?}");
        assert_eq!(
            reading.xid_error,
            "XID events: XID events not supported on GPU 2"
        );
        assert!(reading.gpus[0].unknown_fields.is_empty());
        assert_eq!(reading.gpus[1].unknown_fields, ["xid_events"]);
        let now = SystemTime::now();
        let verdicts: Vec<Verdict> = reading.gpus.iter().map(|g| health(g, now).0).collect();
        assert_eq!(verdicts, [Verdict::Ok, Verdict::Critical]);
        assert_eq!(judge_reading(&reading, &verdicts).0, Verdict::Critical);
    }

    #[test]
    fn fewer_gpus_than_expected_is_critical() {
        let gpus = parse_xml(H100_XML).unwrap();
        let mut r = GpuReading {
            present: true,
            source: "nvidia-smi".into(),
            gpus,
            expected: Some(8),
            ..GpuReading::default()
        };
        let (v, why) = judge_reading(&r, &[Verdict::Ok]);
        assert_eq!(
            (v, why.as_str()),
            (Verdict::Critical, "expected 8 GPUs, found 1")
        );
        r.expected = Some(1);
        assert_eq!(judge_reading(&r, &[Verdict::Ok]).0, Verdict::Ok);
        let none = GpuReading {
            expected: Some(1),
            ..GpuReading::default()
        };
        let (v, why) = judge_reading(&none, &[]);
        assert_eq!(v, Verdict::Critical);
        assert!(why.contains("neither NVML nor nvidia-smi"), "{why}");
        // Without an expectation, no GPU is a normal answer.
        assert_eq!(judge_reading(&GpuReading::default(), &[]).0, Verdict::Ok);
    }

    #[test]
    fn aer_counters_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("0000:00:06.0");
        std::fs::create_dir(&dev).unwrap();
        std::fs::write(
            dev.join("aer_dev_correctable"),
            "RxErr 2\nBadTLP 1\nTOTAL_ERR_COR 3\n",
        )
        .unwrap();
        std::fs::write(
            dev.join("aer_dev_nonfatal"),
            "Undefined 0\nTOTAL_ERR_NONFATAL 0\n",
        )
        .unwrap();
        std::fs::write(
            dev.join("aer_dev_fatal"),
            "Undefined 0\nTOTAL_ERR_FATAL 1\n",
        )
        .unwrap();
        assert_eq!(read_aer(dir.path(), "0000:00:06.0"), Some((3, 0, 1)));
        assert_eq!(read_aer(dir.path(), "0000:00:07.0"), None);
        assert_eq!(sysfs_bus_id("00000000:00:06.0"), "0000:00:06.0");
        assert_eq!(sysfs_bus_id("0000:3B:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn nvml_answers_map_with_errors_unknown() {
        let n = NvmlGpu {
            index: 2,
            uuid: Answer::Value("GPU-x".into()),
            name: Answer::Value("NVIDIA H100".into()),
            temperature_c: Answer::Failed(999),
            nvlinks: Answer::Value((18, 0)),
            throttle: Answer::Value(0x1 | 0x40),
            power_mw: Answer::Value(78_450),
            remapped: Answer::Value((1, 0, true, false)),
            ..NvmlGpu::default()
        };
        let mut xid = nvml::XidTally::default();
        xid.record(48, SystemTime::now());
        xid.record(48, SystemTime::now());
        let g = from_nvml(n, Some(xid));
        assert_eq!(g.unknown_fields, ["temperature"]);
        assert_eq!(g.throttle_reasons, ["gpu_idle", "hw_thermal_slowdown"]);
        assert_eq!(g.power_draw_w, Some(78.45));
        assert_eq!(g.remapped_rows_pending, Some(true));
        assert_eq!((g.xid_events, g.last_xid), (2, 48));
        assert_eq!(health(&g, SystemTime::now()).0, Verdict::Critical);
    }

    #[test]
    fn a_gpu_lost_after_its_handle_is_lost() {
        let n = NvmlGpu {
            uuid: Answer::Value("GPU-x".into()),
            memory: Answer::Value((81559, 0)),
            temperature_c: Answer::Failed(nvml::ERROR_GPU_IS_LOST),
            power_mw: Answer::Failed(nvml::ERROR_GPU_IS_LOST),
            ..NvmlGpu::default()
        };
        let g = from_nvml(n, None);
        assert!(g.lost, "{g:?}");
        let (v, why) = health(&g, SystemTime::now());
        assert_eq!(v, Verdict::Critical);
        assert!(why[0].contains("fell off the bus"), "{why:?}");
        // Any other error is unknown, not lost.
        let n = NvmlGpu {
            temperature_c: Answer::Failed(999),
            ..NvmlGpu::default()
        };
        assert!(!from_nvml(n, None).lost);
    }

    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("nvidia-smi");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn without_nvml(nvidia_smi: &Path) -> GpuConfig {
        GpuConfig {
            nvml_library: None,
            nvidia_smi: nvidia_smi.to_owned(),
            expected: None,
            pci_devices: "/nonexistent".into(),
        }
    }

    #[tokio::test]
    async fn absent_tools_mean_no_gpu() {
        let r = collect(&without_nvml(Path::new("/nonexistent/nvidia-smi"))).await;
        assert_eq!(r, GpuReading::default());
        // NVML named but not installed falls back to nvidia-smi (absent too): still no GPU.
        let config = GpuConfig {
            nvml_library: Some("libnodekeeper-no-such-nvml.so.1".into()),
            ..without_nvml(Path::new("nodekeeper-no-such-nvidia-smi"))
        };
        let r = collect(&config).await;
        assert!(
            !r.present && r.error.is_empty() && r.source.is_empty(),
            "{r:?}"
        );
    }

    #[tokio::test]
    async fn a_slow_gpu_read_is_waited_for_within_bounds_and_never_doubled() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("answer.xml"), H100_XML).unwrap();
        let runs = dir.path().join("runs");
        let gate = dir.path().join("gate");
        // Hangs until the test creates the gate file (bounded, so no process outlives the
        // test), counting how often it was started.
        let path = script(
            dir.path(),
            &format!(
                "echo run >> {runs}\ni=0\nwhile [ ! -e {gate} ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\ncat {answer}",
                runs = runs.display(),
                gate = gate.display(),
                answer = dir.path().join("answer.xml").display(),
            ),
        );
        let config = without_nvml(&path);
        let started = || {
            std::fs::read_to_string(&runs)
                .unwrap_or_default()
                .lines()
                .count()
        };
        let reader = Reader::with_limits(Duration::from_millis(300), Duration::from_secs(1));
        let t = std::time::Instant::now();
        let r = reader.read(&config).await;
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(r.error.contains("did not finish within 300ms"), "{r:?}");
        assert!(!r.present);
        // The read is still running: a second call neither waits nor starts another.
        let t = std::time::Instant::now();
        let r = reader.read(&config).await;
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert!(r.error.contains("did not finish"), "{r:?}");
        assert_eq!(started(), 1);
        // It finishes: its reading is the next call's.
        std::fs::write(&gate, "").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let r = loop {
            let r = reader.read(&config).await;
            if r.present || std::time::Instant::now() > deadline {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(r.present && r.error.is_empty(), "{r:?}");
        assert_eq!(r.gpus[0].model, "NVIDIA H100 80GB HBM3");
    }

    #[tokio::test]
    async fn runs_a_fake_nvidia_smi() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("answer.xml"), H100_XML).unwrap();
        let path = script(
            dir.path(),
            &format!(
                "[ \"$1 $2\" = \"-q -x\" ] || {{ echo bad args >&2; exit 2; }}\ncat {}/answer.xml",
                dir.path().display()
            ),
        );
        let r = collect(&without_nvml(&path)).await;
        assert!(r.present, "{r:?}");
        assert_eq!((r.source.as_str(), r.error.as_str()), ("nvidia-smi", ""));
        assert_eq!(r.gpus[0].model, "NVIDIA H100 80GB HBM3");

        let path = script(
            dir.path(),
            "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
        );
        let r = collect(&without_nvml(&path)).await;
        assert!(!r.present);
        assert!(r.error.contains("could not communicate"), "{r:?}");

        let path = script(dir.path(), "echo 'No devices were found'; exit 6");
        let r = collect(&without_nvml(&path)).await;
        assert!(!r.present && r.error.is_empty(), "{r:?}");
    }
}
