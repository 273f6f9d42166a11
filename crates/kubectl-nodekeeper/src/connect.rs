//! A client from the kubeconfig the way kubectl picks it (`--kubeconfig`, else `$KUBECONFIG`,
//! else `~/.kube/config`; `--context`), with bounded timeouts so a dead API server fails in
//! seconds with a line that says so.
//!
//! kube's default retry (every 429/503/504, up to 15 times) is replaced by kubectl's rule
//! ([`nodekeeper_api::client`]): only what the API server asks to be retried is retried. A 503
//! from the Service proxy carries no `Retry-After`: it means the controller is not running, and
//! is said at once.

use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::cli::Global;
use crate::error::{Error, chain};

/// Connecting to an address that does not answer fails after this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A client and what the verbs need to name in messages.
#[derive(Clone)]
pub struct Connection {
    pub client: kube::Client,
    /// The API server's URL, for messages.
    pub server: String,
    /// The controller's namespace (`-n`).
    pub namespace: String,
}

impl Connection {
    /// [`Error::from_kube`] for a request to this API server.
    pub fn error(&self, what: &str, error: kube::Error) -> Error {
        Error::from_kube(what, &self.server, error)
    }
}

/// Loads the kubeconfig and builds a client; does not contact the API server yet.
pub async fn connect(global: &Global) -> Result<Connection, Error> {
    let options = KubeConfigOptions {
        context: global.context.clone(),
        cluster: None,
        user: None,
    };
    let load_error = |detail: String| Error::LoadKubeconfig {
        path: global.kubeconfig.clone(),
        detail,
    };
    let mut config = match &global.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path).map_err(|e| load_error(chain(&e)))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(|e| load_error(chain(&e)))?
        }
        None => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| load_error(chain(&e)))?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(global.request_timeout);
    config.write_timeout = Some(global.request_timeout);
    let server = config.cluster_url.to_string();
    let client =
        nodekeeper_api::client::server_asked_retry(config).map_err(|e| Error::BuildClient {
            server: server.clone(),
            detail: chain(&e),
        })?;
    Ok(Connection {
        client,
        server: server.trim_end_matches('/').to_owned(),
        namespace: global.namespace.clone(),
    })
}
