//! Well-known names: the API group and version, labels, annotations, condition types and
//! reasons, field managers and event reasons that the controller and tests share.

/// The API group of every nodekeeper resource.
pub const GROUP: &str = "nodekeeper.dev";
/// The served and stored version.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of nodekeeper resources.
pub const API_VERSION: &str = "nodekeeper.dev/v1alpha1";

// Field managers: one per controller, so server-side apply keeps their fields apart.

/// Field manager of the NetworkTest controller.
pub const MANAGER_NETWORK_TEST: &str = "nodekeeper-networktest";
/// Field manager of the NodeNetworkConfig controller.
pub const MANAGER_NODE_NETWORK_CONFIG: &str = "nodekeeper-nodenetworkconfig";
/// Field manager of the NodeMaintenance controller.
pub const MANAGER_NODE_MAINTENANCE: &str = "nodekeeper-nodemaintenance";
/// Field manager of the NodeSet controller.
pub const MANAGER_NODE_SET: &str = "nodekeeper-nodeset";
/// Field manager of the NodeDiagnostic controller.
pub const MANAGER_NODE_DIAGNOSTIC: &str = "nodekeeper-nodediagnostic";
/// Field manager of the kube-node controller (a machine for a Node a user created).
pub const MANAGER_KUBE_NODE: &str = "nodekeeper-kubenode";
/// Field manager of the node-condition writer (health, tunables, reachability).
pub const MANAGER_NODE_CONDITIONS: &str = "nodekeeper-nodeconditions";

// Labels and annotations.

/// Finalizer on a NodeDiagnostic: its bundles on the controller's disk are deleted first.
pub const FINALIZER_DIAGNOSTIC_BUNDLES: &str = "nodekeeper.dev/diagnostic-bundles";

/// Annotation on a Node a user creates: the NodeClass its machine is made from (the kube-node
/// way: `kubectl create -f node.yaml`; deleting the Node drains it and deletes the machine).
pub const ANNOTATION_NODE_CLASS: &str = "nodekeeper.dev/node-class";
/// Finalizer on a Node with [`ANNOTATION_NODE_CLASS`]: its machine is deleted (after a drain)
/// before the Node object goes.
pub const FINALIZER_MACHINE: &str = "nodekeeper.dev/machine";

/// Label on a Node created by a NodeSet: the NodeSet's name.
pub const LABEL_NODE_SET: &str = "nodekeeper.dev/nodeset";
/// Label on a Node created by a NodeSet: the NodeClass it was made from.
pub const LABEL_NODE_CLASS: &str = "nodekeeper.dev/nodeclass";
/// Annotation on a Node cordoned by a NodeMaintenance: that NodeMaintenance's name, so only it
/// uncordons the node (a node someone else cordoned stays cordoned).
pub const ANNOTATION_CORDONED_BY: &str = "nodekeeper.dev/cordoned-by";
/// Annotation on a Node held by one or more NodeMaintenances: JSON with the node's
/// `spec.unschedulable` from before the first of them touched it and each holder's phase, so
/// that any controller replica can continue or restore it.
pub const ANNOTATION_MAINTENANCE: &str = "nodekeeper.dev/maintenance";
/// Label on a Node held by a NodeMaintenance (value `true`), so the held nodes are one
/// label-selected list away, whatever their other labels do meanwhile.
pub const LABEL_MAINTAINED: &str = "nodekeeper.dev/maintained";

// Condition types on Nodes (patched only when status or reason changes).

/// The node's agent answered the last pull.
pub const NODE_CONDITION_REACHABLE: &str = "NodekeeperReachable";
/// The NodeNetworkConfig for this node is applied.
pub const NODE_CONDITION_NETWORK_READY: &str = "NodeNetworkReady";
/// Every tunable is within its rule.
pub const NODE_CONDITION_TUNABLES_IN_BOUNDS: &str = "TunablesInBounds";
/// GPUs report no critical problem.
pub const NODE_CONDITION_GPU_HEALTHY: &str = "GpuHealthy";
/// A NodeMaintenance will cordon and drain this node when its turn comes (KEP-5683).
pub const NODE_CONDITION_MAINTENANCE_PLANNED: &str = "MaintenancePlanned";
/// A NodeMaintenance covers this node.
pub const NODE_CONDITION_MAINTENANCE_IN_PROGRESS: &str = "MaintenanceInProgress";
/// The node is being drained.
pub const NODE_CONDITION_DRAIN_IN_PROGRESS: &str = "DrainInProgress";
/// The node's drain finished.
pub const NODE_CONDITION_DRAINED: &str = "Drained";

// Condition types on nodekeeper resources.

/// Ready: the resource's desired state is in force.
pub const CONDITION_READY: &str = "Ready";
/// Progressing: the controller is working toward the desired state.
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// NetworkTest: whether the spec could be turned into probes.
pub const CONDITION_SPEC_VALID: &str = "SpecValid";
/// NetworkTest and NodeMaintenance: finished, and how.
pub const CONDITION_COMPLETE: &str = "Complete";
/// NodeMaintenance: every selected node is cordoned.
pub const CONDITION_CORDONED: &str = "Cordoned";
/// NodeMaintenance: every selected node is drained.
pub const CONDITION_DRAINED: &str = "Drained";
/// NodeMaintenance: at least one node's drain is held up or failed.
pub const CONDITION_BLOCKED: &str = "Blocked";

// Condition reasons and event reasons (PascalCase).

/// The spec failed validation; the message names the field.
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";
/// The selector picks no node.
pub const REASON_NO_MATCHING_NODES: &str = "NoMatchingNodes";
/// Work is under way.
pub const REASON_IN_PROGRESS: &str = "InProgress";
/// Everything asked for is done.
pub const REASON_DONE: &str = "Done";
/// A node's agent could not be reached.
pub const REASON_AGENT_UNREACHABLE: &str = "AgentUnreachable";
/// A PodDisruptionBudget refused an eviction.
pub const REASON_BLOCKED_BY_PDB: &str = "BlockedByPodDisruptionBudget";
/// A drain took longer than its timeout.
pub const REASON_DRAIN_TIMED_OUT: &str = "DrainTimedOut";
/// A network change failed and was rolled back.
pub const REASON_ROLLED_BACK: &str = "RolledBack";

// NodeNetworkConfig.

/// Finalizer on a NodeNetworkConfig: the VNICs it attached are detached (and their host side
/// removed) before the object goes.
pub const FINALIZER_NODE_NETWORK_CONFIG: &str = "nodekeeper.dev/node-network-config";
/// The well-known Node label holding the instance's shape (OKE sets it to e.g.
/// `VM.Standard.E5.Flex`).
pub const LABEL_INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";
/// NodeNetworkConfig `Progressing=False`: the failure threshold holds the rollout.
pub const REASON_PAUSED: &str = "FailureThresholdReached";
/// NodeNetworkConfig `Ready=False`: nodes are failing or pending.
pub const REASON_NOT_APPLIED: &str = "NotAllApplied";
/// NodeNetworkConfig `Ready=False`: VNICs are to be attached, but the controller was started
/// without an OCI endpoint or region and credentials.
pub const REASON_CLOUD_NOT_CONFIGURED: &str = "CloudNotConfigured";
/// Node `NodeNetworkReady=False`: the node cannot get the object's VNICs (spec against the
/// node's shape, or an OCI answer); the message names the field or OCI's code.
pub const REASON_VNIC_ATTACH_FAILED: &str = "VnicAttachFailed";
/// Node `NodeNetworkReady=True`: the host network is applied (the same reason the node sweep
/// writes from the agent's report, so the two writers agree).
pub const REASON_NETWORK_CONVERGED: &str = "NetworkConverged";
/// Node `NodeNetworkReady=False`: applying on the host failed (the sweep's reason too).
pub const REASON_NETWORK_APPLY_FAILED: &str = "NetworkApplyFailed";
