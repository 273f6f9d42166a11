//! The `NetworkTest` controller: spec checking and target expansion, deterministic peer
//! selection, fan-out to agents, result aggregation, the phase machine with the status it
//! produces, the in-memory store of full results behind the HTTP API, and the reconciler
//! (`reconcile`) that drives them from the API server. Everything but `reconcile` is plain
//! functions over plain data.

pub mod aggregate;
pub mod crd;
pub mod fanout;
pub mod peers;
pub mod plan;
pub mod reconcile;
pub mod status;
pub mod store;
pub mod wire;

pub use aggregate::{PairResult, Summary, aggregate};
pub use plan::{Environment, SourceNode, SpecError, TargetSpec, TestPlan, TestSpec, plan};
pub use status::{Event, Phase, TestStatus, transition};
pub use store::ResultsStore;
