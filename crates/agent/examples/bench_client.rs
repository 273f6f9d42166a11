//! The load side of `cargo xtask bench agent`: writes throwaway test certificates, and drives
//! `GetReport` at a fixed rate against an agent on 127.0.0.1 over mutual TLS, printing latency
//! figures as one JSON object. Every loop is bounded by a request count and a deadline.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_client::NodeAgentClient;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const SERVER_NAME: &str = "agent.nodekeeper.internal";

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write ca.crt, tls.crt/tls.key (agent) and client.crt/client.key into DIR.
    Certs { dir: PathBuf },
    /// Drive GetReport at RATE per second for SECONDS, alternating full ("changed", asking with
    /// revision 0) and "unchanged" (asking with the current revision) calls.
    Load {
        #[arg(long)]
        addr: String,
        #[arg(long)]
        certs: PathBuf,
        #[arg(long, default_value_t = 100)]
        rate: u32,
        #[arg(long, default_value_t = 30)]
        seconds: u32,
        /// Only full reports (for a run with --report-max-age=0, where each is a fresh collection).
        #[arg(long)]
        full_only: bool,
    },
}

fn write_certs(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "nodekeeper bench CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key)?;
    std::fs::write(dir.join("ca.crt"), ca_cert.pem())?;
    let issuer = Issuer::new(ca, ca_key);
    for (name, usage, file) in [
        (SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth, "tls"),
        (
            "controller.nodekeeper.internal",
            ExtendedKeyUsagePurpose::ClientAuth,
            "client",
        ),
    ] {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.to_string()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer)?;
        std::fs::write(dir.join(format!("{file}.crt")), cert.pem())?;
        std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem())?;
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary(mut ms: Vec<f64>) -> serde_json::Value {
    ms.sort_by(f64::total_cmp);
    serde_json::json!({
        "count": ms.len(),
        "p50_ms": percentile(&ms, 50.0),
        "p99_ms": percentile(&ms, 99.0),
        "max_ms": ms.last().copied().unwrap_or(0.0),
    })
}

async fn load(
    addr: &str,
    certs: &Path,
    rate: u32,
    seconds: u32,
    full_only: bool,
) -> anyhow::Result<()> {
    let read = |f: &str| std::fs::read(certs.join(f)).with_context(|| format!("read {f}"));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.crt")?))
        .identity(Identity::from_pem(read("client.crt")?, read("client.key")?))
        .domain_name(SERVER_NAME);
    let channel = Channel::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .timeout(Duration::from_secs(5))
        .connect()
        .await?;
    let mut client = NodeAgentClient::new(channel);
    let total = u64::from(rate) * u64::from(seconds);
    let deadline = Instant::now() + Duration::from_secs(u64::from(seconds) * 2 + 10);
    let mut ticker = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut changed, mut unchanged) = (Vec::new(), Vec::new());
    let (mut revision, mut unchanged_answers, mut bytes_full) = (0u64, 0u64, 0usize);
    let started = Instant::now();
    for i in 0..total {
        if Instant::now() > deadline {
            bail!("deadline passed after {i} of {total} requests");
        }
        ticker.tick().await;
        let full = full_only || i % 2 == 0;
        let since = if full { 0 } else { revision };
        let t = Instant::now();
        let answer = client
            .get_report(pb::GetReportRequest {
                since_revision: since,
            })
            .await?
            .into_inner();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        revision = answer.revision;
        match answer.result {
            Some(pb::get_report_response::Result::Unchanged(_)) => {
                unchanged_answers += 1;
                unchanged.push(ms);
            }
            Some(pb::get_report_response::Result::Report(r)) => {
                bytes_full = prost::Message::encoded_len(&r);
                // A full answer to a call that asked with the current revision means the report
                // moved in between; it still counts as a full (changed) answer.
                changed.push(ms);
            }
            None => bail!("answer without a result"),
        }
    }
    let out = serde_json::json!({
        "requests": total,
        "wall_seconds": started.elapsed().as_secs_f64(),
        "changed": summary(changed),
        "unchanged": summary(unchanged),
        "unchanged_answers": unchanged_answers,
        "full_report_bytes": bytes_full,
    });
    // The JSON line is this program's output; xtask reads it.
    #[allow(clippy::print_stdout)]
    {
        println!("{out}");
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Certs { dir } => write_certs(&dir),
        Cmd::Load {
            addr,
            certs,
            rate,
            seconds,
            full_only,
        } => load(&addr, &certs, rate, seconds, full_only).await,
    }
}
