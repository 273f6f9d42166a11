//! One node's VNIC diff: the VNICs `spec.ociVnics.attach` asks for against the attachments OCI
//! reports for the node's instance, giving what to attach, keep and detach. Only attachments whose
//! VNIC carries this object's owner tag are ever detached; an attachment is matched to a desired
//! VNIC by its display name, so a retried or restarted reconcile never attaches twice.

use nodekeeper_api::crd::node_network_config::{OWNER_TAG, OciVnic};

/// `lifecycleState` of a VNIC attachment (OCI Compute API 20160918).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachmentState {
    Attaching,
    Attached,
    Detaching,
    Detached,
}

/// An attachment found on the node's instance (ListVnicAttachments, plus the VNIC's owner tag
/// from GetVnic).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundAttachment {
    pub id: String,
    pub display_name: Option<String>,
    pub state: AttachmentState,
    /// The value of the [`OWNER_TAG`] freeform tag on its VNIC: the NodeNetworkConfig that
    /// attached it, if nodekeeper did.
    pub owner: Option<String>,
}

/// What the planner knows about one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFacts {
    pub node: String,
    /// The instance's shape, e.g. `VM.Standard.E5.Flex`; bare-metal shapes start with `BM.`.
    pub shape: String,
    /// VNICs the shape allows, the primary included (`Shape.maxVnicAttachments`); `None`: unknown,
    /// the attach call's own error decides.
    pub max_vnics: Option<u32>,
    pub attachments: Vec<FoundAttachment>,
}

impl NodeFacts {
    pub fn bare_metal(&self) -> bool {
        self.shape.starts_with("BM.")
    }
}

/// The node's plan: indices into `spec.ociVnics.attach`, and attachment ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePlan {
    /// Desired VNICs with no attachment yet: attach these (one at a time: OCI refuses parallel
    /// attaches to one instance).
    pub attach: Vec<usize>,
    /// Desired VNICs already attached or attaching: `(index, attachment id, ATTACHED yet)`.
    pub keep: Vec<(usize, String, bool)>,
    /// Attachments this object created that the spec no longer lists: detach these, after their
    /// host side is removed.
    pub detach: Vec<String>,
    /// Desired VNICs whose previous attachment is still detaching: attached on a later pass.
    pub waiting: Vec<usize>,
}

impl NodePlan {
    /// Every desired VNIC is attached and nothing is left to detach.
    pub fn converged(&self) -> bool {
        self.attach.is_empty()
            && self.detach.is_empty()
            && self.waiting.is_empty()
            && self.keep.iter().all(|(_, _, attached)| *attached)
    }
}

/// Why a node cannot get this object's VNICs; each names the field and what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "spec.ociVnics.attach[{index}].nicIndex: node {node} has the VM shape {shape}, where a VNIC \
         cannot choose a physical NIC; remove nicIndex or select only bare-metal (BM.) nodes"
    )]
    NicIndexOnVm {
        index: usize,
        node: String,
        shape: String,
    },
    #[error(
        "spec.ociVnics.attach: node {node} (shape {shape}) allows {limit} VNICs including the \
         primary; it has {present} and this object adds {adding}; attach fewer VNICs or select \
         nodes of a larger shape"
    )]
    TooManyVnics {
        node: String,
        shape: String,
        limit: u32,
        present: u32,
        adding: u32,
    },
    #[error(
        "spec.ociVnics.attach[{index}].displayName: node {node} already has a VNIC named \
         {display_name:?} attached by NodeNetworkConfig {owner:?}; choose another display name"
    )]
    DisplayNameTaken {
        index: usize,
        node: String,
        display_name: String,
        owner: String,
    },
}

/// Plans one node for NodeNetworkConfig `owner` (its name, the value of [`OWNER_TAG`]). All
/// problems are returned, so that one status update lists them together.
pub fn plan_node(
    owner: &str,
    desired: &[OciVnic],
    facts: &NodeFacts,
) -> Result<NodePlan, Vec<PlanError>> {
    let mut errors = Vec::new();
    let mut plan = NodePlan::default();
    if !facts.bare_metal() {
        for (index, vnic) in desired.iter().enumerate() {
            if vnic.nic_index.is_some() {
                errors.push(PlanError::NicIndexOnVm {
                    index,
                    node: facts.node.clone(),
                    shape: facts.shape.clone(),
                });
            }
        }
    }
    // Detached attachments linger in the list for a while; they hold nothing.
    let live: Vec<&FoundAttachment> = facts
        .attachments
        .iter()
        .filter(|a| a.state != AttachmentState::Detached)
        .collect();
    for (index, vnic) in desired.iter().enumerate() {
        let same_name: Vec<&&FoundAttachment> = live
            .iter()
            .filter(|a| a.display_name.as_deref() == Some(vnic.display_name.as_str()))
            .collect();
        if let Some(other) = same_name
            .iter()
            .find_map(|a| a.owner.as_deref().filter(|o| *o != owner))
        {
            errors.push(PlanError::DisplayNameTaken {
                index,
                node: facts.node.clone(),
                display_name: vnic.display_name.clone(),
                owner: other.to_string(),
            });
            continue;
        }
        // An untagged attachment of that name was made by hand or before tagging: adopt it (keep
        // it) but never detach it, since this object did not create it.
        match same_name
            .iter()
            .find(|a| a.state != AttachmentState::Detaching)
        {
            Some(a) => {
                plan.keep
                    .push((index, a.id.clone(), a.state == AttachmentState::Attached));
            }
            None if !same_name.is_empty() => plan.waiting.push(index),
            None => plan.attach.push(index),
        }
    }
    for a in &live {
        let ours = a.owner.as_deref() == Some(owner);
        let wanted = desired
            .iter()
            .any(|v| a.display_name.as_deref() == Some(v.display_name.as_str()));
        if ours && !wanted && a.state != AttachmentState::Detaching {
            plan.detach.push(a.id.clone());
        }
    }
    if let Some(limit) = facts.max_vnics {
        // Detaching attachments still occupy a slot until OCI finishes.
        let present = u32::try_from(live.len()).unwrap_or(u32::MAX);
        let adding = u32::try_from(plan.attach.len() + plan.waiting.len()).unwrap_or(u32::MAX);
        let leaving = u32::try_from(plan.detach.len()).unwrap_or(u32::MAX);
        if present.saturating_sub(leaving).saturating_add(adding) > limit {
            errors.push(PlanError::TooManyVnics {
                node: facts.node.clone(),
                shape: facts.shape.clone(),
                limit,
                present,
                adding,
            });
        }
    }
    if errors.is_empty() {
        Ok(plan)
    } else {
        Err(errors)
    }
}

/// The freeform tags to put on a VNIC this object attaches.
pub fn owner_tags(owner: &str) -> Vec<(String, String)> {
    vec![(OWNER_TAG.to_string(), owner.to_string())]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vnic(name: &str) -> OciVnic {
        OciVnic {
            display_name: name.into(),
            subnet_id: "ocid1.subnet.oc1.phx.aaaa".into(),
            nsg_ids: vec![],
            skip_source_dest_check: false,
            nic_index: None,
            secondary_private_ip_count: 0,
        }
    }

    fn found(id: &str, name: &str, state: AttachmentState, owner: Option<&str>) -> FoundAttachment {
        FoundAttachment {
            id: id.into(),
            display_name: Some(name.into()),
            state,
            owner: owner.map(Into::into),
        }
    }

    fn node(shape: &str, max: Option<u32>, attachments: Vec<FoundAttachment>) -> NodeFacts {
        let mut all = vec![found("primary", "primary", AttachmentState::Attached, None)];
        all.extend(attachments);
        NodeFacts {
            node: "n1".into(),
            shape: shape.into(),
            max_vnics: max,
            attachments: all,
        }
    }

    use AttachmentState::*;

    #[test]
    fn attaches_missing_keeps_present_detaches_only_its_own() {
        let facts = node(
            "VM.Standard.E5.Flex",
            Some(8),
            vec![
                found("a1", "a", Attached, Some("cfg")),
                found("b1", "b", Attaching, Some("cfg")),
                found("old1", "old", Attached, Some("cfg")),
                found("x1", "x", Attached, Some("other")),
                found("h1", "hand", Attached, None),
                found("gone", "old2", Detached, Some("cfg")),
            ],
        );
        let plan = plan_node("cfg", &[vnic("a"), vnic("b"), vnic("c")], &facts).unwrap();
        assert_eq!(plan.attach, [2]);
        assert_eq!(
            plan.keep,
            [(0, "a1".to_string(), true), (1, "b1".to_string(), false)]
        );
        assert_eq!(plan.detach, ["old1"]);
        assert!(plan.waiting.is_empty());
        assert!(!plan.converged());
    }

    #[test]
    fn a_second_pass_after_attaching_changes_nothing() {
        let facts = node(
            "VM.Standard3.Flex",
            Some(4),
            vec![
                found("a1", "a", Attached, Some("cfg")),
                found("b1", "b", Attached, Some("cfg")),
            ],
        );
        let plan = plan_node("cfg", &[vnic("a"), vnic("b")], &facts).unwrap();
        assert!(plan.attach.is_empty() && plan.detach.is_empty());
        assert!(plan.converged());
    }

    #[test]
    fn a_hand_made_attachment_of_that_name_is_adopted_not_doubled_nor_detached() {
        let facts = node(
            "VM.Standard3.Flex",
            None,
            vec![found("h1", "a", Attached, None)],
        );
        let plan = plan_node("cfg", &[vnic("a")], &facts).unwrap();
        assert!(plan.attach.is_empty());
        assert_eq!(plan.keep, [(0, "h1".to_string(), true)]);
        let removed = plan_node("cfg", &[], &facts).unwrap();
        assert!(removed.detach.is_empty(), "{removed:?}");
    }

    #[test]
    fn a_detaching_namesake_makes_the_vnic_wait() {
        let facts = node(
            "VM.Standard3.Flex",
            None,
            vec![found("a0", "a", Detaching, Some("cfg"))],
        );
        let plan = plan_node("cfg", &[vnic("a")], &facts).unwrap();
        assert_eq!(plan.waiting, [0]);
        assert!(plan.attach.is_empty() && plan.detach.is_empty());
    }

    #[test]
    fn vnic_count_above_the_shape_limit_names_the_field() {
        let facts = node("VM.Standard2.1", Some(2), vec![]);
        let errors = plan_node("cfg", &[vnic("a"), vnic("b")], &facts).unwrap_err();
        assert_eq!(
            errors,
            [PlanError::TooManyVnics {
                node: "n1".into(),
                shape: "VM.Standard2.1".into(),
                limit: 2,
                present: 1,
                adding: 2,
            }]
        );
        let text = errors[0].to_string();
        assert!(text.starts_with("spec.ociVnics.attach:"), "{text}");
        assert!(text.contains("allows 2 VNICs"), "{text}");
        // Exactly at the limit is fine, and a VNIC being detached frees its slot.
        assert!(plan_node("cfg", &[vnic("a")], &facts).is_ok());
        let swapping = node(
            "VM.Standard2.1",
            Some(2),
            vec![found("o", "old", Attached, Some("cfg"))],
        );
        let plan = plan_node("cfg", &[vnic("new")], &swapping).unwrap();
        assert_eq!(
            (plan.attach.as_slice(), plan.detach.as_slice()),
            ([0].as_slice(), ["o".to_string()].as_slice())
        );
    }

    #[test]
    fn nic_index_is_refused_on_vm_shapes_only() {
        let mut v = vnic("a");
        v.nic_index = Some(1);
        let vm = node("VM.Standard.E5.Flex", None, vec![]);
        let errors = plan_node("cfg", &[vnic("z"), v.clone()], &vm).unwrap_err();
        assert!(matches!(
            errors[..],
            [PlanError::NicIndexOnVm { index: 1, .. }]
        ));
        assert!(
            errors[0]
                .to_string()
                .starts_with("spec.ociVnics.attach[1].nicIndex: node n1 has the VM shape"),
            "{}",
            errors[0]
        );
        let bm = node("BM.Standard3.64", None, vec![]);
        assert_eq!(plan_node("cfg", &[v], &bm).unwrap().attach, [0]);
    }

    #[test]
    fn a_name_held_by_another_object_is_an_error_not_a_second_attach() {
        let facts = node(
            "VM.Standard3.Flex",
            None,
            vec![found("x1", "a", Attached, Some("other"))],
        );
        let errors = plan_node("cfg", &[vnic("a")], &facts).unwrap_err();
        assert!(
            matches!(&errors[..], [PlanError::DisplayNameTaken { owner, .. }] if owner == "other")
        );
        assert!(
            errors[0]
                .to_string()
                .contains("choose another display name")
        );
    }

    #[test]
    fn owner_tag_carries_the_object_name() {
        assert_eq!(
            owner_tags("cfg"),
            [("nodekeeper.dev/nnc".to_string(), "cfg".to_string())]
        );
    }
}
