//! nodekeeper's end-to-end harness: a real local Kubernetes control plane (etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, kwok) built from pinned Go modules, and the helpers
//! tests use against it. `cargo xtask cluster` drives the same code.
//!
//! # Using it from a test
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, install_crds, test_namespace};
//!
//! # async fn example() -> anyhow::Result<()> {
//! let cp = ControlPlane::shared();           // started once per test binary, lazily
//! let client = cp.client().await?;           // a fresh kube::Client per test (per runtime)
//! install_crds(&client).await?;              // deploy/crds/*.yaml, server-side apply, Established
//! let ns = test_namespace(&client, "my-test").await?;   // isolated, unique namespace
//! let nodes = create_simulated_nodes(&client, "my-test", 3, &BTreeMap::new(), &[]).await?;
//! # let _ = (ns, nodes); Ok(()) }
//! ```
//!
//! - [`ControlPlane::shared`] starts one control plane per test binary on first use and its
//!   processes die with the binary (SIGKILL via the parent-death signal, set with `setpriv`).
//!   When `NODEKEEPER_TEST_KUBECONFIG` names a kubeconfig, that running cluster is used instead,
//!   so a test runner can start one (`cargo xtask cluster up`) for every test binary.
//! - [`ControlPlane::start`] starts a private one with [`Options`], e.g. `audit: true` for a
//!   benchmark that counts requests per user in [`ControlPlane::audit_log`].
//! - Isolation: use [`unique_name`] for every cluster-scoped object, [`test_namespace`] for
//!   namespaced ones, and a label of your own on your simulated nodes.
//! - Simulated nodes carry `nodekeeper.dev/simulated=true` (what kwok manages), have no taints,
//!   and get a distinct 127.1.x.y InternalIP each.
//! - Clients from [`ControlPlane::client`] have kube's default retry layer switched off: kube 5
//!   otherwise retries every 429 (a PDB-refused eviction included) with backoff for minutes.
//! - Clients act as `nodekeeper-admin` (`system:masters`); kwok acts as `kwok`, the controllers as
//!   `system:kube-controller-manager` / their service accounts, the scheduler as
//!   `system:kube-scheduler`.
//!
//! [`install`] installs `deploy/` as a user does (`kubectl kustomize`, server-side apply, a
//! ServiceAccount's kubeconfig), for the install tests and the demo.
//!
//! [`rig`] starts a `nodekeeper-controller` and agents against a control plane, the one way the
//! controller e2e tests, `cargo xtask bench fleet|networktest` and `cargo xtask demo` do it. The
//! kube-free test helpers (network namespaces, the skip-unless-root check, free ports, loopback
//! addresses) are in `nodekeeper-testkit`.
//!
//! The first use builds the binaries into `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/controlplane/`
//! (needs Go; about 20 minutes on 2 cores); later uses start in seconds.

pub mod controlplane;
pub mod gotool;
mod harness;
pub mod install;
pub mod oci_endpoint;
pub mod rig;

pub use controlplane::{Lifetime, Options};
pub use harness::{
    ControlPlane, FIELD_MANAGER, KUBECONFIG_ENV, apply_labelled_spec, apply_spec, crds_dir,
    create_simulated_nodes, install_crds, node_condition, test_namespace, unique_name, wait_for,
};
