//! The built-in kubelet and container-runtime checks against stand-ins on this machine: a
//! kubelet healthz on 127.0.0.1 (healthy, failing, silent, absent), a CRI socket in a temporary
//! directory, and a `crictl` stand-in script. The conditions follow NPD's health checker.

use std::os::unix::fs::PermissionsExt as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nodekeeper_agent::monitor::health::{self, HealthConfig};
use nodekeeper_agent::monitor::state::{ConditionStatus, ProblemState, lock};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;

/// A healthz stand-in: answers `ok` while `healthy`, HTTP 500 otherwise.
async fn kubelet(healthy: Arc<AtomicBool>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let ok = healthy.load(Ordering::Relaxed);
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let answer = if ok {
                    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                } else {
                    "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 30\r\n\r\n[-]syncloop failed: reason withheld"
                };
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

const T: Duration = Duration::from_secs(2);

#[tokio::test]
async fn kubelet_healthz_answers() {
    let healthy = Arc::new(AtomicBool::new(true));
    let addr = kubelet(healthy.clone()).await;
    assert_eq!(health::check_kubelet(&addr, "/healthz", T).await, Ok(()));
    healthy.store(false, Ordering::Relaxed);
    assert_eq!(
        health::check_kubelet(&addr, "/healthz", T).await,
        Err("/healthz answered HTTP 500".into())
    );

    // Nobody listening.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gone_addr = gone.local_addr().unwrap().to_string();
    drop(gone);
    let err = health::check_kubelet(&gone_addr, "/healthz", T)
        .await
        .unwrap_err();
    assert!(err.contains("connect to"), "{err}");

    // Accepts and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let started = Instant::now();
    let err = health::check_kubelet(&silent_addr, "/healthz", Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(err.contains("no answer"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn runtime_socket_and_crictl() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("containerd.sock");
    assert!(
        health::check_runtime(&socket, None, T)
            .await
            .unwrap_err()
            .contains("connect to")
    );
    let _listener = tokio::net::UnixListener::bind(&socket).unwrap();
    assert_eq!(health::check_runtime(&socket, None, T).await, Ok(()));

    // crictl, when present, is asked over the socket.
    let args = dir.path().join("args");
    let crictl = dir.path().join("crictl");
    let script = |code: u8| {
        std::fs::write(
            &crictl,
            format!("#!/bin/sh\necho \"$@\" > {}\nexit {code}\n", args.display()),
        )
        .unwrap();
        std::fs::set_permissions(&crictl, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    script(0);
    assert_eq!(
        health::check_runtime(&socket, Some(&crictl), T).await,
        Ok(())
    );
    let passed = std::fs::read_to_string(&args).unwrap();
    assert_eq!(
        passed.trim(),
        format!(
            "--runtime-endpoint=unix://{} --timeout=2s version",
            socket.display()
        )
    );
    script(1);
    assert_eq!(
        health::check_runtime(&socket, Some(&crictl), T).await,
        Err("crictl version failed".into())
    );
}

#[tokio::test]
async fn conditions_follow_the_checks_with_npd_types_and_reasons() {
    let healthy = Arc::new(AtomicBool::new(true));
    let addr = kubelet(healthy.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("containerd.sock");
    let config = HealthConfig {
        kubelet: Some((addr, "/healthz".into())),
        cri_socket: Some(socket.clone()),
        crictl: None,
        interval: Duration::from_millis(100),
        timeout: Duration::from_secs(1),
    };
    let shared = ProblemState::new_shared();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(health::run(config, shared.clone(), shutdown.clone()));
    let wait_for = |kind: &'static str, status: ConditionStatus| {
        let shared = shared.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(c) = lock(&shared).condition(kind)
                    && c.status == status
                {
                    return c.clone();
                }
                assert!(
                    Instant::now() < deadline,
                    "{kind} not {status:?} within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // No socket yet: the runtime is unhealthy, with containerd's reason (NPD's).
    let c = wait_for("ContainerRuntimeUnhealthy", ConditionStatus::True).await;
    assert_eq!(c.reason, "ContainerdUnhealthy");
    let c = wait_for("KubeletUnhealthy", ConditionStatus::False).await;
    assert_eq!(
        (c.reason.as_str(), c.message.as_str()),
        (
            "KubeletIsHealthy",
            "kubelet on the node is functioning properly"
        )
    );
    let _listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let c = wait_for("ContainerRuntimeUnhealthy", ConditionStatus::False).await;
    assert_eq!(c.reason, "ContainerRuntimeIsHealthy");
    healthy.store(false, Ordering::Relaxed);
    let c = wait_for("KubeletUnhealthy", ConditionStatus::True).await;
    assert_eq!(
        (c.reason.as_str(), c.message.as_str()),
        ("KubeletUnhealthy", "/healthz answered HTTP 500")
    );
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}
