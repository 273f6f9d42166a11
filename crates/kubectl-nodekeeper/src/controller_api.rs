//! The controller's HTTP API, reached through the API server's service proxy, and the JSON it
//! serves, read with this crate's own lenient structs (unknown fields ignored, missing ones
//! defaulted) so a newer controller does not break an older plugin.

use std::collections::BTreeMap;

use http_body_util::BodyExt as _;
use serde::{Deserialize, Serialize};

use crate::connect::Connection;
use crate::error::{Error, chain};

/// The controller's Service and its port name.
pub const SERVICE: &str = "nodekeeper-controller";
pub const PORT: &str = "http";

/// The API-server path that proxies `path` (starting with `/`) to the controller.
pub fn proxy_path(namespace: &str, path: &str) -> String {
    format!("/api/v1/namespaces/{namespace}/services/{SERVICE}:{PORT}/proxy{path}")
}

/// What the controller answered.
#[derive(Debug)]
pub enum Answer {
    Found(serde_json::Value),
    /// The controller (not the API server) answered 404, with its message.
    NotFound(String),
}

/// `GET path` on the controller through the service proxy: the answer with its body unread
/// (a bundle is streamed from it).
pub async fn send_get(
    conn: &Connection,
    path: &str,
    accept: &str,
) -> Result<http::Response<kube::client::Body>, Error> {
    let uri = proxy_path(&conn.namespace, path);
    let request = http::Request::get(&uri)
        .header(http::header::ACCEPT, accept)
        .body(Vec::new())
        .map_err(|e| Error::InvalidFlags(format!("cannot request {uri}: {e}")))?;
    conn.client
        .send(request.map(kube::client::Body::from))
        .await
        .map_err(|e| conn.error(&format!("GET {uri}"), e))
}

/// `GET path` on the controller through the service proxy, read as JSON.
pub async fn get(conn: &Connection, path: &str) -> Result<Answer, Error> {
    let response = send_get(conn, path, "application/json").await?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| Error::ReachApiServer {
            server: conn.server.clone(),
            detail: chain(&e),
        })?
        .to_bytes();
    let text = String::from_utf8_lossy(&body).trim().to_owned();
    classify(&conn.namespace, &conn.server, status.as_u16(), &text)
}

/// Tells the API server's own answers (a `Status` object: no Service, no endpoints, forbidden)
/// from the controller's (its JSON, or its `{"error": …}` / plain-text errors).
pub(crate) fn classify(
    namespace: &str,
    server: &str,
    code: u16,
    text: &str,
) -> Result<Answer, Error> {
    let json: Option<serde_json::Value> = serde_json::from_str(text).ok();
    let from_api_server = json.as_ref().is_some_and(|v| v["kind"] == "Status");
    let message = || -> String {
        match &json {
            Some(v) if v["message"].is_string() => v["message"].as_str().unwrap_or("").to_owned(),
            Some(v) if v["error"].is_string() => v["error"].as_str().unwrap_or("").to_owned(),
            _ if text.is_empty() => format!("HTTP {code}"),
            _ => text.to_owned(),
        }
    };
    let unavailable = |detail: String| Error::ControllerUnavailable {
        namespace: namespace.to_owned(),
        detail,
    };
    match code {
        200..=299 => json
            .map(Answer::Found)
            .ok_or_else(|| Error::UnexpectedAnswer {
                what: format!("the controller in namespace {namespace}"),
                detail: format!("not JSON: {}", truncate(text, 200)),
            }),
        401 => Err(Error::Unauthorized {
            server: server.to_owned(),
        }),
        403 if from_api_server => Err(Error::Forbidden { message: message() }),
        // No Service, no endpoints, no ready leader, or the proxy could not dial the Pod.
        404 | 503 if from_api_server => Err(unavailable(message())),
        404 => Ok(Answer::NotFound(message())),
        502..=504 => Err(unavailable(message())),
        _ => Err(Error::UnexpectedAnswer {
            what: format!("the controller in namespace {namespace}"),
            detail: format!("HTTP {code}: {}", truncate(&message(), 200)),
        }),
    }
}

fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// `/api/v1/summary`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Summary {
    pub identity: String,
    pub leader: bool,
    pub nodes_synced: bool,
    pub fleet: Fleet,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Fleet {
    pub nodes: u64,
    pub read: u64,
    pub stale: u64,
    /// Nodes whose agent's latest call failed, counted at once (before the condition turns
    /// False). `None` from a controller too old to serve it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<u64>,
    /// Some of them by name (the controller lists at most 50), sorted.
    pub unreachable_nodes: Vec<String>,
    /// Nodes whose agent refuses the tuning rules the controller accepted. `None` from a
    /// controller too old to serve it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusing_rules: Option<u64>,
    /// Some of them by name (at most 50), sorted.
    pub refusing_rules_nodes: Vec<String>,
    pub without_internal_ip: u64,
    /// `Type=Status` → nodes.
    pub conditions: BTreeMap<String, u64>,
    /// Rule → nodes where it is out of bounds.
    pub tunables_out_of_bounds: BTreeMap<String, u64>,
}

/// `/api/v1/nodes/{name}`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeDetail {
    pub name: String,
    pub address: Option<String>,
    pub stale: bool,
    pub consecutive_failures: u64,
    pub last_failure: Option<LastFailure>,
    /// The tuning rules revision this node's agent refused on its merits, and why. `None` when
    /// it refuses none, or from a controller too old to serve it.
    pub rules_refused: Option<RulesRefusal>,
    pub conditions: Vec<WrittenCondition>,
    /// `None` while the controller has not read the agent, and once the node is stale (the
    /// controller drops a stale node's last report: it no longer describes the node).
    pub report: Option<Report>,
}

/// Rules the controller accepted and the agent still refused (it checks what only the node can
/// tell: a sysctl this kernel lacks, its own version's limits). That revision is not pushed to
/// the agent again; the next one is.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct RulesRefusal {
    pub revision: u64,
    /// The agent's message: it names the rule and the field.
    pub error: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct LastFailure {
    pub outcome: String,
    pub detail: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WrittenCondition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_time: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Report {
    pub node_name: String,
    pub agent_version: String,
    pub revision: u64,
    pub collected_at_unix_ms: i64,
    pub indicators: Vec<Indicator>,
    pub tunables: Vec<Tunable>,
    pub interfaces: Vec<Interface>,
    /// Pods' host-side links (veths whose peer is in a pod's namespace): counted, not listed.
    pub pod_links: u32,
    pub gpu: Gpu,
    pub plugins: Vec<Plugin>,
    pub collector_errors: Vec<(String, String)>,
    pub system: System,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Indicator {
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub verdict: String,
    pub message: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Tunable {
    pub rule: String,
    pub key: String,
    pub current: String,
    pub verdict: String,
    pub expected: String,
    pub previous: String,
    pub repaired_at_unix_ms: i64,
    pub conflict: bool,
    pub error: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub mac: String,
    pub mtu: u32,
    pub up: bool,
    pub oper_state: String,
    pub kind: String,
    pub addresses: Vec<String>,
    /// nodekeeper owns this interface (it configured it).
    pub managed: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Gpu {
    pub present: bool,
    pub source: String,
    pub error: String,
    pub gpus: Vec<GpuInfo>,
    /// The agent's verdict over all GPUs: the worst GPU's, or critical when fewer GPUs than
    /// expected were found (which no single GPU's verdict can say).
    pub verdict: String,
    pub message: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub temperature_c: f64,
    pub utilization_percent: f64,
    pub ecc_uncorrected: u64,
    pub xid_events: u64,
    pub verdict: String,
    pub message: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Plugin {
    pub name: String,
    pub state: String,
    pub message: String,
    pub verdict: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct System {
    pub kernel_release: String,
    pub boot_id: String,
    pub cpus: u32,
    pub memory_total_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(code: u16, text: &str) -> String {
        classify("nk", "https://h", code, text)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn api_server_answers_mean_the_controller_is_unreachable() {
        let no_endpoints = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"no endpoints available for service \"nodekeeper-controller\"","reason":"ServiceUnavailable","code":503}"#;
        let e = err(503, no_endpoints);
        assert!(e.starts_with("the nodekeeper controller is not reachable through Service nk/nodekeeper-controller"), "{e}");
        assert!(e.contains("no endpoints available"), "{e}");
        let no_service = r#"{"kind":"Status","message":"services \"nodekeeper-controller\" not found","reason":"NotFound","code":404}"#;
        assert!(err(404, no_service).contains("services \"nodekeeper-controller\" not found"));
        let dial =
            "error trying to reach service: dial tcp 10.0.0.1:8080: connect: connection refused";
        assert!(err(503, dial).contains("connection refused"));
        let forbidden = r#"{"kind":"Status","message":"services \"nodekeeper-controller\" is forbidden: User \"u\" cannot get resource \"services/proxy\"","code":403}"#;
        assert!(err(403, forbidden).starts_with("permission denied: services"));
    }

    #[test]
    fn controller_answers_are_passed_on() {
        let a = classify(
            "nk",
            "h",
            404,
            r#"{"error":"node \"x\" is not known to the controller"}"#,
        )
        .unwrap();
        assert!(matches!(a, Answer::NotFound(m) if m.contains("not known")));
        let standby = err(
            503,
            r#"{"error":"c-1 is a standby and holds no fleet data; ask the leader"}"#,
        );
        assert!(standby.contains("standby"), "{standby}");
        let a = classify("nk", "h", 200, r#"{"identity":"c-0","fleet":{"nodes":3}}"#).unwrap();
        let Answer::Found(v) = a else { panic!() };
        let s: Summary = serde_json::from_value(v).unwrap();
        assert_eq!((s.identity.as_str(), s.fleet.nodes), ("c-0", 3));
    }
}
