//! The controller's HTTP API, served from memory (never from etcd): `/api/v1/summary`,
//! `/api/v1/nodes/{name}`, `/metrics` (Prometheus text), `/healthz`, `/readyz`, and the routes
//! the controllers add (`/api/networktests/{namespace}/{name}`, full NetworkTest results;
//! `/api/diagnostics/{namespace}/{name}/{node}/{token}`, diagnostics bundles, each served only
//! with the token its NodeDiagnostic's status publishes; see
//! [`crate::controllers::Controllers::router`]). Served on the standby too. Reachable in a
//! cluster through the API server's service proxy, e.g.
//! `kubectl get --raw /api/v1/namespaces/nodekeeper/services/nodekeeper-controller:http/proxy/api/v1/summary`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::sync::watch;

use crate::conditions::Written;
use crate::shared::metrics::SweepMetrics;
use crate::shared::{Fleet, TuningState};
use crate::view::StoredReport;

/// What the HTTP API reads.
pub struct Context {
    pub identity: String,
    /// Set by the runtime while this replica holds the Lease.
    pub is_leader: Arc<AtomicBool>,
    pub fleet: Arc<Fleet>,
    pub tuning: watch::Receiver<Arc<TuningState>>,
    pub registry: Registry,
    pub sweep: SweepMetrics,
}

impl Context {
    fn tuning(&self) -> Arc<TuningState> {
        Arc::clone(&self.tuning.borrow())
    }
}

/// The API's routes, plus `extra` (the routes controllers serve).
pub fn router(ctx: Arc<Context>, extra: Router) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/summary", get(summary))
        .route("/api/v1/nodes/{name}", get(node))
        .with_state(ctx)
        .merge(extra)
}

/// Ready when this replica leads and has read the Node list, or when it is a healthy standby:
/// the Service sends API traffic only to the leader through the `nodekeeper.dev/leader` Pod
/// label, so readiness need not exclude the standby (which would pin the PodDisruptionBudget).
async fn readyz(State(ctx): State<Arc<Context>>) -> Response {
    let leader = ctx.is_leader.load(Ordering::Relaxed);
    if leader && !ctx.fleet.synced() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "leader, reading the node list\n",
        )
            .into_response();
    }
    (
        StatusCode::OK,
        if leader {
            "ready (leader)\n"
        } else {
            "ready (standby)\n"
        },
    )
        .into_response()
}

async fn metrics(State(ctx): State<Arc<Context>>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &ctx.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn not_leader(ctx: &Context) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({ "error": format!("{} is a standby and holds no fleet data; ask the leader", ctx.identity) })),
    )
        .into_response()
}

async fn summary(State(ctx): State<Arc<Context>>) -> Response {
    if !ctx.is_leader.load(Ordering::Relaxed) {
        return not_leader(&ctx);
    }
    let tuning = ctx.tuning();
    let fleet = ctx.fleet.summary();
    axum::Json(json!({
        "identity": ctx.identity,
        "leader": true,
        "nodesSynced": ctx.fleet.synced(),
        "initialSweepSeconds": ctx.sweep.initial_sweep_seconds.get(),
        "fleet": fleet,
        "tuning": &*tuning,
    }))
    .into_response()
}

fn written_json(written: &[Written]) -> Vec<serde_json::Value> {
    written
        .iter()
        .map(|w| {
            json!({
                "type": w.condition.type_,
                "status": w.condition.status.as_str(),
                "reason": w.condition.reason,
                "message": w.condition.message,
                "lastTransitionTime": w.last_transition_time,
            })
        })
        .collect()
}

async fn node(State(ctx): State<Arc<Context>>, Path(name): Path<String>) -> Response {
    if !ctx.is_leader.load(Ordering::Relaxed) {
        return not_leader(&ctx);
    }
    let body = {
        let nodes = ctx.fleet.lock();
        let Some(entry) = nodes.get(&name) else {
            return (
                StatusCode::NOT_FOUND,
                axum::Json(
                    json!({ "error": format!("node {name:?} is not known to the controller") }),
                ),
            )
                .into_response();
        };
        json!({
            "name": name,
            "address": entry.address.map(|a| a.to_string()),
            "stale": entry.stale,
            "consecutiveFailures": entry.schedule.failures,
            "rulesRefused": entry.rules_refusal,
            "lastFailure": entry.last_failure.as_ref().map(|(outcome, detail)| json!({ "outcome": format!("{outcome:?}"), "detail": detail })),
            // Condition types another writer keeps alive here, which nodekeeper leaves to it.
            "conditionsLeftToOthers": entry.foreign.as_deref().unwrap_or_default(),
            "conditions": written_json(&entry.written),
            "report": entry.report.as_ref().map(StoredReport::view),
        })
    };
    axum::Json(body).into_response()
}
