//! The kernel log reader: `/dev/kmsg` records (`prio,seq,ts_usec,flags;message`, followed by
//! dictionary lines that start with a space) read one by one on a thread of their own and fed
//! to the kmsg rule files. Memory stays bounded when the log floods: records are matched as they
//! are read (the kernel's ring buffer is the only queue), a line is cut at [`MAX_LINE_BYTES`],
//! and records the kernel overwrote before they were read are counted from the sequence gaps.

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use super::persist::{Persist, Snapshot};
use super::rules::LogMonitor;
use super::state::{SharedState, lock};

/// Longest record line kept; the kernel's own limit is about 1 KiB, a file stand-in may hold more.
pub const MAX_LINE_BYTES: usize = 8 * 1024;
/// How long to wait at the end of a file (or a FIFO without a writer) before reading again.
const IDLE_POLL: Duration = Duration::from_millis(100);
/// How long to wait before reopening a log that cannot be opened.
const REOPEN: Duration = Duration::from_secs(5);
/// How far before the real boot [`boot_time`] may be: `btime` is in whole seconds.
const BOOT_ROUNDING: Duration = Duration::from_secs(1);

/// One parsed `/dev/kmsg` record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Syslog priority and facility (`facility << 3 | level`).
    pub priority: u32,
    pub seq: u64,
    /// Microseconds since boot.
    pub ts_usec: u64,
    /// The message, decoded lossily (invalid UTF-8 becomes U+FFFD) and trimmed, as NPD trims it.
    pub message: String,
}

/// Parses one record line (without its dictionary lines). `None` when it is not a record.
pub fn parse_record(line: &[u8]) -> Option<Record> {
    let semi = line.iter().position(|&b| b == b';')?;
    let header = std::str::from_utf8(&line[..semi]).ok()?;
    let mut fields = header.split(',');
    let priority = fields.next()?.parse().ok()?;
    let seq = fields.next()?.parse().ok()?;
    let ts_usec = fields.next()?.parse().ok()?;
    let text = String::from_utf8_lossy(&line[semi + 1..]);
    Some(Record {
        priority,
        seq,
        ts_usec,
        message: text.trim().to_owned(),
    })
}

/// Boot time, the same at every agent start on one boot: the kernel's own, `btime` in
/// `/proc/stat` (whole seconds). The kernel records an agent reads again after a restart (its
/// lookback) so keep the timestamps they had, and the controller, which compares timestamps
/// when an agent restarts, does not take them for new problems. NPD's now minus `/proc/uptime`
/// moves at every start (uptime's 10 ms steps, the time between the two reads), and so did the
/// replayed records' timestamps. `btime` moves only when the wall clock is stepped. Without a
/// `btime` line, NPD's way.
pub fn boot_time() -> std::io::Result<SystemTime> {
    boot_time_in(Path::new("/proc"), SystemTime::now())
}

/// [`boot_time`] with `/proc` at `proc_root`, `now` being the time now.
pub fn boot_time_in(proc_root: &Path, now: SystemTime) -> std::io::Result<SystemTime> {
    let stat = std::fs::read_to_string(proc_root.join("stat"));
    if let Some(btime) = stat.as_deref().ok().and_then(btime) {
        return Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(btime));
    }
    let path = proc_root.join("uptime");
    let uptime = std::fs::read_to_string(&path).map_err(|error| {
        std::io::Error::new(
            error.kind(),
            format!(
                "no btime in {} and {} unreadable: {error}",
                proc_root.join("stat").display(),
                path.display()
            ),
        )
    })?;
    let secs: f64 = uptime
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::new(ErrorKind::InvalidData, "odd /proc/uptime"))?;
    Ok(now - Duration::from_secs_f64(secs))
}

/// The `btime` line of `/proc/stat`: boot time in seconds since the Unix epoch.
fn btime(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|line| line.strip_prefix("btime ")?.trim().parse().ok())
}

/// The condition message while the kernel log cannot be opened: the path, the error and the fix.
pub fn unreadable_message(path: &Path, error: &std::io::Error) -> String {
    format!(
        "kernel log {} cannot be opened ({error}), so kernel problems are not known; run the \
         agent privileged (Helm: agent.privileged=true), as containerd and CRI-O need for \
         /dev/kmsg, or turn the kernel-log monitor off (Helm: agent.hostMounts.kmsg=false; \
         flag: --kernel-monitor=false)",
        path.display()
    )
}

/// Where to read and what to apply.
pub struct KmsgReader {
    pub path: PathBuf,
    pub boot: SystemTime,
    pub monitors: Vec<LogMonitor>,
    pub state: SharedState,
    /// Set to stop; checked after every record and while idle (the log is read non-blocking,
    /// so the thread ends within 100 ms of the request).
    pub stop: Arc<AtomicBool>,
    /// Stop at the end of the input instead of waiting for more (tests and one-shot reads).
    pub stop_at_end: bool,
    /// Told once the backlog has been read (or the log cannot be opened), so that the first
    /// report already holds what the backlog showed.
    pub caught_up: Option<tokio::sync::oneshot::Sender<()>>,
    /// Where the `True` conditions are kept across agent restarts on one boot; `None`: not kept.
    pub persist: Option<Persist>,
}

/// What one read loop saw (for tests and logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    pub records: u64,
    pub skipped_before_start: u64,
    pub malformed: u64,
    pub truncated: u64,
    pub lost: u64,
    /// Records at or before the last sequence number read (seen again after a reopen).
    pub already_read: u64,
}

impl KmsgReader {
    /// Runs on the calling thread until stopped; reopens the log when it cannot be read.
    pub fn run(mut self) -> ReadStats {
        let mut stats = ReadStats::default();
        let now = SystemTime::now();
        {
            let mut state = lock(&self.state);
            for m in &self.monitors {
                m.declare(&mut state, now);
            }
        }
        // A record's time is `boot` plus its stamp, and `boot` (whole seconds, [`boot_time`])
        // may be up to a second before the real boot: a record written right after this start
        // may read as up to a second before it, and must not be skipped as older.
        let starts: Vec<SystemTime> = self
            .monitors
            .iter()
            .map(|m| m.start_time(self.boot, now - BOOT_ROUNDING))
            .collect();
        let mut keeper = self
            .persist
            .take()
            .map(|p| Keeper::restore(p, &self.monitors, &self.state));
        let origin = self.path.display().to_string();
        // Kept across reopens: a reopened /dev/kmsg starts again at its oldest record, and what
        // was already read must not fire twice.
        let mut last_seq: Option<u64> = None;
        while !self.stop.load(Ordering::Relaxed) {
            let opened = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&self.path);
            let file = match opened {
                Ok(f) => {
                    let mut state = lock(&self.state);
                    state.clear_refusals(&origin);
                    let now = SystemTime::now();
                    for m in &self.monitors {
                        m.known(&mut state, now);
                    }
                    drop(state);
                    f
                }
                Err(e) => {
                    self.signal_caught_up();
                    let mut state = lock(&self.state);
                    if !state.refusals().iter().any(|r| r.origin == origin) {
                        state.refuse(&origin, "", &format!("open kernel log: {e}; retrying"));
                    }
                    // Healthy would be a claim the monitor cannot make without the log.
                    let why = unreadable_message(&self.path, &e);
                    let now = SystemTime::now();
                    for m in &self.monitors {
                        m.unknown(&why, &mut state, now);
                    }
                    drop(state);
                    if self.stop_at_end {
                        break;
                    }
                    self.sleep(REOPEN);
                    continue;
                }
            };
            self.read(file, &starts, &mut stats, &mut last_seq, keeper.as_mut());
            if self.stop_at_end {
                break;
            }
            // A read error ended that pass; do not spin on a log that keeps failing.
            self.sleep(REOPEN);
        }
        stats
    }

    fn signal_caught_up(&mut self) {
        if let Some(tx) = self.caught_up.take() {
            let _ = tx.send(());
        }
    }

    fn sleep(&self, total: Duration) {
        let step = IDLE_POLL.min(total);
        let mut slept = Duration::ZERO;
        while slept < total && !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(step);
            slept += step;
        }
    }

    fn read(
        &mut self,
        file: File,
        starts: &[SystemTime],
        stats: &mut ReadStats,
        last_seq: &mut Option<u64>,
        mut keeper: Option<&mut Keeper>,
    ) {
        let mut reader = BufReader::with_capacity(16 * 1024, file);
        let mut pending = Line::default();
        while !self.stop.load(Ordering::Relaxed) {
            let complete = match read_line_bounded(&mut reader, &mut pending, MAX_LINE_BYTES) {
                Ok(complete) => complete,
                // The log is opened non-blocking so that a stop request is seen while idle.
                Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                // /dev/kmsg answers EPIPE when the record to read was overwritten; the next
                // read continues at the oldest record still there, and the gap counts it.
                Err(e) if e.kind() == ErrorKind::BrokenPipe => {
                    pending.clear();
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(error = %e, path = %self.path.display(), "read kernel log");
                    return;
                }
            };
            if !complete {
                self.signal_caught_up();
                // A line without its newline yet stays pending, unless the input has ended.
                if !self.stop_at_end {
                    std::thread::sleep(IDLE_POLL);
                    continue;
                }
                if pending.bytes.is_empty() {
                    return;
                }
            }
            if pending.truncated {
                stats.truncated += 1;
            }
            if self.handle(&pending.bytes, starts, stats, last_seq) > 0
                && let Some(k) = keeper.as_deref_mut()
            {
                k.save_if_changed(&self.state);
            }
            pending.clear();
        }
    }

    fn handle(
        &mut self,
        line: &[u8],
        starts: &[SystemTime],
        stats: &mut ReadStats,
        last_seq: &mut Option<u64>,
    ) -> usize {
        // Dictionary lines (` SUBSYSTEM=…`) belong to the record before them.
        if line.first() == Some(&b' ') || line.is_empty() {
            return 0;
        }
        let Some(record) = parse_record(line) else {
            stats.malformed += 1;
            return 0;
        };
        if last_seq.is_some_and(|prev| record.seq <= prev) {
            stats.already_read += 1;
            return 0;
        }
        stats.records += 1;
        if let Some(prev) = *last_seq
            && record.seq > prev + 1
        {
            let gap = record.seq - prev - 1;
            stats.lost += gap;
            lock(&self.state).add_lost(gap);
        }
        *last_seq = Some(record.seq);
        if record.message.is_empty() {
            return 0;
        }
        let at = self.boot + Duration::from_micros(record.ts_usec);
        let mut state = None;
        let mut fired = 0;
        for (monitor, start) in self.monitors.iter_mut().zip(starts) {
            if at < *start {
                stats.skipped_before_start += 1;
                continue;
            }
            // Every monitor's buffer must see every line, so the lock is taken once per record.
            let guard = state.get_or_insert_with(|| lock(&self.state));
            fired += monitor.process(&record.message, at, guard);
        }
        fired
    }
}

/// The reader's kept conditions: restored at start, saved whenever the set of `True` ones
/// changes (a permanent rule firing; rare, so a synced write each time is cheap).
struct Keeper {
    persist: Persist,
    /// The condition types of the reader's rule files.
    kinds: Vec<String>,
    saved: Snapshot,
}

impl Keeper {
    fn restore(persist: Persist, monitors: &[LogMonitor], state: &SharedState) -> Keeper {
        let kinds: Vec<String> = monitors
            .iter()
            .flat_map(|m| m.conditions.iter().map(|c| c.kind.clone()))
            .collect();
        let mut state = lock(state);
        let restored = persist.restore(&kinds, &mut state);
        if restored > 0 {
            tracing::info!(
                restored,
                path = %persist.path.display(),
                "kernel-log conditions of this boot restored"
            );
        }
        let saved = Persist::snapshot(&kinds, &state);
        Keeper {
            persist,
            kinds,
            saved,
        }
    }

    fn save_if_changed(&mut self, state: &SharedState) {
        let now = Persist::snapshot(&self.kinds, &lock(state));
        if now == self.saved {
            return;
        }
        match self.persist.save(&now) {
            Ok(()) => self.saved = now,
            Err(error) => tracing::warn!(
                %error,
                path = %self.persist.path.display(),
                "keep kernel-log conditions; an agent restart on this boot shows them healthy"
            ),
        }
    }
}

/// A line being read: at most the reader's limit kept, and whether more was dropped.
#[derive(Default)]
pub(super) struct Line {
    pub(super) bytes: Vec<u8>,
    pub(super) truncated: bool,
}

impl Line {
    pub(super) fn clear(&mut self) {
        self.bytes.clear();
        self.truncated = false;
    }
}

/// Reads into `line` up to the next newline, keeping at most `max` bytes of it; `Ok(false)` when
/// the input has no more for now (the part read so far stays in `line`).
pub(super) fn read_line_bounded(
    reader: &mut impl BufRead,
    line: &mut Line,
    max: usize,
) -> std::io::Result<bool> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(false);
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1),
            None => (buf, buf.len()),
        };
        let room = max.saturating_sub(line.bytes.len());
        if chunk.len() > room {
            line.truncated = true;
        }
        line.bytes
            .extend_from_slice(&chunk[..chunk.len().min(room)]);
        let ended = done > chunk.len();
        reader.consume(done);
        if ended {
            return Ok(true);
        }
    }
}

/// A started reader thread (kernel log or journal).
pub struct Running<S = ReadStats> {
    pub stop: Arc<AtomicBool>,
    pub thread: std::thread::JoinHandle<S>,
    /// Resolves once the backlog has been read.
    pub caught_up: tokio::sync::oneshot::Receiver<()>,
}

/// Starts `run` on a thread of its own named `name` (reading and matching must not hold a
/// runtime worker), handing it the stop flag and the caught-up signal.
pub(super) fn start_thread<S: Send + 'static>(
    name: &str,
    run: impl FnOnce(Arc<AtomicBool>, tokio::sync::oneshot::Sender<()>) -> S + Send + 'static,
) -> Running<S> {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, caught_up) = tokio::sync::oneshot::channel();
    let flag = stop.clone();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || run(flag, tx))
        .unwrap_or_else(|e| panic!("spawn the {name} thread: {e}"));
    Running {
        stop,
        thread,
        caught_up,
    }
}

/// Starts the kernel log reader on its own thread.
pub fn spawn(
    path: &Path,
    boot: SystemTime,
    monitors: Vec<LogMonitor>,
    state: SharedState,
    persist: Option<Persist>,
) -> Running {
    let path = path.to_owned();
    start_thread("kmsg", move |stop, tx| {
        KmsgReader {
            path,
            boot,
            monitors,
            state,
            stop,
            stop_at_end: false,
            caught_up: Some(tx),
            persist,
        }
        .run()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_records_lossily() {
        let r = parse_record(b"6,339,5140900,-;NET: Registered protocol family 10").unwrap();
        assert_eq!((r.priority, r.seq, r.ts_usec), (6, 339, 5_140_900));
        assert_eq!(r.message, "NET: Registered protocol family 10");
        let r = parse_record(b"3,1,2,c;bad \xff\xfe bytes  ").unwrap();
        assert_eq!(r.message, "bad \u{fffd}\u{fffd} bytes");
        assert!(parse_record(b" SUBSYSTEM=pci").is_none());
        assert!(parse_record(b"x,1,2,-;msg").is_none());
        assert!(parse_record(b"no header at all").is_none());
    }

    #[test]
    fn boot_time_is_the_kernels_at_every_agent_start_on_one_boot() {
        let proc = tempfile::tempdir().unwrap();
        std::fs::write(
            proc.path().join("stat"),
            "cpu  10 0 5 100 0 0 0 0 0 0\ncpu0 10 0 5 100 0 0 0 0 0 0\nintr 1\nbtime 1795280706\n",
        )
        .unwrap();
        std::fs::write(proc.path().join("uptime"), "1234.56 2000.00\n").unwrap();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_282_000);
        let boot = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_280_706);
        // Two starts 3 ms (and an uptime step) apart read the same boot, so a kernel record
        // read again gets the timestamp it had.
        assert_eq!(boot_time_in(proc.path(), now).unwrap(), boot);
        std::fs::write(proc.path().join("uptime"), "1234.57 2000.00\n").unwrap();
        assert_eq!(
            boot_time_in(proc.path(), now + Duration::from_millis(3)).unwrap(),
            boot
        );
        // Without btime: now minus the uptime, as NPD does.
        std::fs::write(proc.path().join("stat"), "cpu  1 2 3 4\n").unwrap();
        std::fs::write(proc.path().join("uptime"), "1234.5 2000.00\n").unwrap();
        assert_eq!(
            boot_time_in(proc.path(), now).unwrap(),
            now - Duration::from_millis(1_234_500)
        );
        std::fs::remove_file(proc.path().join("uptime")).unwrap();
        let error = boot_time_in(proc.path(), now).unwrap_err().to_string();
        assert!(error.contains("no btime in"), "{error}");
    }

    #[test]
    fn long_lines_are_cut_and_partial_lines_wait() {
        let mut input = vec![b'a'; MAX_LINE_BYTES * 3];
        input.extend_from_slice(b"\nnext\npart");
        let mut reader = BufReader::with_capacity(100, &input[..]);
        let mut line = Line::default();
        assert!(read_line_bounded(&mut reader, &mut line, MAX_LINE_BYTES).unwrap());
        assert!(line.truncated);
        assert_eq!(line.bytes.len(), MAX_LINE_BYTES);
        line.clear();
        assert!(read_line_bounded(&mut reader, &mut line, MAX_LINE_BYTES).unwrap());
        assert_eq!(
            (line.bytes.as_slice(), line.truncated),
            (&b"next"[..], false)
        );
        line.clear();
        assert!(!read_line_bounded(&mut reader, &mut line, MAX_LINE_BYTES).unwrap());
        assert_eq!(line.bytes, b"part");
    }
}
