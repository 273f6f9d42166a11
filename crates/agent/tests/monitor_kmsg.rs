//! The kernel-log monitor fed through a `/dev/kmsg` stand-in (a file, and a FIFO) with lines in
//! the kernel's own printk formats, one or more for every built-in rule (NPD v1.36.0
//! kernel-monitor.json and readonly-monitor.json): each permanent rule turns its condition True
//! with its reason, each temporary rule counts an Event-worthy problem. Also: lookback, records
//! lost to the ring buffer, non-UTF-8 text, a flood, and an invalid rule next to good ones.

use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime};

use nodekeeper_agent::monitor::kmsg::{self, KmsgReader, ReadStats};
use nodekeeper_agent::monitor::persist::Persist;
use nodekeeper_agent::monitor::state::{
    ConditionStatus, MAX_RECENT, ProblemState, SharedState, lock,
};
use nodekeeper_agent::monitor::{self, rules::LogMonitor};

/// The node booted an hour ago; records are stamped relative to that.
const UPTIME: Duration = Duration::from_secs(3600);

/// Formats one record as `/dev/kmsg` prints it, `age` before now.
fn record(seq: u64, age: Duration, message: &str) -> String {
    let ts = (UPTIME - age).as_micros();
    format!("3,{seq},{ts},-;{message}\n")
}

struct Feed {
    lines: String,
    seq: u64,
}

impl Feed {
    fn new() -> Feed {
        Feed {
            lines: String::new(),
            seq: 1000,
        }
    }
    fn push(&mut self, message: &str) -> &mut Feed {
        self.push_aged(Duration::from_secs(1), message)
    }
    fn push_aged(&mut self, age: Duration, message: &str) -> &mut Feed {
        self.seq += 1;
        self.lines.push_str(&record(self.seq, age, message));
        self
    }
}

/// Reads `path` to its end through the built-in rules plus those in `dir`.
fn read_file(path: &Path, dir: Option<&Path>) -> (ProblemState, ReadStats) {
    let shared = ProblemState::new_shared();
    let loaded = monitor::load(dir, &mut lock(&shared));
    let stats = read_with(path, loaded.log_monitors, &shared);
    let state = lock(&shared).clone();
    (state, stats)
}

fn read_with(path: &Path, monitors: Vec<LogMonitor>, shared: &SharedState) -> ReadStats {
    KmsgReader {
        path: path.to_owned(),
        boot: SystemTime::now() - UPTIME,
        monitors,
        state: shared.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        stop_at_end: true,
        caught_up: None,
        persist: None,
    }
    .run()
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Real kernel lines, by the rule reason they must trigger. Sources: mm/oom_kill.c
/// (`__oom_kill_process`), kernel/hung_task.c, net/core/dev.c (`netdev_wait_allrefs`),
/// arch/x86/mm/fault.c (pre-4.17 wording), arch/x86/kernel/dumpstack.c (`__die_header` on a
/// non-PREEMPT, non-PTI build), fs/ext4/super.c, fs/buffer.c, fs/xfs/xfs_fsops.c
/// (`xfs_do_force_shutdown`), drivers/edac/edac_mc.c, drivers/firmware/efi/cper.c. The modern
/// KernelOops lines (built-in kernel-monitor-modern.json) follow arch/x86/mm/fault.c
/// `show_fault_oops()` since v5.2 (`"BUG: kernel NULL pointer dereference, address: %px"`,
/// `"BUG: unable to handle page fault for address: %px"`) and arch/x86/kernel/dumpstack.c
/// `__die_header()` (`"%s: %04lx [#%d]%s%s%s%s%s"` with " PREEMPT", " SMP", " PTI"/" NOPTI"
/// since v4.15; `"Oops: %s: %04lx [#%d]…"` since v6.9; the preemption model moved out of it
/// in v6.15).
const TEMPORARY: &[(&str, &str)] = &[
    (
        "OOMKilling",
        "Out of memory: Killed process 4242 (stress-ng) total-vm:8426496kB, anon-rss:7845632kB, \
         file-rss:4kB, shmem-rss:0kB, UID:0 pgtables:15440kB oom_score_adj:0",
    ),
    (
        "OOMKilling",
        "Memory cgroup out of memory: Killed process 977 (java) total-vm:4417180kB, \
         anon-rss:1047712kB, file-rss:21224kB, shmem-rss:0kB, UID:1000 pgtables:2452kB oom_score_adj:936",
    ),
    (
        "TaskHung",
        "INFO: task kworker/u8:2:1234 blocked for more than 120 seconds.",
    ),
    (
        "UnregisterNetDevice",
        "unregister_netdevice: waiting for eth0 to become free. Usage count = 1",
    ),
    (
        "KernelOops",
        "BUG: unable to handle kernel NULL pointer dereference at 0000000000000008",
    ),
    ("KernelOops", "divide error: 0000 [#1] SMP"),
    (
        "KernelOops",
        "BUG: kernel NULL pointer dereference, address: 0000000000000008",
    ),
    (
        "KernelOops",
        "BUG: unable to handle page fault for address: ffffc90000a3f000",
    ),
    ("KernelOops", "divide error: 0000 [#1] SMP PTI"),
    ("KernelOops", "divide error: 0000 [#1] PREEMPT SMP NOPTI"),
    (
        "KernelOops",
        "Oops: divide error: 0000 [#1] PREEMPT SMP NOPTI",
    ),
    ("KernelOops", "Oops: divide error: 0000 [#1] SMP NOPTI"),
    ("KernelOops", "Oops: divide error: 0000 [#1] SMP"),
    (
        "Ext4Error",
        "EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm ls: reading directory lblock 0",
    ),
    (
        "Ext4Warning",
        "EXT4-fs warning (device sda1): ext4_dx_add_entry:2461: Directory (ino: 1234) index full, \
         reach max htree level :2",
    ),
    (
        "IOError",
        "Buffer I/O error on dev sdb1, logical block 0, async page read",
    ),
    (
        "MemoryReadError",
        "EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0 (channel:1 slot:0 \
         page:0x3a1c9 offset:0x2c0 grain:32 syndrome:0x0 - area:DRAM err_code:0001:0091 socket:0 \
         ha:0 channel_mask:2 rank:0)",
    ),
    (
        "CperHardwareErrorCorrected",
        "{1}[Hardware Error]: event severity: corrected",
    ),
    (
        "CperHardwareErrorRecoverable",
        "{2}[Hardware Error]: event severity: recoverable",
    ),
];

/// Permanent rules: (line, condition type, reason). The DockerHung line also counts a TaskHung.
const PERMANENT: &[(&str, &str, &str)] = &[
    (
        "XFS (dm-0): Corruption of in-memory data (0x8) detected at xfs_trans_cancel+0x12f/0x150 \
         [xfs] (fs/xfs/xfs_trans.c:1104).  Shutting down filesystem.",
        "XfsShutdown",
        "XfsHasShutdown",
    ),
    (
        "{3}[Hardware Error]: event severity: fatal",
        "CperHardwareErrorFatal",
        "CperHardwareErrorFatal",
    ),
    (
        "INFO: task docker:7 blocked for more than 120 seconds.",
        "KernelDeadlock",
        "DockerHung",
    ),
    (
        "EXT4-fs (sda1): Remounting filesystem read-only",
        "ReadonlyFilesystem",
        "FilesystemIsReadOnly",
    ),
];

#[test]
fn every_builtin_rule_fires_on_its_kernel_line() {
    let dir = tempfile::tempdir().unwrap();
    // Before any problem line: every condition is declared healthy.
    let quiet = write(
        dir.path(),
        "quiet",
        &record(1, Duration::from_secs(1), "Linux version 6.8.0"),
    );
    let (state, _) = read_file(&quiet, None);
    let healthy: Vec<_> = state
        .conditions()
        .map(|c| (c.kind.as_str(), c.status, c.reason.as_str()))
        .collect();
    assert_eq!(
        healthy,
        [
            (
                "CperHardwareErrorFatal",
                ConditionStatus::False,
                "CperHardwareHasNoFatalError"
            ),
            (
                "KernelDeadlock",
                ConditionStatus::False,
                "KernelHasNoDeadlock"
            ),
            (
                "ReadonlyFilesystem",
                ConditionStatus::False,
                "FilesystemIsNotReadOnly"
            ),
            ("XfsShutdown", ConditionStatus::False, "XfsHasNotShutDown"),
        ]
    );

    // Each temporary line alone: exactly its reason is counted once, no condition moves.
    for (reason, line) in TEMPORARY {
        let mut feed = Feed::new();
        feed.push("usb 1-1: new high-speed USB device number 2 using xhci_hcd")
            .push(line);
        let path = write(dir.path(), "one", &feed.lines);
        let (state, _) = read_file(&path, None);
        assert_eq!(
            state.counter(reason),
            1,
            "{reason} from {line:?}: {:?}",
            state.counters()
        );
        assert_eq!(
            state.counters().values().sum::<u64>(),
            1,
            "{line:?}: {:?}",
            state.counters()
        );
        let recent = state.recent().last().expect("a problem record");
        assert_eq!(recent.message, *line);
        assert!(
            state
                .conditions()
                .all(|c| c.status == ConditionStatus::False)
        );
    }

    // Each permanent line alone: its condition is True with its reason and the line as message.
    for (line, kind, reason) in PERMANENT {
        let mut feed = Feed::new();
        feed.push(line);
        let path = write(dir.path(), "one", &feed.lines);
        let (state, _) = read_file(&path, None);
        let c = state.condition(kind).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str()),
            (ConditionStatus::True, *reason),
            "{line:?}"
        );
        assert_eq!(c.message, *line);
        let others_true = state
            .conditions()
            .filter(|c| c.status == ConditionStatus::True)
            .count();
        assert_eq!(others_true, 1, "{line:?}");
    }
}

#[test]
fn a_restart_does_not_fire_lines_older_than_the_lookback() {
    let dir = tempfile::tempdir().unwrap();
    let mut feed = Feed::new();
    // Ten minutes ago (NPD's built-in lookback is 5m): ignored after a restart.
    feed.push_aged(
        Duration::from_secs(600),
        "EXT4-fs (sda1): Remounting filesystem read-only",
    )
    .push_aged(
        Duration::from_secs(600),
        "Buffer I/O error on dev sdb1, logical block 0, async page read",
    )
    // A minute ago: inside the window, acted on.
    .push_aged(
        Duration::from_secs(60),
        "Buffer I/O error on dev sdb1, logical block 8, async page read",
    );
    let path = write(dir.path(), "kmsg", &feed.lines);
    let (state, stats) = read_file(&path, None);
    assert_eq!(
        state.condition("ReadonlyFilesystem").unwrap().status,
        ConditionStatus::False
    );
    assert_eq!(state.counter("IOError"), 1);
    // Three monitors (kernel, readonly and kernel-monitor-modern) each skip the two old records.
    assert_eq!(stats.skipped_before_start, 6);
}

#[test]
fn dictionary_lines_gaps_and_bad_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = Vec::new();
    bytes.extend_from_slice(
        record(
            10,
            Duration::from_secs(5),
            "Buffer I/O error on dev sdb1, logical block 0, async page read",
        )
        .as_bytes(),
    );
    // Dictionary lines follow a record and are not records themselves.
    bytes.extend_from_slice(b" SUBSYSTEM=block\n DEVICE=b8:17\n");
    // Records 11..=14 were overwritten before they were read.
    // And the device name holds bytes that are not UTF-8.
    bytes.extend_from_slice(
        format!("3,15,{},-;EXT4-fs error (device sd", UPTIME.as_micros() - 1).as_bytes(),
    );
    bytes.extend_from_slice(b"\xff\xfeb1): ext4_lookup:1700: comm x: bad\n");
    bytes.extend_from_slice(b"not a record at all\n");
    let path = dir.path().join("kmsg");
    std::fs::write(&path, &bytes).unwrap();
    let (state, stats) = read_file(&path, None);
    assert_eq!(state.counter("IOError"), 1);
    assert_eq!(state.counter("Ext4Error"), 1);
    let msg = &state.recent().last().unwrap().message;
    assert!(
        msg.starts_with("EXT4-fs error (device sd\u{fffd}\u{fffd}b1)"),
        "{msg:?}"
    );
    assert_eq!(state.lost_records(), 4);
    assert_eq!((stats.records, stats.malformed, stats.lost), (2, 1, 4));
}

#[test]
fn an_invalid_rule_is_refused_and_the_rest_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules");
    std::fs::create_dir(&rules).unwrap();
    write(
        &rules,
        "gpu.json",
        r#"{
          "plugin": "kmsg", "source": "gpu-monitor", "lookback": "5m",
          "conditions": [{"type": "GpuFellOff", "reason": "GpuOnBus", "message": "all GPUs on the bus"}],
          "rules": [
            {"type": "temporary", "reason": "Broken", "pattern": "NVRM: Xid ((\\d+)"},
            {"type": "temporary", "reason": "NvidiaXid", "pattern": "NVRM: Xid \\(PCI:[0-9a-f:.]+\\): \\d+, .*"},
            {"type": "permanent", "condition": "GpuFellOff", "reason": "GpuFellOffTheBus",
             "pattern": "NVRM: Xid \\(PCI:[0-9a-f:.]+\\): 79, .*"}
          ]
        }"#,
    );
    let mut feed = Feed::new();
    feed.push("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.")
        .push("INFO: task jbd2/sda1-8:300 blocked for more than 122 seconds.");
    let path = write(dir.path(), "kmsg", &feed.lines);
    let (state, _) = read_file(&path, Some(&rules));
    let refused = state.refusals();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(refused[0].origin.ends_with("gpu.json"));
    assert_eq!(refused[0].item, "rules[0] (Broken)");
    assert!(
        refused[0].reason.contains("not a valid regex"),
        "{}",
        refused[0].reason
    );
    assert_eq!(state.counter("NvidiaXid"), 1);
    let c = state.condition("GpuFellOff").unwrap();
    assert_eq!(
        (c.status, c.reason.as_str()),
        (ConditionStatus::True, "GpuFellOffTheBus")
    );
    // The built-in rules still run beside the custom file.
    assert_eq!(state.counter("TaskHung"), 1);
}

#[test]
fn a_flood_keeps_memory_bounded_and_counts_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kmsg");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let total = 100_000u64;
    let mut problems = 0;
    for seq in 0..total {
        let message = if seq % 1000 == 0 {
            problems += 1;
            format!("Buffer I/O error on dev sdb1, logical block {seq}, async page read")
        } else {
            // A kernel line far longer than the kernel allows, every so often.
            let filler = if seq % 977 == 0 { 20_000 } else { 40 };
            format!("audit: type=1400 {}", "x".repeat(filler))
        };
        file.write_all(record(seq, Duration::from_secs(2), &message).as_bytes())
            .unwrap();
    }
    drop(file);
    let (state, stats) = read_file(&path, None);
    assert_eq!(stats.records, total);
    assert_eq!(state.counter("IOError"), problems);
    assert_eq!(state.recent().count(), MAX_RECENT);
    assert!(stats.truncated > 0);
}

/// The monitor on a FIFO, as a long-running thread: lines written later are picked up, and
/// stopping ends the thread.
#[test]
fn a_fifo_is_followed_until_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let shared = ProblemState::new_shared();
    let loaded = monitor::load(None, &mut lock(&shared));
    let kmsg::Running { stop, thread, .. } = kmsg::spawn(
        &fifo,
        SystemTime::now() - UPTIME,
        loaded.log_monitors,
        shared.clone(),
        None,
    );
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    writer
        .write_all(
            record(
                1,
                Duration::from_secs(1),
                "EXT4-fs (nvme0n1p1): Remounting filesystem read-only",
            )
            .as_bytes(),
        )
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if lock(&shared)
            .condition("ReadonlyFilesystem")
            .unwrap()
            .status
            == ConditionStatus::True
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "condition not set within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(writer);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let stats = thread.join().unwrap();
    assert_eq!(stats.records, 1);
}

/// After a reopen, /dev/kmsg starts again at its oldest record; records up to the last sequence
/// number already read are skipped, so nothing fires twice.
#[test]
fn records_read_before_do_not_fire_again() {
    let dir = tempfile::tempdir().unwrap();
    let oom = "Out of memory: Killed process 9 (x) total-vm:1kB, anon-rss:1kB, file-rss:0kB, shmem-rss:0kB";
    let mut lines = String::new();
    for seq in [1, 2, 3, 2, 3, 4] {
        let message = if seq == 3 { oom } else { "usb 1-1: reset" };
        lines.push_str(&record(seq, Duration::from_secs(1), message));
    }
    let path = write(dir.path(), "kmsg", &lines);
    let (state, stats) = read_file(&path, None);
    assert_eq!(state.counter("OOMKilling"), 1);
    assert_eq!((stats.records, stats.already_read, stats.lost), (4, 2, 0));
}

/// A kernel log that cannot be opened leaves every kernel-log condition Unknown (never healthy),
/// with a message naming the path, the error and the fix; once it opens they are healthy again.
#[test]
fn an_unopenable_log_turns_the_conditions_unknown_until_it_opens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kmsg");
    let shared = ProblemState::new_shared();
    let run = |shared: &SharedState| {
        let loaded = monitor::load(None, &mut lock(shared));
        read_with(&path, loaded.log_monitors, shared)
    };
    run(&shared);
    {
        let state = lock(&shared);
        for kind in ["KernelDeadlock", "ReadonlyFilesystem"] {
            let c = state.condition(kind).unwrap();
            assert_eq!(c.status, ConditionStatus::Unknown, "{kind}: {c:?}");
            for part in [
                path.to_str().unwrap(),
                "No such file or directory",
                "agent.privileged=true",
                "agent.hostMounts.kmsg=false",
            ] {
                assert!(
                    c.message.contains(part),
                    "{part:?} missing from {:?}",
                    c.message
                );
            }
        }
        assert!(
            state
                .refusals()
                .iter()
                .any(|r| r.origin == path.to_str().unwrap()),
            "{:?}",
            state.refusals()
        );
    }
    std::fs::write(&path, Feed::new().push("nothing to see").lines.as_str()).unwrap();
    run(&shared);
    let state = lock(&shared);
    for kind in ["KernelDeadlock", "ReadonlyFilesystem"] {
        let c = state.condition(kind).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str()),
            (
                ConditionStatus::False,
                if kind == "KernelDeadlock" {
                    "KernelHasNoDeadlock"
                } else {
                    "FilesystemIsNotReadOnly"
                }
            ),
            "{kind}"
        );
    }
    assert_eq!(state.refusals(), &[]);
}

/// A condition a kernel line turned True survives an agent restart on the same boot (the line
/// is past the lookback window by then), and is healthy again on another boot.
#[test]
fn true_conditions_are_kept_across_restarts_on_one_boot() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    let reader = |path: &Path, boot_id: &str| {
        let shared = ProblemState::new_shared();
        let loaded = monitor::load(None, &mut lock(&shared));
        KmsgReader {
            path: path.to_owned(),
            boot: SystemTime::now() - UPTIME,
            monitors: loaded.log_monitors,
            state: shared.clone(),
            stop: Arc::new(AtomicBool::new(false)),
            stop_at_end: true,
            caught_up: None,
            persist: Some(Persist::new(&state_dir, boot_id.to_owned())),
        }
        .run();
        lock(&shared).clone()
    };
    let readonly = |s: &ProblemState| {
        let c = s.condition("ReadonlyFilesystem").unwrap();
        (c.status, c.reason.clone())
    };
    let first = write(
        dir.path(),
        "kmsg-1",
        &Feed::new()
            .push("EXT4-fs (sda1): Remounting filesystem read-only")
            .lines,
    );
    let before = reader(&first, "boot-a");
    assert_eq!(
        readonly(&before),
        (ConditionStatus::True, "FilesystemIsReadOnly".into())
    );
    // After the restart the line is older than the 5 min lookback: it does not fire again.
    let later = write(
        dir.path(),
        "kmsg-2",
        &Feed::new()
            .push_aged(
                Duration::from_secs(1800),
                "EXT4-fs (sda1): Remounting filesystem read-only",
            )
            .push("nothing new")
            .lines,
    );
    let after = reader(&later, "boot-a");
    assert_eq!(
        readonly(&after),
        (ConditionStatus::True, "FilesystemIsReadOnly".into())
    );
    let c = after.condition("ReadonlyFilesystem").unwrap();
    assert_eq!(
        c.message,
        before.condition("ReadonlyFilesystem").unwrap().message
    );
    // Restoring does not count the problem a second time.
    assert_eq!(after.counter("FilesystemIsReadOnly"), 0);
    assert_eq!(
        after.condition("KernelDeadlock").unwrap().status,
        ConditionStatus::False
    );
    let rebooted = reader(&later, "boot-b");
    assert_eq!(
        readonly(&rebooted),
        (ConditionStatus::False, "FilesystemIsNotReadOnly".into())
    );
}

/// A whole modern page-fault oops, as a 6.x kernel prints it (fault.c's BUG and #PF lines, the
/// page-table dump, dumpstack.c's header with the `Oops: ` prefix): one KernelOops, not one per
/// line that names it.
#[test]
fn a_modern_oops_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut feed = Feed::new();
    for line in [
        "BUG: kernel NULL pointer dereference, address: 0000000000000018",
        "#PF: supervisor read access in kernel mode",
        "#PF: error_code(0x0000) - not-present page",
        "PGD 1c2383067 P4D 1c2383067 PUD 20b703067 PMD 0",
        "Oops: Oops: 0000 [#1] SMP NOPTI",
        "CPU: 8 UID: 0 PID: 727 Comm: kworker/8:1 Not tainted 6.17.0 #1 PREEMPT(voluntary)",
        "RIP: 0010:nsh_key_put_from_nlattr+0x19d/0x610 [openvswitch]",
    ] {
        feed.push(line);
    }
    let path = write(dir.path(), "oops", &feed.lines);
    let (state, _) = read_file(&path, None);
    assert_eq!(state.counter("KernelOops"), 1, "{:?}", state.counters());
    assert_eq!(
        state.recent().last().unwrap().message,
        "BUG: kernel NULL pointer dereference, address: 0000000000000018"
    );
}
