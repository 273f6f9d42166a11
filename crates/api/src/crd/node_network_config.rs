//! `NodeNetworkConfig`: desired secondary VNICs and host interfaces for the nodes a selector picks,
//! rolled out a few nodes at a time, with counts and the failing nodes in status.

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, FieldError, IntOrPercent, LabelSelector, conditions_schema};
use nodekeeper_model::network::{NetworkState, RULE_PRIORITY_MAX, RULE_PRIORITY_MIN};
use nodekeeper_model::oci_ids::{
    MAX_OCID_LEN, NSG_OCID_PATTERN, OcidKind, SUBNET_OCID_PATTERN, check_ocid,
};

/// Most VNICs one object may ask for per node (the largest shapes allow a few dozen in all; the
/// controller checks each node's own shape limit).
pub const MAX_ATTACH: usize = 32;
/// Most network security groups per VNIC (OCI's limit).
pub const MAX_NSGS_PER_VNIC: usize = 5;
/// Most secondary private IPv4 addresses per VNIC (`shared/oci/README.md`: up to 31 besides the
/// primary address).
pub const MAX_SECONDARY_PRIVATE_IPS: u32 = 31;
/// `Progressing` reason: the rollout is paused because its failing nodes fill
/// `rollout.maxUnavailable` (below `failureThreshold`), so no further node can start.
pub const REASON_MAX_UNAVAILABLE_FAILING: &str = "MaxUnavailableFailing";
/// Why `secondaryPrivateIpCount` other than 0 is refused (`validate()`).
const SECONDARY_IPS_UNSUPPORTED: &str = "secondaryPrivateIpCount is not supported yet: nodekeeper \
    does not assign secondary private IPs; remove the field (or set it to 0), assign them with \
    `oci network vnic assign-private-ip` and configure them under spec.state.addresses";
/// The freeform tag key put on every VNIC this object attaches, valued with the object's name;
/// only VNICs carrying it with this object's name are ever detached.
pub const OWNER_TAG: &str = "nodekeeper.dev/nnc";

/// Network configuration for the nodes `nodeSelector` picks. Cloud side: the OCI secondary VNICs
/// each node must have attached (`ociVnics.attach`). Host side: the layout of every secondary VNIC
/// the node's instance metadata lists (`ociVnics`), and/or an explicit `state` of links,
/// addresses, routes and rules. Rolled out at most `rollout.maxUnavailable` nodes at a time; a
/// node whose post-apply check fails is rolled back and listed in status, and the rollout pauses
/// once `rollout.failureThreshold` nodes fail.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeNetworkConfig",
    plural = "nodenetworkconfigs",
    singular = "nodenetworkconfig",
    shortname = "nnc",
    category = "nodekeeper",
    status = "NodeNetworkConfigStatus",
    derive = "PartialEq",
    doc = "Desired host networking (OCI secondary VNICs, links, addresses, routes, rules) for selected nodes.",
    printcolumn(name = "Matched", type_ = "integer", json_path = ".status.matched"),
    printcolumn(name = "Attached", type_ = "integer", json_path = ".status.attached"),
    printcolumn(name = "Applied", type_ = "integer", json_path = ".status.applied"),
    printcolumn(name = "Failing", type_ = "integer", json_path = ".status.failing"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "has(self.ociVnics) || has(self.state)",
        "message": "spec: set ociVnics, state, or both; an empty configuration changes nothing"
    }
]))]
pub struct NodeNetworkConfigSpec {
    /// The nodes this configuration applies to. Required; write `{}` to pick every node.
    pub node_selector: LabelSelector,
    /// Configure every secondary VNIC the node's instance metadata lists (VM: the NIC with the
    /// VNIC's MAC; bare metal: macvlan + VLAN on the physical NIC), each with its own routing
    /// table and source rules. The primary VNIC and 169.254.0.0/16 are never touched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_vnics: Option<OciVnics>,
    /// Links, addresses, routes and rules applied to every selected node, in addition to
    /// `ociVnics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<NetworkState>,
    /// How fast the configuration reaches the selected nodes, and when it stops.
    #[serde(default)]
    pub rollout: Rollout,
    /// After applying, each of these `address` or `address:port` targets must answer (ICMP, or TCP
    /// connect when a port is given) from the node, or the change is rolled back. Empty: no check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(
            length(min = 1, max = 64),
            regex(pattern = r"^([0-9.]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+)(:[0-9]{1,5})?$")
        )
    )]
    pub check_targets: Vec<String>,
    /// Timeout of the whole post-apply check, in milliseconds.
    #[serde(default = "default_check_timeout_ms")]
    #[schemars(range(min = 100, max = 60000))]
    pub check_timeout_ms: u32,
}

/// Pace and brakes of a rollout.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// The most selected nodes that may be changing (or failing) at once: a count or a percentage
    /// of the selected nodes (rounded down, at least 1).
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrPercent,
    /// The rollout pauses (no further node is started) once this many selected nodes are failing:
    /// a count (0 counts as 1) or a percentage of the selected nodes (rounded up, at least 1). The
    /// `Progressing` condition then names the failing nodes; fix them or the spec to resume.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: IntOrPercent,
}

impl Default for Rollout {
    fn default() -> Self {
        Self {
            max_unavailable: default_max_unavailable(),
            failure_threshold: default_failure_threshold(),
        }
    }
}

impl Rollout {
    /// Nodes that may be changing at once among `matched` (at least 1).
    pub fn max_unavailable_of(&self, matched: u32) -> u32 {
        self.max_unavailable.resolve(matched, false).max(1)
    }

    /// Failing nodes at which the rollout pauses among `matched` (at least 1).
    pub fn failure_threshold_of(&self, matched: u32) -> u32 {
        self.failure_threshold.resolve(matched, true).max(1)
    }
}

fn default_max_unavailable() -> IntOrPercent {
    IntOrPercent::Int(1)
}
fn default_failure_threshold() -> IntOrPercent {
    IntOrPercent::Int(1)
}
fn default_check_timeout_ms() -> u32 {
    5000
}

/// OCI secondary VNICs: the ones to attach to every selected node (cloud side), and how every
/// secondary VNIC of the node is laid out on the host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciVnics {
    /// VNICs every selected node must have attached, each identified by its `displayName`.
    /// Missing ones are attached, ones this object attached earlier and no longer lists are
    /// detached (after their host side is removed); VNICs attached by anyone else are never
    /// touched. Empty: attach nothing, only lay out the VNICs the node already has.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_ATTACH),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["displayName"])
    )]
    pub attach: Vec<OciVnic>,
    /// MTU of the VNIC interfaces (OCI's is 9000).
    #[serde(default = "default_mtu")]
    #[schemars(range(min = 576, max = 9000))]
    pub mtu: u32,
    /// VNIC number `i` (its position in the metadata answer) uses routing table `tableBase + i`.
    #[serde(default = "default_table_base")]
    #[schemars(range(min = 1, max = 200))]
    pub table_base: u32,
    /// The rule keeping the metadata service on the primary VNIC uses this priority; VNIC `i`
    /// uses `rulePriorityBase + i`. Must leave room within nodekeeper's range 20000–20999.
    #[serde(default = "default_rule_priority_base")]
    #[schemars(range(min = 20000, max = 20900))]
    pub rule_priority_base: u32,
}

impl Default for OciVnics {
    fn default() -> Self {
        Self {
            attach: Vec::new(),
            mtu: default_mtu(),
            table_base: default_table_base(),
            rule_priority_base: default_rule_priority_base(),
        }
    }
}

/// One secondary VNIC to attach to every selected node (OCI `AttachVnic`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciVnic {
    /// Display name of the VNIC and its attachment in OCI; unique within this object. An existing
    /// attachment with this name on the node is reused, never doubled, so a retried or restarted
    /// rollout is safe. Renaming a VNIC here attaches a new one and detaches the old one.
    #[schemars(
        length(min = 1, max = 64),
        regex(pattern = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
    )]
    pub display_name: String,
    /// OCID of the subnet the VNIC is created in, e.g. `ocid1.subnet.oc1.phx.aaaa…`; it must be in
    /// the node's availability domain (or be regional).
    #[schemars(length(max = MAX_OCID_LEN), extend("x-kubernetes-validations" = [{
        "rule": format!("self.matches('{SUBNET_OCID_PATTERN}')"),
        "message": "subnetId must be a subnet OCID such as ocid1.subnet.oc1.phx.aaaa…; copy it from the subnet's page in the console or `oci network subnet list`"
    }]))]
    pub subnet_id: String,
    /// OCIDs of the network security groups the VNIC joins (at most 5). Empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_NSGS_PER_VNIC),
        inner(length(max = MAX_OCID_LEN)),
        extend("x-kubernetes-validations" = [{
            "rule": format!("self.all(n, n.matches('{NSG_OCID_PATTERN}'))"),
            "message": "nsgIds entries must be network security group OCIDs such as ocid1.networksecuritygroup.oc1.phx.aaaa…; copy them from `oci network nsg list`"
        }])
    )]
    pub nsg_ids: Vec<String>,
    /// Turn off OCI's source/destination check on this VNIC, for nodes that route or NAT traffic
    /// for addresses not their own (pod networking, gateways).
    #[serde(default)]
    pub skip_source_dest_check: bool,
    /// Bare-metal shapes only: the physical NIC (0 or 1) the VNIC attaches to. Leave it unset on
    /// VM shapes; the controller refuses it there with a per-node error, because the shape is
    /// known per node only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1))]
    pub nic_index: Option<u32>,
    /// Reserved; only 0 (the default) is accepted. nodekeeper does not assign secondary private
    /// IPv4 addresses yet: assign them with `oci network vnic assign-private-ip` and configure
    /// them on the host under `spec.state.addresses`.
    #[serde(default)]
    // The schema keeps accepting 0–31, as it did when the field was documented as working, so
    // objects stored then stay valid (docs/crd-versions.md); `validate()` refuses a count.
    #[schemars(range(min = 0, max = MAX_SECONDARY_PRIVATE_IPS))]
    pub secondary_private_ip_count: u32,
}

fn default_mtu() -> u32 {
    9000
}
fn default_table_base() -> u32 {
    100
}
fn default_rule_priority_base() -> u32 {
    20100
}

impl NodeNetworkConfigSpec {
    /// Everything the schema cannot check: the network state's own rules (references between
    /// links, address syntax, reserved ranges) and the selector. Each error names its field.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        self.node_selector
            .validate("spec.nodeSelector", &mut errors);
        if self.oci_vnics.is_none() && self.state.is_none() {
            errors.push(FieldError::new(
                "spec",
                "set ociVnics, state, or both; an empty configuration changes nothing",
            ));
        }
        if let Some(v) = &self.oci_vnics {
            validate_attach(&v.attach, &mut errors);
            // VNIC rules take rulePriorityBase + index; leave room for 100 VNICs inside the reserved range.
            if v.rule_priority_base < RULE_PRIORITY_MIN
                || v.rule_priority_base > RULE_PRIORITY_MAX - 99
            {
                errors.push(FieldError::new(
                    "spec.ociVnics.rulePriorityBase",
                    format!(
                        "{} leaves no room for the VNIC rules; use {RULE_PRIORITY_MIN}–{}",
                        v.rule_priority_base,
                        RULE_PRIORITY_MAX - 99
                    ),
                ));
            }
        }
        if let Some(state) = &self.state {
            // Past the size caps only those are reported: one error per entry of an oversized
            // list would not fit in a condition.
            let problems = match state.check_sizes() {
                sizes if !sizes.is_empty() => sizes,
                _ => state.validate().err().unwrap_or_default(),
            };
            errors.extend(
                problems
                    .into_iter()
                    .map(|p| FieldError::new(format!("spec.state.{}", p.path), p.message)),
            );
        }
        for (i, target) in self.check_targets.iter().enumerate() {
            if parse_check_target(target).is_none() {
                errors.push(FieldError::new(
                    format!("spec.checkTargets[{i}]"),
                    format!("{target:?} is not an address or address:port (IPv6 with a port as [address]:port)"),
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// The cloud-side checks the schema also makes (kept here so that the controller refuses the
/// same objects with the same fields named when the CRD is older than the controller).
fn validate_attach(attach: &[OciVnic], errors: &mut Vec<FieldError>) {
    if attach.len() > MAX_ATTACH {
        errors.push(FieldError::new(
            "spec.ociVnics.attach",
            format!("{} VNICs; at most {MAX_ATTACH} per object", attach.len()),
        ));
    }
    for (i, vnic) in attach.iter().enumerate() {
        let at = |f: &str| format!("spec.ociVnics.attach[{i}].{f}");
        if attach[..i]
            .iter()
            .any(|other| other.display_name == vnic.display_name)
        {
            errors.push(FieldError::new(
                at("displayName"),
                format!(
                    "{:?} is used by an earlier VNIC; give each VNIC its own display name",
                    vnic.display_name
                ),
            ));
        }
        if vnic.display_name.is_empty() {
            errors.push(FieldError::new(at("displayName"), "must be set"));
        }
        if let Err(message) = check_ocid(OcidKind::Subnet, &vnic.subnet_id) {
            errors.push(FieldError::new(at("subnetId"), message));
        }
        if vnic.nsg_ids.len() > MAX_NSGS_PER_VNIC {
            errors.push(FieldError::new(
                at("nsgIds"),
                format!(
                    "{} NSGs; OCI allows at most {MAX_NSGS_PER_VNIC} per VNIC",
                    vnic.nsg_ids.len()
                ),
            ));
        }
        for (j, nsg) in vnic.nsg_ids.iter().enumerate() {
            if let Err(message) = check_ocid(OcidKind::NetworkSecurityGroup, nsg) {
                errors.push(FieldError::new(at(&format!("nsgIds[{j}]")), message));
            }
        }
        if vnic.nic_index.is_some_and(|n| n > 1) {
            errors.push(FieldError::new(
                at("nicIndex"),
                "must be 0 or 1 (the physical NIC of a two-NIC bare-metal shape)",
            ));
        }
        // The field was documented and accepted, but the attach never sent it: a VNIC came up
        // without the addresses asked for. Refused until the attach assigns them.
        if vnic.secondary_private_ip_count != 0 {
            errors.push(FieldError::new(
                at("secondaryPrivateIpCount"),
                format!(
                    "{}: {SECONDARY_IPS_UNSUPPORTED}",
                    vnic.secondary_private_ip_count
                ),
            ));
        }
    }
}

/// Parses a check target (`10.0.0.1`, `10.0.0.1:443`, `fd00::1`, `[fd00::1]:443`).
pub fn parse_check_target(s: &str) -> Option<(std::net::IpAddr, Option<u16>)> {
    if let Ok(ip) = s.parse() {
        return Some((ip, None));
    }
    let sa: std::net::SocketAddr = s.parse().ok()?;
    (sa.port() != 0).then_some((sa.ip(), Some(sa.port())))
}

/// One node where the configuration is not in force.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailingNode {
    /// The node's name.
    #[schemars(length(max = 253))]
    pub node: String,
    /// What went wrong (the failing step, or why the agent could not be asked).
    #[schemars(length(max = 1024))]
    pub error: String,
    /// Whether the node was returned to its previous state.
    #[serde(default)]
    pub rolled_back: bool,
}

/// Rollout counts and the failing nodes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeNetworkConfigStatus {
    /// Nodes the selector picks.
    #[serde(default)]
    pub matched: u32,
    /// Nodes that have every VNIC of `ociVnics.attach` attached (all matched nodes when nothing
    /// is to be attached).
    #[serde(default)]
    pub attached: u32,
    /// Nodes where this generation is applied and the check passed.
    #[serde(default)]
    pub applied: u32,
    /// Nodes where applying failed.
    #[serde(default)]
    pub failing: u32,
    /// Failing nodes, at most 50 (the rest are counted in `omittedFailing`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub failing_nodes: Vec<FailingNode>,
    /// Failing nodes not listed in `failingNodes`.
    #[serde(default)]
    pub omitted_failing: u32,
    /// `Ready` (every matched node applied) and `Progressing`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {"matchLabels": {"pool": "gpu"}},
            "ociVnics": {},
            "checkTargets": ["10.0.0.1", "[fd00::1]:443", "10.0.0.2:0", "nope"],
        }))
        .unwrap();
        assert_eq!(spec.rollout, Rollout::default());
        assert_eq!(spec.rollout.max_unavailable, IntOrPercent::Int(1));
        assert_eq!(spec.oci_vnics, Some(OciVnics::default()));
        assert_eq!(spec.check_timeout_ms, 5000);
        let errors = spec.validate().unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.checkTargets[2]", "spec.checkTargets[3]"]);
    }

    /// Oversized state lists and texts are refused by the schema and, for objects stored under
    /// an earlier CRD, by `validate`, naming the field.
    #[test]
    fn state_sizes_are_capped() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(NodeNetworkConfig::crd()).unwrap();
        let state = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["state"]["properties"];
        for (list, max) in [
            ("links", 64),
            ("addresses", 256),
            ("routes", 256),
            ("rules", 256),
        ] {
            assert_eq!(state[list]["maxItems"], max, "{list}");
        }
        assert_eq!(
            state["routes"]["items"]["properties"]["gateway"]["maxLength"],
            64
        );
        assert_eq!(
            state["links"]["items"]["properties"]["name"]["maxLength"],
            15
        );

        let link = |i: usize| serde_json::json!({"name": format!("l{i}"), "kind": "existing"});
        let mut spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {},
            "state": {
                "links": (0..65).map(link).collect::<Vec<_>>(),
                "routes": [{"destination": "10.0.0.0/8", "gateway": "1".repeat(65), "link": "l0"}],
            },
        }))
        .unwrap();
        let fields = |spec: &NodeNetworkConfigSpec| {
            spec.validate()
                .unwrap_err()
                .into_iter()
                .map(|e| e.field)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            fields(&spec),
            ["spec.state.links", "spec.state.routes[0].gateway"]
        );
        let state = spec.state.as_mut().unwrap();
        state.links.truncate(64);
        state.routes[0].gateway = Some("10.0.0.1".into());
        spec.validate().unwrap();
    }

    fn vnic(name: &str) -> serde_json::Value {
        serde_json::json!({
            "displayName": name,
            "subnetId": "ocid1.subnet.oc1.phx.aaaa",
        })
    }

    #[test]
    fn attach_defaults_and_a_valid_list() {
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {},
            "ociVnics": {"attach": [vnic("a"), {
                "displayName": "b",
                "subnetId": "ocid1.subnet.oc1..bbbb",
                "nsgIds": ["ocid1.networksecuritygroup.oc1.phx.cccc"],
                "skipSourceDestCheck": true,
                "nicIndex": 1,
                "secondaryPrivateIpCount": 0,
            }]},
        }))
        .unwrap();
        spec.validate().unwrap();
        let attach = &spec.oci_vnics.as_ref().unwrap().attach;
        assert_eq!(attach[0].nic_index, None);
        assert!(!attach[0].skip_source_dest_check);
        assert_eq!(attach[0].secondary_private_ip_count, 0);
        assert_eq!(attach[1].nic_index, Some(1));
    }

    #[test]
    fn bad_attach_entries_name_their_field() {
        let mut bad = vnic("a");
        bad["subnetId"] = "ocid1.vcn.oc1.phx.aaaa".into();
        bad["nsgIds"] = serde_json::json!(["sg-1"]);
        bad["nicIndex"] = 2.into();
        bad["secondaryPrivateIpCount"] = 32.into();
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {},
            "ociVnics": {"attach": [bad, vnic("b"), vnic("b")]},
        }))
        .unwrap();
        let errors = spec.validate().unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.ociVnics.attach[0].subnetId",
                "spec.ociVnics.attach[0].nsgIds[0]",
                "spec.ociVnics.attach[0].nicIndex",
                "spec.ociVnics.attach[0].secondaryPrivateIpCount",
                "spec.ociVnics.attach[2].displayName",
            ]
        );
        assert!(
            errors[0].message.contains("oci network subnet list"),
            "{errors:?}"
        );
        assert!(errors[4].message.contains("own display name"), "{errors:?}");
    }

    /// Secondary private IPs were accepted and documented but never assigned; any count but 0
    /// is refused, naming the field and the way to do it.
    #[test]
    fn secondary_private_ips_are_refused_until_supported() {
        let mut two = vnic("a");
        two["secondaryPrivateIpCount"] = 2.into();
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {},
            "ociVnics": {"attach": [two]},
        }))
        .unwrap();
        let errors = spec.validate().unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].field,
            "spec.ociVnics.attach[0].secondaryPrivateIpCount"
        );
        for words in [
            "2: ",
            "not supported yet",
            "remove the field",
            "assign-private-ip",
        ] {
            assert!(errors[0].message.contains(words), "{words}: {errors:?}");
        }
    }

    #[test]
    fn rollout_bounds_resolve_to_at_least_one() {
        let r: Rollout = serde_json::from_value(serde_json::json!({
            "maxUnavailable": "10%", "failureThreshold": "5%"
        }))
        .unwrap();
        assert_eq!(r.max_unavailable_of(1000), 100);
        assert_eq!(r.max_unavailable_of(5), 1);
        assert_eq!(r.failure_threshold_of(1000), 50);
        assert_eq!(r.failure_threshold_of(3), 1);
        let zero: Rollout =
            serde_json::from_value(serde_json::json!({"failureThreshold": 0})).unwrap();
        assert_eq!(zero.failure_threshold_of(10), 1);
        assert_eq!(zero.max_unavailable, IntOrPercent::Int(1));
    }

    #[test]
    fn state_errors_are_prefixed_with_the_field() {
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {},
            "state": {"addresses": [{"link": "missing", "cidr": "10.0.0.5/24"}]},
        }))
        .unwrap();
        let errors = spec.validate().unwrap_err();
        assert!(
            errors.iter().all(|e| e.field.starts_with("spec.state.")),
            "{errors:?}"
        );
        assert!(!errors.is_empty());
    }

    #[test]
    fn empty_configuration_is_refused() {
        let spec: NodeNetworkConfigSpec =
            serde_json::from_value(serde_json::json!({"nodeSelector": {}})).unwrap();
        let errors = spec.validate().unwrap_err();
        assert_eq!(errors[0].field, "spec");
    }

    #[test]
    fn node_selector_is_required() {
        let err =
            serde_json::from_value::<NodeNetworkConfigSpec>(serde_json::json!({"ociVnics": {}}))
                .unwrap_err();
        assert!(err.to_string().contains("nodeSelector"), "{err}");
    }
}
