//! The `NetworkTest` controller's domain logic: spec checking and target expansion, deterministic
//! peer selection, fan-out to agents, result aggregation, the phase machine with the status it
//! produces, and the in-memory store of full results behind the HTTP API. Plain functions over
//! plain data wherever possible; the Kubernetes- and gRPC-facing reconciler is not here yet.

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
