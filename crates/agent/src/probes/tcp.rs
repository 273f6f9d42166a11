//! The TCP probe: timed connects to one address and port; the connection is closed at once.

use std::net::SocketAddr;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Tally;
use super::validate::Plan;

pub(super) async fn probe(addr: SocketAddr, plan: &Plan) -> Tally {
    let mut tally = Tally::default();
    for i in 0..plan.count {
        let start = Instant::now();
        match tokio::time::timeout(plan.timeout, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                let rtt = start.elapsed();
                drop(stream);
                tally.success(rtt);
            }
            Ok(Err(e)) => tally.failure(format!("connect to {addr}: {e}")),
            Err(_) => tally.failure(format!(
                "connect to {addr}: no answer within {:?}",
                plan.timeout
            )),
        }
        super::pause(plan, i).await;
    }
    tally
}
