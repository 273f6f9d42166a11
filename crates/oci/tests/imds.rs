//! The IMDS client against a local HTTP server on 127.0.0.1 that checks the v2 header and serves
//! the shared samples, garbage, errors and slow answers.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use nodekeeper_oci::{ImdsClient, ImdsConfig, ImdsError};

#[derive(Default)]
struct Counters {
    requests: AtomicU32,
    flaky: AtomicU32,
}

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

async fn handle(
    req: Request<Incoming>,
    c: Arc<Counters>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    c.requests.fetch_add(1, Ordering::SeqCst);
    let reply = |status: StatusCode, body: String| {
        Ok(Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body)))
            .unwrap())
    };
    if req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        != Some("Bearer Oracle")
    {
        return reply(
            StatusCode::UNAUTHORIZED,
            "missing Authorization: Bearer Oracle".into(),
        );
    }
    let path = req.uri().path().to_string();
    let (prefix, rest) = path[1..]
        .split_once('/')
        .map(|(a, b)| (a.to_string(), format!("/{b}")))
        .unwrap_or_default();
    let sample = match rest.as_str() {
        "/opc/v2/vnics/" => "vnics",
        "/opc/v2/instance/" => "instance",
        _ => return reply(StatusCode::NOT_FOUND, "no such path".into()),
    };
    match prefix.as_str() {
        "vm" => reply(StatusCode::OK, fixture(&format!("{sample}-vm.json"))),
        "bm" => reply(StatusCode::OK, fixture(&format!("{sample}-bm.json"))),
        "null" => reply(StatusCode::OK, fixture("vnics-vm-null-subnet.json")),
        "garbage" => reply(
            StatusCode::OK,
            "<html><body>captive portal</body></html>".into(),
        ),
        "e500" => reply(StatusCode::INTERNAL_SERVER_ERROR, "boom".into()),
        "e404" => reply(StatusCode::NOT_FOUND, "v1 disabled".into()),
        "flaky" => {
            if c.flaky.fetch_add(1, Ordering::SeqCst) < 2 {
                reply(StatusCode::SERVICE_UNAVAILABLE, "busy".into())
            } else {
                reply(StatusCode::OK, fixture("vnics-vm.json"))
            }
        }
        "slow" => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            reply(StatusCode::OK, fixture("vnics-vm.json"))
        }
        _ => reply(StatusCode::NOT_FOUND, "unknown prefix".into()),
    }
}

async fn server() -> (String, Arc<Counters>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counters = Arc::new(Counters::default());
    let c = counters.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let c = c.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| handle(req, c.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), counters)
}

fn client(base: &str, prefix: &str) -> ImdsClient {
    let mut cfg = ImdsConfig::new(format!("{base}/{prefix}"));
    cfg.timeout = Duration::from_millis(300);
    cfg.retries = 2;
    cfg.backoff = Duration::from_millis(20);
    ImdsClient::new(cfg).unwrap()
}

#[tokio::test]
async fn samples_are_fetched_with_the_v2_header() {
    let (base, c) = server().await;
    let vnics = client(&base, "vm").vnics().await.unwrap();
    assert_eq!(vnics.len(), 3);
    assert_eq!(vnics[1].mac_addr, "02:00:17:0a:22:02");
    let inst = client(&base, "bm").instance().await.unwrap();
    assert!(inst.is_bare_metal());
    assert_eq!(c.requests.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn missing_header_is_refused_by_the_server() {
    // Guards the test server itself: without the header it answers 401.
    let (base, _) = server().await;
    let stream = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = send
        .send_request(
            Request::get("/vm/opc/v2/vnics/")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn server_errors_are_retried_with_backoff_and_bounded() {
    let (base, c) = server().await;
    let vnics = client(&base, "flaky").vnics().await.unwrap();
    assert_eq!(vnics.len(), 3);
    assert_eq!(c.requests.load(Ordering::SeqCst), 3);

    let (base, c) = server().await;
    let e = client(&base, "e500").vnics().await.unwrap_err();
    assert_eq!(
        c.requests.load(Ordering::SeqCst),
        3,
        "1 attempt + 2 retries"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "request {base}/e500/opc/v2/vnics/ failed after 3 attempt(s): status 500 Internal Server Error"
        )
    );
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    let (base, c) = server().await;
    let e = client(&base, "e404").vnics().await.unwrap_err();
    assert!(
        matches!(
            e,
            ImdsError::Status {
                status: StatusCode::NOT_FOUND,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(c.requests.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn slow_answers_time_out() {
    let (base, c) = server().await;
    let t = Instant::now();
    let e = client(&base, "slow").vnics().await.unwrap_err();
    assert!(
        e.to_string()
            .ends_with("failed after 3 attempt(s): no answer within 300 ms"),
        "{e}"
    );
    assert!(
        t.elapsed() < Duration::from_millis(1800),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(c.requests.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn garbage_and_null_fields_name_the_endpoint_and_field() {
    let (base, _) = server().await;
    let e = client(&base, "garbage")
        .vnics()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "{base}/garbage/opc/v2/vnics/ gave a malformed answer: vnics: not JSON"
        )),
        "{e}"
    );
    let e = client(&base, "null").vnics().await.unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{base}/null/opc/v2/vnics/ gave a malformed answer: vnics[1].subnetCidrBlock: expected a CIDR, got \"<null>\" \
             (the VNIC has an IPv4 privateIp)"
        )
    );
}

#[tokio::test]
async fn connection_refused_is_retried_then_reported() {
    // A port that was just free on 127.0.0.1.
    let addr = format!("127.0.0.1:{}", nodekeeper_testkit::free_port());
    let e = client(&format!("http://{addr}"), "vm")
        .vnics()
        .await
        .unwrap_err();
    assert!(matches!(e, ImdsError::Request { attempts: 3, .. }), "{e}");
    assert!(ImdsClient::new(ImdsConfig::new("https://169.254.169.254")).is_err());
    assert!(ImdsClient::new(ImdsConfig::new("not a url")).is_err());
}
