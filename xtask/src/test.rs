//! `cargo xtask test`: the whole test suite — the one command CI runs.
//!
//! It installs missing host prerequisites, builds the pinned control plane if the cache lacks it,
//! starts **one** control plane for the whole run, and runs `cargo test --workspace` with
//! `NODEKEEPER_TEST_KUBECONFIG` pointing at it, so every test binary shares it instead of starting
//! its own. The control plane dies with this process however the run ends.
//!
//! Before that, when the chosen tests include the image tests (`tests/tests/images.rs`, the
//! uninstall Job's container in `tests/tests/install_cleanup.rs`) and we run as root, it builds
//! the images as `cargo xtask image` does (the static musl release binaries, in the same cargo
//! target directory, so a kept target directory makes it incremental) and hands their directory
//! to the tests in `NODEKEEPER_TEST_IMAGES`: cargo holds the target directory's lock while tests
//! run, so a test cannot build them itself.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use clap::Args;
use nodekeeper_e2e::{KUBECONFIG_ENV, Lifetime, Options, controlplane};

use crate::{deps, image};

#[derive(Args)]
pub struct TestArgs {
    /// Arguments for `cargo test`, after `--`: e.g. `-- -p nodekeeper-agent` for one package, or
    /// `-- -p nodekeeper-e2e -- pdb` for the tests whose names contain `pdb`.
    #[arg(last = true)]
    cargo_args: Vec<String>,
}

pub fn run(args: TestArgs) -> Result<()> {
    let started = Instant::now();
    deps::ensure(deps::TEST)?;
    deps::ensure_python_oci()?;
    if !nodekeeper_testkit::is_root() {
        eprintln!(
            "xtask: not running as root: network-namespace and VM tests will report SKIPPED (CI runs them as root)"
        );
    }

    let images = if runs_image_tests(&args.cargo_args) {
        images()
    } else {
        Ok(None)
    };

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let name = format!("test-suite-{}", std::process::id());
    let options = Options::new(name.clone(), Lifetime::WithThisProcess);
    let mut cluster = runtime
        .block_on(controlplane::up(&options, &mut |line| {
            eprintln!("xtask: {line}")
        }))
        .context("start the test control plane")?;
    eprintln!(
        "xtask: control plane `{name}` ready at {} after {:.0}s; running the test suite",
        cluster.apiserver_url(),
        started.elapsed().as_secs_f64()
    );

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = crate::cargo::command(&cargo);
    command.args(["test", "--no-fail-fast"]);
    // The whole workspace unless the arguments pick packages (`-- -p nodekeeper-e2e --test x`).
    let picks_packages = args
        .cargo_args
        .iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "-p" || a == "--package" || a.starts_with("--package="));
    if !picks_packages {
        command.arg("--workspace");
    }
    command.args(&args.cargo_args);
    command.env(KUBECONFIG_ENV, &cluster.kubeconfig);
    // The fuzz campaign (fuzz/tests/campaign.rs) runs with the suite: a bounded few seconds per
    // target from a fixed seed, so CI is repeatable; `cargo xtask fuzz` runs it longer.
    if std::env::var_os("NODEKEEPER_FUZZ_SECONDS").is_none() {
        command.env("NODEKEEPER_FUZZ_SECONDS", "5");
    }
    match &images {
        Ok(Some(dir)) => {
            command.env(image::TEST_IMAGES_ENV, dir);
        }
        Ok(None) => {}
        // The image tests fail with this reason; the rest of the suite still runs.
        Err(e) => {
            command.env(IMAGES_FAILED_ENV, format!("{e:#}"));
        }
    }
    let status = command.status().context("run cargo test")?;

    cluster.stop();
    let _ = controlplane::down(&name, true);
    eprintln!(
        "xtask: test suite finished in {:.0}s ({status})",
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = images {
        bail!("building the images failed: {e:#}");
    }
    if !status.success() {
        bail!("the test suite failed; see the failing tests above");
    }
    Ok(())
}

/// Why the images could not be built, for the image tests' failure message.
const IMAGES_FAILED_ENV: &str = "NODEKEEPER_TEST_IMAGES_FAILED";

/// The test binaries of `nodekeeper-e2e` that run the images.
const IMAGE_TESTS: [&str; 2] = ["images", "install_cleanup"];

/// Whether `cargo test <cargo_args>` runs an image test: the whole workspace, or
/// `nodekeeper-e2e` with no `--test` or with one of [`IMAGE_TESTS`]. A run of other tests does
/// not pay for the musl build.
fn runs_image_tests(cargo_args: &[String]) -> bool {
    let ours: Vec<&str> = cargo_args
        .iter()
        .map(String::as_str)
        .take_while(|a| *a != "--")
        .collect();
    let values = |long: &str, short: Option<&str>| -> Vec<String> {
        let mut found = Vec::new();
        for (i, a) in ours.iter().enumerate() {
            if Some(*a) == short || *a == long {
                found.extend(ours.get(i + 1).map(|v| (*v).to_owned()));
            } else if let Some(v) = a.strip_prefix(&format!("{long}=")) {
                found.push(v.to_owned());
            }
        }
        found
    };
    let packages = values("--package", Some("-p"));
    let tests = values("--test", None);
    let package_included = packages.is_empty() || packages.iter().any(|p| p == "nodekeeper-e2e");
    let test_included = tests.is_empty() || tests.iter().any(|t| IMAGE_TESTS.contains(&t.as_str()));
    package_included && test_included
}

/// The directory of the image archives the image tests load: `NODEKEEPER_TEST_IMAGES` if set,
/// else built now into `<cargo target dir>/images`. `None` when not root (the tests skip).
fn images() -> Result<Option<PathBuf>> {
    if let Some(dir) = std::env::var_os(image::TEST_IMAGES_ENV) {
        eprintln!(
            "xtask: image tests use the archives in {}",
            PathBuf::from(&dir).display()
        );
        return Ok(Some(dir.into()));
    }
    if !nodekeeper_testkit::is_root() {
        eprintln!("xtask: not root: the images are not built (their tests need podman as root)");
        return Ok(None);
    }
    deps::ensure(deps::IMAGE_SMOKE)?;
    let root = crate::codegen::repo_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map_or_else(|| root.join("target"), |d| root.join(d));
    let out = target.join("images");
    let started = Instant::now();
    eprintln!(
        "xtask: building the images (release, {}) for the image tests",
        image::TARGET
    );
    let components: Vec<String> = image::COMPONENTS.iter().map(|c| (*c).to_owned()).collect();
    for line in image::build_all(&components, &out, "latest", None)? {
        eprintln!("xtask: {line}");
    }
    eprintln!(
        "xtask: images built in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::runs_image_tests;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_image_tests_are_picked_by_package_and_test_name() {
        assert!(runs_image_tests(&[]));
        assert!(runs_image_tests(&args("-- pdb")));
        assert!(runs_image_tests(&args("-p nodekeeper-e2e")));
        assert!(runs_image_tests(&args("-p nodekeeper-e2e --test images")));
        assert!(runs_image_tests(&args(
            "--package=nodekeeper-e2e --test=install_cleanup"
        )));
        assert!(!runs_image_tests(&args("-p nodekeeper-agent")));
        assert!(!runs_image_tests(&args(
            "-p nodekeeper-e2e --test node_maintenance"
        )));
        // A filter after `--` names tests, not test binaries.
        assert!(!runs_image_tests(&args(
            "-p nodekeeper-e2e --test crds -- images"
        )));
    }
}
