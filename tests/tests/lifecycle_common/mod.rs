//! Shared pieces of the upgrade and uninstall tests: a controller process acting as one of the
//! installed ServiceAccounts of a test's own control plane, logging to a file, and waiting for
//! a line in that log.
// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use nodekeeper_e2e::rig::{ControllerConfig, ControllerProcess, Output, Program};
use nodekeeper_e2e::{ControlPlane, unique_name, wait_for};

use crate::{controller_common, install_common};

/// This test binary as `nodekeeper-controller` for ServiceAccount `namespace/account` of
/// `cluster`, logging to a file in `work` (returned); `env` is added to its environment.
pub async fn start_as(
    cluster: &ControlPlane,
    namespace: &str,
    account: &str,
    selector: &str,
    agent_port: u16,
    work: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<(ControllerProcess, PathBuf)> {
    let client = cluster.client().await?;
    let kubeconfig = work.join(unique_name("kubeconfig"));
    install_common::service_account_kubeconfig(
        &client,
        cluster.kubeconfig(),
        namespace,
        account,
        &kubeconfig,
    )
    .await?;
    let log = work.join(format!("{}.log", unique_name(account)));
    let config = ControllerConfig {
        kubeconfig,
        namespace: namespace.to_owned(),
        identity: unique_name("lc"),
        http: SocketAddr::from((Ipv4Addr::LOCALHOST, controller_common::free_port())),
        agent_port,
        node_selector: selector.to_owned(),
        log: Some("info,kube=warn".into()),
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        output: Output::Log(log.clone()),
    };
    let program = Program::this_test_binary(controller_common::HELPER, "controller")?;
    Ok((ControllerProcess::spawn(&program, &config)?, log))
}

/// Waits until `path` holds a line with every one of `needles`; that line.
pub async fn log_line(path: &Path, needles: &[&str], timeout: Duration) -> anyhow::Result<String> {
    wait_for(&format!("a log line with {needles:?}"), timeout, || async {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        Ok(text
            .lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned))
    })
    .await
    .with_context(|| std::fs::read_to_string(path).unwrap_or_default())
}
