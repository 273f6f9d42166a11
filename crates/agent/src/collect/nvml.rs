//! NVIDIA's management library (NVML, `libnvidia-ml.so.1`) loaded at run time with `dlopen`, so
//! the agent has no link-time dependency on the driver: no library, or a library that finds no
//! GPU, is the normal "no GPU" answer. One GPU's health facts are read per call ([`read_all`]);
//! XID critical-error events are delivered asynchronously, so a watcher thread
//! ([`XidWatcher`]) waits on an NVML event set and counts them per GPU.
//!
//! Symbols, types and constants are those of `nvml.h` (NVML API version 11+, drivers R450 on):
//! the `_v2` entry points for init, count and handles, `nvmlEventSetWait_v2`, and the
//! `nvmlPciInfo_t` fields `domain`/`bus`/`device` at byte offsets 16/20/24 (unchanged since the
//! first version of the struct; the bus id string's own offset moved in v3, so it is rebuilt
//! from them). A symbol an older driver lacks makes that one reading `None`, not a failure.
//!
//! Every `unsafe` block calls a function pointer resolved from the library with the signature
//! `nvml.h` declares, passing pointers to locals that outlive the call.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime};

/// `nvmlReturn_t` values used here.
pub const SUCCESS: c_int = 0;
pub const ERROR_INVALID_ARGUMENT: c_int = 2;
pub const ERROR_NOT_SUPPORTED: c_int = 3;
pub const ERROR_INSUFFICIENT_SIZE: c_int = 7;
pub const ERROR_TIMEOUT: c_int = 10;
pub const ERROR_GPU_IS_LOST: c_int = 15;
/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID_CRITICAL: c_ulonglong = 0x8;
/// NVLink links asked about per GPU (`NVML_NVLINK_MAX_LINKS` is 18 from Hopper on).
const MAX_NVLINKS: c_uint = 18;
/// `nvmlClocksEventReasons` bits, with the names `nvidia-smi -q` prints.
pub const THROTTLE_REASONS: &[(u64, &str)] = &[
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clocks_setting"),
];

type Device = *mut c_void;

/// One NVML answer: the value, "not supported on this GPU" (`None`), or an error code that makes
/// the field Unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Answer<T> {
    Value(T),
    #[default]
    NotSupported,
    Failed(c_int),
}

impl<T> Answer<T> {
    fn from(code: c_int, value: T) -> Answer<T> {
        match code {
            SUCCESS => Answer::Value(value),
            ERROR_NOT_SUPPORTED => Answer::NotSupported,
            code => Answer::Failed(code),
        }
    }
}

/// The library and the entry points used, resolved once.
pub struct Nvml {
    handle: *mut c_void,
}

// SAFETY (for the two impls below): NVML is documented thread-safe ("NVML is thread-safe so it
// is safe to make simultaneous NVML calls from multiple threads"); the handle is only used to
// look symbols up, which dlsym allows from any thread.
unsafe impl Send for Nvml {}
unsafe impl Sync for Nvml {}

/// Why NVML is not available (a normal answer on a node without a GPU driver).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// The library is not on this node (or not mounted into the agent).
    NoLibrary(String),
    /// The library loaded but `nvmlInit_v2` failed (no driver loaded, no device).
    InitFailed(String),
}

impl Nvml {
    /// Loads `library` and initialises NVML. The handle lives for the process (NVML is never
    /// shut down: the XID watcher and later collections share it).
    pub fn load(library: &str) -> Result<Nvml, Unavailable> {
        let name = std::ffi::CString::new(library)
            .map_err(|_| Unavailable::NoLibrary(format!("{library:?} has a NUL byte")))?;
        // SAFETY: dlopen with a valid C string; the result is checked for NULL.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns NULL or a valid C string owned by libc.
            let why = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    "dlopen failed".to_owned()
                } else {
                    CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            return Err(Unavailable::NoLibrary(why));
        }
        let nvml = Nvml { handle };
        let init: Option<unsafe extern "C" fn() -> c_int> = nvml.symbol("nvmlInit_v2");
        let failed = match init {
            None => "no nvmlInit_v2 in the library".to_owned(),
            // SAFETY: nvmlInit_v2 takes no arguments.
            Some(init) => match unsafe { init() } {
                SUCCESS => return Ok(nvml),
                code => nvml.error_string(code),
            },
        };
        // A failed load is tried again later (see `loaded`): let this reference go.
        // SAFETY: the handle came from dlopen above and nothing resolved from it is kept.
        unsafe { libc::dlclose(handle) };
        Err(Unavailable::InitFailed(failed))
    }

    /// Resolves `name` as a function pointer of type `F` (which must match `nvml.h`).
    fn symbol<F: Copy>(&self, name: &str) -> Option<F> {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        let cname = std::ffi::CString::new(name).ok()?;
        // SAFETY: dlsym on the open handle with a valid C string.
        let ptr = unsafe { libc::dlsym(self.handle, cname.as_ptr()) };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: F is a function pointer type of pointer size with the C signature nvml.h
        // declares for `name`.
        Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&ptr) })
    }

    /// `nvmlErrorString`, or the code.
    pub fn error_string(&self, code: c_int) -> String {
        let f: Option<unsafe extern "C" fn(c_int) -> *const c_char> =
            self.symbol("nvmlErrorString");
        match f {
            // SAFETY: returns a static C string for any code.
            Some(f) => unsafe {
                let s = f(code);
                if s.is_null() {
                    format!("NVML error {code}")
                } else {
                    CStr::from_ptr(s).to_string_lossy().into_owned()
                }
            },
            None => format!("NVML error {code}"),
        }
    }

    pub fn count(&self) -> Result<u32, c_int> {
        let f: unsafe extern "C" fn(*mut c_uint) -> c_int = self
            .symbol("nvmlDeviceGetCount_v2")
            .ok_or(ERROR_NOT_SUPPORTED)?;
        let mut n: c_uint = 0;
        // SAFETY: out-pointer to a local.
        match unsafe { f(&mut n) } {
            SUCCESS => Ok(n),
            code => Err(code),
        }
    }

    pub fn device(&self, index: u32) -> Result<Device, c_int> {
        let f: unsafe extern "C" fn(c_uint, *mut Device) -> c_int = self
            .symbol("nvmlDeviceGetHandleByIndex_v2")
            .ok_or(ERROR_NOT_SUPPORTED)?;
        let mut d: Device = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        match unsafe { f(index, &mut d) } {
            SUCCESS => Ok(d),
            code => Err(code),
        }
    }

    fn string(&self, name: &str, d: Device) -> Answer<String> {
        let Some(f) =
            self.symbol::<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int>(name)
        else {
            return Answer::NotSupported;
        };
        let mut buf = [0 as c_char; 96];
        // SAFETY: buffer and its length.
        let code = unsafe { f(d, buf.as_mut_ptr(), buf.len() as c_uint) };
        // SAFETY: NVML NUL-terminates within the given length on success; the last byte is 0.
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Answer::from(code, text)
    }

    fn uint(&self, name: &str, d: Device) -> Answer<u32> {
        let Some(f) = self.symbol::<unsafe extern "C" fn(Device, *mut c_uint) -> c_int>(name)
        else {
            return Answer::NotSupported;
        };
        let mut v: c_uint = 0;
        // SAFETY: out-pointer to a local.
        let code = unsafe { f(d, &mut v) };
        Answer::from(code, v)
    }

    fn ulonglong(&self, name: &str, d: Device) -> Answer<u64> {
        let Some(f) = self.symbol::<unsafe extern "C" fn(Device, *mut c_ulonglong) -> c_int>(name)
        else {
            return Answer::NotSupported;
        };
        let mut v: c_ulonglong = 0;
        // SAFETY: out-pointer to a local.
        let code = unsafe { f(d, &mut v) };
        Answer::from(code, v)
    }

    /// Reads one GPU.
    pub fn read(&self, index: u32) -> Result<NvmlGpu, c_int> {
        let d = self.device(index)?;
        let mut g = NvmlGpu {
            index,
            uuid: self.string("nvmlDeviceGetUUID", d),
            name: self.string("nvmlDeviceGetName", d),
            ..NvmlGpu::default()
        };
        // nvmlPciInfo_t: domain, bus, device at offsets 16, 20, 24 in every version; the buffer
        // is larger than any version of the struct.
        if let Some(f) =
            self.symbol::<unsafe extern "C" fn(Device, *mut u8) -> c_int>("nvmlDeviceGetPciInfo_v3")
        {
            let mut buf = [0u8; 256];
            // SAFETY: the buffer is larger than nvmlPciInfo_t.
            let code = unsafe { f(d, buf.as_mut_ptr()) };
            let word = |at: usize| u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4"));
            g.bus_id = Answer::from(
                code,
                format!("{:04x}:{:02x}:{:02x}.0", word(16), word(20), word(24)),
            );
        }
        if let Some(f) = self
            .symbol::<unsafe extern "C" fn(Device, *mut [c_ulonglong; 3]) -> c_int>(
                "nvmlDeviceGetMemoryInfo",
            )
        {
            let mut m = [0 as c_ulonglong; 3];
            // SAFETY: nvmlMemory_t is three unsigned long longs (total, free, used).
            let code = unsafe { f(d, &mut m) };
            g.memory = Answer::from(code, (m[0] / (1 << 20), m[2] / (1 << 20)));
        }
        if let Some(f) = self.symbol::<unsafe extern "C" fn(Device, c_int, *mut c_uint) -> c_int>(
            "nvmlDeviceGetTemperature",
        ) {
            let mut t: c_uint = 0;
            // SAFETY: NVML_TEMPERATURE_GPU = 0; out-pointer to a local.
            let code = unsafe { f(d, 0, &mut t) };
            g.temperature_c = Answer::from(code, t);
        }
        if let Some(f) = self.symbol::<unsafe extern "C" fn(Device, *mut [c_uint; 2]) -> c_int>(
            "nvmlDeviceGetUtilizationRates",
        ) {
            let mut u = [0 as c_uint; 2];
            // SAFETY: nvmlUtilization_t is two unsigned ints (gpu, memory).
            let code = unsafe { f(d, &mut u) };
            g.utilization = Answer::from(code, u[0]);
        }
        if let Some(f) = self
            .symbol::<unsafe extern "C" fn(Device, c_int, c_int, *mut c_ulonglong) -> c_int>(
                "nvmlDeviceGetTotalEccErrors",
            )
        {
            let mut n: c_ulonglong = 0;
            // SAFETY: NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1, NVML_VOLATILE_ECC = 0.
            let code = unsafe { f(d, 1, 0, &mut n) };
            g.ecc_uncorrected = Answer::from(code, n);
        }
        if let Some(f) = self.symbol::<unsafe extern "C" fn(
            Device,
            c_int,
            *mut c_uint,
            *mut c_ulonglong,
        ) -> c_int>("nvmlDeviceGetRetiredPages")
        {
            let mut pages = [Answer::NotSupported; 2];
            for (cause, slot) in pages.iter_mut().enumerate() {
                let mut n: c_uint = 0;
                // SAFETY: count 0 with a NULL buffer asks for the count only.
                let code = unsafe { f(d, cause as c_int, &mut n, std::ptr::null_mut()) };
                let code = if code == ERROR_INSUFFICIENT_SIZE {
                    SUCCESS
                } else {
                    code
                };
                *slot = Answer::from(code, u64::from(n));
            }
            (g.retired_sbe, g.retired_dbe) = (pages[0], pages[1]);
        }
        g.retired_pending = self
            .uint("nvmlDeviceGetRetiredPagesPendingStatus", d)
            .map(|v| v != 0);
        if let Some(f) = self.symbol::<unsafe extern "C" fn(
            Device,
            *mut c_uint,
            *mut c_uint,
            *mut c_uint,
            *mut c_uint,
        ) -> c_int>("nvmlDeviceGetRemappedRows")
        {
            let (mut c, mut u, mut p, mut fl) = (0, 0, 0, 0);
            // SAFETY: four out-pointers to locals.
            let code = unsafe { f(d, &mut c, &mut u, &mut p, &mut fl) };
            g.remapped = Answer::from(code, (c, u, p != 0, fl != 0));
        }
        if let Some(f) = self.symbol::<unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> c_int>(
            "nvmlDeviceGetNvLinkState",
        ) {
            let (mut total, mut down, mut failed) = (0u32, 0u32, None);
            for link in 0..MAX_NVLINKS {
                let mut active: c_uint = 0;
                // SAFETY: out-pointer to a local.
                match unsafe { f(d, link, &mut active) } {
                    SUCCESS => {
                        total += 1;
                        if active == 0 {
                            down += 1;
                        }
                    }
                    // Past the GPU's last link, or a GPU without NVLink.
                    ERROR_NOT_SUPPORTED | ERROR_INVALID_ARGUMENT => {}
                    code => failed = Some(code),
                }
            }
            g.nvlinks = match failed {
                Some(code) => Answer::Failed(code),
                None => Answer::Value((total, down)),
            };
        }
        g.pcie_width = self.uint("nvmlDeviceGetCurrPcieLinkWidth", d);
        g.pcie_width_max = self.uint("nvmlDeviceGetMaxPcieLinkWidth", d);
        g.pcie_gen = self.uint("nvmlDeviceGetCurrPcieLinkGeneration", d);
        g.pcie_gen_max = self.uint("nvmlDeviceGetMaxPcieLinkGeneration", d);
        g.pcie_replays = self.uint("nvmlDeviceGetPcieReplayCounter", d);
        g.throttle = match self.ulonglong("nvmlDeviceGetCurrentClocksEventReasons", d) {
            Answer::NotSupported => self.ulonglong("nvmlDeviceGetCurrentClocksThrottleReasons", d),
            other => other,
        };
        g.power_mw = self.uint("nvmlDeviceGetPowerUsage", d);
        g.power_limit_mw = self.uint("nvmlDeviceGetEnforcedPowerLimit", d);
        Ok(g)
    }
}

impl<T> Answer<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Answer<U> {
        match self {
            Answer::Value(v) => Answer::Value(f(v)),
            Answer::NotSupported => Answer::NotSupported,
            Answer::Failed(c) => Answer::Failed(c),
        }
    }
}

/// One GPU as NVML answered, field by field.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NvmlGpu {
    pub index: u32,
    pub uuid: Answer<String>,
    pub name: Answer<String>,
    pub bus_id: Answer<String>,
    /// (total, used) MiB.
    pub memory: Answer<(u64, u64)>,
    pub temperature_c: Answer<u32>,
    pub utilization: Answer<u32>,
    pub ecc_uncorrected: Answer<u64>,
    pub retired_sbe: Answer<u64>,
    pub retired_dbe: Answer<u64>,
    pub retired_pending: Answer<bool>,
    /// (correctable, uncorrectable, pending, failure).
    pub remapped: Answer<(u32, u32, bool, bool)>,
    /// (links, links down).
    pub nvlinks: Answer<(u32, u32)>,
    pub pcie_width: Answer<u32>,
    pub pcie_width_max: Answer<u32>,
    pub pcie_gen: Answer<u32>,
    pub pcie_gen_max: Answer<u32>,
    pub pcie_replays: Answer<u32>,
    pub throttle: Answer<u64>,
    pub power_mw: Answer<u32>,
    pub power_limit_mw: Answer<u32>,
}

/// The XID events of one GPU since the watcher started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XidTally {
    pub count: u64,
    /// The latest XID code and when it came.
    pub last: u64,
    pub last_at: Option<SystemTime>,
    /// The latest hardware XID ([`super::gpu::HARDWARE_XIDS`]) and when it came, kept apart
    /// so that an application's XID (13, 31, 43) after it does not hide it.
    pub last_hardware: u64,
    pub last_hardware_at: Option<SystemTime>,
}

impl XidTally {
    pub fn record(&mut self, xid: u64, at: SystemTime) {
        self.count += 1;
        (self.last, self.last_at) = (xid, Some(at));
        if super::gpu::HARDWARE_XIDS.contains(&xid) {
            (self.last_hardware, self.last_hardware_at) = (xid, Some(at));
        }
    }
}

/// XID events per GPU UUID.
pub type XidCounts = Arc<Mutex<BTreeMap<String, XidTally>>>;

/// Counts XID critical errors from NVML's event set on a thread of its own.
#[derive(Default)]
pub struct XidWatcher {
    pub counts: XidCounts,
    /// Set when XID events are not watched on some or all GPUs for a reason that is no GPU's
    /// fault (no event API, the event set or thread could not be made, a GPU that does not
    /// support the event): a note beside the reading, not a failure of it.
    pub error: Option<String>,
    /// GPUs (by UUID) whose registration failed, and why: their XID count is unknown.
    pub unregistered: BTreeMap<String, String>,
}

impl XidWatcher {
    /// Registers every GPU for XID events and starts the waiting thread (it lives as long as
    /// the process, like the library).
    pub fn start(nvml: &'static Nvml) -> XidWatcher {
        let counts: XidCounts = Arc::default();
        let create: Option<unsafe extern "C" fn(*mut *mut c_void) -> c_int> =
            nvml.symbol("nvmlEventSetCreate");
        let register: Option<unsafe extern "C" fn(Device, c_ulonglong, *mut c_void) -> c_int> =
            nvml.symbol("nvmlDeviceRegisterEvents");
        let wait: Option<unsafe extern "C" fn(*mut c_void, *mut u8, c_uint) -> c_int> =
            nvml.symbol("nvmlEventSetWait_v2");
        let (Some(create), Some(register), Some(wait)) = (create, register, wait) else {
            return XidWatcher {
                counts,
                error: Some("this NVML has no event API".into()),
                ..XidWatcher::default()
            };
        };
        let mut set: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let code = unsafe { create(&mut set) };
        if code != SUCCESS {
            return XidWatcher {
                counts,
                error: Some(format!("nvmlEventSetCreate: {}", nvml.error_string(code))),
                ..XidWatcher::default()
            };
        }
        let mut uuids = BTreeMap::new();
        let mut unsupported = Vec::new();
        let mut unregistered = BTreeMap::new();
        for i in 0..nvml.count().unwrap_or(0) {
            let Ok(d) = nvml.device(i) else { continue };
            // SAFETY: a device handle from NVML and the event set just created.
            let code = unsafe { register(d, EVENT_XID_CRITICAL, set) };
            let uuid = match nvml.string("nvmlDeviceGetUUID", d) {
                Answer::Value(u) => u,
                _ => String::new(),
            };
            match code {
                SUCCESS => {}
                ERROR_NOT_SUPPORTED => unsupported.push(format!("GPU {i}")),
                code => {
                    unregistered.insert(uuid.clone(), nvml.error_string(code));
                }
            }
            if !uuid.is_empty() {
                uuids.insert(d as usize, uuid.clone());
                counts
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(uuid, XidTally::default());
            }
        }
        let shared = counts.clone();
        let set = set as usize;
        let spawned = std::thread::Builder::new()
            .name("nvml-xid".into())
            .spawn(move || {
                loop {
                    // nvmlEventData_t: device, eventType, eventData (then instance ids); the
                    // buffer is larger than the struct.
                    let mut data = [0u8; 64];
                    // SAFETY: the event set lives for the process; the buffer outlives the call.
                    let code = unsafe { wait(set as *mut c_void, data.as_mut_ptr(), 1000) };
                    match code {
                        SUCCESS => {
                            let word = |at: usize| {
                                u64::from_ne_bytes(data[at..at + 8].try_into().expect("8"))
                            };
                            let (device, xid) = (word(0) as usize, word(16));
                            let uuid = uuids.get(&device).cloned().unwrap_or_default();
                            tracing::warn!(gpu = %uuid, xid, "NVIDIA XID critical error");
                            let mut c = shared.lock().unwrap_or_else(PoisonError::into_inner);
                            c.entry(uuid).or_default().record(xid, SystemTime::now());
                        }
                        ERROR_TIMEOUT => {}
                        code => {
                            tracing::warn!(code, "nvmlEventSetWait_v2 failed; XID watch paused");
                            std::thread::sleep(Duration::from_secs(10));
                        }
                    }
                }
            });
        XidWatcher {
            counts,
            error: match spawned {
                Err(e) => Some(format!("start the XID thread: {e}")),
                Ok(_) if !unsupported.is_empty() => Some(format!(
                    "XID events not supported on {}",
                    unsupported.join(", ")
                )),
                Ok(_) => None,
            },
            unregistered,
        }
    }
}

/// NVML loaded for the process, and its XID watcher.
pub struct Loaded {
    pub nvml: &'static Nvml,
    pub xid: XidWatcher,
}

/// First wait before NVML is tried again after it could not be loaded.
const RETRY_FIRST: Duration = Duration::from_secs(10);
/// Longest wait between tries (the wait doubles from [`RETRY_FIRST`] up to this).
const RETRY_MAX: Duration = Duration::from_secs(600);

/// The last failure to load NVML and when to try again.
#[derive(Debug)]
struct Failure {
    library: String,
    why: Unavailable,
    wait: Duration,
    next: Instant,
}

/// Where NVML is kept: loaded once and for good, or the last failure until its retry is due.
#[derive(Default)]
struct Cell {
    loaded: OnceLock<Loaded>,
    failure: Mutex<Option<Failure>>,
}

impl Cell {
    /// The loaded NVML, or why not. Success is kept for the process (NVML is process-wide
    /// state and the XID thread holds it); a failure only until its retry is due, so a driver
    /// that was still loading when the agent started (or is reinstalled) is found later. Tries
    /// are spaced by a doubling wait so that a node without a working driver is not probed on
    /// every collection. A call naming another library tries it at once.
    fn get(
        &self,
        library: &str,
        now: Instant,
        load: impl FnOnce() -> Result<Loaded, Unavailable>,
    ) -> Result<&Loaded, Unavailable> {
        if let Some(l) = self.loaded.get() {
            return Ok(l);
        }
        // Held while loading: one caller loads, the others wait for its outcome.
        let mut failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = self.loaded.get() {
            return Ok(l);
        }
        if let Some(f) = failure.as_ref()
            && f.library == library
            && now < f.next
        {
            return Err(f.why.clone());
        }
        match load() {
            Ok(l) => {
                *failure = None;
                Ok(self.loaded.get_or_init(|| l))
            }
            Err(why) => {
                let wait = match failure.as_ref() {
                    Some(f) if f.library == library => (f.wait * 2).min(RETRY_MAX),
                    _ => RETRY_FIRST,
                };
                *failure = Some(Failure {
                    library: library.to_owned(),
                    why: why.clone(),
                    wait,
                    next: now + wait,
                });
                Err(why)
            }
        }
    }
}

/// Loads `library` (once it succeeds, later calls return it, whatever library they name: NVML
/// is process-wide state); a failure is retried after a doubling wait.
pub fn loaded(library: &str) -> Result<&'static Loaded, Unavailable> {
    static CELL: OnceLock<Cell> = OnceLock::new();
    CELL.get_or_init(Cell::default)
        .get(library, Instant::now(), || {
            let nvml: &'static Nvml = Box::leak(Box::new(Nvml::load(library)?));
            let xid = XidWatcher::start(nvml);
            Ok(Loaded { nvml, xid })
        })
}

/// One GPU's answers, or its index and why its handle could not be had.
pub type GpuAnswer = Result<NvmlGpu, (u32, String)>;

/// Reads every GPU NVML sees: per GPU the answer or the error code of its handle (a lost GPU
/// answers `NVML_ERROR_GPU_IS_LOST`).
pub fn read_all(nvml: &Nvml) -> Result<Vec<GpuAnswer>, String> {
    let n = nvml
        .count()
        .map_err(|code| format!("nvmlDeviceGetCount: {}", nvml.error_string(code)))?;
    Ok((0..n)
        .map(|i| {
            nvml.read(i).map_err(|code| {
                let lost = if code == ERROR_GPU_IS_LOST {
                    " (the GPU fell off the bus)"
                } else {
                    ""
                };
                (i, format!("{}{lost}", nvml.error_string(code)))
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_no_library() {
        match Nvml::load("libnodekeeper-no-such-nvml.so.1") {
            Err(Unavailable::NoLibrary(why)) => assert!(why.contains("no-such"), "{why}"),
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("loaded a library that does not exist"),
        }
    }

    #[test]
    fn a_failed_load_is_retried_after_a_doubling_wait_and_success_sticks() {
        let cell = Cell::default();
        let t0 = Instant::now();
        let tries = std::cell::Cell::new(0);
        let fail = || {
            tries.set(tries.get() + 1);
            Err(Unavailable::InitFailed("Driver Not Loaded".into()))
        };
        assert!(cell.get("libnvidia-ml.so.1", t0, fail).is_err());
        // Within the wait the failure is answered without a try.
        let at = |d: Duration| t0 + d;
        assert!(
            cell.get("libnvidia-ml.so.1", at(RETRY_FIRST / 2), fail)
                .is_err()
        );
        assert_eq!(tries.get(), 1);
        // Then tried again, and the next wait is twice as long.
        assert!(
            cell.get("libnvidia-ml.so.1", at(RETRY_FIRST), fail)
                .is_err()
        );
        assert_eq!(tries.get(), 2);
        assert!(
            cell.get("libnvidia-ml.so.1", at(RETRY_FIRST * 2), fail)
                .is_err()
        );
        assert_eq!(tries.get(), 2);
        // Another library is tried at once.
        assert!(cell.get("libother.so", at(RETRY_FIRST * 2), fail).is_err());
        assert_eq!(tries.get(), 3);
        // The driver came up: the next due try loads NVML, and that is kept.
        let nvml: &'static Nvml = Box::leak(Box::new(Nvml {
            handle: std::ptr::null_mut(),
        }));
        let ok = || {
            Ok(Loaded {
                nvml,
                xid: XidWatcher::default(),
            })
        };
        assert!(
            cell.get("libnvidia-ml.so.1", at(RETRY_FIRST * 3), ok)
                .is_ok()
        );
        assert!(
            cell.get("libnvidia-ml.so.1", at(RETRY_FIRST * 3), fail)
                .is_ok()
        );
        assert_eq!(tries.get(), 3);
    }

    #[test]
    fn a_library_without_nvml_is_refused_by_its_missing_symbol() {
        // libc is loaded in every process and has no nvmlInit_v2.
        match Nvml::load("libc.so.6") {
            Err(Unavailable::InitFailed(why)) => assert!(why.contains("nvmlInit_v2"), "{why}"),
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("libc is not NVML"),
        }
    }
}
