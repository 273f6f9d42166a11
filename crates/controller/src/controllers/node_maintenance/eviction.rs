//! What an answer of the `policy/v1` Eviction subresource means for a drain. A 429 is a
//! PodDisruptionBudget saying "not now": a wait, not an error; so is the 500 the API server gives
//! for a pod covered by more than one budget (it cannot decide; a person must). The budget's name
//! is taken from the answer's causes, where the API server puts it.

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
