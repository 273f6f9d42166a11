//! The `NetworkTest` controller: spec checking and target expansion (`plan`, `crd`),
//! deterministic peer selection (`peers`), fan-out to agents (`fanout`, `wire`), result
//! aggregation (`aggregate`), the phase machine with the status it produces (`status`), the
//! in-memory store of full results behind the HTTP API (`store`), and the reconciler
//! (`reconcile`) that drives them from the API server. Everything but `reconcile` is plain
//! functions over plain data. This file holds the [`Context`] and the [`Config`] (flags).

pub mod aggregate;
pub mod crd;
pub mod fanout;
pub mod peers;
pub mod plan;
pub mod reconcile;
pub mod status;
pub mod store;
pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use kube::Api;
use kube::runtime::controller::Action;
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_model::address_policy::{self, Cidr};
use tokio::sync::watch;

pub use aggregate::{PairResult, Summary, aggregate};
pub use plan::{Environment, SourceNode, SpecError, TargetSpec, TestPlan, TestSpec, plan};
pub use reconcile::{Error, error_policy, reconcile};
pub use status::{Event, Phase, TestStatus, transition};
pub use store::ResultsStore;

use super::Reconciler;
use crate::shared::{Agents, Fleet, Shared, TuningState};

/// The NetworkTest controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "networktest")]
pub struct Config {
    /// The API server as nodes reach it (`address:port`, e.g. `10.0.0.1:6443`), probed by a
    /// NetworkTest target `apiServer: true`. Default: the address the controller itself uses
    /// when it is an IP address (in a Pod, the `kubernetes` Service from
    /// `KUBERNETES_SERVICE_HOST`/`_PORT`); without either such a test fails with a condition
    /// naming `spec.targets[i].apiServer`.
    #[arg(long, env = "NODEKEEPER_API_SERVER_ADDRESS")]
    pub api_server_address: Option<SocketAddr>,

    /// The cloud metadata service's IP address, probed by a NetworkTest target
    /// `metadataService: true`. Unset by default and never assumed: such a test then fails with a
    /// condition naming `spec.targets[i].metadataService`.
    #[arg(long, env = "NODEKEEPER_METADATA_SERVICE_ADDRESS")]
    pub metadata_service_address: Option<IpAddr>,

    /// The cluster's pod ranges (comma-separated CIDRs), which NetworkTest probes may reach.
    /// Default: each selected node's `spec.podCIDRs`.
    #[arg(long, env = "NODEKEEPER_POD_CIDRS", value_parser = cidr_list)]
    pub pod_cidrs: Option<CidrList>,

    /// The cluster's service ranges (comma-separated CIDRs, e.g. `10.96.0.0/16`), which
    /// NetworkTest probes may reach (the dns example's resolver is a Service address). Not
    /// discoverable from the API: unset, Service addresses are refused unless the tuning
    /// ConfigMap's `probeAllowedCidrs` lists them.
    #[arg(long, env = "NODEKEEPER_SERVICE_CIDRS", value_parser = cidr_list)]
    pub service_cidrs: Option<CidrList>,

    /// NetworkTests run at once.
    #[arg(long, env = "NODEKEEPER_NETWORKTEST_CONCURRENCY", default_value_t = 4)]
    pub networktest_concurrency: u16,

    /// Agents asked at once by one NetworkTest. Probe calls mostly wait (count × interval), so
    /// the default of 1024 in flight runs a 10,000-node mesh in ten rounds; each call in flight
    /// holds about 50 KiB of controller memory (a connection's TLS and HTTP/2 state; BENCHMARKS.md
    /// § networktest).
    #[arg(
        long,
        env = "NODEKEEPER_NETWORKTEST_AGENT_CONCURRENCY",
        default_value_t = 1024
    )]
    pub networktest_agent_concurrency: usize,
}

/// A list of address ranges given as one flag value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CidrList(pub Vec<Cidr>);

fn cidr_list(s: &str) -> Result<CidrList, String> {
    address_policy::parse_list(s).map(CidrList)
}

/// Where the address policy's changing parts come from (see
/// [`nodekeeper_model::address_policy`]); the default knows none of them.
#[derive(Clone, Default)]
pub struct PolicySources {
    /// No `--pod-cidrs`: take each selected node's `spec.podCIDRs`.
    pub pod_cidrs_from_nodes: bool,
    /// Every managed node's InternalIP.
    pub fleet: Option<Arc<Fleet>>,
    /// `probeAllowedCidrs` of the tuning in force.
    pub tuning: Option<watch::Receiver<Arc<TuningState>>>,
}

/// What the reconciler needs.
pub struct Context {
    pub client: kube::Client,
    /// The agents' gRPC port on each node's InternalIP.
    pub agent_port: u16,
    /// How the probes are run on the source nodes.
    pub agents: Arc<dyn Agents>,
    /// The API server and metadata service addresses, from the controller's configuration.
    pub env: Environment,
    pub store: ResultsStore,
    /// Agents asked at once, per test.
    pub agent_concurrency: usize,
    /// Tests run at once.
    pub test_concurrency: u16,
    /// Watch only this namespace's tests; `None` watches all.
    pub namespace: Option<String>,
    /// The address policy's sources besides `env`.
    pub policy: PolicySources,
}

impl Context {
    /// The ranges of the address policy that change while the controller runs: every managed
    /// node's InternalIP and the tuning ConfigMap's `probeAllowedCidrs`.
    pub fn allowed_ranges(&self) -> Vec<Cidr> {
        let mut out = Vec::new();
        if let Some(fleet) = &self.policy.fleet {
            out.extend(
                fleet
                    .lock()
                    .values()
                    .filter_map(|e| e.address)
                    .map(Cidr::host),
            );
        }
        if let Some(tuning) = &self.policy.tuning {
            out.extend(tuning.borrow().config.probe_allowed_cidrs.iter().copied());
        }
        out
    }
}

impl Context {
    /// The controller's context in the running controller-manager: every namespace, the shared
    /// agents service, results kept in `store`.
    pub fn new(shared: &Shared, config: &Config, store: &ResultsStore) -> Self {
        Self {
            client: shared.client.clone(),
            agent_port: shared.agent_port,
            agents: shared.agents(),
            env: Environment {
                api_server: config.api_server_address,
                api_server_is_service: config.api_server_address.is_some_and(|a| {
                    is_service_address(
                        a.ip(),
                        std::env::var("KUBERNETES_SERVICE_HOST")
                            .ok()
                            .and_then(|h| h.parse().ok()),
                        config.service_cidrs.as_ref().map_or(&[], |l| &l.0),
                    )
                }),
                metadata_service: config.metadata_service_address,
                allowed: [&config.pod_cidrs, &config.service_cidrs]
                    .into_iter()
                    .flatten()
                    .flat_map(|l| l.0.iter().copied())
                    .collect(),
            },
            store: store.clone(),
            agent_concurrency: config.networktest_agent_concurrency,
            test_concurrency: config.networktest_concurrency,
            namespace: None,
            policy: PolicySources {
                pod_cidrs_from_nodes: config.pod_cidrs.is_none(),
                fleet: Some(Arc::clone(&shared.fleet)),
                tuning: Some(shared.tuning.clone()),
            },
        }
    }
}

/// Whether `ip` is a Service ClusterIP: the `kubernetes` Service's (`KUBERNETES_SERVICE_HOST`
/// in a Pod, the controller's default API server address), or in `--service-cidrs`.
pub fn is_service_address(
    ip: IpAddr,
    kubernetes_service: Option<IpAddr>,
    service_cidrs: &[Cidr],
) -> bool {
    kubernetes_service == Some(ip) || service_cidrs.iter().any(|c| c.contains(ip))
}

impl Reconciler for Context {
    type Object = NetworkTest;
    type Error = Error;
    const NAME: &'static str = "networktest";
    const CALLS_AGENTS: bool = true;

    fn api(&self) -> Api<NetworkTest> {
        match &self.namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        }
    }

    fn concurrency(&self) -> u16 {
        self.test_concurrency
    }

    fn reconcile(
        obj: Arc<NetworkTest>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NetworkTest>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_addresses() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let kube = Some(ip("10.96.0.1"));
        assert!(is_service_address(ip("10.96.0.1"), kube, &[]));
        assert!(!is_service_address(ip("10.0.0.1"), kube, &[]));
        assert!(!is_service_address(ip("10.96.0.1"), None, &[]));
        let cidrs = address_policy::parse_list("10.96.0.0/12").unwrap();
        assert!(is_service_address(ip("10.100.0.7"), None, &cidrs));
    }
}
