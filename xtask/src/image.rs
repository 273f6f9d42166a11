//! `cargo xtask image`: reproducible OCI image archives of the agent and the controller, built
//! without a container daemon.
//!
//! The binaries are built statically linked for `x86_64-unknown-linux-musl`: musl resolves host
//! names itself from `/etc/resolv.conf` and `/etc/hosts`, so a binary on an empty base still
//! resolves (the agent's HTTP probes, the OCI API's host names). A static glibc binary
//! (`-C target-feature=+crt-static`) would need glibc's NSS modules as shared libraries at run
//! time for `getaddrinfo`, which an empty image does not have.
//!
//! Each image is described by `deploy/images/<component>.Containerfile`, which podman or docker
//! can build too; this module reads the subset those files use (`FROM scratch`, `COPY [--chmod]
//! [--chown]`, `USER`, `ENV`, `LABEL`, `ENTRYPOINT`, `CMD`) and writes one layer, the image
//! config, the manifest and an OCI image layout, packed as a tar (`oci-archive`, what `podman
//! load` and `skopeo copy oci-archive:` read). Every tar has sorted entries, mtime 0, numeric
//! owners and no user names; gzip has no name and mtime 0; the config has no creation time. So
//! the same binaries and files give the same digests, on any machine.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use clap::Args;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

/// The musl target the images' binaries are built for.
pub const TARGET: &str = "x86_64-unknown-linux-musl";

#[derive(Args)]
pub struct ImageArgs {
    /// Which images: `agent`, `controller` (default: both).
    components: Vec<String>,
    /// Where the archives go (`<component>.oci.tar`).
    #[arg(long, env = "NODEKEEPER_IMAGE_OUT", default_value = "target/images")]
    out: PathBuf,
    /// The image tag recorded in the archive's index (`org.opencontainers.image.ref.name`).
    #[arg(long, env = "NODEKEEPER_IMAGE_TAG", default_value = "latest")]
    tag: String,
    /// Use this directory's `nodekeeper-agent` / `nodekeeper-controller` instead of building.
    #[arg(long, env = "NODEKEEPER_IMAGE_BINARIES")]
    binaries: Option<PathBuf>,
    /// Then run the suite's image tests on them (`tests/tests/images.rs`): podman loads each
    /// archive and runs it `--version`, and the agent as its DaemonSet says (host network,
    /// read-only root, its capabilities) until a controller certificate gets a report over
    /// mutual TLS on 127.0.0.1. Needs root; installs Debian's podman and runc when missing.
    #[arg(long, env = "NODEKEEPER_IMAGE_SMOKE")]
    smoke: bool,
}

/// The images, in the order `cargo xtask image` builds them.
pub const COMPONENTS: [&str; 2] = ["agent", "controller"];

/// The variable naming the directory of built archives (`<component>.oci.tar`) that the image
/// tests (`tests/tests/images.rs`, `tests/tests/install_cleanup.rs`) load into podman.
pub const TEST_IMAGES_ENV: &str = "NODEKEEPER_TEST_IMAGES";

// The archives' paths and digests are this command's output.
#[allow(clippy::print_stdout)]
pub fn run(args: ImageArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    let components: Vec<String> = if args.components.is_empty() {
        COMPONENTS.iter().map(|c| (*c).to_owned()).collect()
    } else {
        args.components.clone()
    };
    let out = root.join(&args.out);
    for image in build_all(&components, &out, &args.tag, args.binaries.as_deref())? {
        println!("{image}");
    }
    if args.smoke {
        crate::deps::ensure(crate::deps::IMAGE_SMOKE)?;
        smoke(&root, &out, &components)?;
    }
    Ok(())
}

/// Builds `components`' binaries (or takes them from `binaries`) and writes
/// `<out>/<component>.oci.tar`, tagged `nodekeeper-<component>:<tag>`; one line per image.
pub fn build_all(
    components: &[String],
    out: &Path,
    tag: &str,
    binaries: Option<&Path>,
) -> anyhow::Result<Vec<String>> {
    let root = crate::codegen::repo_root();
    for c in components {
        if !COMPONENTS.contains(&c.as_str()) {
            bail!("unknown image `{c}`: choose agent or controller");
        }
    }
    let binaries: Vec<PathBuf> = match binaries {
        Some(dir) => components
            .iter()
            .map(|c| dir.join(format!("nodekeeper-{c}")))
            .collect(),
        None => build_static(&root, components)?,
    };
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let mut lines = Vec::new();
    for (component, binary) in components.iter().zip(&binaries) {
        check_static(binary)?;
        let name = format!("nodekeeper-{component}");
        let containerfile = root
            .join("deploy/images")
            .join(format!("{component}.Containerfile"));
        let context = Context {
            dir: root.join("deploy/images"),
            overrides: BTreeMap::from([(name.clone(), binary.clone())]),
        };
        let image = build(&containerfile, &context, &format!("{name}:{tag}"))?;
        let path = out.join(format!("{component}.oci.tar"));
        std::fs::write(&path, &image.archive)
            .with_context(|| format!("write {}", path.display()))?;
        lines.push(format!(
            "{name}: {} (manifest {}; layer {:.1} MiB compressed, {:.1} MiB unpacked)",
            path.display(),
            image.manifest_digest,
            image.layer_bytes as f64 / 1048576.0,
            image.unpacked_bytes as f64 / 1048576.0,
        ));
    }
    Ok(lines)
}

/// `--smoke`: the image tests of the suite (`tests/tests/images.rs`: podman loads the archives
/// and runs them as their manifests say) against the archives just built. The tests, not this
/// command, hold the podman code, so the suite and this command run the same thing.
fn smoke(root: &Path, out: &Path, components: &[String]) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = crate::cargo::command(&cargo);
    command
        .current_dir(root)
        .args(["test", "-p", "nodekeeper-e2e", "--test", "images", "--"]);
    // Only the chosen images' tests (their names start with the component).
    command.args(components);
    command.env(TEST_IMAGES_ENV, out);
    let status = command.status().context("run the image tests")?;
    if !status.success() {
        bail!("the image smoke test failed; see its output above");
    }
    Ok(())
}

/// What the musl build needs from Debian: a C compiler for musl (ring's C and assembly).
const BUILD_REQUIREMENTS: &[crate::deps::Requirement] = &[crate::deps::Requirement {
    command: "musl-gcc",
    package: Some("musl-tools"),
    why: "compiles ring's C and assembly for the musl target",
}];

/// Makes sure the Rust toolchain has the standard library for [`TARGET`]: adds it with rustup
/// when the toolchain is rustup's (a fresh machine, CI), and fails with the fix otherwise.
fn check_rust_target() -> anyhow::Result<()> {
    let has_target = || -> anyhow::Result<(bool, PathBuf)> {
        let out = std::process::Command::new("rustc")
            .args(["--print", "sysroot"])
            .output()
            .context("run rustc --print sysroot")?;
        let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Ok((sysroot.join("lib/rustlib").join(TARGET).is_dir(), sysroot))
    };
    let (present, sysroot) = has_target()?;
    if present {
        return Ok(());
    }
    eprintln!("xtask: the Rust toolchain has no standard library for {TARGET}; running `rustup target add {TARGET}`");
    let added = std::process::Command::new("rustup")
        .args(["target", "add", TARGET])
        .status()
        .is_ok_and(|s| s.success());
    if added && has_target()?.0 {
        return Ok(());
    }
    bail!(
        "the Rust toolchain at {} has no standard library for {TARGET} and `rustup target add {TARGET}` did not add it: install the target for this toolchain",
        sysroot.display()
    )
}

/// `cargo build --release --target x86_64-unknown-linux-musl` of the components' binaries.
fn build_static(root: &Path, components: &[String]) -> anyhow::Result<Vec<PathBuf>> {
    crate::deps::ensure(BUILD_REQUIREMENTS)?;
    check_rust_target()?;
    // Both binaries in one cargo run, whichever images are asked for: cargo unifies the
    // features of the packages it builds together, so the agent built alone links other
    // dependency builds than the agent built beside the controller (a different binary, and a
    // second set of musl artifacts in the target directory). Built together, `cargo xtask image
    // agent` and `cargo xtask image` give the same agent image, and their dependencies are
    // built once.
    let [agent, controller] = COMPONENTS.map(|c| format!("nodekeeper-{c}"));
    let args = [
        "build",
        "--release",
        "--target",
        TARGET,
        "-p",
        &agent,
        "--bin",
        &agent,
        "-p",
        &controller,
        "--bin",
        &controller,
    ];
    let built = crate::cargo::build_executables(root, &args, [agent.as_str(), controller.as_str()])
        .with_context(|| format!("build {agent} and {controller} for {TARGET}"))?;
    let found = components
        .iter()
        .map(|c| {
            let i = COMPONENTS
                .iter()
                .position(|k| k == c)
                .expect("checked by build_all");
            built[i].clone()
        })
        .collect();
    Ok(found)
}

/// Fails unless `binary` is an ELF executable without a program interpreter (statically linked:
/// it runs on an empty base).
pub fn check_static(binary: &Path) -> anyhow::Result<()> {
    let bytes = std::fs::read(binary).with_context(|| format!("read {}", binary.display()))?;
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        bail!("{} is not a 64-bit ELF executable", binary.display());
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap()) as usize;
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        if at + 4 > bytes.len() {
            bail!("{}: truncated program headers", binary.display());
        }
        // PT_INTERP: the binary needs a dynamic loader (ld.so) that an empty image lacks.
        if u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) == 3 {
            bail!(
                "{} is dynamically linked (it names a program interpreter): build it for {TARGET}",
                binary.display()
            );
        }
    }
    Ok(())
}

/// Where `COPY` sources come from: a directory, with some names taken from elsewhere (the
/// binaries, which live in cargo's target directory).
pub struct Context {
    pub dir: PathBuf,
    pub overrides: BTreeMap<String, PathBuf>,
}

impl Context {
    fn source(&self, name: &str) -> PathBuf {
        self.overrides
            .get(name)
            .cloned()
            .unwrap_or_else(|| self.dir.join(name))
    }
}

/// A built image.
pub struct Image {
    /// The OCI image layout as one tar.
    pub archive: Vec<u8>,
    pub manifest_digest: String,
    pub layer_bytes: usize,
    pub unpacked_bytes: usize,
}

/// One file of the layer.
struct File {
    mode: u32,
    uid: u64,
    gid: u64,
    bytes: Vec<u8>,
}

/// The image config fields a Containerfile sets.
#[derive(Default)]
struct Config {
    user: Option<String>,
    env: Vec<String>,
    labels: BTreeMap<String, String>,
    entrypoint: Option<Value>,
    cmd: Option<Value>,
}

/// Builds the image `containerfile` describes, tagged `reference` in the archive's index.
pub fn build(containerfile: &Path, context: &Context, reference: &str) -> anyhow::Result<Image> {
    let text = std::fs::read_to_string(containerfile)
        .with_context(|| format!("read {}", containerfile.display()))?;
    let place = |n: usize| format!("{}:{}", containerfile.display(), n + 1);
    let mut files: BTreeMap<String, File> = BTreeMap::new();
    let mut config = Config::default();
    let mut from = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim();
        match instruction.to_ascii_uppercase().as_str() {
            "FROM" if rest == "scratch" => from = true,
            "FROM" => bail!(
                "{}: only `FROM scratch` is supported (the image is one static binary)",
                place(n)
            ),
            _ if !from => bail!("{}: the first instruction must be `FROM scratch`", place(n)),
            "COPY" => {
                let mut mode = None;
                let (mut uid, mut gid) = (0, 0);
                let mut words: Vec<&str> = Vec::new();
                for word in rest.split_whitespace() {
                    if let Some(m) = word.strip_prefix("--chmod=") {
                        mode = Some(u32::from_str_radix(m, 8).with_context(|| {
                            format!("{}: --chmod={m} is not an octal mode", place(n))
                        })?);
                    } else if let Some(owner) = word.strip_prefix("--chown=") {
                        let (u, g) = owner.split_once(':').unwrap_or((owner, owner));
                        uid = u.parse().with_context(|| {
                            format!("{}: --chown needs numeric ids, not {owner}", place(n))
                        })?;
                        gid = g.parse().with_context(|| {
                            format!("{}: --chown needs numeric ids, not {owner}", place(n))
                        })?;
                    } else {
                        words.push(word);
                    }
                }
                let [source, dest] = words[..] else {
                    bail!("{}: COPY takes one source and one destination", place(n));
                };
                if !dest.starts_with('/') || dest.ends_with('/') {
                    bail!(
                        "{}: COPY's destination must be an absolute file path",
                        place(n)
                    );
                }
                let path = context.source(source);
                let bytes = std::fs::read(&path)
                    .with_context(|| format!("{}: read {}", place(n), path.display()))?;
                let mode = match mode {
                    Some(m) => m,
                    None => {
                        use std::os::unix::fs::PermissionsExt as _;
                        std::fs::metadata(&path)?.permissions().mode() & 0o7777
                    }
                };
                files.insert(
                    dest.trim_start_matches('/').to_owned(),
                    File {
                        mode,
                        uid,
                        gid,
                        bytes,
                    },
                );
            }
            "USER" => config.user = Some(rest.to_owned()),
            "ENV" => {
                let (k, v) = rest
                    .split_once('=')
                    .with_context(|| format!("{}: ENV takes KEY=value", place(n)))?;
                config.env.push(format!("{k}={v}"));
            }
            "LABEL" => {
                let (k, v) = rest
                    .split_once('=')
                    .with_context(|| format!("{}: LABEL takes key=\"value\"", place(n)))?;
                config
                    .labels
                    .insert(k.to_owned(), v.trim_matches('"').to_owned());
            }
            "ENTRYPOINT" | "CMD" => {
                let value: Value = serde_json::from_str(rest).with_context(|| {
                    format!("{}: {instruction} takes a JSON array (exec form)", place(n))
                })?;
                if instruction.eq_ignore_ascii_case("ENTRYPOINT") {
                    config.entrypoint = Some(value);
                } else {
                    config.cmd = Some(value);
                }
            }
            other => bail!(
                "{}: `{other}` is not supported by `cargo xtask image` (FROM scratch, COPY, USER, ENV, LABEL, ENTRYPOINT, CMD)",
                place(n)
            ),
        }
    }
    if files.is_empty() {
        bail!(
            "{}: no COPY: the image would be empty",
            containerfile.display()
        );
    }
    pack(&files, &config, reference)
}

/// Tar entries by path: (mode, uid, gid, content; `None` for a directory).
type Entries<'a> = BTreeMap<String, (u32, u64, u64, Option<&'a [u8]>)>;

/// A tar of `entries` (path → (mode, uid, gid, content; `None` for a directory)) in path
/// order, with every varying header field fixed.
fn tar(entries: &Entries<'_>) -> anyhow::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, (mode, uid, gid, bytes)) in entries {
        let mut header = tar::Header::new_ustar();
        header.set_mode(*mode);
        header.set_uid(*uid);
        header.set_gid(*gid);
        header.set_mtime(0);
        match bytes {
            Some(bytes) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(bytes.len() as u64);
                builder.append_data(&mut header, path, *bytes)?;
            }
            None => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                builder.append_data(&mut header, format!("{path}/"), std::io::empty())?;
            }
        }
    }
    Ok(builder.into_inner()?)
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn pack(files: &BTreeMap<String, File>, config: &Config, reference: &str) -> anyhow::Result<Image> {
    // The layer: every parent directory (root-owned, 0755), then the files, sorted by path.
    let mut entries: Entries<'_> = BTreeMap::new();
    for (path, file) in files {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            entries.insert(dir.to_string_lossy().into_owned(), (0o755, 0, 0, None));
            parent = dir.parent();
        }
        entries.insert(
            path.clone(),
            (file.mode, file.uid, file.gid, Some(file.bytes.as_slice())),
        );
    }
    let layer = tar(&entries)?;
    let diff_id = sha256(&layer);
    let mut gz = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::best());
    gz.write_all(&layer)?;
    let layer_gz = gz.finish()?;

    let mut container_config = json!({ "Env": config.env, "Labels": config.labels });
    if let Some(user) = &config.user {
        container_config["User"] = user.clone().into();
    }
    if let Some(entrypoint) = &config.entrypoint {
        container_config["Entrypoint"] = entrypoint.clone();
    }
    if let Some(cmd) = &config.cmd {
        container_config["Cmd"] = cmd.clone();
    }
    let image_config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": container_config,
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
        "history": [{ "created_by": "cargo xtask image" }],
    }))?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha256(&image_config),
            "size": image_config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": sha256(&layer_gz),
            "size": layer_gz.len(),
        }],
    }))?;
    let manifest_digest = sha256(&manifest);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "annotations": { "org.opencontainers.image.ref.name": reference },
        }],
    }))?;
    let layout = br#"{"imageLayoutVersion":"1.0.0"}"#;

    let blob = |bytes: &[u8]| format!("blobs/sha256/{}", &sha256(bytes)["sha256:".len()..]);
    let mut archive: Entries<'_> = BTreeMap::new();
    archive.insert("blobs".into(), (0o755, 0, 0, None));
    archive.insert("blobs/sha256".into(), (0o755, 0, 0, None));
    for bytes in [&layer_gz[..], &image_config[..], &manifest[..]] {
        archive.insert(blob(bytes), (0o644, 0, 0, Some(bytes)));
    }
    archive.insert("index.json".into(), (0o644, 0, 0, Some(&index)));
    archive.insert("oci-layout".into(), (0o644, 0, 0, Some(layout)));
    Ok(Image {
        archive: tar(&archive)?,
        manifest_digest,
        layer_bytes: layer_gz.len(),
        unpacked_bytes: files.values().map(|f| f.bytes.len()).sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A context with a fake binary of `content` beside the real passwd/group files.
    fn context(dir: &Path, content: &[u8]) -> Context {
        let binary = dir.join("nodekeeper-agent");
        std::fs::write(&binary, content).unwrap();
        Context {
            dir: crate::codegen::repo_root().join("deploy/images"),
            overrides: BTreeMap::from([("nodekeeper-agent".into(), binary)]),
        }
    }

    fn agent_containerfile() -> PathBuf {
        crate::codegen::repo_root().join("deploy/images/agent.Containerfile")
    }

    #[test]
    fn same_inputs_give_the_same_digest_and_bytes() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let first = build(&agent_containerfile(), &context(a.path(), b"binary"), "x:1").unwrap();
        // Another directory, another file mtime, a later run: nothing of that may leak in.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let second = build(&agent_containerfile(), &context(b.path(), b"binary"), "x:1").unwrap();
        assert_eq!(first.manifest_digest, second.manifest_digest);
        assert!(first.archive == second.archive, "archives differ");
        // A different binary is a different image.
        let third = build(
            &agent_containerfile(),
            &context(b.path(), b"binary2"),
            "x:1",
        )
        .unwrap();
        assert_ne!(first.manifest_digest, third.manifest_digest);
    }

    #[test]
    fn the_archive_is_an_oci_layout_whose_digests_check_out() {
        let dir = tempfile::tempdir().unwrap();
        let image = build(
            &agent_containerfile(),
            &context(dir.path(), b"\x7fELF"),
            "a:b",
        )
        .unwrap();
        let mut archive = tar::Archive::new(&image.archive[..]);
        let mut blobs = BTreeMap::new();
        let mut names = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().to_string_lossy().into_owned();
            assert_eq!(entry.header().mtime().unwrap(), 0, "{name}");
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
            names.push(name.clone());
            blobs.insert(name, bytes);
        }
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "entries are sorted");
        for (name, bytes) in &blobs {
            if let Some(hex) = name.strip_prefix("blobs/sha256/").filter(|h| !h.is_empty()) {
                assert_eq!(sha256(bytes), format!("sha256:{hex}"), "{name}");
            }
        }
        let index: Value = serde_json::from_slice(&blobs["index.json"]).unwrap();
        assert_eq!(index["manifests"][0]["digest"], image.manifest_digest);
        assert_eq!(
            index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
            "a:b"
        );
        let manifest_blob = format!("blobs/sha256/{}", &image.manifest_digest[7..]);
        let manifest: Value = serde_json::from_slice(&blobs[&manifest_blob]).unwrap();
        let config_blob = format!(
            "blobs/sha256/{}",
            &manifest["config"]["digest"].as_str().unwrap()[7..]
        );
        let config: Value = serde_json::from_slice(&blobs[&config_blob]).unwrap();
        assert_eq!(config["config"]["User"], "0:0");
        assert_eq!(
            config["config"]["Entrypoint"],
            json!(["/usr/local/bin/nodekeeper-agent"])
        );
        // The layer unpacks to the Containerfile's files, the binary executable.
        let layer_blob = format!(
            "blobs/sha256/{}",
            &manifest["layers"][0]["digest"].as_str().unwrap()[7..]
        );
        let layer = flate2::read::GzDecoder::new(&blobs[&layer_blob][..]);
        let mut files = BTreeMap::new();
        for entry in tar::Archive::new(layer).entries().unwrap() {
            let entry = entry.unwrap();
            let header = entry.header();
            files.insert(
                entry.path().unwrap().to_string_lossy().into_owned(),
                (header.mode().unwrap(), header.uid().unwrap()),
            );
        }
        assert_eq!(files["usr/local/bin/nodekeeper-agent"], (0o755, 0));
        assert_eq!(files["etc/passwd"], (0o644, 0));
        assert!(files.contains_key("usr/local/bin/"), "{files:?}");
    }

    #[test]
    fn unsupported_containerfiles_are_refused_naming_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.Containerfile");
        std::fs::write(&file, "FROM debian:12\nCOPY a /a\n").unwrap();
        let ctx = Context {
            dir: dir.path().into(),
            overrides: BTreeMap::new(),
        };
        let error = build(&file, &ctx, "x").err().unwrap().to_string();
        assert!(
            error.contains("x.Containerfile:1") && error.contains("FROM scratch"),
            "{error}"
        );
        std::fs::write(&file, "FROM scratch\nRUN true\n").unwrap();
        let error = build(&file, &ctx, "x").err().unwrap().to_string();
        assert!(error.contains(":2") && error.contains("RUN"), "{error}");
    }

    #[test]
    fn a_dynamic_binary_is_refused() {
        // This test binary is linked dynamically (the host target).
        let me = std::env::current_exe().unwrap();
        let error = check_static(&me).unwrap_err().to_string();
        assert!(error.contains("dynamically linked"), "{error}");
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("script");
        std::fs::write(&text, "#!/bin/sh\n").unwrap();
        assert!(
            check_static(&text)
                .unwrap_err()
                .to_string()
                .contains("not a 64-bit ELF")
        );
    }
}
