//! Builds the pinned control-plane binaries from their Go modules (`xtask/controlplane/*`) with
//! the machine's Go toolchain and caches them outside the repository, keyed by version.

use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest as _, Sha256};

use super::Error;

/// One binary of the control plane and the Go module that pins it.
#[derive(Debug, Clone, Copy)]
pub struct Component {
    /// File name of the binary in the cache's `bin/` directory.
    pub name: &'static str,
    /// Directory under `xtask/controlplane/` holding the pinning `go.mod`.
    module: &'static str,
    /// Go package path of the `main` package.
    package: &'static str,
    /// Rough cold build time on a 2-core machine, shown so a first run does not look hung.
    cold_minutes: u32,
}

/// Every binary `cluster up` and the test harness need, in build order (smallest first, so a
/// broken toolchain fails fast).
pub const COMPONENTS: [Component; 6] = [
    Component {
        name: "etcd",
        module: "etcd",
        package: "go.etcd.io/etcd/server/v3",
        cold_minutes: 2,
    },
    Component {
        name: "kwok",
        module: "kwok",
        package: "sigs.k8s.io/kwok/cmd/kwok",
        cold_minutes: 6,
    },
    Component {
        name: "kube-apiserver",
        module: "kubernetes",
        package: "k8s.io/kubernetes/cmd/kube-apiserver",
        cold_minutes: 18,
    },
    Component {
        name: "kube-controller-manager",
        module: "kubernetes",
        package: "k8s.io/kubernetes/cmd/kube-controller-manager",
        cold_minutes: 6,
    },
    Component {
        name: "kube-scheduler",
        module: "kubernetes",
        package: "k8s.io/kubernetes/cmd/kube-scheduler",
        cold_minutes: 3,
    },
    Component {
        name: "kubectl",
        module: "kubernetes",
        package: "k8s.io/kubernetes/cmd/kubectl",
        cold_minutes: 3,
    },
];

/// The directory holding the built binaries.
#[derive(Debug, Clone)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// Path of one binary (`"kube-apiserver"`, `"etcd"`, …).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The cache's `bin/` directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// `xtask/controlplane/` in this checkout: the Go modules that pin every component, plus the
/// kwok stages and the audit policy.
pub fn controlplane_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("xtask")
        .join("controlplane")
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper`.
pub fn cache_root() -> PathBuf {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/tmp"));
            home.join(".cache")
        }
    };
    base.join("nodekeeper")
}

/// The pinned versions, read from the `require` lines of the three `go.mod` files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versions {
    pub kubernetes: String,
    pub etcd: String,
    pub kwok: String,
}

/// The version a `go.mod` requires for `module_path` (`require X vN` or inside a `require (…)` block).
pub fn required_version(go_mod: &str, module_path: &str) -> Option<String> {
    go_mod.lines().find_map(|line| {
        let line = line.trim();
        let line = line.strip_prefix("require").map(str::trim).unwrap_or(line);
        let mut words = line.split_whitespace();
        (words.next() == Some(module_path))
            .then(|| words.next().map(str::to_owned))
            .flatten()
    })
}

fn read(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path).map_err(|source| Error::Io {
        context: format!("read {}", path.display()),
        source,
    })
}

/// Reads the pinned versions and a short hash of every `go.mod`/`go.sum`, which together name
/// the cache directory (a changed pin or checksum builds into a fresh directory).
pub fn cache_key(dir: &Path) -> Result<(Versions, String), Error> {
    let pins = [
        ("kubernetes", "k8s.io/kubernetes"),
        ("etcd", "go.etcd.io/etcd/server/v3"),
        ("kwok", "sigs.k8s.io/kwok"),
    ];
    let mut hasher = Sha256::new();
    let mut found = Vec::new();
    for (module, path) in pins {
        let go_mod_path = dir.join(module).join("go.mod");
        let go_mod = read(&go_mod_path)?;
        let version = required_version(&go_mod, path).ok_or_else(|| Error::ReadPin {
            path: go_mod_path.clone(),
            module: path.to_owned(),
        })?;
        hasher.update(go_mod.as_bytes());
        hasher.update(read(&dir.join(module).join("go.sum"))?.as_bytes());
        found.push(version);
    }
    // How the binaries are built is part of what they are: a changed recipe builds into a fresh
    // directory and leaves the old one to whoever still uses it.
    hasher.update(BUILD_RECIPE.as_bytes());
    let hash = hex::encode(&hasher.finalize()[..6]);
    let mut found = found.into_iter();
    let versions = Versions {
        kubernetes: found.next().unwrap_or_default(),
        etcd: found.next().unwrap_or_default(),
        kwok: found.next().unwrap_or_default(),
    };
    Ok((versions, hash))
}

/// Checks that `go` runs; the one-line error says how to get it.
fn check_go(go: &str) -> Result<String, Error> {
    match Command::new(go)
        .arg("version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        Ok(_) | Err(_) => Err(Error::FindGo),
    }
}

/// Returns the cached binaries, building whichever are missing. `progress` receives one line
/// per component built. Concurrent callers (several test binaries) serialise on a lock file.
pub fn ensure(progress: &mut dyn FnMut(&str)) -> Result<Binaries, Error> {
    ensure_in(&cache_root(), "go", progress)
}

/// [`ensure`] with the cache root and the `go` command given (tests use a missing one).
pub fn ensure_in(
    cache_root: &Path,
    go: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<Binaries, Error> {
    let source = controlplane_dir();
    let (v, hash) = cache_key(&source)?;
    let root = cache_root
        .join("controlplane")
        .join(format!("{}-{}-{}-{hash}", v.kubernetes, v.etcd, v.kwok));
    let bin = root.join("bin");
    let binaries = Binaries { dir: bin.clone() };
    let missing = |b: &Binaries| {
        COMPONENTS
            .iter()
            .filter(|c| !b.path(c.name).is_file())
            .count()
    };
    if missing(&binaries) == 0 {
        return Ok(binaries);
    }
    // Before anything is written: without Go nothing can be built, and nothing should change.
    let go_version = check_go(go)?;
    fs::create_dir_all(&bin).map_err(|source| Error::Io {
        context: format!("create {}", bin.display()),
        source,
    })?;
    let lock_path = root.join(".build.lock");
    let lock_file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|source| Error::Io {
            context: format!("open {}", lock_path.display()),
            source,
        })?;
    let _lock =
        Flock::lock(lock_file, FlockArg::LockExclusive).map_err(|(_, errno)| Error::Io {
            context: format!("lock {}", lock_path.display()),
            source: io::Error::from(errno),
        })?;
    // Another process may have finished the build while this one waited for the lock.
    if missing(&binaries) == 0 {
        return Ok(binaries);
    }
    progress(&format!(
        "control-plane binaries go to {} ({go_version})",
        bin.display()
    ));
    let log_path = root.join("build.log");
    for component in COMPONENTS
        .iter()
        .filter(|c| !binaries.path(c.name).is_file())
    {
        progress(&format!(
            "building {} (first run takes ~{} minutes on 2 cores; later runs reuse the cache)…",
            component.name, component.cold_minutes
        ));
        let started = Instant::now();
        build_one(
            go,
            component,
            &source.join(component.module),
            &bin,
            &log_path,
            &v,
        )?;
        progress(&format!(
            "built {} in {:.0}s",
            component.name,
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(binaries)
}

/// Names the way [`build_one`] builds (flags that change the output); part of the cache key.
const BUILD_RECIPE: &str = "trimpath; kubernetes version stamped by -ldflags -X (1)";

/// The Go packages whose link-time variables carry a Kubernetes binary's version (the ones the
/// upstream release build, `hack/lib/version.sh`, sets).
const K8S_VERSION_PACKAGES: [&str; 2] = [
    "k8s.io/component-base/version",
    "k8s.io/client-go/pkg/version",
];

/// `-ldflags` for a Kubernetes component built from module version `version` (`v1.36.3`).
///
/// `go build` of a module dependency leaves the version variables at their source defaults,
/// `v0.0.0-master+$Format:%H$`, which is not semver: `kubectl version` fails to parse the
/// server's `/version` and kube-apiserver's own compatibility-version logic falls back to a
/// built-in guess. The upstream release build stamps them at link time; so does this, from the
/// pinned module version. The commit and build date are fixed (there is no git checkout to read
/// them from, and a fixed date keeps the build reproducible), the tree is `clean` because the
/// sources are the module's, checked by `go.sum`.
pub fn k8s_version_ldflags(version: &str) -> Option<String> {
    let core = version.strip_prefix('v')?;
    let mut parts = core.split(['.', '-', '+']);
    let major = parts.next().filter(|p| p.parse::<u32>().is_ok())?;
    let minor = parts.next().filter(|p| p.parse::<u32>().is_ok())?;
    let mut flags = Vec::new();
    for package in K8S_VERSION_PACKAGES {
        for (var, value) in [
            ("gitVersion", version),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitCommit", ""),
            ("gitTreeState", "clean"),
            ("buildDate", "1970-01-01T00:00:00Z"),
        ] {
            flags.push(format!("-X {package}.{var}={value}"));
        }
    }
    Some(flags.join(" "))
}

fn build_one(
    go: &str,
    component: &Component,
    module_dir: &Path,
    bin: &Path,
    log_path: &Path,
    versions: &Versions,
) -> Result<(), Error> {
    let tmp = bin.join(format!(".{}.partial", component.name));
    let mut command = Command::new(go);
    command.args(["build", "-trimpath"]);
    if component.module == "kubernetes"
        && let Some(flags) = k8s_version_ldflags(&versions.kubernetes)
    {
        command.arg(format!("-ldflags={flags}"));
    }
    let out = command
        .arg("-o")
        .arg(&tmp)
        .arg(component.package)
        .current_dir(module_dir)
        // The repository is not a Go workspace; a GOWORK from the environment must not leak in.
        .env("GOWORK", "off")
        .stdin(Stdio::null())
        .output()
        .map_err(|_| Error::FindGo)?;
    if let Ok(mut log) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
    {
        let _ = writeln!(log, "== go build {} ({})", component.package, out.status);
        let _ = log.write_all(&out.stderr);
    }
    if !out.status.success() {
        return Err(Error::BuildComponent {
            component: component.name,
            status: out.status.to_string(),
            tail: tail_lines(&String::from_utf8_lossy(&out.stderr), 15),
        });
    }
    let dest = bin.join(component.name);
    fs::rename(&tmp, &dest).map_err(|source| Error::Io {
        context: format!("move build to {}", dest.display()),
        source,
    })
}

/// The last `n` lines of `text`, for error messages that quote a log.
pub(crate) fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_required_version_inline_and_in_block() {
        let go_mod = "module x\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes v1.36.3\n\nrequire (\n\tgo.etcd.io/etcd/server/v3 v3.6.16\n\tcel.dev/expr v0.25.1 // indirect\n)\n";
        assert_eq!(
            required_version(go_mod, "k8s.io/kubernetes").as_deref(),
            Some("v1.36.3")
        );
        assert_eq!(
            required_version(go_mod, "go.etcd.io/etcd/server/v3").as_deref(),
            Some("v3.6.16")
        );
        assert_eq!(required_version(go_mod, "sigs.k8s.io/kwok"), None);
    }

    #[test]
    fn cache_key_names_the_checked_in_pins() {
        let (versions, hash) = cache_key(&controlplane_dir()).expect("pins are readable");
        assert!(versions.kubernetes.starts_with("v1.36."), "{versions:?}");
        assert!(versions.etcd.starts_with("v3.6."), "{versions:?}");
        assert!(versions.kwok.starts_with("v0."), "{versions:?}");
        assert_eq!(hash.len(), 12);
    }

    #[test]
    fn missing_go_is_one_line_with_the_fix() {
        let cache = tempfile::tempdir().unwrap();
        let error = ensure_in(cache.path(), "go-is-not-installed-here", &mut |_| {}).unwrap_err();
        assert!(matches!(error, Error::FindGo), "{error}");
        let message = error.to_string();
        assert!(!message.contains('\n'), "{message}");
        assert!(message.contains("install Go"), "{message}");
    }

    #[test]
    fn kubernetes_builds_are_stamped_with_their_module_version() {
        let flags = k8s_version_ldflags("v1.36.3").unwrap();
        for want in [
            "-X k8s.io/component-base/version.gitVersion=v1.36.3",
            "-X k8s.io/component-base/version.gitMajor=1",
            "-X k8s.io/component-base/version.gitMinor=36",
            "-X k8s.io/client-go/pkg/version.gitVersion=v1.36.3",
            "-X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z",
        ] {
            assert!(flags.contains(want), "{want} in {flags}");
        }
        assert_eq!(
            k8s_version_ldflags("v1.37.0-rc.1").map(|f| f.contains("gitMinor=37 ")),
            Some(true)
        );
        assert_eq!(k8s_version_ldflags("1.36.3"), None);
        assert_eq!(k8s_version_ldflags("vX.Y"), None);
    }

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail_lines("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail_lines("a", 5), "a");
    }
}
