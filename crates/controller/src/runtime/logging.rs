//! Log output: `--log-format json` writes one JSON object per line carrying the current span and
//! the list of enclosing spans (so a reconcile's `object` or an agent call's `node` is on every
//! line inside it); `--log-format plain` writes text, coloured only when stderr is a terminal so
//! that files and log collectors get no ANSI escape codes.

use std::io::IsTerminal as _;

use super::cli::{Cli, LogFormat};

/// Installs the global subscriber (once; later calls in the same process are no-ops).
pub fn init(cli: &Cli) {
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cli.log_format {
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
        LogFormat::Plain => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
    };
}
