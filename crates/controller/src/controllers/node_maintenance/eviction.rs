//! What an answer of the `policy/v1` Eviction subresource means for a drain. A 429 is a
//! PodDisruptionBudget saying "not now": a wait, not an error; so is the 500 the API server gives
//! for a pod covered by more than one budget (it cannot decide; a person must). The budget's name
//! is taken from the answer's causes, where the API server puts it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::api::{Api, PostParams};
use nodekeeper_api::crd::LabelSelector;

use super::plan::PodFacts;

/// A PodDisruptionBudget as read at the start of a reconcile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    pub namespace: String,
    pub name: String,
    /// `None`: the budget selects no pod (a nil selector in policy/v1).
    pub selector: Option<LabelSelector>,
    /// `status.disruptionsAllowed`, decremented here as evictions are sent.
    pub allowed: i32,
}

/// Whether to send an eviction now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Send it (no budget covers the pod, or its one budget allows a disruption now; that
    /// allowance is taken, or the pod is not Running and Ready, which the API server may evict
    /// without an allowance). With two or more budgets the API server decides (and refuses).
    Send,
    /// The pod's budget allows no disruption now: sending would only earn a 429.
    Wait { pdb: String, message: String },
}

/// Decides for one pod, against the budgets of its namespace. Saves the 429s that evicting every
/// pod of a budget at once would earn: one request per pod that can actually go.
///
/// Only a pod that is Running and Ready is held back here. The API server evicts a Pending pod
/// without looking at any budget, and a not-Ready pod even when its budget allows no disruption
/// (with `unhealthyPodEvictionPolicy: AlwaysAllow`, or under the default `IfHealthyBudget` while
/// the budget has its healthy pods), as `kubectl drain` relies on: holding such a pod back would
/// stall the drain on a crash-looping pod until `drainTimeout`. For those the eviction is sent
/// and the API server decides; a refusal comes back as a 429 like any other. Their eviction
/// takes no allowance (the API server does not count it), so none is spent here.
pub fn admit(budgets: &mut [Budget], pod: &PodFacts) -> Admit {
    let (namespace, labels) = (pod.namespace.as_str(), &pod.labels);
    if !pod.healthy {
        return Admit::Send;
    }
    let mut matching: Vec<&mut Budget> = budgets
        .iter_mut()
        .filter(|b| {
            b.namespace == namespace && b.selector.as_ref().is_some_and(|s| s.matches(labels))
        })
        .collect();
    match matching.as_mut_slice() {
        [one] if one.allowed <= 0 => Admit::Wait {
            pdb: one.name.clone(),
            message: format!(
                "PodDisruptionBudget {} allows no disruption now; waiting for its pods to be healthy elsewhere",
                one.name
            ),
        },
        [one] => {
            one.allowed -= 1;
            Admit::Send
        }
        _ => Admit::Send,
    }
}

/// The one budget covering a pod, `(namespace, name)`: the allowance an accepted eviction
/// spent. `None` with no budget or with two or more (the API server refuses those).
pub fn sole_budget(
    budgets: &[Budget],
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Option<(String, String)> {
    let mut matching = budgets.iter().filter(|b| {
        b.namespace == namespace && b.selector.as_ref().is_some_and(|s| s.matches(labels))
    });
    match (matching.next(), matching.next()) {
        (Some(one), None) => Some((one.namespace.clone(), one.name.clone())),
        _ => None,
    }
}

/// How one eviction attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EvictionAnswer {
    /// Accepted: the pod is terminating.
    Evicted,
    /// The pod is already gone.
    Gone,
    /// A PodDisruptionBudget refused it for now; try again later.
    Blocked {
        pdb: Option<String>,
        message: String,
    },
    /// Refused for another reason; reported, tried again later.
    Failed { message: String },
}

/// Sends one `policy/v1` Eviction for the pod `name` whose UID is `uid`, and says how it ended.
///
/// The body is written here rather than through `kube::Api::evict`: kube 5.0 serialises its
/// options as `delete_options`, a field the API server does not know and drops, so the UID
/// precondition never reached it and a StatefulSet's replacement (same name, new UID, still
/// Pending) could be evicted in place of the pod that was listed. With the precondition, an
/// eviction aimed at a pod that is gone answers 409 and is reported as [`EvictionAnswer::Gone`].
pub async fn send(api: &Api<Pod>, name: &str, uid: Option<&str>) -> EvictionAnswer {
    let eviction = Eviction {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: uid.map(|uid| Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteOptions::default()
        }),
    };
    let answer: Result<serde_json::Value, kube::Error> = api
        .create_subresource("eviction", name, &PostParams::default(), &eviction)
        .await;
    match answer {
        Ok(_) => EvictionAnswer::Evicted,
        Err(kube::Error::Api(status)) => {
            let causes: Vec<String> = status
                .details
                .as_ref()
                .map(|d| d.causes.iter().map(|c| c.message.clone()).collect())
                .unwrap_or_default();
            // A UID precondition that fails means the pod we listed is gone.
            if status.code == 409 && status.message.contains("UID") {
                EvictionAnswer::Gone
            } else {
                classify(status.code, &status.message, &causes)
            }
        }
        Err(error) => EvictionAnswer::Failed {
            message: error.to_string(),
        },
    }
}

/// Classifies an answer: HTTP `code`, the Status `message`, and its `details.causes[].message`.
pub fn classify(code: u16, message: &str, causes: &[String]) -> EvictionAnswer {
    match code {
        200 | 201 => EvictionAnswer::Evicted,
        404 => EvictionAnswer::Gone,
        429 => {
            let pdb = causes.iter().find_map(|c| budget_name(c));
            let detail = causes
                .iter()
                .find(|c| budget_name(c).is_some())
                .cloned()
                .unwrap_or_else(|| message.to_owned());
            EvictionAnswer::Blocked {
                pdb,
                message: detail,
            }
        }
        500 if message.contains("more than one PodDisruptionBudget") => EvictionAnswer::Blocked {
            pdb: None,
            message: format!(
                "{message} (the API server cannot evict a pod two budgets cover; merge or delete one)"
            ),
        },
        _ => EvictionAnswer::Failed {
            message: format!("eviction answered {code}: {message}"),
        },
    }
}

/// The budget's name in a cause such as "The disruption budget web needs 2 healthy pods and has
/// 2 currently".
fn budget_name(cause: &str) -> Option<String> {
    let rest = cause.strip_prefix("The disruption budget ")?;
    let name = rest.split_whitespace().next()?;
    Some(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controllers::node_maintenance::plan::Owner;

    fn pod(namespace: &str, labels: &BTreeMap<String, String>, healthy: bool) -> PodFacts {
        PodFacts {
            namespace: namespace.into(),
            name: "p".into(),
            labels: labels.clone(),
            owner: Owner::Controller,
            mirror: false,
            priority: 0,
            finished: false,
            terminating: false,
            healthy,
            local_storage: false,
            grace_seconds: 30,
        }
    }

    #[test]
    fn budgets_are_spent_locally_so_no_eviction_is_sent_to_be_refused() {
        let sel = |app: &str| {
            Some(LabelSelector {
                match_labels: [("app".to_string(), app.to_string())].into(),
                match_expressions: vec![],
            })
        };
        let mut budgets = vec![
            Budget {
                namespace: "a".into(),
                name: "web".into(),
                selector: sel("web"),
                allowed: 1,
            },
            Budget {
                namespace: "a".into(),
                name: "none".into(),
                selector: None,
                allowed: 0,
            },
        ];
        let web: BTreeMap<String, String> = [("app".to_string(), "web".to_string())].into();
        let in_a = pod("a", &web, true);
        assert_eq!(admit(&mut budgets, &in_a), Admit::Send);
        assert!(matches!(admit(&mut budgets, &in_a), Admit::Wait { pdb, .. } if pdb == "web"));
        // Another namespace's budget does not apply; a nil selector selects nothing.
        assert_eq!(admit(&mut budgets, &pod("b", &web, true)), Admit::Send);
        assert_eq!(
            admit(&mut budgets, &pod("a", &BTreeMap::new(), true)),
            Admit::Send
        );
        // Two budgets: the API server decides.
        budgets.push(Budget {
            namespace: "a".into(),
            name: "web2".into(),
            selector: sel("web"),
            allowed: 0,
        });
        assert_eq!(admit(&mut budgets, &in_a), Admit::Send);
        assert_eq!(sole_budget(&budgets, "a", &web), None);
        assert_eq!(
            sole_budget(&budgets[..1], "a", &web),
            Some(("a".to_string(), "web".to_string()))
        );
        assert_eq!(sole_budget(&budgets, "b", &web), None);
    }

    #[test]
    fn a_pod_that_is_not_running_and_ready_is_sent_whatever_its_budget_allows() {
        let web: BTreeMap<String, String> = [("app".to_string(), "web".to_string())].into();
        let mut budgets = vec![Budget {
            namespace: "a".into(),
            name: "web".into(),
            selector: Some(LabelSelector {
                match_labels: web.clone(),
                match_expressions: vec![],
            }),
            allowed: 0,
        }];
        // Crash-looping (Running, not Ready) or Pending: the API server may evict it with the
        // budget at 0, so the eviction is sent; it takes no allowance.
        assert_eq!(admit(&mut budgets, &pod("a", &web, false)), Admit::Send);
        assert_eq!(budgets[0].allowed, 0);
        // A healthy pod of the same budget waits.
        assert!(matches!(
            admit(&mut budgets, &pod("a", &web, true)),
            Admit::Wait { pdb, .. } if pdb == "web"
        ));
        // An unhealthy pod never spends an allowance a healthy one could use.
        budgets[0].allowed = 1;
        assert_eq!(admit(&mut budgets, &pod("a", &web, false)), Admit::Send);
        assert_eq!(admit(&mut budgets, &pod("a", &web, true)), Admit::Send);
        assert_eq!(budgets[0].allowed, 0);
    }

    #[test]
    fn answers() {
        assert_eq!(classify(201, "", &[]), EvictionAnswer::Evicted);
        assert_eq!(classify(404, "not found", &[]), EvictionAnswer::Gone);
        assert_eq!(
            classify(
                429,
                "Cannot evict pod as it would violate the pod's disruption budget.",
                &["The disruption budget web-pdb needs 2 healthy pods and has 2 currently".into()]
            ),
            EvictionAnswer::Blocked {
                pdb: Some("web-pdb".into()),
                message: "The disruption budget web-pdb needs 2 healthy pods and has 2 currently"
                    .into()
            }
        );
        // A 429 from the API server's own rate limits names no budget: still a wait.
        assert!(matches!(
            classify(429, "too many requests", &[]),
            EvictionAnswer::Blocked { pdb: None, .. }
        ));
        assert!(matches!(
            classify(
                500,
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                &[]
            ),
            EvictionAnswer::Blocked { pdb: None, .. }
        ));
        assert!(matches!(
            classify(500, "etcd timeout", &[]),
            EvictionAnswer::Failed { .. }
        ));
        assert!(matches!(
            classify(403, "forbidden", &[]),
            EvictionAnswer::Failed { .. }
        ));
    }
}
