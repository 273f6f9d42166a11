//! The NVML path end to end through `dlopen`: a stand-in `libnvidia-ml` (tests/fixtures/gpu/
//! fake_nvml.c, built here with the system C compiler) with two GPUs, one answering with problems
//! and an XID event, one lost. It proves the symbols are resolved and called, the answers are
//! mapped (an NVML error is Unknown, a lost handle is a lost GPU), the XID thread counts events,
//! and the verdicts follow. It cannot prove the real library's struct layouts; those follow
//! nvml.h (see collect/nvml.rs). Its own test binary: NVML is loaded once per process.

// A skipped test prints `SKIPPED: <reason>`: that line is the contract with CI.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nodekeeper_agent::collect::gpu::{self, GpuConfig};
use nodekeeper_agent::report::judge_gpu;
use nodekeeper_model::indicators::Verdict;

#[tokio::test]
async fn a_stand_in_nvml_is_loaded_read_and_judged() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libfake-nvml.so.1");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpu/fake_nvml.c");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&source)
        .status();
    if !built.is_ok_and(|s| s.success()) {
        println!("SKIPPED: no C compiler (cc) to build the stand-in NVML library");
        return;
    }
    let config = GpuConfig {
        nvml_library: Some(lib.display().to_string()),
        nvidia_smi: "/nonexistent/nvidia-smi".into(),
        expected: Some(2),
        pci_devices: "/nonexistent".into(),
    };
    // The XID event arrives on the watcher thread; read until it is counted (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    let reading = loop {
        let r = gpu::collect(&config).await;
        if r.gpus.first().is_some_and(|g| g.xid_events > 0) || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(reading.source, "nvml", "{reading:?}");
    assert_eq!(reading.error, "");
    assert!(reading.present);
    assert_eq!(reading.gpus.len(), 2, "{reading:?}");
    let g = &reading.gpus[0];
    assert_eq!(g.uuid, "GPU-fake-0000");
    assert_eq!(g.model, "NVIDIA H100 80GB HBM3");
    assert_eq!(g.bus_id, "0000:3b:00.0");
    assert_eq!((g.memory_total_mib, g.memory_used_mib), (81559, 496));
    assert_eq!(g.utilization_percent, 37.0);
    assert_eq!(g.unknown_fields, ["temperature"]);
    assert_eq!(g.nvlinks, Some((4, 1)));
    assert_eq!(
        (
            g.remapped_rows_correctable,
            g.remapped_rows_uncorrectable,
            g.remapped_rows_pending
        ),
        (Some(2), Some(1), Some(true))
    );
    assert_eq!((g.retired_pages_sbe, g.retired_pages_pending), (None, None));
    assert_eq!(
        (g.pcie_link_width, g.pcie_link_width_max),
        (Some(16), Some(16))
    );
    assert_eq!(g.throttle_reasons, ["hw_thermal_slowdown"]);
    assert_eq!(
        (g.power_draw_w, g.power_limit_w),
        (Some(312.5), Some(700.0))
    );
    assert_eq!((g.xid_events, g.last_xid), (1, 79));
    let (verdict, message) = judge_gpu(g, &[]);
    assert_eq!(verdict, Verdict::Critical);
    for part in [
        "1 of 4 NVLinks down",
        "XID 79",
        "row remapping pending",
        "could not read temperature",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    let lost = &reading.gpus[1];
    assert!(lost.lost, "{lost:?}");
    assert_eq!(judge_gpu(lost, &[]).0, Verdict::Critical);
    // Two found of two expected: the count itself is fine; the GPUs are not.
    let (v, why) = gpu::judge_reading(&reading, &[Verdict::Critical, Verdict::Critical]);
    assert_eq!((v, why.as_str()), (Verdict::Critical, ""));
}
