//! The `NodeMaintenance` controller: declarative cordon and drain. The domain logic is plain
//! functions over plain data — drain plan and timeouts (`plan`), stage to per-node holds
//! (`stage`), what is recorded on each node and how it is restored (`record`), eviction answers
//! (`eviction`), admission safety (`admission`) and the status (`status`) — driven by the
//! reconciler.

pub mod admission;
pub mod eviction;
pub mod plan;
pub mod reconcile;
pub mod record;
pub mod stage;
pub mod status;
