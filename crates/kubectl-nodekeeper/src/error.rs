//! Everything that can stop a verb, each as one line naming the problem and what to do.

use std::path::PathBuf;

/// Why a verb could not do its job. Every message names the object and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("start the async runtime: {0}")]
    StartRuntime(#[source] std::io::Error),
    #[error(
        "load the kubeconfig {}: {detail}; point --kubeconfig (or KUBECONFIG) at a valid file, and --context at a context in it",
        path.as_ref().map_or_else(|| "($KUBECONFIG or ~/.kube/config)".to_owned(), |p| p.display().to_string())
    )]
    LoadKubeconfig {
        path: Option<PathBuf>,
        detail: String,
    },
    #[error("build a client for {server}: {detail}; check the cluster entry of the kubeconfig")]
    BuildClient { server: String, detail: String },
    #[error(
        "reach the API server at {server}: {detail}; check that the cluster is up and that --kubeconfig/--context name it"
    )]
    ReachApiServer { server: String, detail: String },
    #[error(
        "the API server at {server} refused the credentials (401 Unauthorized); renew the token or certificate of the kubeconfig's user"
    )]
    Unauthorized { server: String },
    #[error("permission denied: {message}; ask a cluster admin to grant it (RBAC)")]
    Forbidden { message: String },
    #[error(
        "the nodekeeper controller is not reachable through Service {namespace}/nodekeeper-controller (port http): {detail}; check `kubectl -n {namespace} get deploy,svc,endpoints nodekeeper-controller`, or pass -n with the namespace it runs in"
    )]
    ControllerUnavailable { namespace: String, detail: String },
    #[error("node {name:?} not found; `kubectl get nodes` lists the nodes")]
    NodeNotFound { name: String },
    #[error(
        "node {name:?} exists but the controller has no report for it: {detail}; it may be outside the controller's --node-selector, or just added (wait for one sweep)"
    )]
    NodeNotManaged { name: String, detail: String },
    #[error("invalid selector {selector:?}: {reason}")]
    InvalidSelector { selector: String, reason: String },
    #[error(
        "no node matches the selector {selector:?}, so nothing was created; `kubectl get nodes --show-labels` shows the labels to select on"
    )]
    NoMatchingNodes { selector: String },
    #[error("invalid target {target:?}: {reason}")]
    InvalidTarget { target: String, reason: String },
    #[error("invalid flags: {0}")]
    InvalidFlags(String),
    #[error(
        "the API server refused the NetworkTest in namespace {namespace}: {message}; nothing was created"
    )]
    RefusedNetworkTest { namespace: String, message: String },
    #[error("the controller refused networktest {id}: {message}; {disposition}")]
    ControllerRefusedNetworkTest {
        id: String,
        message: String,
        disposition: String,
    },
    #[error(
        "node {name:?} cannot be selected by name: its kubernetes.io/hostname label is {}; write a NodeMaintenance or NodeDiagnostic with a spec.nodeSelector on its labels instead (kubectl apply)",
        label.as_ref().map_or_else(|| "missing".to_owned(), |l| format!("{l:?}"))
    )]
    NodeNotSelectableByName { name: String, label: Option<String> },
    #[error("the API server refused the {what}: {message}; nothing was changed")]
    Refused { what: String, message: String },
    #[error("the controller refused {what}: {message}; {disposition}")]
    ControllerRefused {
        what: String,
        message: String,
        disposition: String,
    },
    #[error(
        "nodemaintenance {name} is finished (stage Complete) and cannot be reopened; leave out --name (a new one is created) or pick another name"
    )]
    MaintenanceFinished { name: String },
    #[error(
        "nodemaintenance {name} selects other nodes ({selector}); leave out --name to create one for these nodes, or name the nodes it selects"
    )]
    MaintenanceSelectsOtherNodes { name: String, selector: String },
    #[error(
        "several unfinished NodeMaintenances select exactly these nodes ({}); pick one with --name",
        names.join(", ")
    )]
    AmbiguousMaintenance { names: Vec<String> },
    #[error(
        "no NodeMaintenance {what}; `kubectl get nodemaintenances` lists them (pass --name), or start one with `kubectl nodekeeper maintain NODES`"
    )]
    MaintenanceNotFound { what: String },
    #[error("write {}: {source}", path.display())]
    WriteFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unexpected answer from {what}: {detail}")]
    UnexpectedAnswer { what: String, detail: String },
    #[error("{what}: {detail}")]
    Api { what: String, detail: String },
    #[error("write the output: {0}")]
    WriteOutput(#[source] std::io::Error),
}

impl Error {
    /// Maps a failed API request about `what` to the error a user can act on: credentials,
    /// permissions and connection problems get their own lines, the rest names the request.
    pub fn from_kube(what: &str, server: &str, error: kube::Error) -> Error {
        match error {
            kube::Error::Api(status) => match status.code {
                401 => Error::Unauthorized {
                    server: server.to_owned(),
                },
                403 => Error::Forbidden {
                    message: status.message.clone(),
                },
                _ => Error::Api {
                    what: what.to_owned(),
                    detail: if status.message.is_empty() {
                        format!("HTTP {}", status.code)
                    } else {
                        status.message.clone()
                    },
                },
            },
            // kube's own wording ("ServiceError: …") adds nothing for a person: start at the cause.
            kube::Error::HyperError(_) | kube::Error::Service(_) => Error::ReachApiServer {
                server: server.to_owned(),
                detail: std::error::Error::source(&error).map_or_else(|| chain(&error), chain),
            },
            other => Error::Api {
                what: what.to_owned(),
                detail: chain(&other),
            },
        }
    }
}

/// An error and its causes in one line, without repeats (hyper and tower nest the same text).
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "x")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn permission_and_credential_problems_say_what_to_do() {
        let e = Error::from_kube("list nodes", "https://h:6443", api(401, "Unauthorized"));
        assert!(e.to_string().contains("renew the token"), "{e}");
        let e = Error::from_kube(
            "list nodes",
            "https://h:6443",
            api(
                403,
                "nodes is forbidden: User \"u\" cannot list resource \"nodes\"",
            ),
        );
        let text = e.to_string();
        assert!(
            text.starts_with("permission denied: nodes is forbidden"),
            "{text}"
        );
        assert!(text.contains("RBAC"), "{text}");
        let e = Error::from_kube("get networktest x", "s", api(500, "boom"));
        assert_eq!(e.to_string(), "get networktest x: boom");
    }

    #[test]
    fn chain_drops_repeated_causes() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer: inner")]
        struct Outer(#[source] Inner);
        #[derive(Debug, thiserror::Error)]
        #[error("inner")]
        struct Inner;
        assert_eq!(chain(&Outer(Inner)), "outer: inner");
    }
}
