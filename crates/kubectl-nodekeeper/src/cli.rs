//! The command line: kubectl's conventions (`--kubeconfig`, `--context`, `-n`, `-o`), one
//! subcommand per verb, every flag also settable as a `NODEKEEPER_…` environment variable.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

const ABOUT: &str = "nodekeeper from the command line: fleet status, node reports, network checks, maintenance and diagnostics";

const LONG_ABOUT: &str = "\
nodekeeper from the command line: fleet status, node reports, network checks, node \
maintenance (cordon, drain, uncordon) and diagnostics bundles.

Talks only to the Kubernetes API server: NetworkTests, NodeMaintenances and NodeDiagnostics \
directly, the \
controller's HTTP API (`/api/...`) through the API server's service proxy to the Service \
`nodekeeper-controller` (port `http`) in the controller's namespace (-n). It never contacts an \
agent. Install it by putting `kubectl-nodekeeper` on your PATH; kubectl then runs it as \
`kubectl nodekeeper`.";

const AFTER_HELP: &str = "\
Examples:
  kubectl nodekeeper status                      # the fleet at a glance
  kubectl nodekeeper status --watch              # refresh every 5s until Ctrl-C
  kubectl nodekeeper node worker-7               # one node's full report
  kubectl nodekeeper node worker-7 -o json       # the same, as the controller serves it
  kubectl nodekeeper netcheck                    # every node pings 3 of its peers
  kubectl nodekeeper netcheck -l pool=gpu --kind tcp --port 443 10.0.0.10 apiserver
  kubectl nodekeeper netcheck --kind dns --resolver 10.96.0.10 kubernetes.default.svc.cluster.local
  kubectl nodekeeper maintain worker-7 --drain    # cordon and drain, showing what blocks
  kubectl nodekeeper maintain complete worker-7  # uncordon when the work is done
  kubectl nodekeeper diag worker-7 -O /tmp/inc   # collect, download and check a bundle
  kubectl nodekeeper completion bash > /etc/bash_completion.d/kubectl-nodekeeper

Exit codes:
  0    done, and what was checked is fine
  1    done, and what was checked failed (netcheck: a pair failed, or the test did not finish;
       maintain: a drain timed out; diag: a bundle not collected or not downloaded)
  2    not done: bad usage, API server unreachable, credentials refused, permission denied,
       unknown node, selector matching no node, object refused (by the API server or the
       controller), controller not reachable; nothing is created (maintain: a
       NodeMaintenance created before a later read failed is named, with how to resume)
  130  interrupted (Ctrl-C): netcheck and diag delete what they created unless --keep;
       maintain leaves the NodeMaintenance as it is and prints how to resume

Output: tables on a terminal are coloured and progress is redrawn in place on stderr; piped
output is plain and stable (progress as one stderr line per change). Use -o json or
-o yaml in scripts.";

/// The `kubectl nodekeeper` plugin.
#[derive(Debug, Parser)]
#[command(
    name = "kubectl-nodekeeper",
    bin_name = "kubectl nodekeeper",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP,
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every verb takes.
#[derive(Clone, Debug, Args)]
pub struct Global {
    /// Path of the kubeconfig file. Default: $KUBECONFIG, then ~/.kube/config.
    #[arg(
        long,
        global = true,
        env = "NODEKEEPER_KUBECONFIG",
        value_name = "PATH"
    )]
    pub kubeconfig: Option<PathBuf>,

    /// The kubeconfig context to use. Default: the current context.
    #[arg(long, global = true, env = "NODEKEEPER_CONTEXT", value_name = "NAME")]
    pub context: Option<String>,

    /// Namespace of the nodekeeper controller (its Service), and of the NetworkTests and
    /// NodeDiagnostics netcheck and diag create.
    #[arg(
        short = 'n',
        long,
        global = true,
        env = "NODEKEEPER_NAMESPACE",
        default_value = "nodekeeper"
    )]
    pub namespace: String,

    /// Output format.
    #[arg(
        short = 'o',
        long,
        global = true,
        env = "NODEKEEPER_OUTPUT",
        value_enum,
        default_value_t = OutputFormat::Table
    )]
    pub output: OutputFormat,

    /// Timeout of each request to the API server (e.g. 30s, 1m).
    #[arg(
        long,
        global = true,
        env = "NODEKEEPER_REQUEST_TIMEOUT",
        default_value = "30s",
        value_parser = duration,
        value_name = "DURATION"
    )]
    pub request_timeout: Duration,
}

/// `-o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Tables for people.
    Table,
    /// Tables with more columns.
    Wide,
    /// JSON for scripts.
    Json,
    /// YAML for scripts.
    Yaml,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The fleet at a glance: nodes by condition, tunables out of bounds, unreachable agents,
    /// stale reports, active NetworkTests and NodeMaintenances.
    Status(crate::status::Args),
    /// One node's full report from the controller: indicators with verdicts, tunables,
    /// interfaces (nodekeeper's marked), GPUs, plugins.
    Node(crate::node::Args),
    /// Runs a network test (a NetworkTest) from the selected nodes, shows its progress, and
    /// prints the summary and the failing pairs. Exits 1 when a pair failed.
    Netcheck(crate::netcheck::Args),
    /// Cordons or drains nodes through a NodeMaintenance and follows it node by node, with the
    /// pods that block; `maintain complete` uncordons. Exits 1 when a drain timed out.
    Maintain(crate::maintain::Args),
    /// Collects a diagnostics bundle from each node (a NodeDiagnostic), downloads it through
    /// the API server and checks its sha256. Exits 1 when a bundle is missing.
    Diag(crate::diag::Args),
    /// Prints a shell completion script.
    Completion(CompletionArgs),
}

#[derive(Debug, Args)]
pub struct CompletionArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Parses `30s`, `2m`, `1h30m`.
pub fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 30s, 2m, 1h)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn kubectl_flags_are_global() {
        let cli = Cli::try_parse_from([
            "kubectl-nodekeeper",
            "node",
            "n1",
            "-n",
            "ops",
            "-o",
            "json",
            "--context",
            "prod",
        ])
        .unwrap();
        assert_eq!(cli.global.namespace, "ops");
        assert_eq!(cli.global.output, OutputFormat::Json);
        assert_eq!(cli.global.context.as_deref(), Some("prod"));
    }

    #[test]
    fn every_verb_that_changes_something_has_examples_in_its_help() {
        let mut cli = Cli::command();
        for verb in ["netcheck", "maintain", "diag"] {
            let help = cli
                .find_subcommand_mut(verb)
                .unwrap_or_else(|| panic!("{verb}"))
                .render_long_help()
                .to_string();
            assert!(
                help.contains("Examples:") && help.contains(&format!("kubectl nodekeeper {verb} ")),
                "{verb}:\n{help}"
            );
        }
    }

    #[test]
    fn help_documents_the_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        for needle in ["Exit codes:", "130", "netcheck", "-o json"] {
            assert!(help.contains(needle), "{needle} missing from:\n{help}");
        }
    }
}
