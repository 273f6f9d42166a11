//! Running the project's images the way a kubelet would run them from `deploy/`: podman, the
//! archives `cargo xtask test` builds (`NODEKEEPER_TEST_IMAGES`), and a container made from a
//! manifest's Pod template — its securityContext, env (fieldRefs resolved as the kubelet
//! resolves them), volume mounts, resource limit, host network, and a ServiceAccount's projected
//! token with the cluster CA and `KUBERNETES_SERVICE_HOST/PORT`.
// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use serde_json::Value;

/// The directory of `<component>.oci.tar` archives (set by `cargo xtask test`).
pub const IMAGES_ENV: &str = "NODEKEEPER_TEST_IMAGES";
/// Why `cargo xtask test` could not build them.
const IMAGES_FAILED_ENV: &str = "NODEKEEPER_TEST_IMAGES_FAILED";

/// Where a ServiceAccount token volume is mounted in every container of a Pod.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The archive of `component` (`agent`, `controller`) the suite built. Fails (the caller has
/// already skipped when not root) when there is none: the test must not pass without the image.
pub fn archive(component: &str) -> anyhow::Result<PathBuf> {
    if let Ok(why) = std::env::var(IMAGES_FAILED_ENV) {
        bail!("`cargo xtask test` could not build the images: {why}");
    }
    let dir = std::env::var_os(IMAGES_ENV).with_context(|| {
        format!(
            "{IMAGES_ENV} is not set: `cargo xtask test` builds the images and sets it \
             (alone: `cargo xtask image --out DIR`, then {IMAGES_ENV}=DIR)"
        )
    })?;
    let path = Path::new(&dir).join(format!("{component}.oci.tar"));
    if !path.is_file() {
        bail!(
            "{} is missing: `cargo xtask image {component} --out {}` builds it",
            path.display(),
            Path::new(&dir).display()
        );
    }
    Ok(path)
}

/// Fails unless the Pod template's first container runs image `name` (any tag): the manifest
/// and the archive the test loads are the same component.
pub fn ensure_image(pod: &Value, name: &str) -> anyhow::Result<()> {
    let image = &pod["containers"][0]["image"];
    if !image
        .as_str()
        .is_some_and(|i| i.starts_with(&format!("{name}:")))
    {
        bail!("the manifest runs {image}, not {name}");
    }
    Ok(())
}

/// Runs `podman args…`: its stdout, or an error with its output.
pub fn podman(args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new("podman")
        .args(args)
        .output()
        .context(
            "run podman (Debian's `podman` package; `cargo xtask test` installs it as root)",
        )?;
    if !out.status.success() {
        bail!(
            "podman {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Copies the archive of `component` into podman's storage; its image ID. Containers are run by
/// ID, not by tag: another run on this machine may load another build under the same tag.
pub fn load(component: &str) -> anyhow::Result<String> {
    let archive = archive(component)?;
    let id = podman(&["pull", "-q", &format!("oci-archive:{}", archive.display())])?;
    let id = id.trim().lines().last().unwrap_or_default().to_owned();
    if id.is_empty() {
        bail!("podman pull of {} printed no image ID", archive.display());
    }
    Ok(id)
}

/// Whether this host mounts cgroups in hybrid mode: v1 controllers under a tmpfs
/// `/sys/fs/cgroup` with a cgroup2 tree at `/sys/fs/cgroup/unified` (crun refuses that).
fn cgroups_hybrid() -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let fs_at = |dir: &str| {
        // The last mount at a path is the one in effect.
        mounts.lines().rev().find_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, fs) = (f.next()?, f.next()?, f.next()?);
            (at == dir).then(|| fs.to_owned())
        })
    };
    fs_at("/sys/fs/cgroup").as_deref() != Some("cgroup2")
        && fs_at("/sys/fs/cgroup/unified").as_deref() == Some("cgroup2")
}

/// The hard limit on the `/proc/self/limits` line named `name` (1024 when unreadable;
/// "unlimited" as u64::MAX).
fn hard_limit(limits: &str, name: &str) -> u64 {
    limits
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().nth(1))
        .map_or(1024, |v| v.parse().unwrap_or(u64::MAX))
}

/// `podman run` with what this host needs around the container's own arguments: runc where the
/// cgroups are hybrid, and open-file and process limits at or below our own hard limits —
/// podman's defaults (1,048,576 open files; the host's process limit) are above what a
/// sandboxed root may set, and the runtime then fails before the image starts
/// (`setrlimit RLIMIT_NOFILE: Operation not permitted`). Neither image needs more.
pub fn podman_run(args: &[String]) -> anyhow::Result<String> {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let nofile = hard_limit(&limits, "Max open files").min(16_384);
    let nproc = hard_limit(&limits, "Max processes").min(4_096);
    let mut all: Vec<String> = Vec::new();
    if cgroups_hybrid() {
        all.extend(["--runtime".into(), "runc".into()]);
    }
    all.extend([
        "run".into(),
        "--ulimit".into(),
        format!("nofile={nofile}:{nofile}"),
        "--ulimit".into(),
        format!("nproc={nproc}:{nproc}"),
    ]);
    all.extend(args.iter().cloned());
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    podman(&all)
}

/// A container podman runs by name; removed (with `podman rm -f`) when dropped.
pub struct Container {
    pub name: String,
}

impl Container {
    /// Its log so far (stdout and stderr).
    pub fn logs(&self) -> String {
        std::process::Command::new("podman")
            .args(["logs", &self.name])
            .output()
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_default()
    }

    /// Waits for it to exit: its exit code.
    pub fn wait(&self) -> anyhow::Result<i32> {
        let code = podman(&["wait", &self.name])?;
        code.trim()
            .parse()
            .with_context(|| format!("podman wait {} printed {code:?}", self.name))
    }

    /// Whether it is still running.
    pub fn running(&self) -> bool {
        podman(&["inspect", "--format", "{{.State.Running}}", &self.name])
            .is_ok_and(|s| s.trim() == "true")
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "-f", "-t", "2", &self.name]);
    }
}

/// A Pod's view of one container, as a kubelet would give it: what the manifest leaves to the
/// node (the values of fieldRefs, the host directories of volumes, a network) supplied by the
/// test.
pub struct PodRun<'a> {
    /// The Pod template's `spec`.
    pub pod: &'a Value,
    /// The image ID (from [`load`]).
    pub image: &'a str,
    /// fieldRef paths (`metadata.namespace`, `spec.nodeName`, `status.hostIP`) and their values.
    pub fields: BTreeMap<&'a str, String>,
    /// Host directories for volumes by name: secret volumes and `DirectoryOrCreate` hostPaths
    /// (which the test must not create on the host) need one; other hostPaths are mounted as
    /// they are.
    pub volumes: BTreeMap<&'a str, PathBuf>,
    /// Env values the test replaces (a listen address on 127.0.0.1 instead of every interface),
    /// each named in the test.
    pub env_overrides: BTreeMap<&'a str, String>,
    /// Instead of the Pod's network (`hostNetwork` → the host's): e.g. `ns:/run/netns/<name>`.
    pub network: Option<String>,
    /// The ServiceAccount token volume (from [`service_account_volume`]) and the API server's
    /// `(host, port)`, for a Pod that mounts its ServiceAccount's token.
    pub service_account: Option<(PathBuf, (String, u16))>,
}

/// `$(VAR)` in `value` replaced by an earlier variable of the container, as the kubelet does.
fn expand(value: &str, env: &[(String, String)]) -> String {
    let mut out = value.to_owned();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

impl PodRun<'_> {
    /// The `podman run` arguments for the Pod's first container, detached, named `name`.
    pub fn args(&self, name: &str) -> anyhow::Result<Vec<String>> {
        let container = &self.pod["containers"][0];
        let cname = container["name"].as_str().unwrap_or("container");
        let mut args: Vec<String> = vec!["-d".into(), "--name".into(), name.into()];
        match &self.network {
            Some(network) => args.push(format!("--network={network}")),
            None if self.pod["hostNetwork"] == true => args.push("--network=host".into()),
            // A Pod network of its own: podman's default bridge would reach only this host.
            None => {
                bail!("container {cname}: the Pod has no hostNetwork and the test gave no network")
            }
        }

        // securityContext: the container's, over the Pod's.
        let pod_sc = &self.pod["securityContext"];
        let sc = &container["securityContext"];
        let field = |k: &str| {
            if sc[k].is_null() {
                pod_sc[k].clone()
            } else {
                sc[k].clone()
            }
        };
        if let Some(uid) = field("runAsUser").as_u64() {
            args.push(format!("--user={uid}"));
            if field("runAsNonRoot") == true && uid == 0 {
                bail!("container {cname}: runAsNonRoot with runAsUser 0 (the kubelet refuses it)");
            }
        } else if field("runAsNonRoot") == true {
            bail!("container {cname}: runAsNonRoot without runAsUser: name the uid");
        }
        if field("readOnlyRootFilesystem") == true {
            // Without podman's own tmpfs on /tmp and /run: a kubelet adds none.
            args.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
        }
        if field("allowPrivilegeEscalation") == false {
            args.push("--security-opt=no-new-privileges".into());
        }
        if field("privileged") == true {
            args.push("--privileged".into());
        }
        for cap in sc["capabilities"]["drop"].as_array().into_iter().flatten() {
            args.push(format!("--cap-drop={}", cap.as_str().unwrap_or_default()));
        }
        for cap in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            args.push(format!("--cap-add={}", cap.as_str().unwrap_or_default()));
        }
        // seccompProfile RuntimeDefault is podman's default profile: nothing to add.
        if let Some(memory) = container["resources"]["limits"]["memory"].as_str() {
            let bytes = memory
                .strip_suffix("Mi")
                .and_then(|m| m.parse::<u64>().ok())
                .with_context(|| format!("container {cname}: memory limit {memory} (want NMi)"))?;
            args.push(format!("--memory={bytes}m"));
        }

        // env, in order, fieldRefs from the node's values, `$(VAR)` expanded.
        let mut env: Vec<(String, String)> = Vec::new();
        for e in container["env"].as_array().into_iter().flatten() {
            let key = e["name"].as_str().context("env entry without a name")?;
            let value = if let Some(v) = e["value"].as_str() {
                expand(v, &env)
            } else if let Some(path) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                self.fields.get(path).cloned().with_context(|| {
                    format!("env {key}: the test gave no value for fieldRef {path}")
                })?
            } else {
                bail!("env {key}: neither value nor fieldRef");
            };
            env.push((key.to_owned(), value));
        }
        for (key, value) in &self.env_overrides {
            match env.iter_mut().find(|(k, _)| k == key) {
                Some(e) => e.1 = value.clone(),
                None => bail!("override of env {key}, which the manifest does not set"),
            }
        }
        if let Some((_, (host, port))) = &self.service_account {
            env.push(("KUBERNETES_SERVICE_HOST".into(), host.clone()));
            env.push(("KUBERNETES_SERVICE_PORT".into(), port.to_string()));
        }
        for (k, v) in &env {
            args.extend(["-e".into(), format!("{k}={v}")]);
        }

        // Volumes.
        let volumes: BTreeMap<&str, &Value> = self.pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| Some((v["name"].as_str()?, v)))
            .collect();
        for m in container["volumeMounts"].as_array().into_iter().flatten() {
            let vname = m["name"].as_str().context("volumeMount without a name")?;
            let at = m["mountPath"]
                .as_str()
                .context("volumeMount without a path")?;
            let volume = volumes
                .get(vname)
                .with_context(|| format!("volumeMount {vname}: no such volume"))?;
            let source = match self.volumes.get(vname) {
                Some(dir) => dir.clone(),
                None => match volume["hostPath"]["type"].as_str() {
                    Some("Directory" | "CharDevice" | "File") => {
                        PathBuf::from(volume["hostPath"]["path"].as_str().unwrap_or_default())
                    }
                    _ => bail!(
                        "volume {vname}: the test gave no directory (a kubelet would create or project it)"
                    ),
                },
            };
            let mut options = vec![if m["readOnly"] == true { "ro" } else { "rw" }];
            if m["mountPropagation"] == "HostToContainer" {
                options.push("rslave");
            }
            args.extend([
                "-v".into(),
                format!("{}:{at}:{}", source.display(), options.join(",")),
            ]);
        }
        if let Some((dir, _)) = &self.service_account {
            if self.pod["automountServiceAccountToken"] == false {
                bail!("the Pod does not mount its ServiceAccount's token");
            }
            args.extend([
                "-v".into(),
                format!("{}:{SERVICE_ACCOUNT_DIR}:ro", dir.display()),
            ]);
        }

        if let Some(command) = container["command"].as_array() {
            args.push(format!("--entrypoint={}", Value::Array(command.clone())));
        }
        args.push(self.image.to_owned());
        for a in container["args"].as_array().into_iter().flatten() {
            args.push(expand(a.as_str().unwrap_or_default(), &env));
        }
        Ok(args)
    }

    /// Starts the container, detached, under a unique name.
    pub fn start(&self, prefix: &str) -> anyhow::Result<Container> {
        let name = nodekeeper_e2e::unique_name(prefix);
        let args = self.args(&name)?;
        let container = Container { name };
        podman_run(&args)?;
        Ok(container)
    }
}

/// The projected token volume a kubelet gives a Pod of ServiceAccount `namespace/account`, in
/// `dir`: `token` (from the TokenRequest API), `ca.crt` (the `kube-root-ca.crt` ConfigMap that
/// kube-controller-manager publishes in every namespace) and `namespace`; world-readable, as
/// the kubelet's defaultMode 0644, so a non-root container user reads them.
pub async fn service_account_volume(
    client: &kube::Client,
    namespace: &str,
    account: &str,
    dir: &Path,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let token = nodekeeper_e2e::install::service_account_token(
        client,
        namespace,
        account,
        std::time::Duration::from_secs(3607),
    )
    .await?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let ca = nodekeeper_e2e::wait_for(
        "kube-root-ca.crt in the namespace",
        std::time::Duration::from_secs(60),
        || {
            let maps = maps.clone();
            async move {
                Ok(maps
                    .get_opt("kube-root-ca.crt")
                    .await?
                    .and_then(|m| m.data?.get("ca.crt").cloned()))
            }
        },
    )
    .await?;
    std::fs::create_dir_all(dir)?;
    for (file, content) in [
        ("token", token),
        ("ca.crt", ca),
        ("namespace", namespace.to_owned()),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, content)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
    }
    world_readable(dir)?;
    Ok(())
}

/// Makes `dir` and its parents up to the temporary directory traversable by any user (a
/// `tempdir` is 0700; the container's user is not its owner).
pub fn world_readable(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = std::env::temp_dir();
    let mut at = Some(dir);
    while let Some(d) = at.filter(|d| d.starts_with(&tmp) && *d != tmp) {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        at = d.parent();
    }
    Ok(())
}

/// The API server's `(host, port)` from an admin kubeconfig's first cluster.
pub fn api_server(kubeconfig: &Path) -> anyhow::Result<(String, u16)> {
    let config: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(kubeconfig)?)?;
    let server = config["clusters"][0]["cluster"]["server"]
        .as_str()
        .context("the kubeconfig names no server")?;
    let uri: http::Uri = server.parse()?;
    Ok((
        uri.host().context("server without a host")?.to_owned(),
        uri.port_u16().unwrap_or(443),
    ))
}

#[test]
fn hard_limits_are_read_from_proc_self_limits() {
    let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                  Max processes             96364                96364                processes\n\
                  Max open files            20000                40000                files\n\
                  Max locked memory         unlimited            unlimited            bytes\n";
    assert_eq!(hard_limit(limits, "Max open files"), 40_000);
    assert_eq!(hard_limit(limits, "Max processes"), 96_364);
    assert_eq!(hard_limit(limits, "Max locked memory"), u64::MAX);
    assert_eq!(hard_limit(limits, "Max nice priority"), 1024);
}
