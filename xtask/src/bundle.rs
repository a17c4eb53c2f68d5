//! `cargo xtask gpu-bundle`: everything that must run on the GPU machine, built here in release.
//!
//! The GPU machine has no Rust toolchain, so tests, helper binaries, examples and benchmarks are
//! gathered into `target/gpu-bundle` with `run.sh`, which runs them all and prints a pass/fail
//! summary last. The device tool carries at most 64 MiB, so the folder is also packed into
//! `target/gpu-bundle.tar.xz` (xz: release binaries compress about 5x, where gzip gave 2x and
//! outgrew the carry), whose size is checked here: carry that, and unpack it there with
//! `tar xJf target/gpu-bundle.tar.xz -C target` (or Python's `tarfile` where `xz` is missing).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};

use std::process::Command;

use crate::{cargo, cargo_command, run, workspace_root};

/// The device tool carries at most 64 MiB, the working tree (2 MiB) included: 56 MiB of packed
/// bundle leaves room for both.
const SIZE_LIMIT: u64 = 56 << 20;

/// Binaries that tests start as second processes, and benchmarks. [`check_helpers`] makes sure
/// every helper a test or helper names is among them.
const BINARIES: &[&str] = &[
    "tq",
    "ipc-helper",
    "tq-peer",
    "tq-user",
    "tq-fault",
    "tq-cross",
    "tcp-peer",
    "tq-hostile",
    "tq-rings",
    "outside-peer",
    "outside-msg-peer",
    "outside4-peer",
    "outside-inline-peer",
    "outside5-peer",
    "outside6-peer",
    "outside7-peer",
    "nccl-peer",
    "primitive-costs",
    "tq-bench",
    "tq-hosts",
];

/// Where tests and helpers name the binaries they start: `bin_path("NAME")` (the integration
/// tests' lookup, which the bundle's `run.sh` points at its `bin` folder).
const HELPER_MARKERS: &[(&str, &str)] = &[("bin_path(\"", "\"")];

/// Cargo's path to a binary it built (`env!("CARGO_BIN_EXE_NAME")`): baked into the test at
/// compile time, it names a folder of this machine that does not exist on the GPU machine, so
/// [`check_helpers`] refuses a test that uses it (`bin_path` finds the bundle's copy instead).
const CARGO_BIN_PATH: &str = concat!("CARGO_BIN", "_EXE_");

const RUN_SCRIPT: &str = include_str!("run-bundle.sh");
const BENCH_SCRIPT: &str = include_str!("bench-bundle.sh");
const PYTHON_SCRIPT: &str = include_str!("python-bundle.sh");

pub fn build() -> Result<()> {
    let root = workspace_root();
    let bundle = root.join("target/gpu-bundle");
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)?;
    }
    for dir in ["bin", "tests", "examples", "bench"] {
        std::fs::create_dir_all(bundle.join(dir))?;
    }

    check_helpers(&root)?;
    // `bench` brings tq-bench and its plotting crates, which test runs leave out.
    cargo(&["build", "--release", "--workspace", "--bins", "--examples", "--features", "integration-tests/bench"])?;
    for name in BINARIES {
        copy(&root.join("target/release").join(name), &bundle.join("bin").join(name))?;
    }
    for example in release_examples(&root)? {
        let name = example.file_name().context("example without a name")?;
        copy(&example, &bundle.join("examples").join(name))?;
    }
    for (name, executable) in release_test_executables()? {
        copy(&executable, &bundle.join("tests").join(name))?;
    }
    for (name, text) in [("run.sh", RUN_SCRIPT), ("bench.sh", BENCH_SCRIPT)] {
        std::fs::write(bundle.join(name), text)?;
        make_executable(&bundle.join(name))?;
    }
    // The benchmark's anchors: the C socket floor (built here like the rest), PyTorch's queues, and
    // the cross-device anchors (NCCL, torch.multiprocessing).
    let bench = root.join("tests/bench");
    run(Command::new("cc")
        .args(["-O2", "-Wall", "-o"])
        .arg(bundle.join("bin/socket-floor"))
        .arg(bench.join("socket_floor.c")))
    .context("compiling the socket floor needs a C compiler (cc)")?;
    for script in ["torch_anchor.py", "cross_anchors.py"] {
        copy(&bench.join(script), &bundle.join("bench").join(script))?;
    }
    // The Python package: its abi3 wheel, pytest's wheels, its tests, benchmark and examples
    // (run.sh installs the wheels with pip into a folder on PYTHONPATH: the machine is offline).
    let python = bundle.join("python");
    crate::python::bundle_wheels(&python)?;
    std::fs::write(python.join("run.sh"), PYTHON_SCRIPT)?;
    make_executable(&python.join("run.sh"))?;
    for dir in ["tests", "bench", "examples"] {
        let from = root.join("tensor-queue/python").join(dir);
        if from.is_dir() {
            std::fs::create_dir_all(python.join(dir))?;
            for entry in std::fs::read_dir(&from)? {
                let path = entry?.path();
                if path.extension().is_some_and(|e| e == "py") {
                    copy(&path, &python.join(dir).join(path.file_name().context("a file without a name")?))?;
                }
            }
        }
    }

    let packed = root.join("target/gpu-bundle.tar.xz");
    run(Command::new("tar")
        .arg("cJf")
        .arg(&packed)
        .arg("-C")
        .arg(root.join("target"))
        .arg("gpu-bundle")
        .env("XZ_OPT", "-6 -T0"))
    .context("packing the bundle needs tar and xz")?;
    let size = std::fs::metadata(&packed)?.len();
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    println!(
        "xtask gpu-bundle: {} ({:.1} MiB), packed in {} ({:.1} MiB): carry that and unpack it with `tar xJf target/gpu-bundle.tar.xz -C target`",
        bundle.display(),
        mib(folder_size(&bundle)?),
        packed.display(),
        mib(size)
    );
    if size > SIZE_LIMIT {
        bail!("the bundle is {size} bytes, over the {SIZE_LIMIT}-byte budget for the device carry");
    }
    Ok(())
}

/// Fails, before anything is built, if a test or helper of the workspace starts a binary that is
/// not in [`BINARIES`], or finds one through cargo's build path ([`CARGO_BIN_PATH`]): either
/// would fail only on the GPU machine ("No such file").
fn check_helpers(root: &Path) -> Result<()> {
    let mut sources = Vec::new();
    for crate_dir in ["tests", "tensor-queue", "ipc-core", "kernels"] {
        rust_files(&root.join(crate_dir), &mut sources)?;
    }
    let sources = sources
        .iter()
        .map(|source| {
            let text = std::fs::read_to_string(source).with_context(|| format!("reading {}", source.display()))?;
            Ok((source.strip_prefix(root).unwrap_or(source).to_path_buf(), text))
        })
        .collect::<Result<Vec<_>>>()?;
    unbundled_helpers(&sources)
}

/// The check of [`check_helpers`] on `(path, text)` pairs of source files.
fn unbundled_helpers(sources: &[(PathBuf, String)]) -> Result<()> {
    let mut missing: Vec<(String, &Path)> = Vec::new();
    let mut cargo_paths: Vec<&Path> = Vec::new();
    for (source, text) in sources {
        for name in helpers_named(text) {
            if !BINARIES.contains(&name.as_str()) && !missing.iter().any(|(n, _)| *n == name) {
                missing.push((name, source));
            }
        }
        if text.contains(CARGO_BIN_PATH) {
            cargo_paths.push(source);
        }
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        let missing: Vec<String> =
            missing.iter().map(|(name, source)| format!("{name} (started in {})", source.display())).collect();
        problems.push(format!(
            "tests start binaries the GPU bundle would not carry (add them to BINARIES in xtask/src/bundle.rs): {}",
            missing.join(", ")
        ));
    }
    if !cargo_paths.is_empty() {
        let files: Vec<String> = cargo_paths.iter().map(|p| p.display().to_string()).collect();
        problems.push(format!(
            "tests find binaries through cargo's build path ({CARGO_BIN_PATH}NAME), which does not exist in the GPU \
             bundle: use integration_tests::bin_path (or the bundle's TQ_BIN) instead, in {}",
            files.join(", ")
        ));
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

/// The binaries `text` names through [`HELPER_MARKERS`] (names built at run time, such as the
/// examples' `bin_path(&format!(..))`, are not literal and are not counted).
fn helpers_named(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (start, end) in HELPER_MARKERS {
        for (at, _) in text.match_indices(start) {
            let rest = &text[at + start.len()..];
            let Some(len) = rest.find(end) else { continue };
            let name = &rest[..len];
            let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if plain && !names.iter().any(|n| n == name) {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Every `.rs` file under `dir` (none if it does not exist), `target` folders left out.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                rust_files(&path, found)?;
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    Ok(())
}

/// Example executables: plain files without an extension or a `-hash` suffix.
fn release_examples(root: &Path) -> Result<Vec<PathBuf>> {
    let dir = root.join("target/release/examples");
    let mut found = Vec::new();
    if !dir.is_dir() {
        return Ok(found);
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        if path.is_file() && !name.contains('.') && !name.contains('-') {
            found.push(path);
        }
    }
    Ok(found)
}

/// Builds the test targets in release and returns `(package-target, executable)` pairs.
fn release_test_executables() -> Result<Vec<(String, PathBuf)>> {
    let mut command = cargo_command(&[
        "test",
        "--release",
        "--workspace",
        "--no-run",
        "--features",
        "integration-tests/bench",
        "--message-format=json-render-diagnostics",
    ])?;
    let output = command.stderr(Stdio::inherit()).output()?;
    if !output.status.success() {
        bail!("building release tests failed");
    }
    let mut found = Vec::new();
    for line in output.stdout.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let message: serde_json::Value = serde_json::from_slice(line)?;
        let kind = message["target"]["kind"][0].as_str().unwrap_or("test");
        // Binaries' own (empty) test harnesses and xtask's are not worth carrying.
        let is_test = message["profile"]["test"].as_bool() == Some(true)
            && matches!(kind, "lib" | "test")
            && !message["package_id"].as_str().unwrap_or_default().contains("xtask");
        let (Some(executable), true) = (message["executable"].as_str(), is_test) else {
            continue;
        };
        let package = message["package_id"].as_str().unwrap_or_default();
        let package = package.rsplit('/').next().unwrap_or(package);
        let package = package.split(['#', '@']).next().unwrap_or(package);
        let target = message["target"]["name"].as_str().unwrap_or("test");
        let name = if kind == "lib" { format!("{package}-unit") } else { format!("{package}-{target}") };
        found.push((name, PathBuf::from(executable)));
    }
    Ok(found)
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    Ok(())
}

fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn folder_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { folder_size(&entry.path())? } else { meta.len() };
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_helpers_tests_start() {
        let text = r#"Command::new(bin_path("tcp-peer")?); bin_path(&format!("../examples/{name}"));
            bin_path("tq-cross"); bin_path("tcp-peer")"#;
        assert_eq!(helpers_named(text), ["tcp-peer", "tq-cross"]);
    }

    fn sources(texts: &[(&str, &str)]) -> Vec<(PathBuf, String)> {
        texts.iter().map(|(path, text)| (PathBuf::from(path), text.to_string())).collect()
    }

    /// A test that finds a binary through cargo's build path is refused, named; one that uses
    /// the bin-dir lookup passes; a helper the bundle does not carry is refused too.
    #[test]
    fn refuses_cargo_build_paths_and_unbundled_helpers() {
        let cargo_path = format!("let peer = env!(\"{CARGO_BIN_PATH}tq-cross\");");
        let error = unbundled_helpers(&sources(&[
            ("tests/tests/a.rs", "bin_path(\"tq-cross\")"),
            ("tests/tests/b.rs", &cargo_path),
        ]))
        .unwrap_err()
        .to_string();
        assert!(error.contains("tests/tests/b.rs") && !error.contains("a.rs") && error.contains("bin_path"), "{error}");
        // Also as a fallback after the bin-dir lookup: the baked-in path is still wrong there.
        let fallback = format!("bin_path(\"tq\").unwrap_or_else(|_| env!(\"{CARGO_BIN_PATH}tq\").into())");
        assert!(unbundled_helpers(&sources(&[("c.rs", &fallback)])).is_err());
        let error = unbundled_helpers(&sources(&[("d.rs", "bin_path(\"not-carried\")")])).unwrap_err().to_string();
        assert!(error.contains("not-carried (started in d.rs)"), "{error}");
        unbundled_helpers(&sources(&[("e.rs", "Command::new(bin_path(\"tq-fault\")?)")])).unwrap();
    }

    /// The check the bundle makes, on this workspace: every helper a test starts is carried.
    #[test]
    fn every_helper_the_tests_start_is_bundled() {
        check_helpers(&workspace_root()).unwrap();
    }
}
