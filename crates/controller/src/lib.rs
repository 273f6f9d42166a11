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
//! Nothing else in the crate changes; outside it, a new watched kind needs its RBAC rules in
//! `deploy/controller/controller.yaml`.

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

#[cfg(test)]
mod layering {
    //! The layer rule of the crate doc, checked on the source text: a file may import (`crate::…`)
    //! only from its own layer or the ones below it.

    use std::path::{Path, PathBuf};

    /// Layers from the bottom; a file's layer is its first path component under `src/`.
    const LAYERS: &[&[&str]] = &[
        &["certs.rs", "conditions.rs", "view.rs", "schedule.rs"],
        &["shared"],
        &["controllers"],
        &["runtime"],
    ];

    fn layer_of(component: &str) -> Option<usize> {
        LAYERS.iter().position(|l| l.contains(&component))
    }

    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn no_module_imports_from_a_layer_above_it_or_from_the_crate_root() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut all = Vec::new();
        files(&src, &mut all);
        let mut wrong = Vec::new();
        for path in all {
            let relative = path.strip_prefix(&src).unwrap();
            let first = relative.components().next().unwrap();
            let first = first.as_os_str().to_str().unwrap();
            let Some(own) = layer_of(first) else { continue };
            let text = std::fs::read_to_string(&path).unwrap();
            for (n, line) in text.lines().enumerate() {
                for (i, _) in line.match_indices("crate::") {
                    let rest = &line[i + "crate::".len()..];
                    let target: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    let target_layer =
                        layer_of(&target).or_else(|| layer_of(&format!("{target}.rs")));
                    match target_layer {
                        Some(t) if t <= own => {}
                        _ => {
                            wrong.push(format!("{}:{}: {}", relative.display(), n + 1, line.trim()))
                        }
                    }
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "imports from a higher layer or the crate root:\n{}",
            wrong.join("\n")
        );
    }
}
