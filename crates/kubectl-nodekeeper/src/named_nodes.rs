//! Nodes named on the command line: each checked to exist before anything is created, and turned
//! into the label selector a NodeMaintenance or NodeDiagnostic carries (those objects select by
//! labels, so names become `kubernetes.io/hostname in (…)`, which the kubelet sets to the node's
//! name unless `--hostname-override` says otherwise — checked, not assumed).

use k8s_openapi::api::core::v1::Node;
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::common::{LabelSelector, LabelSelectorRequirement, SelectorOperator};

use crate::connect::Connection;
use crate::error::Error;

/// The well-known label that holds a node's hostname.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// The named nodes, sorted and without repeats, read from the API server; the first unknown
/// name is an error.
pub async fn resolve(conn: &Connection, names: &[String]) -> Result<Vec<Node>, Error> {
    let mut names: Vec<&String> = names.iter().collect();
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(Error::InvalidFlags(
            "name at least one node (`kubectl get nodes` lists them)".into(),
        ));
    }
    let api: Api<Node> = Api::all(conn.client.clone());
    let mut nodes = Vec::with_capacity(names.len());
    for name in names {
        let unknown = || Error::NodeNotFound { name: name.clone() };
        if name.is_empty() || name.contains('/') {
            return Err(unknown());
        }
        let node = api
            .get_opt(name)
            .await
            .map_err(|e| conn.error(&format!("get node {name}"), e))?
            .ok_or_else(unknown)?;
        nodes.push(node);
    }
    Ok(nodes)
}

/// The selector that picks exactly `nodes` by their hostname label; a node whose label is not
/// its name cannot be picked this way, and the error says what to do instead.
pub fn selector(nodes: &[Node]) -> Result<LabelSelector, Error> {
    let mut values = Vec::with_capacity(nodes.len());
    for node in nodes {
        let name = node.name_any();
        let label = node.labels().get(HOSTNAME_LABEL);
        if label != Some(&name) {
            return Err(Error::NodeNotSelectableByName {
                name,
                label: label.cloned(),
            });
        }
        values.push(name);
    }
    values.sort();
    Ok(LabelSelector {
        match_expressions: vec![LabelSelectorRequirement {
            key: HOSTNAME_LABEL.to_owned(),
            operator: SelectorOperator::In,
            values,
        }],
        ..LabelSelector::default()
    })
}

/// The node names a selector made by [`selector`] picks; `None` for any other selector.
pub fn names_of(selector: &LabelSelector) -> Option<Vec<String>> {
    match (
        selector.match_labels.is_empty(),
        selector.match_expressions.as_slice(),
    ) {
        (true, [r]) if r.key == HOSTNAME_LABEL && r.operator == SelectorOperator::In => {
            let mut names = r.values.clone();
            names.sort();
            Some(names)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, hostname: Option<&str>) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        if let Some(h) = hostname {
            n.metadata.labels = Some([(HOSTNAME_LABEL.to_owned(), h.to_owned())].into());
        }
        n
    }

    #[test]
    fn names_become_a_hostname_selector_and_back() {
        let s = selector(&[node("b", Some("b")), node("a", Some("a"))]).unwrap();
        assert_eq!(s.to_query(), "kubernetes.io/hostname in (a,b)");
        assert_eq!(names_of(&s), Some(vec!["a".to_owned(), "b".to_owned()]));
        let mut other = s.clone();
        other.match_labels.insert("pool".into(), "x".into());
        assert_eq!(names_of(&other), None);
    }

    #[test]
    fn a_node_whose_hostname_label_differs_is_refused_with_the_fix() {
        let e = selector(&[node("a", Some("a.example"))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"a.example\""), "{e}");
        assert!(e.contains("spec.nodeSelector"), "{e}");
        let e = selector(&[node("a", None)]).unwrap_err().to_string();
        assert!(e.contains("hostname label is missing"), "{e}");
    }
}
