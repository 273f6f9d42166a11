//! A local stand-in for OCI's Compute API and each instance's metadata service, on 127.0.0.1,
//! for tests and benchmarks. It behaves as Oracle documents the API (`shared/oci/compute-api.md`),
//! not as our client expects:
//!
//! - every API request's signature is verified against registered public keys (401
//!   `NotAuthenticated` otherwise);
//! - AttachVnic answers ATTACHING and the attachment becomes ATTACHED (with `vnicId`, `vlanTag`)
//!   after a configurable delay; DetachVnic is a DELETE that goes DETACHING → DETACHED and deletes
//!   the VNIC; a second attach or detach on an instance that is being modified gets 409;
//! - VNIC counts are limited per shape (the primary VNIC counts); `nicIndex` is refused on VMs;
//! - LaunchInstance (PROVISIONING → RUNNING; its checks, ListShapes and images in
//!   `instances.rs`), GetInstance, ListInstances (paginated, TERMINATED ones stay listed),
//!   TerminateInstance (TERMINATING → TERMINATED);
//! - `opc-retry-token` replays the first answer of a create; `opc-request-id` on every answer;
//! - faults on demand: 429 bursts, 500s, and "Out of host capacity" per shape;
//! - `GET /imds/<instance>/opc/v2/instance/` and `…/opc/v2/vnics/` answer like IMDS v2 (with
//!   `Authorization: Bearer Oracle` required), listing the VNICs attached so far, primary first,
//!   so the agent's IMDS client pointed at [`OciEndpoint::imds_url`] picks them up.
//!
//! State changes are computed from timestamps whenever something reads them, so there are no
//! background tasks to leak; the server task ends when the [`OciEndpoint`] is dropped.

mod instances;
mod verify;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use http::{HeaderMap, Method, Response, Uri};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

pub use instances::{InstanceView, MAX_METADATA_BYTES};
pub use verify::MAX_SKEW;

const API_PREFIX: &str = "/20160918";

/// Timing and limits of the simulated service.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// ATTACHING → ATTACHED.
    pub attach_delay: Duration,
    /// DETACHING → DETACHED.
    pub detach_delay: Duration,
    /// PROVISIONING → RUNNING.
    pub launch_delay: Duration,
    /// TERMINATING → TERMINATED.
    pub terminate_delay: Duration,
    /// Most VNIC attachments (primary included) per shape.
    pub shape_limits: BTreeMap<String, usize>,
    /// For shapes not in `shape_limits`.
    pub default_limit: usize,
    /// Largest `limit` a list call may ask for.
    pub max_page_size: usize,
    /// Short region code IMDS reports (`phx`) and its canonical name.
    pub region: (String, String),
    /// Lifetime of the security tokens the federation endpoint issues.
    pub token_ttl: Duration,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            attach_delay: Duration::from_millis(200),
            detach_delay: Duration::from_millis(200),
            launch_delay: Duration::from_millis(200),
            terminate_delay: Duration::from_millis(200),
            shape_limits: BTreeMap::from([
                ("VM.Standard.E5.Flex".to_string(), 2),
                ("VM.Standard2.4".to_string(), 4),
                ("BM.Standard.E5.192".to_string(), 8),
            ]),
            default_limit: 2,
            max_page_size: 1000,
            region: ("phx".into(), "us-phoenix-1".into()),
            token_ttl: Duration::from_secs(3600),
        }
    }
}

/// An instance to create directly (a node that already exists), RUNNING with its primary VNIC.
#[derive(Clone, Debug)]
pub struct InstanceSpec {
    pub display_name: String,
    pub shape: String,
    pub compartment_id: String,
    pub availability_domain: String,
    /// The primary VNIC's subnet (from [`OciEndpoint::add_subnet`]).
    pub subnet_id: String,
}

/// An injected answer: the next `count` API requests that match get `status` with this error.
#[derive(Clone, Debug)]
pub struct Fault {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub count: u32,
    /// Only requests with this method; all when `None`.
    pub method: Option<Method>,
}

impl Fault {
    pub fn throttle(count: u32) -> Self {
        Self {
            status: 429,
            code: "TooManyRequests".into(),
            message: "Too many requests for the user".into(),
            count,
            method: None,
        }
    }

    pub fn internal(count: u32) -> Self {
        Self {
            status: 500,
            code: "InternalError".into(),
            message: "Internal error occurred".into(),
            count,
            method: None,
        }
    }
}

/// One API request as the endpoint saw it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: Method,
    /// Path without the API version prefix and without the query.
    pub path: String,
    pub query: String,
    pub status: u16,
    pub retry_token: Option<String>,
    /// The verified keyId, when the signature verified.
    pub key_id: Option<String>,
    /// When the endpoint answered it (for the benchmarks' timelines).
    pub at: Instant,
}

#[derive(Clone, Debug)]
struct Subnet {
    network: Ipv4Addr,
    prefix: u8,
    next_host: u32,
}

#[derive(Clone, Debug)]
struct VnicRec {
    id: String,
    subnet_id: String,
    private_ip: Ipv4Addr,
    mac: String,
    is_primary: bool,
    display_name: Option<String>,
    skip_source_dest_check: bool,
    nsg_ids: Vec<String>,
    freeform_tags: Value,
}

#[derive(Clone, Debug)]
struct AttachmentRec {
    id: String,
    instance_id: String,
    subnet_id: String,
    display_name: Option<String>,
    nic_index: Option<u32>,
    vlan_tag: u32,
    created_wall: SystemTime,
    attached_at: Instant,
    detach_requested: Option<Instant>,
    vnic: VnicRec,
    order: u64,
}

impl AttachmentRec {
    fn state(&self, now: Instant, cfg: &EndpointConfig) -> &'static str {
        match self.detach_requested {
            Some(t) if now >= t + cfg.detach_delay => "DETACHED",
            Some(_) => "DETACHING",
            None if now >= self.attached_at => "ATTACHED",
            None => "ATTACHING",
        }
    }
}

#[derive(Clone, Debug)]
struct InstanceRec {
    id: String,
    display_name: String,
    shape: String,
    compartment_id: String,
    availability_domain: String,
    fault_domain: String,
    created_wall: SystemTime,
    running_at: Instant,
    terminate_requested: Option<Instant>,
    freeform_tags: Value,
    metadata: Value,
    order: u64,
}

impl InstanceRec {
    fn state(&self, now: Instant, cfg: &EndpointConfig) -> &'static str {
        match self.terminate_requested {
            Some(t) if now >= t + cfg.terminate_delay => "TERMINATED",
            Some(_) => "TERMINATING",
            None if now >= self.running_at => "RUNNING",
            None => "PROVISIONING",
        }
    }
}

/// An instance's identity for instance principals: what IMDS serves under `/opc/v2/identity/`.
#[derive(Clone, Debug)]
struct Identity {
    cert_pem: String,
    key_pem: String,
    intermediate_pem: String,
    /// `<tenancy>/fed-x509-sha256/<SHA-256 of the certificate>`.
    key_id: String,
}

struct State {
    cfg: EndpointConfig,
    identities: HashMap<String, Identity>,
    /// Service-account tokens OKE workload identity accepts.
    service_account_tokens: Vec<String>,
    keys: verify::Keys,
    subnets: HashMap<String, Subnet>,
    /// Boot images LaunchInstance accepts (`instances.rs`).
    images: Vec<String>,
    instances: HashMap<String, InstanceRec>,
    attachments: HashMap<String, AttachmentRec>,
    /// Retry token → (SHA-256 of the body, status, answer).
    retry_tokens: HashMap<String, ([u8; 32], u16, Value)>,
    faults: VecDeque<Fault>,
    out_of_capacity: Vec<String>,
    log: Vec<Recorded>,
    counter: u64,
}

impl State {
    fn next(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn ocid(&mut self, kind: &str) -> String {
        let n = self.next();
        let salt: u32 = rand::random();
        format!("ocid1.{kind}.oc1.phx.local{n:06}x{salt:08x}")
    }

    fn limit_of(&self, shape: &str) -> usize {
        self.cfg
            .shape_limits
            .get(shape)
            .copied()
            .unwrap_or(self.cfg.default_limit)
    }

    fn new_vnic(
        &mut self,
        subnet_id: &str,
        is_primary: bool,
        details: &Value,
    ) -> Result<VnicRec, Answer> {
        let subnet = self
            .subnets
            .get_mut(subnet_id)
            .ok_or_else(|| not_found(&format!("subnet {subnet_id}")))?;
        let size = 1u32 << (32 - subnet.prefix as u32);
        if subnet.next_host >= size - 1 {
            return Err(error(
                400,
                "InvalidParameter",
                &format!("subnet {subnet_id} has no free private IP address"),
            ));
        }
        let ip = Ipv4Addr::from(u32::from(subnet.network) + subnet.next_host);
        subnet.next_host += 1;
        let n = self.next();
        Ok(VnicRec {
            id: self.ocid("vnic"),
            subnet_id: subnet_id.to_string(),
            private_ip: ip,
            mac: format!(
                "02:00:17:{:02x}:{:02x}:{:02x}",
                (n >> 16) & 0xff,
                (n >> 8) & 0xff,
                n & 0xff
            ),
            is_primary,
            display_name: details
                .get("displayName")
                .and_then(Value::as_str)
                .map(str::to_string),
            skip_source_dest_check: details
                .get("skipSourceDestCheck")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            nsg_ids: details
                .get("nsgIds")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            freeform_tags: details.get("freeformTags").cloned().unwrap_or(json!({})),
        })
    }

    fn attachment_json(&self, a: &AttachmentRec, now: Instant) -> Value {
        let state = a.state(now, &self.cfg);
        let instance = &self.instances[&a.instance_id];
        let mut v = json!({
            "id": a.id,
            "instanceId": a.instance_id,
            "lifecycleState": state,
            "subnetId": a.subnet_id,
            "availabilityDomain": instance.availability_domain,
            "compartmentId": instance.compartment_id,
            "timeCreated": httpdate::fmt_http_date(a.created_wall),
        });
        if let Some(n) = &a.display_name {
            v["displayName"] = json!(n);
        }
        if let Some(i) = a.nic_index {
            v["nicIndex"] = json!(i);
        }
        // vnicId and vlanTag appear once the attach completes.
        if state != "ATTACHING" {
            v["vnicId"] = json!(a.vnic.id);
            v["vlanTag"] = json!(a.vlan_tag);
        }
        v
    }

    fn instance_json(&self, i: &InstanceRec, now: Instant) -> Value {
        json!({
            "id": i.id,
            "displayName": i.display_name,
            "shape": i.shape,
            "lifecycleState": i.state(now, &self.cfg),
            "availabilityDomain": i.availability_domain,
            "compartmentId": i.compartment_id,
            "faultDomain": i.fault_domain,
            "region": self.cfg.region.1,
            "timeCreated": httpdate::fmt_http_date(i.created_wall),
            "freeformTags": i.freeform_tags,
            "metadata": i.metadata,
        })
    }

    fn vnic_json(&self, v: &VnicRec, lifecycle: &str) -> Value {
        let mut out = json!({
            "id": v.id,
            "lifecycleState": lifecycle,
            "privateIp": v.private_ip.to_string(),
            "macAddress": v.mac,
            "isPrimary": v.is_primary,
            "subnetId": v.subnet_id,
            "skipSourceDestCheck": v.skip_source_dest_check,
            "nsgIds": v.nsg_ids,
            "freeformTags": v.freeform_tags,
        });
        if let Some(n) = &v.display_name {
            out["displayName"] = json!(n);
        }
        out
    }

    /// An instance is "being modified" while one of its attachments is ATTACHING or DETACHING.
    fn busy(&self, instance_id: &str, now: Instant) -> bool {
        self.attachments.values().any(|a| {
            a.instance_id == instance_id
                && matches!(a.state(now, &self.cfg), "ATTACHING" | "DETACHING")
        })
    }

    fn live_attachments(&self, instance_id: &str, now: Instant) -> Vec<&AttachmentRec> {
        let mut v: Vec<&AttachmentRec> = self
            .attachments
            .values()
            .filter(|a| a.instance_id == instance_id && a.state(now, &self.cfg) != "DETACHED")
            .collect();
        v.sort_by_key(|a| a.order);
        v
    }

    fn create_instance(
        &mut self,
        spec: &InstanceSpec,
        running_at: Instant,
    ) -> Result<String, Answer> {
        let id = self.ocid("instance");
        let primary = self.new_vnic(&spec.subnet_id, true, &json!({}))?;
        let order = self.next();
        self.instances.insert(
            id.clone(),
            InstanceRec {
                id: id.clone(),
                display_name: spec.display_name.clone(),
                shape: spec.shape.clone(),
                compartment_id: spec.compartment_id.clone(),
                availability_domain: spec.availability_domain.clone(),
                fault_domain: "FAULT-DOMAIN-1".into(),
                created_wall: SystemTime::now(),
                running_at,
                terminate_requested: None,
                freeform_tags: json!({}),
                metadata: json!({}),
                order,
            },
        );
        let att_id = self.ocid("vnicattachment");
        let vlan_tag = 100 + self.next() as u32;
        let order = self.next();
        self.attachments.insert(
            att_id.clone(),
            AttachmentRec {
                id: att_id,
                instance_id: id.clone(),
                subnet_id: spec.subnet_id.clone(),
                display_name: None,
                nic_index: spec.shape.starts_with("BM.").then_some(0),
                vlan_tag,
                created_wall: SystemTime::now(),
                attached_at: running_at,
                detach_requested: None,
                vnic: primary,
                order,
            },
        );
        Ok(id)
    }
}

/// A status and JSON body (or none).
struct Answer {
    status: u16,
    body: Option<Value>,
    /// A plain-text answer (IMDS identity files) instead of JSON.
    text: Option<String>,
    headers: Vec<(&'static str, String)>,
}

fn empty(status: u16) -> Answer {
    Answer {
        status,
        body: None,
        text: None,
        headers: Vec::new(),
    }
}

fn ok(body: Value) -> Answer {
    Answer {
        status: 200,
        body: Some(body),
        text: None,
        headers: Vec::new(),
    }
}

fn no_content() -> Answer {
    empty(204)
}

fn error(status: u16, code: &str, message: &str) -> Answer {
    Answer {
        status,
        body: Some(json!({"code": code, "message": message})),
        text: None,
        headers: Vec::new(),
    }
}

fn not_found(what: &str) -> Answer {
    error(
        404,
        "NotAuthorizedOrNotFound",
        &format!("Authorization failed or requested resource not found: {what}."),
    )
}

fn missing(name: &str) -> Answer {
    error(
        400,
        "MissingParameter",
        &format!("Missing parameter {name}."),
    )
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: &str) -> HashMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// One page of `items` per `limit`/`page`, with `opc-next-page` when more remain.
fn paginate(items: Vec<Value>, q: &HashMap<String, String>, max: usize) -> Answer {
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => max.min(100),
        Some(Ok(l)) if (1..=max).contains(&l) => l,
        Some(_) => {
            return error(
                400,
                "InvalidParameter",
                &format!("limit must be between 1 and {max}"),
            );
        }
    };
    let start = match q.get("page") {
        None => 0,
        Some(p) => match p
            .strip_prefix("page-")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) if n <= items.len() => n,
            _ => return error(400, "InvalidParameter", "Invalid page token."),
        },
    };
    let end = (start + limit).min(items.len());
    let mut a = ok(Value::Array(items[start..end].to_vec()));
    if end < items.len() {
        a.headers.push(("opc-next-page", format!("page-{end}")));
    }
    a
}

/// The PEM of the 2048-bit RSA test key in `crates/oci/tests/fixtures` (never a real
/// credential), for clients that sign requests to this endpoint.
pub fn test_key_pem() -> anyhow::Result<String> {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/oci/tests/fixtures/test-key-2048.pem"
    ))
    .context("read the test key fixture")
}

/// One VNIC attachment as [`OciEndpoint::guest_vnics`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestVnic {
    pub attachment_id: String,
    /// The VNIC's OCID.
    pub vnic_id: String,
    pub mac: String,
    pub private_ip: Ipv4Addr,
    /// The subnet's virtual router (its first host address).
    pub router: Ipv4Addr,
    pub prefix: u8,
    pub primary: bool,
    pub display_name: Option<String>,
    /// `ATTACHING`, `ATTACHED`, `DETACHING` or `DETACHED`.
    pub state: &'static str,
}

/// The running local endpoint; dropping it stops the server.
pub struct OciEndpoint {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for OciEndpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl OciEndpoint {
    /// Binds 127.0.0.1 on a free port and serves until dropped.
    pub async fn start(cfg: EndpointConfig) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .context("bind the local OCI endpoint on 127.0.0.1")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            cfg,
            identities: HashMap::new(),
            service_account_tokens: Vec::new(),
            keys: verify::Keys::default(),
            subnets: HashMap::new(),
            images: Vec::new(),
            instances: HashMap::new(),
            attachments: HashMap::new(),
            retry_tokens: HashMap::new(),
            faults: VecDeque::new(),
            out_of_capacity: Vec::new(),
            log: Vec::new(),
            counter: 0,
        }));
        let shared = state.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, std::convert::Infallible>(handle(state, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self {
            addr,
            state,
            server,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `http://127.0.0.1:<port>`: the Compute client's endpoint.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The IMDS base URL of one instance (the agent's `--imds-url`).
    pub fn imds_url(&self, instance_id: &str) -> String {
        format!("http://{}/imds/{instance_id}", self.addr)
    }

    /// Accepts signatures by `key_id` made with the key whose public half is `public_key_pem`.
    pub fn register_key(&self, key_id: &str, public_key_pem: &str) -> anyhow::Result<()> {
        self.lock().keys.insert_pem(key_id, public_key_pem)
    }

    /// A subnet with `cidr` (IPv4); returns its OCID. Its router is the first host address.
    pub fn add_subnet(&self, cidr: &str) -> anyhow::Result<String> {
        let (net, prefix) = cidr.split_once('/').context("cidr needs a /prefix")?;
        let network: Ipv4Addr = net.parse()?;
        let prefix: u8 = prefix.parse()?;
        anyhow::ensure!(prefix <= 30, "subnet {cidr} is too small");
        let mut s = self.lock();
        let id = s.ocid("subnet");
        s.subnets.insert(
            id.clone(),
            Subnet {
                network,
                prefix,
                next_host: 10,
            },
        );
        Ok(id)
    }

    /// An existing RUNNING instance with its primary VNIC.
    pub fn add_instance(&self, spec: &InstanceSpec) -> anyhow::Result<String> {
        let mut s = self.lock();
        s.create_instance(spec, Instant::now())
            .map_err(|a| anyhow::anyhow!("add instance: {:?}", a.body))
    }

    /// Queues a fault for the next matching API requests.
    pub fn inject(&self, fault: Fault) {
        self.lock().faults.push_back(fault);
    }

    /// Gives `instance_id` an identity certificate for instance principals: a certificate for
    /// `leaf_key_pem` (PKCS#8 RSA) whose subject carries `opc-tenant:<tenancy>`, served by its IMDS
    /// with an intermediate, and accepted by [`OciEndpoint::federation_url`].
    pub fn enable_instance_principal(
        &self,
        instance_id: &str,
        tenancy: &str,
        leaf_key_pem: &str,
    ) -> anyhow::Result<()> {
        use rsa::pkcs8::{DecodePrivateKey as _, EncodePublicKey as _};
        let leaf_key =
            rcgen::KeyPair::from_pkcs8_pem_and_sign_algo(leaf_key_pem, &rcgen::PKCS_RSA_SHA256)?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, instance_id);
        params.distinguished_name.push(
            rcgen::DnType::OrganizationalUnitName,
            format!("opc-tenant:{tenancy}"),
        );
        params.distinguished_name.push(
            rcgen::DnType::OrganizationName,
            format!("opc-instance:{instance_id}"),
        );
        let leaf = params.self_signed(&leaf_key)?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "local oci intermediate");
        let intermediate = ca.self_signed(&rcgen::KeyPair::generate()?)?;
        let fingerprint = Sha256::digest(leaf.der().as_ref())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":");
        let key_id = format!("{tenancy}/fed-x509-sha256/{fingerprint}");
        let public = rsa::RsaPrivateKey::from_pkcs8_pem(leaf_key_pem)?
            .to_public_key()
            .to_public_key_pem(rsa::pkcs8::LineEnding::LF)?;
        let mut s = self.lock();
        anyhow::ensure!(
            s.instances.contains_key(instance_id),
            "no instance {instance_id}"
        );
        s.keys.insert_pem(&key_id, &public)?;
        s.identities.insert(
            instance_id.to_string(),
            Identity {
                cert_pem: leaf.pem(),
                key_pem: leaf_key_pem.to_string(),
                intermediate_pem: intermediate.pem(),
                key_id,
            },
        );
        Ok(())
    }

    /// The X.509 federation endpoint (`…/v1/x509`) that exchanges identity certificates for
    /// security tokens.
    pub fn federation_url(&self) -> String {
        format!("http://{}/v1/x509", self.addr)
    }

    /// Accepts `token` as a pod's service-account token at
    /// [`OciEndpoint::workload_identity_url`] (OKE workload identity).
    pub fn enable_workload_identity(&self, service_account_token: &str) {
        self.lock()
            .service_account_tokens
            .push(service_account_token.to_string());
    }

    /// OKE's in-cluster token endpoint (`…:12250/resourcePrincipalSessionTokens` in a cluster).
    pub fn workload_identity_url(&self) -> String {
        format!("http://{}/resourcePrincipalSessionTokens", self.addr)
    }

    /// Revokes every security token issued so far: their next use gets 401.
    pub fn revoke_sessions(&self) {
        self.lock().keys.revoke_sessions();
    }

    /// Changes the ATTACHING → ATTACHED delay for attaches made from now on.
    pub fn set_attach_delay(&self, delay: Duration) {
        self.lock().cfg.attach_delay = delay;
    }

    /// Drops every queued fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Makes LaunchInstance of `shape` answer 500 "Out of host capacity." (or stop doing so).
    pub fn set_out_of_capacity(&self, shape: &str, out: bool) {
        let mut s = self.lock();
        s.out_of_capacity.retain(|x| x != shape);
        if out {
            s.out_of_capacity.push(shape.to_string());
        }
    }

    /// Every API request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().log.clone()
    }

    /// Every attachment of `instance_id` as the guest would notice it (hot-plug): VNIC MAC,
    /// whether it is the primary, and the attachment's lifecycle state now; in attach order.
    pub fn guest_vnics(&self, instance_id: &str) -> Vec<GuestVnic> {
        let s = self.lock();
        let now = Instant::now();
        let mut all: Vec<&AttachmentRec> = s
            .attachments
            .values()
            .filter(|a| a.instance_id == instance_id)
            .collect();
        all.sort_by_key(|a| a.order);
        all.iter()
            .map(|a| {
                let subnet = &s.subnets[&a.subnet_id];
                GuestVnic {
                    attachment_id: a.id.clone(),
                    vnic_id: a.vnic.id.clone(),
                    mac: a.vnic.mac.clone(),
                    private_ip: a.vnic.private_ip,
                    router: Ipv4Addr::from(u32::from(subnet.network) + 1),
                    prefix: subnet.prefix,
                    primary: a.vnic.is_primary,
                    display_name: a.display_name.clone(),
                    state: a.state(now, &s.cfg),
                }
            })
            .collect()
    }

    /// Live (not DETACHED) VNIC attachments of `instance_id`, primary included.
    pub fn live_attachment_count(&self, instance_id: &str) -> usize {
        let s = self.lock();
        s.live_attachments(instance_id, Instant::now()).len()
    }
}

async fn handle(
    state: Arc<Mutex<State>>,
    req: http::Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let request_id = parts
        .headers
        .get("opc-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:032X}", rand::random::<u128>()));
    let answer = {
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        if parts.uri.path().starts_with("/imds/") {
            imds(&s, &parts.uri, &parts.headers)
        } else if parts.uri.path() == "/resourcePrincipalSessionTokens"
            && parts.method == Method::POST
        {
            let a = workload_identity(&mut s, &parts.headers, &body);
            s.log.push(Recorded {
                method: parts.method.clone(),
                path: parts.uri.path().to_string(),
                query: String::new(),
                status: a.status,
                retry_token: None,
                key_id: None,
                at: Instant::now(),
            });
            a
        } else {
            api(&mut s, &parts.method, &parts.uri, &parts.headers, &body)
        }
    };
    let mut response = Response::builder()
        .status(answer.status)
        .header("opc-request-id", &request_id);
    for (k, v) in &answer.headers {
        response = response.header(*k, v);
    }
    let body = match (answer.body, answer.text) {
        (Some(v), _) => {
            response = response.header("content-type", "application/json");
            Bytes::from(v.to_string())
        }
        (None, Some(t)) => {
            response = response.header("content-type", "text/plain");
            Bytes::from(t)
        }
        (None, None) => Bytes::new(),
    };
    response
        .body(Full::new(body))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

/// IMDS v2 for one instance: `/imds/<id>/opc/v2/{instance,vnics}/`.
fn imds(s: &State, uri: &Uri, headers: &HeaderMap) -> Answer {
    let rest = &uri.path()["/imds/".len()..];
    let Some((id, path)) = rest.split_once('/') else {
        return empty(404);
    };
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer Oracle") {
        return empty(401);
    }
    if ["forwarded", "x-forwarded-for", "x-forwarded-host"]
        .iter()
        .any(|h| headers.contains_key(*h))
    {
        return empty(403);
    }
    let Some(instance) = s.instances.get(id) else {
        return empty(404);
    };
    let now = Instant::now();
    let bare_metal = instance.shape.starts_with("BM.");
    match path.trim_end_matches('/') {
        "opc/v2/instance" => ok(json!({
            "id": instance.id,
            "displayName": instance.display_name,
            "shape": instance.shape,
            "region": s.cfg.region.0,
            "canonicalRegionName": s.cfg.region.1,
            "availabilityDomain": instance.availability_domain,
            "faultDomain": instance.fault_domain,
            "compartmentId": instance.compartment_id,
            "state": "Running",
            "metadata": instance.metadata,
        })),
        file @ ("opc/v2/identity/cert.pem"
        | "opc/v2/identity/key.pem"
        | "opc/v2/identity/intermediate.pem") => match s.identities.get(id) {
            Some(identity) => Answer {
                text: Some(match file {
                    "opc/v2/identity/cert.pem" => identity.cert_pem.clone(),
                    "opc/v2/identity/key.pem" => identity.key_pem.clone(),
                    _ => identity.intermediate_pem.clone(),
                }),
                ..empty(200)
            },
            None => empty(404),
        },
        "opc/v2/vnics" => {
            // Only attachments that completed are visible to the guest; primary first.
            let mut attached: Vec<&AttachmentRec> = s
                .live_attachments(id, now)
                .into_iter()
                .filter(|a| a.state(now, &s.cfg) == "ATTACHED")
                .collect();
            attached.sort_by_key(|a| (!a.vnic.is_primary, a.order));
            let list: Vec<Value> = attached
                .iter()
                .map(|a| {
                    let subnet = &s.subnets[&a.subnet_id];
                    let router = Ipv4Addr::from(u32::from(subnet.network) + 1);
                    let mut v = json!({
                        "vnicId": a.vnic.id,
                        "privateIp": a.vnic.private_ip.to_string(),
                        "vlanTag": a.vlan_tag,
                        "macAddr": a.vnic.mac,
                        "virtualRouterIp": router.to_string(),
                        "subnetCidrBlock": format!("{}/{}", subnet.network, subnet.prefix),
                    });
                    if bare_metal {
                        v["nicIndex"] = json!(a.nic_index.unwrap_or(0));
                    }
                    v
                })
                .collect();
            ok(Value::Array(list))
        }
        _ => empty(404),
    }
}

fn api(s: &mut State, method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> Answer {
    let full_path = uri.path().to_string();
    let path = full_path
        .strip_prefix(API_PREFIX)
        .unwrap_or(&full_path)
        .to_string();
    let query = uri.query().unwrap_or("").to_string();
    let retry_token = headers
        .get("opc-retry-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let required = if path == "/v1/x509" {
        verify::FEDERATION
    } else if matches!(*method, Method::POST | Method::PUT | Method::PATCH) {
        verify::BODY
    } else {
        verify::GENERIC
    };
    let verified = verify::verify(
        &s.keys,
        required,
        method,
        uri,
        headers,
        body,
        SystemTime::now(),
    );
    let answer = match &verified {
        Err(reason) => error(
            401,
            "NotAuthenticated",
            &format!(
                "The required information to complete authentication was not provided or was incorrect ({reason})."
            ),
        ),
        Ok(key_id) if path == "/v1/x509" => federate(s, key_id, body),
        Ok(_) => {
            let fault = s
                .faults
                .iter_mut()
                .find(|f| f.count > 0 && f.method.as_ref().is_none_or(|m| m == method));
            match fault {
                Some(f) => {
                    f.count -= 1;
                    let a = error(f.status, &f.code, &f.message);
                    s.faults.retain(|f| f.count > 0);
                    a
                }
                None => route(s, method, &path, &query, body, retry_token.as_deref()),
            }
        }
    };
    s.log.push(Recorded {
        method: method.clone(),
        path,
        query,
        status: answer.status,
        retry_token,
        key_id: verified.ok(),
        at: Instant::now(),
    });
    answer
}

fn route(
    s: &mut State,
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
    retry_token: Option<&str>,
) -> Answer {
    let q = parse_query(query);
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let now = Instant::now();
    match (method.clone(), segments.as_slice()) {
        (Method::POST, ["vnicAttachments"]) => create(s, body, retry_token, attach_vnic),
        (Method::GET, ["vnicAttachments"]) => {
            let Some(compartment) = q.get("compartmentId") else {
                return missing("compartmentId");
            };
            let mut list: Vec<&AttachmentRec> = s
                .attachments
                .values()
                .filter(|a| &s.instances[&a.instance_id].compartment_id == compartment)
                .filter(|a| q.get("instanceId").is_none_or(|i| *i == a.instance_id))
                .filter(|a| q.get("vnicId").is_none_or(|v| *v == a.vnic.id))
                .filter(|a| {
                    q.get("availabilityDomain")
                        .is_none_or(|d| *d == s.instances[&a.instance_id].availability_domain)
                })
                .collect();
            list.sort_by_key(|a| a.order);
            let items = list.iter().map(|a| s.attachment_json(a, now)).collect();
            paginate(items, &q, s.cfg.max_page_size)
        }
        (Method::GET, ["vnicAttachments", id]) => match s.attachments.get(*id) {
            Some(a) => ok(s.attachment_json(a, now)),
            None => not_found(&format!("vnic attachment {id}")),
        },
        (Method::DELETE, ["vnicAttachments", id]) => detach_vnic(s, id, now),
        (Method::GET, ["vnics", id]) => {
            let found = s.attachments.values().find(|a| a.vnic.id == *id);
            match found {
                Some(a) => match a.state(now, &s.cfg) {
                    "ATTACHING" => ok(s.vnic_json(&a.vnic, "PROVISIONING")),
                    "ATTACHED" => ok(s.vnic_json(&a.vnic, "AVAILABLE")),
                    "DETACHING" => ok(s.vnic_json(&a.vnic, "TERMINATING")),
                    _ => not_found(&format!("vnic {id}")),
                },
                None => not_found(&format!("vnic {id}")),
            }
        }
        (Method::POST, ["instances"]) => create(s, body, retry_token, instances::launch_instance),
        (Method::GET, ["shapes"]) => instances::list_shapes(s, &q),
        (Method::GET, ["instances"]) => {
            let Some(compartment) = q.get("compartmentId") else {
                return missing("compartmentId");
            };
            let mut list: Vec<&InstanceRec> = s
                .instances
                .values()
                .filter(|i| &i.compartment_id == compartment)
                .filter(|i| q.get("displayName").is_none_or(|n| *n == i.display_name))
                .filter(|i| {
                    q.get("availabilityDomain")
                        .is_none_or(|d| *d == i.availability_domain)
                })
                .filter(|i| {
                    q.get("lifecycleState")
                        .is_none_or(|st| st == i.state(now, &s.cfg))
                })
                .collect();
            list.sort_by_key(|i| i.order);
            let items = list.iter().map(|i| s.instance_json(i, now)).collect();
            paginate(items, &q, s.cfg.max_page_size)
        }
        (Method::GET, ["instances", id]) => match s.instances.get(*id) {
            Some(i) => ok(s.instance_json(i, now)),
            None => not_found(&format!("instance {id}")),
        },
        (Method::DELETE, ["instances", id]) => {
            let cfg = s.cfg.clone();
            let Some(i) = s.instances.get_mut(*id) else {
                return not_found(&format!("instance {id}"));
            };
            if i.state(now, &cfg) == "TERMINATED" {
                return not_found(&format!("instance {id}"));
            }
            if i.terminate_requested.is_none() {
                i.terminate_requested = Some(now);
            }
            let instance_id = i.id.clone();
            // Termination takes every VNIC with it.
            for a in s.attachments.values_mut() {
                if a.instance_id == instance_id && a.detach_requested.is_none() {
                    a.detach_requested = Some(now);
                }
            }
            no_content()
        }
        (_, ["vnicAttachments", ..] | ["instances", ..] | ["vnics", ..]) => error(
            405,
            "MethodNotAllowed",
            &format!("{method} is not allowed on {path}"),
        ),
        _ => not_found(&format!("path {path}")),
    }
}

/// The X.509 federation call: the caller signed with its identity key; answers a token bound to
/// the session public key it sent, valid for `token_ttl`.
fn federate(s: &mut State, key_id: &str, body: &[u8]) -> Answer {
    let Some((instance_id, identity)) = s
        .identities
        .iter()
        .find(|(_, i)| i.key_id == key_id)
        .map(|(id, i)| (id.clone(), i.clone()))
    else {
        return error(
            401,
            "NotAuthenticated",
            "The keyId is not an instance identity.",
        );
    };
    let details: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let strip = |pem: &str| -> String {
        pem.lines()
            .filter(|l| !l.starts_with("-----"))
            .map(str::trim)
            .collect()
    };
    if details.get("certificate").and_then(Value::as_str) != Some(&strip(&identity.cert_pem)) {
        return error(
            401,
            "NotAuthenticated",
            "The certificate does not match the signing key.",
        );
    }
    let session_key = match session_key(&details, "publicKey") {
        Ok(k) => k,
        Err(a) => return a,
    };
    let token = issue_token(s, &instance_id, session_key);
    ok(json!({ "token": token }))
}

/// The session public key a token request carries in `field` (base64 DER SubjectPublicKeyInfo,
/// PEM armour stripped).
fn session_key(details: &Value, field: &str) -> Result<rsa::RsaPublicKey, Answer> {
    use base64::Engine as _;
    use rsa::pkcs8::DecodePublicKey as _;
    details
        .get(field)
        .and_then(Value::as_str)
        .and_then(|k| base64::engine::general_purpose::STANDARD.decode(k).ok())
        .and_then(|der| rsa::RsaPublicKey::from_public_key_der(&der).ok())
        .ok_or_else(|| {
            error(
                400,
                "InvalidParameter",
                &format!("{field} is not a base64 DER RSA public key."),
            )
        })
}

/// A JWT-shaped token valid for `token_ttl`, accepted as keyId `ST$<token>` with `session_key`.
fn issue_token(s: &mut State, subject: &str, session_key: rsa::RsaPublicKey) -> String {
    use base64::Engine as _;
    let exp = (SystemTime::now() + s.cfg.token_ttl)
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let token = format!(
        "{}.{}.{}",
        url.encode(br#"{"alg":"RS256","typ":"JWT"}"#),
        url.encode(json!({"exp": exp, "sub": subject, "n": s.next()}).to_string()),
        url.encode(rand::random::<u128>().to_be_bytes()),
    );
    s.keys.insert(format!("ST${token}"), session_key);
    token
}

/// OKE workload identity: a known service-account token and a `podKey` give a token whose answer
/// is a JSON string holding base64 of `{"token":"ST$<JWT>"}`.
fn workload_identity(s: &mut State, headers: &HeaderMap, body: &[u8]) -> Answer {
    use base64::Engine as _;
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let Some(bearer) = bearer.filter(|b| s.service_account_tokens.contains(b)) else {
        return error(401, "NotAuthenticated", "Unknown service account token.");
    };
    let details: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let session_key = match session_key(&details, "podKey") {
        Ok(k) => k,
        Err(a) => return a,
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let token = issue_token(s, &format!("workload:{}", bearer.len()), session_key);
    let wrapped = b64.encode(json!({ "token": format!("ST${token}") }).to_string());
    ok(Value::String(wrapped))
}

/// A create with `opc-retry-token`: the same token and body replays the first answer; the same
/// token with another body is a conflict.
fn create(
    s: &mut State,
    body: &[u8],
    retry_token: Option<&str>,
    op: fn(&mut State, &Value) -> Answer,
) -> Answer {
    let hash: [u8; 32] = Sha256::digest(body).into();
    if let Some(t) = retry_token
        && let Some((h, status, answer)) = s.retry_tokens.get(t)
    {
        if *h != hash {
            return error(
                409,
                "Conflict",
                "The retry token was used for a request with different content.",
            );
        }
        let mut a = ok(answer.clone());
        a.status = *status;
        return a;
    }
    let details: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return error(
                400,
                "InvalidParameter",
                "The request body is not a JSON object.",
            );
        }
    };
    let answer = op(s, &details);
    if answer.status == 200
        && let (Some(t), Some(b)) = (retry_token, &answer.body)
    {
        s.retry_tokens
            .insert(t.to_string(), (hash, answer.status, b.clone()));
    }
    answer
}

fn attach_vnic(s: &mut State, details: &Value) -> Answer {
    let now = Instant::now();
    let Some(instance_id) = details.get("instanceId").and_then(Value::as_str) else {
        return missing("instanceId");
    };
    let Some(vnic) = details.get("createVnicDetails") else {
        return missing("createVnicDetails");
    };
    let Some(subnet_id) = vnic.get("subnetId").and_then(Value::as_str) else {
        return missing("createVnicDetails.subnetId");
    };
    let Some(instance) = s.instances.get(instance_id) else {
        return not_found(&format!("instance {instance_id}"));
    };
    if instance.state(now, &s.cfg) != "RUNNING" {
        return error(
            409,
            "IncorrectState",
            &format!("Instance {instance_id} is not running."),
        );
    }
    let shape = instance.shape.clone();
    let nic_index = details.get("nicIndex").and_then(Value::as_u64);
    if let Some(n) = nic_index {
        if !shape.starts_with("BM.") {
            return error(
                400,
                "InvalidParameter",
                &format!("nicIndex is only valid for bare metal shapes; {shape} is a VM shape."),
            );
        }
        if n > 1 {
            return error(400, "InvalidParameter", "nicIndex must be 0 or 1.");
        }
    }
    if s.busy(instance_id, now) {
        return error(
            409,
            "Conflict",
            &format!("Instance {instance_id} is currently being modified, try again later."),
        );
    }
    let limit = s.limit_of(&shape);
    if s.live_attachments(instance_id, now).len() >= limit {
        return error(
            400,
            "LimitExceeded",
            &format!("Shape {shape} supports at most {limit} VNIC attachments."),
        );
    }
    let vnic = match s.new_vnic(subnet_id, false, vnic) {
        Ok(v) => v,
        Err(a) => return a,
    };
    let id = s.ocid("vnicattachment");
    let vlan_tag = 100 + s.next() as u32;
    let order = s.next();
    let rec = AttachmentRec {
        id: id.clone(),
        instance_id: instance_id.to_string(),
        subnet_id: subnet_id.to_string(),
        display_name: details
            .get("displayName")
            .and_then(Value::as_str)
            .map(str::to_string),
        nic_index: nic_index
            .map(|n| n as u32)
            .or(shape.starts_with("BM.").then_some(0)),
        vlan_tag,
        created_wall: SystemTime::now(),
        attached_at: now + s.cfg.attach_delay,
        detach_requested: None,
        vnic,
        order,
    };
    let body = s.attachment_json(&rec, now);
    s.attachments.insert(id, rec);
    ok(body)
}

fn detach_vnic(s: &mut State, id: &str, now: Instant) -> Answer {
    let cfg = s.cfg.clone();
    let Some(a) = s.attachments.get(id) else {
        return not_found(&format!("vnic attachment {id}"));
    };
    match a.state(now, &cfg) {
        "DETACHED" => return not_found(&format!("vnic attachment {id}")),
        "DETACHING" => return no_content(),
        _ => {}
    }
    if a.vnic.is_primary {
        return error(
            400,
            "InvalidParameter",
            "The primary VNIC cannot be detached.",
        );
    }
    let instance_id = a.instance_id.clone();
    let attaching = a.state(now, &cfg) == "ATTACHING";
    let others_busy = s.attachments.values().any(|o| {
        o.id != id
            && o.instance_id == instance_id
            && matches!(o.state(now, &cfg), "ATTACHING" | "DETACHING")
    });
    if attaching || others_busy {
        return error(
            409,
            "Conflict",
            &format!("Instance {instance_id} is currently being modified, try again later."),
        );
    }
    if let Some(a) = s.attachments.get_mut(id) {
        a.detach_requested = Some(now);
    }
    no_content()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("Uocm%3APHX-AD-1+x%20y"), "Uocm:PHX-AD-1 x y");
        assert_eq!(percent_decode("100%"), "100%");
    }

    #[test]
    fn pages_carry_next_tokens_until_the_end() {
        let items: Vec<Value> = (0..5).map(|i| json!(i)).collect();
        let q = parse_query("limit=2");
        let a = paginate(items.clone(), &q, 1000);
        assert_eq!(a.body, Some(json!([0, 1])));
        assert_eq!(a.headers, vec![("opc-next-page", "page-2".to_string())]);
        let a = paginate(items.clone(), &parse_query("limit=2&page=page-4"), 1000);
        assert_eq!(a.body, Some(json!([4])));
        assert!(a.headers.is_empty());
        assert_eq!(
            paginate(items, &parse_query("page=bogus"), 1000).status,
            400
        );
    }
}
