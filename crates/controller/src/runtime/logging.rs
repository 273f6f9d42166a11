//! Log output: `--log-format json` writes one JSON object per line carrying the current span and
//! the list of enclosing spans (so a reconcile's `object` or an agent call's `node` is on every
//! line inside it); `--log-format plain` writes text, coloured only when stderr is a terminal so
//! that files and log collectors get no ANSI escape codes.

use std::io::IsTerminal as _;

use tracing::Subscriber;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt as _;

use super::cli::{Cli, LogFormat};

/// Installs the global subscriber writing to stderr, and routes `log` records into it (once;
/// later calls in the same process are no-ops).
pub fn init(cli: &Cli) {
    let _ = subscriber(cli, std::io::stderr, std::io::stderr().is_terminal()).try_init();
}

/// The subscriber for `cli`'s format and filter, writing to `writer`; ANSI colours only in the
/// plain format and only when `terminal`.
pub fn subscriber<W>(cli: &Cli, writer: W, terminal: bool) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match cli.log_format {
        LogFormat::Json => Box::new(
            builder
                .json()
                .with_current_span(true)
                .with_span_list(true)
                .finish(),
        ),
        LogFormat::Plain => Box::new(builder.with_ansi(terminal).finish()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use clap::Parser as _;

    use super::*;

    /// A writer that keeps what is written.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(format: &str, terminal: bool) -> String {
        let cli = Cli::parse_from(["nodekeeper-controller", "--log-format", format]);
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = subscriber(&cli, move || writer.clone(), terminal);
        tracing::subscriber::with_default(subscriber, || {
            let reconcile =
                tracing::info_span!("reconcile", controller = "networktest", object = "t1");
            let _outer = reconcile.enter();
            let call = tracing::info_span!("agent_call", node = "node-a");
            let _inner = call.enter();
            tracing::warn!(error = "refused", "agent call failed");
        });
        String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn json_lines_carry_the_current_span_and_the_span_list() {
        let text = logged("json", false);
        let line: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON line");
        assert_eq!(line["span"]["name"], "agent_call");
        assert_eq!(line["span"]["node"], "node-a");
        assert_eq!(line["spans"][0]["name"], "reconcile");
        assert_eq!(line["spans"][0]["object"], "t1");
        assert_eq!(line["fields"]["error"], "refused");
    }

    #[test]
    fn plain_lines_are_coloured_only_on_a_terminal() {
        let plain = logged("plain", false);
        assert!(plain.contains("agent call failed"), "{plain}");
        assert!(plain.contains("node-a"), "{plain}");
        assert!(
            !plain.contains('\x1b'),
            "ANSI escape written to a non-terminal: {plain:?}"
        );
        assert!(logged("plain", true).contains('\x1b'));
    }
}
