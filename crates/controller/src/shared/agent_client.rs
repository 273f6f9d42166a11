//! Calls to node agents over mutual TLS: one short-lived connection per read (at 10,000 nodes a
//! pooled connection per agent would cost far more memory than a handshake every few minutes
//! costs CPU), a whole-call timeout, a reply size limit, and the classification of every failure
//! into a bounded [`CallOutcome`]. The handshake is made cheap instead: one rustls client config
//! for all agents with one bounded session store, keyed by the agent's IP address, so the second
//! and later connections to an agent resume its TLS 1.3 session (no certificate signing or
//! verification) instead of a full handshake. This is the transport under [`super::agents`]; controllers
//! call agents through that service, never through this module directly.

use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hyper_util::rt::TokioIo;
use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_client::NodeAgentClient;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, HandshakeKind, SignatureScheme};
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

use prometheus_client::encoding::EncodeLabelValue;

pub use crate::certs::AGENT_SERVER_NAME;
use crate::conditions::FailureClass;

/// Agents whose session is kept for resumption (one entry per agent address, the one met
/// longest ago dropped first; see [`super::tls_sessions`]). An agent whose session was dropped
/// costs one full handshake.
const RESUMPTION_SESSIONS: usize = 65_536;

/// The controller's client identity and the CA it trusts agents with: one rustls config shared
/// by every connection (and so one session store), plus handshake counters.
#[derive(Clone)]
pub struct AgentTls {
    /// Err when the PEM material is unusable: every connection then fails as a TLS failure.
    config: Result<Arc<ClientConfig>, String>,
    handshakes: Arc<Handshakes>,
}

#[derive(Default)]
struct Handshakes {
    full: AtomicU64,
    resumed: AtomicU64,
}

impl AgentTls {
    pub fn new(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Self {
        Self {
            config: client_config(ca_pem, cert_pem, key_pem).map(Arc::new),
            handshakes: Arc::default(),
        }
    }

    /// TLS handshakes completed so far with this identity: (full, resumed).
    pub fn handshakes(&self) -> (u64, u64) {
        (
            self.handshakes.full.load(Ordering::Relaxed),
            self.handshakes.resumed.load(Ordering::Relaxed),
        )
    }
}

fn client_config(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| format!("CA certificate: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("CA certificate: {e}"))?;
    }
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("client certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("client key: {e}"))?;
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::clone(&provider),
    )
    .build()
    .map_err(|e| format!("CA certificate: {e}"))?;
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AgentNameVerifier(webpki)))
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("client certificate: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.resumption = rustls::client::Resumption::store(Arc::new(
        super::tls_sessions::SessionStore::new(RESUMPTION_SESSIONS),
    ));
    Ok(config)
}

/// Verifies agent certificates for [`AGENT_SERVER_NAME`] whatever name the connection used.
/// Connections are made to the agent's IP address as server name so that the session store
/// keeps one entry per agent (every agent presents the same name; keyed by it, agents would
/// be offered each other's tickets and never resume).
#[derive(Debug)]
struct AgentNameVerifier(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for AgentNameVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let name = ServerName::try_from(AGENT_SERVER_NAME)
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        self.0
            .verify_server_cert(end_entity, intermediates, &name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The connector tonic dials through: TCP, then TLS with the shared config.
#[derive(Clone)]
struct TlsDialer {
    config: Arc<ClientConfig>,
    handshakes: Arc<Handshakes>,
    endpoint: SocketAddr,
}

type TlsIo = TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

impl tonic::codegen::Service<Uri> for TlsDialer {
    type Response = TlsIo;
    type Error = std::io::Error;
    type Future = futures::future::BoxFuture<'static, Result<TlsIo, std::io::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let dialer = self.clone();
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(dialer.endpoint).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::IpAddress(dialer.endpoint.ip().into());
            let tls = tokio_rustls::TlsConnector::from(dialer.config)
                .connect(name, tcp)
                .await?;
            let counter = match tls.get_ref().1.handshake_kind() {
                Some(HandshakeKind::Resumed) => &dialer.handshakes.resumed,
                _ => &dialer.handshakes.full,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            Ok(TokioIo::new(tls))
        })
    }
}

/// How one agent call ended. A closed set, so the label stays bounded.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum CallOutcome {
    /// A full report arrived.
    Report,
    /// The agent said our copy is current.
    Unchanged,
    /// No TCP connection (refused, unreachable).
    Connect,
    /// The call did not finish within the per-call timeout.
    Timeout,
    /// The TLS handshake failed: wrong or untrusted certificate on either side.
    Tls,
    /// The reply was not a valid report (garbage, not gRPC, wrong node, missing fields).
    InvalidReply,
    /// The reply exceeded the size limit.
    TooLarge,
    /// The agent answered with a gRPC error status.
    Status,
    /// A call other than `GetReport` was answered.
    Answered,
    /// The node is not one this controller manages: not contacted.
    NotManaged,
}

impl CallOutcome {
    pub fn is_success(self) -> bool {
        matches!(
            self,
            CallOutcome::Report | CallOutcome::Unchanged | CallOutcome::Answered
        )
    }
}

/// A failed call: its class and a one-line description naming the endpoint.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{endpoint}: {detail}")]
pub struct CallError {
    pub outcome: CallOutcome,
    pub endpoint: SocketAddr,
    pub detail: String,
}

impl CallError {
    /// The class an operator sees in the node's condition.
    pub fn class(&self) -> FailureClass {
        match self.outcome {
            CallOutcome::Tls => FailureClass::Certificate,
            CallOutcome::InvalidReply | CallOutcome::TooLarge => FailureClass::InvalidReply,
            _ => FailureClass::Unreachable,
        }
    }
}

/// Limits of one call.
#[derive(Clone, Copy, Debug)]
pub struct CallLimits {
    pub timeout: Duration,
    pub max_reply_bytes: usize,
}

/// A connected agent.
pub struct AgentConnection {
    client: NodeAgentClient<Channel>,
    endpoint: SocketAddr,
    limits: CallLimits,
}

/// Connects (TCP + TLS + HTTP/2) within the call timeout.
pub async fn connect(
    tls: &AgentTls,
    endpoint: SocketAddr,
    limits: CallLimits,
) -> Result<AgentConnection, CallError> {
    connect_windowed(tls, endpoint, limits, None).await
}

/// [`connect`] with HTTP/2 flow-control windows of `window` bytes (stream and connection). A
/// stream the controller writes to disk as it reads (a diagnostics bundle) needs a small window:
/// with hyper's default of 2 MiB per stream, a fast agent could park most of a bundle in the
/// controller's memory while the disk catches up.
pub async fn connect_windowed(
    tls: &AgentTls,
    endpoint: SocketAddr,
    limits: CallLimits,
    window: Option<u32>,
) -> Result<AgentConnection, CallError> {
    let fail = |outcome, detail: String| CallError {
        outcome,
        endpoint,
        detail,
    };
    let config = tls.config.clone().map_err(|problem| {
        fail(
            CallOutcome::Tls,
            format!("unusable controller certificates: {problem}"),
        )
    })?;
    let dialer = TlsDialer {
        config,
        handshakes: Arc::clone(&tls.handshakes),
        endpoint,
    };
    // TLS is done by the dialer, so tonic sees plain HTTP/2 over the stream it is given.
    let ep = Endpoint::from_shared(format!("http://{endpoint}"))
        .map_err(|e| fail(CallOutcome::Connect, chain(&e)))?
        .connect_timeout(limits.timeout)
        .timeout(limits.timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(window)
        .initial_connection_window_size(window);
    let channel =
        match tokio::time::timeout(limits.timeout, ep.connect_with_connector(dialer)).await {
            Err(_) => {
                return Err(fail(
                    CallOutcome::Timeout,
                    format!("no connection within {:?}", limits.timeout),
                ));
            }
            Ok(Err(e)) => {
                let text = chain(&e);
                return Err(fail(classify_transport(&text), text));
            }
            Ok(Ok(channel)) => channel,
        };
    let client = NodeAgentClient::new(channel)
        .max_decoding_message_size(limits.max_reply_bytes)
        .max_encoding_message_size(limits.max_reply_bytes);
    Ok(AgentConnection {
        client,
        endpoint,
        limits,
    })
}

impl AgentConnection {
    pub async fn get_report(
        &mut self,
        since_revision: u64,
    ) -> Result<pb::GetReportResponse, CallError> {
        let (endpoint, timeout) = (self.endpoint, self.limits.timeout);
        finish(
            endpoint,
            timeout,
            self.client
                .get_report(pb::GetReportRequest { since_revision }),
        )
        .await
    }

    pub async fn set_rules(
        &mut self,
        request: pb::SetRulesRequest,
    ) -> Result<pb::SetRulesResponse, CallError> {
        let (endpoint, timeout) = (self.endpoint, self.limits.timeout);
        finish(endpoint, timeout, self.client.set_rules(request)).await
    }

    /// Asks the agent to run a `NetworkTest`'s probes; same limits and failure classes as
    /// every other call.
    pub async fn run_probes(
        &mut self,
        request: pb::RunProbesRequest,
    ) -> Result<pb::RunProbesResponse, CallError> {
        let (endpoint, timeout) = (self.endpoint, self.limits.timeout);
        finish(endpoint, timeout, self.client.run_probes(request)).await
    }

    /// Asks the agent to plan and (unless a dry run) apply host network state.
    pub async fn apply_network(
        &mut self,
        request: pb::ApplyNetworkRequest,
    ) -> Result<pb::ApplyNetworkResponse, CallError> {
        let (endpoint, timeout) = (self.endpoint, self.limits.timeout);
        finish(endpoint, timeout, self.client.apply_network(request)).await
    }
}

impl AgentConnection {
    /// Opens a diagnostics bundle stream. Opening is bounded by the call timeout; the chunks are
    /// read by the caller under a deadline of its own (a bundle takes longer than a report).
    pub async fn collect_diagnostics(
        &mut self,
        request: pb::DiagnosticsRequest,
    ) -> Result<
        impl futures::Stream<Item = Result<pb::DiagnosticsChunk, CallError>> + Send + 'static,
        CallError,
    > {
        use futures::StreamExt as _;
        let (endpoint, timeout) = (self.endpoint, self.limits.timeout);
        let stream = finish(endpoint, timeout, self.client.collect_diagnostics(request)).await?;
        Ok(stream.map(move |item| item.map_err(|status| status_failure(endpoint, &status))))
    }
}

async fn finish<T>(
    endpoint: SocketAddr,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(CallError {
            outcome: CallOutcome::Timeout,
            endpoint,
            detail: format!("no answer within {timeout:?}"),
        }),
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(status_failure(endpoint, &status)),
    }
}

/// A failed call from its status, the status's causes included: a connection the agent closed
/// after a TLS alert ends as a bare `Unknown: transport error` or `Cancelled` status, and only
/// the cause says that the agent refused our certificate.
fn status_failure(endpoint: SocketAddr, status: &tonic::Status) -> CallError {
    let mut detail = format!("{:?}: {}", status.code(), status.message());
    if let Some(cause) = std::error::Error::source(status) {
        detail.push_str(&format!(": {}", chain(cause)));
    }
    CallError {
        outcome: classify_status(status, &detail),
        endpoint,
        detail,
    }
}

/// The error and all its sources on one line, each cause once: wrappers that print their cause
/// in their own text (hyper's and io's do) would otherwise show it twice.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let push = |text: &mut String, part: String| {
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
    };
    let mut source = error.source();
    while let Some(e) = source {
        // io::Error hides a custom inner error from `source()`; show it.
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
        {
            push(&mut text, inner.to_string());
            source = inner.source();
            continue;
        }
        push(&mut text, e.to_string());
        source = e.source();
    }
    text
}

/// Classifies a connection failure from its full text (tonic and rustls do not expose typed
/// causes through the transport error).
///
/// A peer that closes the connection without a word during the handshake (`tls handshake eof`,
/// a reset) is a connection failure, not a certificate rejection: that is what an agent that is
/// wedged, restarting or behind a dropping firewall looks like, and calling it
/// `AgentCertificateRejected` sends the operator to the wrong place (and a node whose failures
/// alternate between a reset and an EOF would have its condition rewritten at every call). A
/// rejection says so: a certificate error on our side, or a TLS alert from the agent.
pub fn classify_transport(text: &str) -> CallOutcome {
    let t = text.to_ascii_lowercase();
    let peer_closed = t.contains("handshake eof")
        || t.contains("unexpected eof")
        || t.contains("connection reset")
        || t.contains("broken pipe");
    if t.contains("certificate")
        || t.contains("unknownissuer")
        || t.contains("notvalidforname")
        || t.contains("alert")
        || (t.contains("handshake") && !peer_closed)
    {
        CallOutcome::Tls
    } else if t.contains("corrupt message")
        || t.contains("invalidmessage")
        || t.contains("invalid message")
        || t.contains("invalidcontenttype")
    {
        // Not TLS at all: the peer speaks something else.
        CallOutcome::InvalidReply
    } else if t.contains("timed out") || t.contains("deadline") {
        CallOutcome::Timeout
    } else {
        CallOutcome::Connect
    }
}

fn classify_status(status: &tonic::Status, detail: &str) -> CallOutcome {
    use tonic::Code;
    let message = status.message().to_ascii_lowercase();
    let causes = detail.to_ascii_lowercase();
    // tonic reports a broken connection as Unknown, Cancelled or Unavailable with the transport
    // error as its cause: the connection's fate, not the agent's answer.
    if matches!(
        status.code(),
        Code::Unknown | Code::Cancelled | Code::Unavailable
    ) && causes.contains("transport error")
    {
        return classify_transport(&causes);
    }
    if message.contains("message length too large")
        || message.contains("too large")
        || status.code() == Code::ResourceExhausted
    {
        return CallOutcome::TooLarge;
    }
    match status.code() {
        Code::DeadlineExceeded | Code::Cancelled => CallOutcome::Timeout,
        Code::Internal
            if message.contains("decode")
                || message.contains("protocol")
                || message.contains("h2") =>
        {
            CallOutcome::InvalidReply
        }
        Code::Unknown | Code::Unimplemented => CallOutcome::InvalidReply,
        Code::Unavailable => classify_transport(&message),
        _ => CallOutcome::Status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_its_wrapper_already_prints_is_shown_once() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "transport error: {}", self.0)
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let io = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "tls handshake eof");
        assert_eq!(chain(&Wrapper(io)), "transport error: tls handshake eof");
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let text = chain(&refused);
        assert_eq!(text.matches("refused").count(), 1, "{text}");
    }

    #[test]
    fn classifies_transport_failures() {
        assert_eq!(
            classify_transport("transport error: invalid peer certificate: UnknownIssuer"),
            CallOutcome::Tls
        );
        assert_eq!(
            classify_transport(
                "transport error: received corrupt message of type InvalidContentType"
            ),
            CallOutcome::InvalidReply
        );
        assert_eq!(
            classify_transport("transport error: Connection refused (os error 111)"),
            CallOutcome::Connect
        );
        // An agent that takes the connection and closes it mid-handshake is not reachable; it
        // rejected no certificate.
        assert_eq!(
            classify_transport("transport error: tls handshake eof: tls handshake eof"),
            CallOutcome::Connect
        );
        assert_eq!(
            classify_transport(
                "transport error: Connection reset by peer (os error 104): Connection reset by peer (os error 104)"
            ),
            CallOutcome::Connect
        );
        // An agent that does not trust our certificate says so with an alert.
        assert_eq!(
            classify_transport("transport error: received fatal alert: UnknownCA"),
            CallOutcome::Tls
        );
        assert_eq!(
            classify_transport("transport error: received fatal alert: CertificateRequired"),
            CallOutcome::Tls
        );
        assert_eq!(
            classify_transport("operation timed out"),
            CallOutcome::Timeout
        );
    }

    fn classify_status_alone(status: &tonic::Status) -> CallOutcome {
        classify_status(
            status,
            &format!("{:?}: {}", status.code(), status.message()),
        )
    }

    #[test]
    fn classifies_statuses() {
        assert_eq!(
            classify_status_alone(&tonic::Status::out_of_range(
                "Error, decoded message length too large: found 9000000 bytes, the limit is: 4194304 bytes"
            )),
            CallOutcome::TooLarge
        );
        assert_eq!(
            classify_status_alone(&tonic::Status::internal(
                "failed to decode Protobuf message"
            )),
            CallOutcome::InvalidReply
        );
        assert_eq!(
            classify_status_alone(&tonic::Status::deadline_exceeded("x")),
            CallOutcome::Timeout
        );
        assert_eq!(
            classify_status_alone(&tonic::Status::invalid_argument("rule a: bad")),
            CallOutcome::Status
        );
        // What an agent that distrusts our certificate produces, call after call (seen in
        // tests/tests/controller_bad_agents.rs): an alert, or just the closed connection.
        let alert = tonic::Status::unknown("transport error");
        assert_eq!(
            classify_status(
                &alert,
                "Unknown: transport error: transport error: connection error: received fatal alert: DecryptError"
            ),
            CallOutcome::Tls
        );
        let closed = tonic::Status::cancelled("operation was canceled");
        assert_eq!(
            classify_status(
                &closed,
                "Cancelled: operation was canceled: transport error: operation was canceled: connection closed"
            ),
            CallOutcome::Connect
        );
        // A real answer with code Unknown (no transport error) is still a bad reply.
        assert_eq!(
            classify_status_alone(&tonic::Status::unknown("panic in handler")),
            CallOutcome::InvalidReply
        );
    }
}
