//! The crate layering the design depends on, checked from `cargo metadata`: the node side (agent,
//! netconf, oci) never links a Kubernetes client, and the plain-data crate links neither kube nor
//! tonic. A regression fails an ordinary test naming the path that brought the dependency in.

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet, VecDeque};

    use anyhow::{Context as _, Result};

    use crate::codegen::repo_root;

    /// Packages (by name) that must not appear among a crate's normal (non-dev, non-build)
    /// dependencies, transitively.
    const FORBIDDEN: &[(&str, &[&str])] = &[
        (
            "nodekeeper-agent",
            &[
                "kube",
                "kube-client",
                "kube-core",
                "k8s-openapi",
                "nodekeeper-api",
            ],
        ),
        (
            "nodekeeper-netconf",
            &["kube", "kube-client", "kube-core", "k8s-openapi", "tonic"],
        ),
        (
            "nodekeeper-oci",
            &["kube", "kube-client", "kube-core", "k8s-openapi", "tonic"],
        ),
        (
            "nodekeeper-model",
            &[
                "kube",
                "kube-client",
                "kube-core",
                "k8s-openapi",
                "tonic",
                "prost",
            ],
        ),
        (
            "nodekeeper-proto",
            &["kube", "kube-client", "kube-core", "k8s-openapi"],
        ),
        // The kubectl plugin talks only to the API server, never to an agent.
        (
            "kubectl-nodekeeper",
            &[
                "nodekeeper-agent",
                "nodekeeper-controller",
                "nodekeeper-proto",
                "tonic",
            ],
        ),
    ];

    /// Package name → the names of its normal dependencies, for the whole resolved graph.
    fn normal_graph() -> Result<BTreeMap<String, BTreeSet<String>>> {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let output = crate::cargo::command(&cargo)
            .current_dir(repo_root())
            .args(["metadata", "--format-version", "1", "--locked"])
            .output()
            .context("run cargo metadata")?;
        anyhow::ensure!(
            output.status.success(),
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let meta: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        let names: BTreeMap<&str, &str> = meta["packages"]
            .as_array()
            .context("packages")?
            .iter()
            .filter_map(|p| Some((p["id"].as_str()?, p["name"].as_str()?)))
            .collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for node in meta["resolve"]["nodes"].as_array().context("resolve")? {
            let Some(name) = node["id"].as_str().and_then(|id| names.get(id)) else {
                continue;
            };
            let entry = graph.entry((*name).to_owned()).or_default();
            for dep in node["deps"].as_array().into_iter().flatten() {
                let normal = dep["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["kind"].is_null());
                if normal && let Some(d) = dep["pkg"].as_str().and_then(|id| names.get(id)) {
                    entry.insert((*d).to_owned());
                }
            }
        }
        Ok(graph)
    }

    /// The chain of packages from `from` to `to` through normal dependencies, if any.
    fn path(
        graph: &BTreeMap<String, BTreeSet<String>>,
        from: &str,
        to: &str,
    ) -> Option<Vec<String>> {
        let mut previous: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([from]);
        while let Some(at) = queue.pop_front() {
            for next in graph.get(at).into_iter().flatten() {
                if next == from || previous.contains_key(next.as_str()) {
                    continue;
                }
                previous.insert(next, at);
                if next == to {
                    let mut chain = vec![to.to_owned()];
                    let mut cur = to;
                    while let Some(p) = previous.get(cur) {
                        chain.push((*p).to_owned());
                        if *p == from {
                            break;
                        }
                        cur = p;
                    }
                    chain.reverse();
                    return Some(chain);
                }
                queue.push_back(next);
            }
        }
        None
    }

    #[test]
    fn node_side_and_model_do_not_depend_on_kube() -> Result<()> {
        let graph = normal_graph()?;
        let mut problems = Vec::new();
        for (krate, forbidden) in FORBIDDEN {
            anyhow::ensure!(
                graph.contains_key(*krate),
                "{krate} is not in the workspace"
            );
            for f in *forbidden {
                if let Some(chain) = path(&graph, krate, f) {
                    problems.push(format!("{krate} depends on {f}: {}", chain.join(" → ")));
                }
            }
        }
        anyhow::ensure!(
            problems.is_empty(),
            "the node side must build without a Kubernetes client (DESIGN.md § layout):\n  {}",
            problems.join("\n  ")
        );
        Ok(())
    }

    #[test]
    fn the_path_finder_finds_a_known_dependency() -> Result<()> {
        // Guards the test above against passing because it finds nothing at all.
        let graph = normal_graph()?;
        let chain = path(&graph, "nodekeeper-controller", "kube-client")
            .context("the controller must reach kube-client")?;
        assert_eq!(
            chain.first().map(String::as_str),
            Some("nodekeeper-controller")
        );
        assert_eq!(chain.last().map(String::as_str), Some("kube-client"));
        Ok(())
    }
}
