//! The endpoint's instance API beyond the record keeping in `mod.rs`: LaunchInstance with the
//! checks Oracle documents (required fields, a shape the service offers, a known image and subnet,
//! `metadata.user_data` in base64, metadata within 32,000 bytes; "Out of host capacity." on
//! demand), ListShapes, boot images, and a read-out of every instance for tests that play the
//! kubelet (an instance that is RUNNING joins as a Node). Facts: `shared/oci/compute-api.md` §3–4.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use base64::Engine as _;
use serde_json::{Value, json};

use super::{Answer, InstanceSpec, OciEndpoint, State, error, missing, not_found, ok, paginate};

/// Largest `metadata` (keys and values together) LaunchInstance accepts, in bytes.
pub const MAX_METADATA_BYTES: usize = 32_000;

/// One instance as [`OciEndpoint::instances`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceView {
    pub id: String,
    pub display_name: String,
    pub shape: String,
    /// `PROVISIONING`, `RUNNING`, `TERMINATING` or `TERMINATED`.
    pub state: &'static str,
    pub freeform_tags: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

impl OciEndpoint {
    /// A boot image LaunchInstance accepts; returns its OCID.
    pub fn add_image(&self) -> String {
        let mut s = self.lock();
        let id = s.ocid("image");
        s.images.push(id.clone());
        id
    }

    /// Every instance, terminated ones included, in creation order, with its state now.
    pub fn instances(&self) -> Vec<InstanceView> {
        let s = self.lock();
        let now = Instant::now();
        let mut all: Vec<_> = s.instances.values().collect();
        all.sort_by_key(|i| i.order);
        all.iter()
            .map(|i| InstanceView {
                id: i.id.clone(),
                display_name: i.display_name.clone(),
                shape: i.shape.clone(),
                state: i.state(now, &s.cfg),
                freeform_tags: string_map(&i.freeform_tags),
                metadata: string_map(&i.metadata),
            })
            .collect()
    }

    /// The shapes ListShapes offers and LaunchInstance accepts.
    pub fn shapes(&self) -> Vec<String> {
        self.lock().cfg.shape_limits.keys().cloned().collect()
    }
}

/// `GET /shapes`: the configured shapes (every availability domain offers all of them).
pub(super) fn list_shapes(s: &State, q: &HashMap<String, String>) -> Answer {
    if !q.contains_key("compartmentId") {
        return missing("compartmentId");
    }
    if let Some(image) = q.get("imageId")
        && !s.images.contains(image)
    {
        return not_found(&format!("image {image}"));
    }
    let items = s
        .cfg
        .shape_limits
        .iter()
        .map(|(shape, vnics)| {
            json!({
                "shape": shape,
                "isFlexible": shape.ends_with(".Flex"),
                "maxVnicAttachments": vnics,
            })
        })
        .collect();
    paginate(items, q, s.cfg.max_page_size)
}

/// `POST /instances`. The error codes are OCI's (`MissingParameter`, `InvalidParameter`,
/// `NotAuthorizedOrNotFound`, 500 `InternalError` "Out of host capacity."); the wording of
/// the messages other than the capacity one is this endpoint's.
pub(super) fn launch_instance(s: &mut State, details: &Value) -> Answer {
    let now = Instant::now();
    let field = |name: &str| {
        details
            .get(name)
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let Some(ad) = field("availabilityDomain") else {
        return missing("availabilityDomain");
    };
    let Some(compartment) = field("compartmentId") else {
        return missing("compartmentId");
    };
    let Some(shape) = field("shape") else {
        return missing("shape");
    };
    let subnet = details
        .get("createVnicDetails")
        .and_then(|v| v.get("subnetId"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| field("subnetId"));
    let Some(subnet) = subnet else {
        return missing("createVnicDetails.subnetId");
    };
    if !s.cfg.shape_limits.contains_key(&shape) {
        return error(
            400,
            "InvalidParameter",
            &format!("Shape {shape} is not offered in availability domain {ad}."),
        );
    }
    if let Some(source) = details.get("sourceDetails") {
        match source.get("sourceType").and_then(Value::as_str) {
            Some("image") => {
                let Some(image) = source.get("imageId").and_then(Value::as_str) else {
                    return missing("sourceDetails.imageId");
                };
                if !s.images.iter().any(|i| i == image) {
                    return not_found(&format!("image {image}"));
                }
            }
            Some("bootVolume") => {}
            _ => {
                return error(
                    400,
                    "InvalidParameter",
                    "sourceDetails.sourceType must be image or bootVolume.",
                );
            }
        }
    }
    if !s.subnets.contains_key(&subnet) {
        return not_found(&format!("subnet {subnet}"));
    }
    let metadata = details.get("metadata").cloned().unwrap_or(json!({}));
    let Some(entries) = metadata.as_object() else {
        return error(400, "InvalidParameter", "metadata must be an object.");
    };
    let mut size = 0;
    for (k, v) in entries {
        let Some(v) = v.as_str() else {
            return error(
                400,
                "InvalidParameter",
                &format!("metadata.{k} must be a string."),
            );
        };
        size += k.len() + v.len();
        if k == "user_data" && base64::engine::general_purpose::STANDARD.decode(v).is_err() {
            return error(
                400,
                "InvalidParameter",
                "metadata.user_data must be base64-encoded.",
            );
        }
    }
    if size > MAX_METADATA_BYTES {
        return error(
            400,
            "InvalidParameter",
            &format!("metadata is {size} bytes; at most {MAX_METADATA_BYTES} are allowed."),
        );
    }
    if s.out_of_capacity.contains(&shape) {
        return error(500, "InternalError", "Out of host capacity.");
    }
    let spec = InstanceSpec {
        display_name: field("displayName").unwrap_or_else(|| "instance".into()),
        shape,
        compartment_id: compartment,
        availability_domain: ad,
        subnet_id: subnet,
    };
    let running_at = now + s.cfg.launch_delay;
    let id = match s.create_instance(&spec, running_at) {
        Ok(id) => id,
        Err(a) => return a,
    };
    if let Some(i) = s.instances.get_mut(&id) {
        i.freeform_tags = details.get("freeformTags").cloned().unwrap_or(json!({}));
        i.metadata = metadata;
    }
    let i = &s.instances[&id];
    ok(s.instance_json(i, now))
}
