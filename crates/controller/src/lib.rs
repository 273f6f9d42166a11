//! The nodekeeper controller-manager. `main.rs` parses [`Cli`] and calls [`run`]; everything
//! else is this library, in four layers, each importing only from the ones below it:
//!
//! * [`runtime`] — the process: flags ([`runtime::cli`]), logging, signals, the shutdown tree,
//!   the Lease and the leader Pod label ([`runtime::leader`]), certificate renewal, the HTTP API
//!   and metrics endpoint ([`runtime::http`]). Losing the Lease ends the process.
//! * [`controllers`] — one folder per controller (`Context`, `reconcile`, `error_policy`),
//!   all started by [`controllers::start`] with a span and reconcile metrics each. Today:
//!   [`controllers::networktest`], and the node sweep [`controllers::nodes`], the one documented
//!   exception (a scheduler over agents, not a watch-reconcile loop).
//! * [`shared`] — what controllers use: the client, the Event recorder factory, the metrics,
//!   the agents service ([`shared::agents`]: report, probes, network, over mutual TLS with
//!   per-call spans and metrics), the fleet fed by the Node watch and the tuning ConfigMap watch.
//! * plain modules — [`certs`] (the PKI in Secrets), [`conditions`] (what a node's conditions
//!   should say), [`view`] (the controller's copy of a node report), [`schedule`] (when each
//!   agent is read next).
//!
//! # Adding a controller
//!
//! Create `src/controllers/<name>/` with a `Context` implementing [`controllers::Reconciler`]
//! (`reconcile`, `error_policy`, the watched kind and a fixed name), optionally a clap `Config`
//! added to [`controllers::Config`], then add `pub mod <name>;` and ONE registration line in
//! [`controllers::Controllers::start`]:
//!
//! ```text
//! r.add(<name>::Context::new(shared, &config.<name>));
//! ```
//!
//! Nothing outside `src/controllers/` changes.

pub mod certs;
pub mod conditions;
pub mod controllers;
pub mod runtime;
pub mod schedule;
pub mod shared;
pub mod view;

pub use runtime::{Cli, Error, LogFormat, run};
/// Kept at the crate root for the tests that talk to agents directly.
pub use shared::agent_client;
