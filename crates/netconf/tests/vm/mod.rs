//! Boots a Debian kernel under qemu with a throw-away initramfs holding one host binary, for the
//! tests this machine's kernel cannot host (802.1Q VLANs). Shared by `cargo xtask vm` (through
//! `#[path]`), `crates/netconf/tests/vlan_vm.rs` and
//! `tests/tests/node_network_config_bare_metal.rs`, so there is exactly one implementation.
//! [`run_in_vm`] boots a VM without a network and waits for its verdict; [`start_in_vm`] returns
//! while it runs, with virtio NICs and loopback-only forwards ([`VmOptions`]) when asked.
//!
//! Only `std` and `anyhow` are used here because every including crate has them.

// Each including crate uses a different subset of these functions.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

/// The Debian metapackage that always depends on the current versioned kernel image.
pub const KERNEL_METAPACKAGE: &str = "linux-image-amd64";

/// Modules the VLAN tests need in the guest; their dependencies are found from the modules'
/// own `.modinfo` sections. `dummy` and `veth` stand in for the physical NIC, `macvlan` carries
/// the VNIC's MAC, `8021q` is the point of the exercise; `virtio_pci` and `virtio_net` drive the
/// PCI NICs of a VM started with [`VmOptions::nics`] (physical NICs with a PCI address, and the
/// user-mode network the host reaches the guest through).
pub const WANTED_MODULES: &[&str] = &[
    "8021q",
    "macvlan",
    "dummy",
    "veth",
    "virtio_pci",
    "virtio_net",
];

/// Written next to `modules.load`: the [`WANTED_MODULES`] a cached kernel was unpacked for, so a
/// cache made for a shorter list is unpacked again instead of booting without a module.
const WANTED_FILE: &str = "modules.wanted";

fn wanted_line() -> String {
    WANTED_MODULES.join(" ")
}

/// Whether `dir` holds a kernel unpacked for today's [`WANTED_MODULES`].
fn unpacked_for_wanted(dir: &Path) -> bool {
    dir.join("modules.load").is_file()
        && fs::read_to_string(dir.join(WANTED_FILE)).is_ok_and(|w| w.trim() == wanted_line())
}

/// Printed by `/init` after the guest program exits; the host looks for it on the console.
pub const VERDICT_PREFIX: &str = "NODEKEEPER-VM-VERDICT:";

/// Set in the guest program's environment, so a test binary knows it runs inside the VM.
pub const GUEST_ENV: &str = "NODEKEEPER_VM_GUEST";

/// The one-line fix printed when qemu is missing.
pub const QEMU_FIX: &str = "apt-get install -y --no-install-recommends qemu-system-x86";
/// The one-line fix printed when busybox is missing.
pub const BUSYBOX_FIX: &str = "apt-get install -y busybox-static";

/// A Debian kernel unpacked in the cache: the image and the modules the guest loads.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// Versioned package name, e.g. `linux-image-6.1.0-56-amd64`.
    pub package: String,
    /// The kernel image (`vmlinuz`).
    pub vmlinuz: PathBuf,
    /// Uncompressed `.ko` files, in the order they must be loaded (dependencies first).
    pub modules: Vec<PathBuf>,
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/vm`: outside the repository, shared by runs.
pub fn cache_dir() -> Result<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME")
                .ok_or_else(|| anyhow!("neither XDG_CACHE_HOME nor HOME is set"))?;
            PathBuf::from(home).join(".cache")
        }
    };
    Ok(base.join("nodekeeper").join("vm"))
}

/// Why the VM cannot run on this machine, if it cannot: the reason names the one-line fix.
pub fn missing_host_tool() -> Option<String> {
    if find_in_path("qemu-system-x86_64").is_none() {
        return Some(format!(
            "qemu-system-x86_64 is not installed; fix: {QEMU_FIX}"
        ));
    }
    if find_busybox().is_none() {
        return Some(format!("busybox is not installed; fix: {BUSYBOX_FIX}"));
    }
    None
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

pub fn find_busybox() -> Option<PathBuf> {
    // busybox-static installs /bin/busybox; /usr/bin is where a merged-/usr system puts it.
    ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .or_else(|| find_in_path("busybox"))
}

/// Returns the cached kernel, downloading and unpacking it first when the cache holds none
/// (or when `refresh` asks to resolve the metapackage again).
pub fn prepare_kernel(refresh: bool) -> Result<Kernel> {
    let cache = cache_dir()?;
    fs::create_dir_all(&cache).with_context(|| format!("create cache dir {}", cache.display()))?;
    if !refresh && let Some(kernel) = cached_kernel(&cache)? {
        return Ok(kernel);
    }
    let package = resolve_kernel_package(&cache)?;
    let dir = cache.join(&package);
    if unpacked_for_wanted(&dir) {
        fs::write(cache.join("current"), &package)?;
        return load_kernel(&dir, &package);
    }
    unpack_kernel(&cache, &package)?;
    fs::write(cache.join("current"), &package)?;
    load_kernel(&dir, &package)
}

fn cached_kernel(cache: &Path) -> Result<Option<Kernel>> {
    let Ok(package) = fs::read_to_string(cache.join("current")) else {
        return Ok(None);
    };
    let package = package.trim().to_owned();
    let dir = cache.join(&package);
    if !unpacked_for_wanted(&dir) {
        return Ok(None);
    }
    load_kernel(&dir, &package).map(Some)
}

fn load_kernel(dir: &Path, package: &str) -> Result<Kernel> {
    let order = fs::read_to_string(dir.join("modules.load"))?;
    let modules = order
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| dir.join("modules").join(l.trim()))
        .collect::<Vec<_>>();
    for module in &modules {
        ensure!(
            module.is_file(),
            "cached module {} is missing; rerun `cargo xtask vm --refresh`",
            module.display()
        );
    }
    let vmlinuz = dir.join("vmlinuz");
    ensure!(
        vmlinuz.is_file(),
        "cached kernel {} is missing; rerun `cargo xtask vm --refresh`",
        vmlinuz.display()
    );
    Ok(Kernel {
        package: package.to_owned(),
        vmlinuz,
        modules,
    })
}

/// Runs `apt-get download` in `dir`, refreshing the package lists once if apt does not know the
/// package yet (a fresh container has empty lists).
fn apt_download(dir: &Path, package: &str) -> Result<PathBuf> {
    let attempt = || -> Result<std::process::Output> {
        Command::new("apt-get")
            .args(["download", package])
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .context("run apt-get (is this a Debian system?)")
    };
    let mut out = attempt()?;
    if !out.status.success() {
        eprintln!("apt-get download {package} failed; running apt-get update once and retrying");
        let update = Command::new("apt-get")
            .args(["update", "-q"])
            .stdin(Stdio::null())
            .status()?;
        ensure!(update.success(), "apt-get update failed");
        out = attempt()?;
    }
    ensure!(
        out.status.success(),
        "apt-get download {package} failed ({}); fix: `apt-get update && cargo xtask vm` as root",
        String::from_utf8_lossy(&out.stderr)
            .trim()
            .replace('\n', " ")
    );
    let prefix = format!("{package}_");
    fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
        })
        .ok_or_else(|| {
            anyhow!(
                "apt-get download {package} succeeded but left no {prefix}*.deb in {}",
                dir.display()
            )
        })
}

fn deb_field(deb: &Path, field: &str) -> Result<String> {
    let out = Command::new("dpkg-deb")
        .arg("-f")
        .arg(deb)
        .arg(field)
        .output()
        .context("run dpkg-deb")?;
    ensure!(
        out.status.success(),
        "dpkg-deb -f {} {field} failed",
        deb.display()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// `linux-image-amd64` → the versioned `linux-image-<abi>-amd64` it depends on.
fn resolve_kernel_package(cache: &Path) -> Result<String> {
    let work = scratch_dir(cache, "resolve")?;
    let result = (|| {
        let meta = apt_download(&work, KERNEL_METAPACKAGE)?;
        let depends = deb_field(&meta, "Depends")?;
        parse_kernel_dependency(&depends).ok_or_else(|| {
            anyhow!("{KERNEL_METAPACKAGE} depends on no linux-image-* package (Depends: {depends})")
        })
    })();
    let _ = fs::remove_dir_all(&work);
    result
}

/// Picks the versioned image out of a Depends field such as
/// `linux-image-6.1.0-56-amd64 (= 6.1.192-2)`.
pub fn parse_kernel_dependency(depends: &str) -> Option<String> {
    depends
        .split([',', '|'])
        .map(|alt| alt.split_whitespace().next().unwrap_or(""))
        .find(|name| name.starts_with("linux-image-") && *name != KERNEL_METAPACKAGE)
        .map(str::to_owned)
}

fn scratch_dir(cache: &Path, what: &str) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let dir = cache.join(format!("tmp-{what}-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Downloads the versioned kernel package, keeps `vmlinuz` and the dependency closure of
/// [`WANTED_MODULES`], and drops the rest (the package unpacks to ~400 MB).
fn unpack_kernel(cache: &Path, package: &str) -> Result<()> {
    let work = scratch_dir(cache, "unpack")?;
    let result = (|| {
        eprintln!(
            "downloading {package} (about 70 MB) into {}",
            cache.display()
        );
        let deb = apt_download(&work, package)?;
        let root = work.join("root");
        let status = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&root)
            .status()?;
        ensure!(status.success(), "dpkg-deb -x {} failed", deb.display());

        let vmlinuz = only_entry(&root.join("boot"), "vmlinuz-")?;
        let modules_root = only_entry(&root.join("lib/modules"), "")
            .or_else(|_| only_entry(&root.join("usr/lib/modules"), ""))?;
        let index = ModuleIndex::scan(&modules_root)?;
        let order = index.load_order(WANTED_MODULES)?;

        let staged = work.join("staged");
        fs::create_dir_all(staged.join("modules"))?;
        fs::copy(&vmlinuz, staged.join("vmlinuz"))?;
        let mut load = String::new();
        for name in &order {
            let src = &index.files[name];
            let file = format!("{name}.ko");
            decompress_module(src, &staged.join("modules").join(&file))?;
            load.push_str(&file);
            load.push('\n');
        }
        fs::write(staged.join("modules.load"), load)?;
        fs::write(staged.join(WANTED_FILE), wanted_line())?;
        // Another run may have finished the same kernel meanwhile; its copy is as good as ours,
        // and replacing it could pull files from under a VM that is booting from it.
        let dest = cache.join(package);
        if !unpacked_for_wanted(&dest) {
            if dest.exists() {
                fs::remove_dir_all(&dest)?;
            }
            fs::rename(&staged, &dest)?;
        }
        eprintln!("cached {package}: vmlinuz and modules {}", order.join(" "));
        Ok(())
    })();
    let _ = fs::remove_dir_all(&work);
    result
}

fn only_entry(dir: &Path, prefix: &str) -> Result<PathBuf> {
    let mut found = fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect::<Vec<_>>();
    ensure!(
        found.len() == 1,
        "expected one {prefix}* in {}, found {found:?}",
        dir.display()
    );
    Ok(found.remove(0))
}

/// Busybox `insmod` takes plain `.ko` files; newer Debian kernels ship `.ko.xz`/`.ko.zst`.
fn decompress_module(src: &Path, dest: &Path) -> Result<()> {
    let name = src.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        Some("xz")
    } else if name.ends_with(".ko.zst") {
        Some("zstd")
    } else if name.ends_with(".ko.gz") {
        Some("gzip")
    } else {
        None
    };
    match tool {
        None => {
            fs::copy(src, dest)?;
        }
        Some(tool) => {
            let out = Command::new(tool)
                .args(["-d", "-c"])
                .arg(src)
                .output()
                .with_context(|| {
                    format!(
                        "run {tool} to decompress {} (install {tool})",
                        src.display()
                    )
                })?;
            ensure!(
                out.status.success(),
                "{tool} -d -c {} failed",
                src.display()
            );
            fs::write(dest, out.stdout)?;
        }
    }
    Ok(())
}

/// What the kernel package says about its modules: file by module name, dependencies, and which
/// names are built into the image (those need no loading).
struct ModuleIndex {
    files: BTreeMap<String, PathBuf>,
    builtin: BTreeSet<String>,
    root: PathBuf,
}

/// The kernel treats `-` and `_` in module names alike.
fn module_name(file_name: &str) -> Option<String> {
    let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .find_map(|ext| file_name.strip_suffix(ext))?;
    Some(stem.replace('-', "_"))
}

impl ModuleIndex {
    fn scan(root: &Path) -> Result<Self> {
        let mut files = BTreeMap::new();
        let mut stack = vec![root.join("kernel")];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
                let path = entry?.path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Some(name) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(module_name)
                {
                    files.insert(name, path);
                }
            }
        }
        let builtin = fs::read_to_string(root.join("modules.builtin"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.rsplit('/').next().and_then(module_name))
            .collect();
        Ok(Self {
            files,
            builtin,
            root: root.to_owned(),
        })
    }

    /// The `depends=` list from a module's `.modinfo` section — the same data `depmod` turns
    /// into `modules.dep`, which the package does not ship (its postinst generates it).
    fn depends(&self, name: &str) -> Result<Vec<String>> {
        let path = &self.files[name];
        let mut raw = Vec::new();
        fs::File::open(path)?.read_to_end(&mut raw)?;
        let object = if path.extension().is_some_and(|e| e == "ko") {
            raw
        } else {
            let tmp = self.root.join(format!(".{name}.ko"));
            decompress_module(path, &tmp)?;
            let data = fs::read(&tmp)?;
            fs::remove_file(&tmp)?;
            data
        };
        let modinfo = elf_section(&object, ".modinfo")
            .with_context(|| format!("read .modinfo of {}", path.display()))?;
        Ok(modinfo_depends(modinfo))
    }

    /// Dependencies first, each module once, built-in ones skipped.
    fn load_order(&self, wanted: &[&str]) -> Result<Vec<String>> {
        let mut order = Vec::new();
        let mut seen = BTreeSet::new();
        for name in wanted {
            self.visit(&name.replace('-', "_"), &mut seen, &mut order, 0)?;
        }
        Ok(order)
    }

    fn visit(
        &self,
        name: &str,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<String>,
        depth: usize,
    ) -> Result<()> {
        ensure!(
            depth < 32,
            "module dependency chain through {name} is too deep (a cycle?)"
        );
        if !seen.insert(name.to_owned()) || self.builtin.contains(name) {
            return Ok(());
        }
        ensure!(
            self.files.contains_key(name),
            "module {name} is neither built into the kernel nor shipped in the package"
        );
        for dep in self.depends(name)? {
            self.visit(&dep, seen, order, depth + 1)?;
        }
        order.push(name.to_owned());
        Ok(())
    }
}

/// Parses the NUL-separated `key=value` strings of `.modinfo` and returns `depends=`.
pub fn modinfo_depends(modinfo: &[u8]) -> Vec<String> {
    modinfo
        .split(|b| *b == 0)
        .filter_map(|entry| std::str::from_utf8(entry).ok())
        .filter_map(|entry| entry.strip_prefix("depends="))
        .flat_map(|list| list.split(','))
        .filter(|d| !d.is_empty())
        .map(|d| d.replace('-', "_"))
        .collect()
}

/// Returns the bytes of a named section of a little-endian ELF64 object.
pub fn elf_section<'a>(elf: &'a [u8], wanted: &str) -> Result<&'a [u8]> {
    let u16_at = |o: usize| -> Result<u64> {
        let b = elf.get(o..o + 2).ok_or_else(|| anyhow!("truncated ELF"))?;
        Ok(u64::from(u16::from_le_bytes([b[0], b[1]])))
    };
    let u32_at = |o: usize| -> Result<u64> {
        let b = elf.get(o..o + 4).ok_or_else(|| anyhow!("truncated ELF"))?;
        Ok(u64::from(u32::from_le_bytes(b.try_into()?)))
    };
    let u64_at = |o: usize| -> Result<u64> {
        let b = elf.get(o..o + 8).ok_or_else(|| anyhow!("truncated ELF"))?;
        Ok(u64::from_le_bytes(b.try_into()?))
    };
    ensure!(
        elf.starts_with(b"\x7fELF\x02\x01"),
        "not a little-endian ELF64 object"
    );
    let shoff = usize::try_from(u64_at(0x28)?)?;
    let shentsize = usize::try_from(u16_at(0x3a)?)?;
    let shnum = usize::try_from(u16_at(0x3c)?)?;
    let shstrndx = usize::try_from(u16_at(0x3e)?)?;
    let section = |i: usize| -> Result<(usize, usize, usize)> {
        let h = shoff + i * shentsize;
        Ok((
            usize::try_from(u32_at(h)?)?,
            usize::try_from(u64_at(h + 24)?)?,
            usize::try_from(u64_at(h + 32)?)?,
        ))
    };
    let (_, str_off, str_size) = section(shstrndx)?;
    let strtab = elf
        .get(str_off..str_off + str_size)
        .ok_or_else(|| anyhow!("truncated ELF string table"))?;
    for i in 0..shnum {
        let (name_off, off, size) = section(i)?;
        let name = strtab
            .get(name_off..)
            .and_then(|s| s.split(|b| *b == 0).next())
            .unwrap_or_default();
        if name == wanted.as_bytes() {
            return elf
                .get(off..off + size)
                .ok_or_else(|| anyhow!("truncated ELF section {wanted}"));
        }
    }
    bail!("no {wanted} section")
}

/// A newc ("070701") cpio archive, the format the kernel unpacks as an initramfs.
pub struct Cpio<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

impl<W: Write> Cpio<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            next_ino: 1,
        }
    }

    fn header(&mut self, name: &str, mode: u32, size: u64) -> Result<()> {
        let size = u32::try_from(size).context("initramfs member larger than 4 GiB")?;
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let namesize = name.len() + 1;
        // Fields: ino mode uid gid nlink mtime filesize devmajor devminor rdevmajor rdevminor namesize check.
        let head = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{size:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
            0, 0, 0, 0, 0, 0, 0, 0
        );
        self.raw(head.as_bytes())?;
        self.raw(name.as_bytes())?;
        self.raw(&[0])?;
        self.pad()
    }

    fn raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> Result<()> {
        let fill = (4 - (self.written % 4) as usize) % 4;
        self.raw(&[0; 3][..fill])
    }

    pub fn dir(&mut self, name: &str) -> Result<()> {
        self.header(name, 0o040755, 0)
    }

    pub fn symlink(&mut self, name: &str, target: &str) -> Result<()> {
        self.header(name, 0o120777, target.len() as u64)?;
        self.raw(target.as_bytes())?;
        self.pad()
    }

    pub fn bytes(&mut self, name: &str, mode: u32, data: &[u8]) -> Result<()> {
        self.header(name, 0o100000 | mode, data.len() as u64)?;
        self.raw(data)?;
        self.pad()
    }

    /// Streams a host file in; its content, not the link, when `source` is a symlink.
    pub fn file(&mut self, name: &str, mode: u32, source: &Path) -> Result<()> {
        let mut file =
            fs::File::open(source).with_context(|| format!("open {}", source.display()))?;
        let size = file.metadata()?.len();
        self.header(name, 0o100000 | mode, size)?;
        let copied = io::copy(&mut file, &mut self.out)?;
        ensure!(
            copied == size,
            "{} changed size while being copied",
            source.display()
        );
        self.written += copied;
        self.pad()
    }

    pub fn finish(mut self) -> Result<W> {
        self.header("TRAILER!!!", 0, 0)?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// The shared libraries (and the loader) `ldd` says `binary` needs, as absolute host paths.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // Static binaries make ldd exit non-zero with "not a dynamic executable".
        return Ok(Vec::new());
    }
    Ok(parse_ldd(&text))
}

/// `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` and `/lib64/ld-linux-x86-64.so.2 (0x…)`
/// give a path; `linux-vdso.so.1 (0x…)` is the kernel's and gives none.
pub fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Directories `name` needs in the archive, parents first, each emitted once.
fn ensure_parents<W: Write>(
    cpio: &mut Cpio<W>,
    made: &mut BTreeSet<String>,
    name: &str,
) -> Result<()> {
    let mut prefix = String::new();
    let parts: Vec<&str> = name.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        if !prefix.is_empty() {
            prefix.push('/');
        }
        prefix.push_str(part);
        if made.insert(prefix.clone()) {
            cpio.dir(&prefix)?;
        }
    }
    Ok(())
}

/// What the guest runs: a host binary (copied with its libraries) and its arguments.
#[derive(Debug, Clone)]
pub struct GuestProgram {
    pub binary: PathBuf,
    pub args: Vec<String>,
    /// Extra environment for the program (besides [`GUEST_ENV`]=1).
    pub env: Vec<(String, String)>,
}

/// The guest's `/init`: mount the pseudo filesystems, load the modules in order, bring up `lo`,
/// run the program, print the verdict, power off. Any failure before the program runs is a
/// verdict too, so the host never waits for a timeout to learn that the guest broke.
pub fn init_script(modules: &[String], program: &GuestProgram, library_dirs: &[String]) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut s = String::from("#!/bin/busybox sh\n");
    s.push_str("/bin/busybox --install -s /bin\n");
    s.push_str("export PATH=/bin\n");
    s.push_str("mkdir -p /proc /sys /dev /tmp /run\n");
    s.push_str(
        "mount -t proc proc /proc\nmount -t sysfs sysfs /sys\nmount -t devtmpfs devtmpfs /dev\n",
    );
    s.push_str(&format!(
        "fail() {{ echo \"{VERDICT_PREFIX} fail $1\"; poweroff -f; sleep 10; exit 1; }}\n"
    ));
    for module in modules {
        s.push_str(&format!(
            "insmod /lib/modules/{module} || fail 'insmod {module}'\n"
        ));
    }
    s.push_str("ip link set lo up || fail 'ip link set lo up'\n");
    s.push_str(&format!("export {GUEST_ENV}=1 HOME=/tmp TMPDIR=/tmp\n"));
    s.push_str(&format!(
        "export LD_LIBRARY_PATH={}\n",
        quote(&library_dirs.join(":"))
    ));
    for (key, value) in &program.env {
        s.push_str(&format!("export {key}={}\n", quote(value)));
    }
    let args = program
        .args
        .iter()
        .map(|a| quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    let path = quote(&format!("/guest/{}", program_file_name(program)));
    s.push_str(&format!("{path} {args}\n"));
    s.push_str(&format!("rc=$?\necho \"{VERDICT_PREFIX} exit $rc\"\n"));
    s.push_str("poweroff -f\nsleep 10\n");
    s
}

/// The program keeps its file name in the guest: multi-call binaries such as busybox choose what
/// to do by `argv[0]`.
fn program_file_name(program: &GuestProgram) -> String {
    program.binary.file_name().map_or_else(
        || "program".to_owned(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Writes the initramfs for one run: busybox, the kernel's modules, `program` with its libraries.
pub fn build_initramfs(kernel: &Kernel, program: &GuestProgram, out: &Path) -> Result<()> {
    build_initramfs_with(kernel, program, &[], out)
}

/// [`build_initramfs`] plus `extra` host binaries, each at `/guest/<file name>` with its
/// libraries (e.g. iproute2's `ip`, which busybox's applet does not replace: it has no `-j`).
pub fn build_initramfs_with(
    kernel: &Kernel,
    program: &GuestProgram,
    extra: &[PathBuf],
    out: &Path,
) -> Result<()> {
    let busybox =
        find_busybox().ok_or_else(|| anyhow!("busybox is not installed; fix: {BUSYBOX_FIX}"))?;
    let mut cpio = Cpio::new(io::BufWriter::with_capacity(
        1 << 20,
        fs::File::create(out)?,
    ));
    let mut made = BTreeSet::new();
    for dir in [
        "bin",
        "lib",
        "lib/modules",
        "guest",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
    ] {
        made.insert(dir.to_owned());
        cpio.dir(dir)?;
    }
    cpio.file("bin/busybox", 0o755, &busybox)?;
    let mut libs = shared_libraries(&busybox)?;

    let mut module_names = Vec::new();
    for module in &kernel.modules {
        let name = module
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| anyhow!("bad module path"))?;
        cpio.file(&format!("lib/modules/{name}"), 0o644, module)?;
        module_names.push(name.to_owned());
    }

    cpio.file(
        &format!("guest/{}", program_file_name(program)),
        0o755,
        &program.binary,
    )?;
    libs.extend(shared_libraries(&program.binary)?);
    for binary in extra {
        let name = binary
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| anyhow!("bad extra binary path {}", binary.display()))?;
        ensure!(
            name != program_file_name(program),
            "extra binary {name} has the guest program's name"
        );
        cpio.file(&format!("guest/{name}"), 0o755, binary)?;
        libs.extend(shared_libraries(binary)?);
    }
    let mut seen = BTreeSet::new();
    let mut library_dirs = Vec::new();
    for lib in libs {
        let name = lib.to_string_lossy().trim_start_matches('/').to_owned();
        if !seen.insert(name.clone()) {
            continue;
        }
        ensure_parents(&mut cpio, &mut made, &name)?;
        cpio.file(&name, 0o755, &lib)?;
        if let Some(parent) = lib.parent().map(|p| p.to_string_lossy().into_owned())
            && !library_dirs.contains(&parent)
        {
            library_dirs.push(parent);
        }
    }
    cpio.bytes(
        "init",
        0o755,
        init_script(&module_names, program, &library_dirs).as_bytes(),
    )?;
    cpio.finish()?;
    Ok(())
}

/// What came back from one boot.
#[derive(Debug)]
pub struct BootOutcome {
    /// The text after [`VERDICT_PREFIX`], e.g. `exit 0` or `fail insmod 8021q.ko`; `None` on timeout
    /// or when qemu exited without one.
    pub verdict: Option<String>,
    /// Everything the guest wrote to its serial console.
    pub console: String,
    /// From starting qemu to reading the verdict line.
    pub boot_to_verdict: Duration,
    /// Whether KVM was available (otherwise TCG software emulation).
    pub kvm: bool,
}

impl BootOutcome {
    /// The exit status the guest program reported, if it ran to the end.
    pub fn exit_code(&self) -> Option<i32> {
        self.verdict
            .as_deref()?
            .strip_prefix("exit ")?
            .trim()
            .parse()
            .ok()
    }
}

/// Whether to ask qemu for KVM. `/dev/kvm` can exist and open while the CPU does not offer
/// virtualisation to this (itself virtual) machine; KVM guests then hang right after the kernel
/// is decompressed. So KVM is used only when the CPU flags say so, and `NODEKEEPER_VM_ACCEL`
/// (`kvm` or `tcg`) overrides the guess.
pub fn kvm_usable() -> bool {
    match std::env::var("NODEKEEPER_VM_ACCEL").as_deref() {
        Ok("kvm") => return true,
        Ok("tcg") => return false,
        _ => {}
    }
    let cpu_offers_it = fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    });
    cpu_offers_it
        && fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok()
}

/// A NIC of the guest: a virtio-net PCI device (so the guest sees a physical NIC with a PCI
/// address) with a fixed MAC, on the bus in the order given.
#[derive(Debug, Clone)]
pub struct Nic {
    pub mac: String,
    pub backend: NicBackend,
}

/// What a [`Nic`] is plugged into.
#[derive(Debug, Clone)]
pub enum NicBackend {
    /// qemu's hub `n`: every NIC on the same hub shares one Ethernet wire (e.g. a physical NIC
    /// and, moved into a network namespace, what answers on its wire), and nothing else.
    Hub(u32),
    /// qemu's user-mode network (slirp, guest `10.0.2.15`, gateway `10.0.2.2`) with `restrict=on`:
    /// the guest reaches nothing outside the VM but the `guestfwd` targets, and the host reaches
    /// the guest only through the `hostfwd` ports, which listen on 127.0.0.1.
    User {
        /// `(host port on 127.0.0.1, guest TCP port)`.
        hostfwd: Vec<(u16, u16)>,
        /// `(guest address, guest port, host port on 127.0.0.1)`: a guest connection to the
        /// address is piped to the host's loopback port (through busybox `nc`, one per
        /// connection).
        guestfwd: Vec<(std::net::Ipv4Addr, u16, u16)>,
    },
}

/// How a VM is started beyond its kernel and program.
#[derive(Debug, Clone)]
pub struct VmOptions {
    /// Guest memory; the initramfs (the program included) is unpacked into it.
    pub memory_mib: u32,
    /// The guest's NICs, in PCI order; none by default.
    pub nics: Vec<Nic>,
    /// More host binaries copied to `/guest/` ([`build_initramfs_with`]).
    pub extra_binaries: Vec<PathBuf>,
}

impl Default for VmOptions {
    fn default() -> Self {
        Self {
            memory_mib: 512,
            nics: Vec::new(),
            extra_binaries: Vec::new(),
        }
    }
}

/// The qemu arguments for `nics` (always `-nic none` first, so qemu adds no default NIC).
pub fn nic_args(nics: &[Nic], busybox: &Path) -> Vec<String> {
    let mut args = vec!["-nic".to_owned(), "none".to_owned()];
    for (i, nic) in nics.iter().enumerate() {
        // No option ROM: iPXE would only slow the boot down.
        let mut device = format!("virtio-net-pci,romfile=,mac={}", nic.mac);
        let netdev = match &nic.backend {
            NicBackend::Hub(hub) => format!("hubport,id=nk{i},hubid={hub}"),
            NicBackend::User { hostfwd, guestfwd } => {
                let mut netdev = format!("user,id=nk{i},restrict=on");
                for (host, guest) in hostfwd {
                    netdev.push_str(&format!(",hostfwd=tcp:127.0.0.1:{host}-:{guest}"));
                }
                for (addr, port, host) in guestfwd {
                    netdev.push_str(&format!(
                        ",guestfwd=tcp:{addr}:{port}-cmd:{} nc 127.0.0.1 {host}",
                        busybox.display()
                    ));
                }
                netdev
            }
        };
        device.push_str(&format!(",netdev=nk{i}"));
        args.extend(["-netdev".to_owned(), netdev, "-device".to_owned(), device]);
    }
    args
}

/// A qemu process running a guest; dropping it kills qemu (by its PID, through the child
/// handle) and removes its scratch files.
pub struct RunningVm {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    reader: Option<std::thread::JoinHandle<()>>,
    errors: Option<std::thread::JoinHandle<String>>,
    started: Instant,
    kvm: bool,
    console: String,
    /// Removed on drop (the initramfs of [`start_in_vm`]).
    scratch: Option<PathBuf>,
}

/// Boots `kernel` with `initramfs` under qemu without any network device, streams the serial
/// console, and kills qemu (by its PID, through the child handle) if no verdict arrives in time.
pub fn boot(
    kernel: &Kernel,
    initramfs: &Path,
    timeout: Duration,
    echo: bool,
) -> Result<BootOutcome> {
    start(kernel, initramfs, &VmOptions::default(), echo)?.wait(timeout)
}

/// Starts qemu with `kernel`, `initramfs` and `opts` and returns at once; the console is read
/// in the background (and echoed to stderr as `[guest] …` when `echo`).
pub fn start(kernel: &Kernel, initramfs: &Path, opts: &VmOptions, echo: bool) -> Result<RunningVm> {
    let kvm = kvm_usable();
    let busybox =
        find_busybox().ok_or_else(|| anyhow!("busybox is not installed; fix: {BUSYBOX_FIX}"))?;
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-nographic",
        "-no-reboot",
        "-m",
        &opts.memory_mib.to_string(),
    ])
    .args(nic_args(&opts.nics, &busybox))
    .arg("-kernel")
    .arg(&kernel.vmlinuz)
    .arg("-initrd")
    .arg(initramfs)
    .args(["-append", "console=ttyS0 panic=-1 quiet"]);
    // With KVM, TCG stays as the fallback should KVM refuse to start: qemu tries them in order.
    if kvm {
        cmd.args(["-accel", "kvm", "-accel", "tcg", "-cpu", "max"]);
    } else {
        cmd.args(["-accel", "tcg", "-cpu", "max"]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("start qemu-system-x86_64 (fix: {QEMU_FIX})"))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("qemu stdout"))?;
    let mut stderr = child.stderr.take().ok_or_else(|| anyhow!("qemu stderr"))?;
    let (tx, lines) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).split(b'\n') {
            let Ok(line) = line else { break };
            let line = String::from_utf8_lossy(&line)
                .trim_end_matches(['\r', '\n'])
                .to_owned();
            if echo {
                eprintln!("[guest] {line}");
            }
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    Ok(RunningVm {
        child,
        lines,
        reader: Some(reader),
        errors: Some(errors),
        started,
        kvm,
        console: String::new(),
        scratch: None,
    })
}

impl RunningVm {
    /// Everything the guest wrote to its console so far.
    pub fn console(&mut self) -> &str {
        while let Ok(line) = self.lines.try_recv() {
            self.console.push_str(&line);
            self.console.push('\n');
        }
        &self.console
    }

    /// Whether qemu still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the guest's verdict until `timeout` after qemu started, then for qemu to
    /// power off (killing it after a grace period, or at once on timeout).
    pub fn wait(mut self, timeout: Duration) -> Result<BootOutcome> {
        let deadline = self.started + timeout;
        let mut verdict = None;
        let mut boot_to_verdict = timeout;
        // Lines read before (by `console`) may hold the verdict already.
        if let Some(rest) = self.console.lines().find_map(|l| {
            l.find(VERDICT_PREFIX)
                .map(|i| &l[i + VERDICT_PREFIX.len()..])
        }) {
            verdict = Some(rest.trim().to_owned());
            boot_to_verdict = self.started.elapsed();
        }
        while verdict.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.console.push_str(&line);
                    self.console.push('\n');
                    if let Some(rest) = line
                        .find(VERDICT_PREFIX)
                        .map(|i| &line[i + VERDICT_PREFIX.len()..])
                    {
                        verdict = Some(rest.trim().to_owned());
                        boot_to_verdict = self.started.elapsed();
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    boot_to_verdict = self.started.elapsed();
                    break;
                }
            }
        }
        // After the verdict the guest powers off by itself; give it a moment, then stop it for sure.
        let grace = Instant::now() + Duration::from_secs(10);
        loop {
            if self.child.try_wait()?.is_some() {
                break;
            }
            if Instant::now() >= grace || verdict.is_none() && Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Collect what the guest wrote after the verdict (its power-off messages).
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.console.push_str(&line);
            self.console.push('\n');
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let qemu_errors = self
            .errors
            .take()
            .and_then(|e| e.join().ok())
            .unwrap_or_default();
        let mut console = std::mem::take(&mut self.console);
        if verdict.is_none() && !qemu_errors.trim().is_empty() {
            console.push_str("--- qemu stderr ---\n");
            console.push_str(&qemu_errors);
        }
        Ok(BootOutcome {
            verdict,
            console,
            boot_to_verdict,
            kvm: self.kvm,
        })
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if let Some(dir) = self.scratch.take() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// Prepares the kernel, builds a fresh initramfs around `program`, boots it, and removes the
/// initramfs again.
pub fn run_in_vm(program: &GuestProgram, timeout: Duration, echo: bool) -> Result<BootOutcome> {
    start_in_vm(program, &VmOptions::default(), echo)?.wait(timeout)
}

/// Prepares the kernel, builds a fresh initramfs around `program` (and `opts.extra_binaries`)
/// and starts the VM with `opts`, returning while it runs; the initramfs goes with the VM.
pub fn start_in_vm(program: &GuestProgram, opts: &VmOptions, echo: bool) -> Result<RunningVm> {
    let kernel = prepare_kernel(false)?;
    let cache = cache_dir()?;
    let work = scratch_dir(&cache, "run")?;
    let initramfs = work.join("initramfs.cpio");
    let result = build_initramfs_with(&kernel, program, &opts.extra_binaries, &initramfs)
        .and_then(|()| start(&kernel, &initramfs, opts, echo));
    match result {
        Ok(mut vm) => {
            vm.scratch = Some(work);
            Ok(vm)
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&work);
            Err(e)
        }
    }
}

/// Last `n` lines of the console, for error messages.
pub fn console_tail(console: &str, n: usize) -> String {
    let lines: Vec<&str> = console.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_dependency_is_the_versioned_image() {
        assert_eq!(
            parse_kernel_dependency("linux-image-6.1.0-56-amd64 (= 6.1.192-2)").as_deref(),
            Some("linux-image-6.1.0-56-amd64")
        );
        assert_eq!(
            parse_kernel_dependency("linux-image-6.12.9-amd64-unsigned | linux-image-6.12.9-amd64")
                .as_deref(),
            Some("linux-image-6.12.9-amd64-unsigned")
        );
        assert_eq!(parse_kernel_dependency("kmod, initramfs-tools"), None);
    }

    #[test]
    fn modinfo_depends_is_read_and_normalised() {
        let modinfo = b"license=GPL\0depends=garp,mrp,nf-conntrack\0name=8021q\0";
        assert_eq!(modinfo_depends(modinfo), ["garp", "mrp", "nf_conntrack"]);
        assert!(modinfo_depends(b"depends=\0name=llc\0").is_empty());
    }

    #[test]
    fn ldd_output_gives_library_and_loader_paths_only() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn cpio_members_are_aligned_and_terminated() {
        let mut cpio = Cpio::new(Vec::new());
        cpio.dir("bin").unwrap();
        cpio.bytes("bin/hello", 0o755, b"hi\n").unwrap();
        cpio.symlink("bin/sh", "busybox").unwrap();
        let out = cpio.finish().unwrap();
        assert_eq!(out.len() % 4, 0);
        // Header is 110 bytes; "bin\0" pads to 116, "bin/hello\0" then data "hi\n" padded.
        assert!(out.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&out);
        assert_eq!(text.matches("070701").count(), 4);
        assert!(text.contains("bin/hello\0"));
        assert!(text.contains("hi\n\0"));
        assert!(text.ends_with("TRAILER!!!\0\0\0\0"));
        // The file's mode and size fields: regular file 0755, three bytes.
        let header = &text[text.find("070701").unwrap() + 116..][..110];
        assert_eq!(&header[14..22], "000081ed");
        assert_eq!(&header[54..62], "00000003");
    }

    #[test]
    fn init_script_loads_modules_in_order_and_reports_a_verdict() {
        let program = GuestProgram {
            binary: "/x".into(),
            args: vec!["a b".into(), "it's".into()],
            env: vec![],
        };
        let script = init_script(
            &["llc.ko".into(), "stp.ko".into()],
            &program,
            &["/lib".into()],
        );
        let llc = script.find("insmod /lib/modules/llc.ko").unwrap();
        let stp = script.find("insmod /lib/modules/stp.ko").unwrap();
        assert!(llc < stp);
        assert!(script.contains(r"'/guest/x' 'a b' 'it'\''s'"));
        assert!(script.contains(&format!("echo \"{VERDICT_PREFIX} exit $rc\"")));
        assert!(script.contains(&format!("export {GUEST_ENV}=1")));
    }

    #[test]
    fn nics_are_virtio_pci_with_their_macs_and_user_net_is_restricted_to_loopback() {
        let nics = [
            Nic {
                mac: "02:00:17:00:00:01".into(),
                backend: NicBackend::User {
                    hostfwd: vec![(40001, 9443)],
                    guestfwd: vec![([10, 0, 2, 100].into(), 80, 40002)],
                },
            },
            Nic {
                mac: "02:00:17:00:00:02".into(),
                backend: NicBackend::Hub(1),
            },
        ];
        let args = nic_args(&nics, Path::new("/bin/busybox"));
        assert_eq!(
            args,
            [
                "-nic",
                "none",
                "-netdev",
                "user,id=nk0,restrict=on,hostfwd=tcp:127.0.0.1:40001-:9443,\
                 guestfwd=tcp:10.0.2.100:80-cmd:/bin/busybox nc 127.0.0.1 40002",
                "-device",
                "virtio-net-pci,romfile=,mac=02:00:17:00:00:01,netdev=nk0",
                "-netdev",
                "hubport,id=nk1,hubid=1",
                "-device",
                "virtio-net-pci,romfile=,mac=02:00:17:00:00:02,netdev=nk1",
            ]
        );
        assert_eq!(nic_args(&[], Path::new("/bin/busybox")), ["-nic", "none"]);
    }

    #[test]
    fn a_kernel_cached_for_other_modules_is_not_used() {
        let dir = std::env::temp_dir().join(format!("nk-vm-wanted-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("modules.load"), "8021q.ko\n").unwrap();
        // A cache from before the list grew has no record of it.
        assert!(!unpacked_for_wanted(&dir));
        fs::write(dir.join(WANTED_FILE), "8021q macvlan dummy veth").unwrap();
        assert!(!unpacked_for_wanted(&dir));
        fs::write(dir.join(WANTED_FILE), wanted_line()).unwrap();
        assert!(unpacked_for_wanted(&dir));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn elf_section_rejects_non_elf() {
        assert!(elf_section(b"not an elf at all", ".modinfo").is_err());
    }
}
