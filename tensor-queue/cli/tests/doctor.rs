//! `tq` as a user runs it: a real process, its text, JSON and exit status checked. Most tests
//! hide the GPUs (`CUDA_VISIBLE_DEVICES=` with no device, which the driver honours where there
//! is one), so they mean the same on a GPU machine; the NCCL rows are checked so that they hold
//! whether NCCL is installed or not. The route verdicts on made-up topologies are unit tests of
//! the binary (`cargo test -p tq`).

use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// The `tq` binary: `TQ_BIN` where set (the GPU bundle, whose binaries are not where cargo
/// built them), else the one cargo built next to (or one folder above) this test. Not cargo's
/// compile-time path to it, which names a folder the bundle does not have.
fn tq() -> PathBuf {
    if let Some(path) = std::env::var_os("TQ_BIN") {
        return path.into();
    }
    let exe = std::env::current_exe().expect("this test's own path");
    let dir = exe.parent().expect("a test in a folder");
    [dir.join("tq"), dir.join("..").join("tq")]
        .into_iter()
        .find(|path| path.is_file())
        .expect("tq next to this test (build it with `cargo test -p tq`, or set TQ_BIN)")
}

/// `tq` with `args`, the GPUs hidden and neither library variable set.
fn command(args: &[&str]) -> Command {
    let mut command = Command::new(tq());
    command
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", "")
        .env_remove("CUDA_SYS_LIBCUDA")
        .env_remove("TQ_NCCL_LIBRARY")
        .stdin(Stdio::null());
    command
}

fn run(args: &[&str]) -> Output {
    command(args).output().expect("starting tq")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn json_of(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", text(&output.stdout)))
}

fn assert_fits(stdout: &str, width: usize) {
    for line in stdout.lines() {
        assert!(line.chars().count() <= width, "a line of {} characters:\n{line}\nin:\n{stdout}", line.chars().count());
    }
}

#[test]
fn without_a_gpu_it_says_so_on_the_first_line_and_exits_0() {
    let output = run(&["doctor"]);
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}\n{}", text(&output.stderr));
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.starts_with("tq doctor ") && first.contains("no GPU or no CUDA driver here"), "{stdout}");
    assert!(stdout.contains("CUDA_VISIBLE_DEVICES="), "{stdout}");
    for fact in ["/dev/shm", "RLIMIT_MEMLOCK", "socket directory", "PID namespace", "pidfd", "NCCL"] {
        assert!(stdout.contains(fact), "{fact} is missing:\n{stdout}");
    }
    assert!(!stdout.contains("GPU pairs"), "no pairs without GPUs:\n{stdout}");
    assert!(stdout.contains("Summary:"), "{stdout}");
}

#[test]
fn the_json_has_every_section_and_nccls_version_and_path() {
    let output = run(&["doctor", "--json"]);
    assert_eq!(output.status.code(), Some(0));
    let json = json_of(&output);
    for key in [
        "tq_version",
        "cuda_visible_devices",
        "measurement",
        "gpu",
        "pairs",
        "handles",
        "host",
        "engines",
        "inline",
        "summary",
    ] {
        assert!(json.get(key).is_some(), "{key} is missing: {json:#}");
    }
    assert_eq!(json["gpu"]["available"], false);
    assert_eq!(json["measurement"], "not_asked");
    assert_eq!(json["pairs"].as_array().map(Vec::len), Some(0));
    let handles = json["handles"].as_array().unwrap();
    let kinds: Vec<&str> = handles.iter().filter_map(|h| h["kind"].as_str()).collect();
    assert_eq!(kinds, ["legacy_ipc_memory", "vmm_fd", "interprocess_event", "stream_memory_ops"]);
    assert!(handles.iter().all(|h| h["verdict"] == "skipped"), "not tried without a GPU");
    let host: Vec<&str> = json["host"].as_array().unwrap().iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(host.len(), 5, "{host:?}");
    assert!(host[0] == "/dev/shm" && host[1].contains("RLIMIT_MEMLOCK") && host[2].starts_with("socket directory"));
    assert!(host[3] == "PID namespace" && host[4] == "pidfd");
    for check in json["host"].as_array().unwrap() {
        let verdict = check["verdict"].as_str().unwrap();
        assert!(["ok", "slower_than_possible", "broken"].contains(&verdict), "{check}");
        assert!(verdict == "ok" || check["fix"].is_string(), "a flagged fact says what to do: {check}");
    }
    // NCCL, installed here or not: without TQ_NCCL_LIBRARY the row is ok either way, and its
    // version and path are fields, both present or both null.
    let nccl = &json["engines"][0];
    assert_eq!((&nccl["name"], &nccl["verdict"], &nccl["named_by"]), (&"NCCL".into(), &"ok".into(), &Value::Null));
    let value = nccl["value"].as_str().unwrap();
    match (nccl["version"].as_str(), nccl["path"].as_str()) {
        (Some(version), Some(path)) => {
            assert!(value.starts_with(&format!("{version} from {path}")), "{nccl}");
            assert!(value.contains("between hosts"), "{nccl}");
        }
        (None, None) => {
            assert!(value.starts_with("not installed (needed only for GPU tensors across hosts)"), "{nccl}");
            assert!(nccl["error"].as_str().unwrap().contains("libnccl.so.2"), "the full story is in the JSON: {nccl}");
        }
        _ => panic!("version and path come together: {nccl}"),
    }
}

/// The decision: without a GPU, `--strict` exits 0 unless a check is broken (a host fact that
/// is only slower than possible, such as a small locked-memory limit, does not fail it), and the
/// JSON's `summary.strict_fails` says in advance which it will be.
#[test]
fn strict_exits_non_zero_exactly_when_something_is_broken() {
    let output = run(&["doctor", "--json", "--strict"]);
    let json = json_of(&output);
    let summary = &json["summary"];
    let broken = summary["broken"].as_u64().unwrap();
    assert_eq!(summary["strict_fails"], broken > 0, "without GPU pairs only broken checks fail strict: {summary}");
    assert_eq!(output.status.code(), Some(if broken > 0 { 1 } else { 0 }), "{summary}");
}

/// Issue 21 item 4: a library the user names is used or reported as broken, never replaced by
/// the system's. The named path does not exist, so the test means the same where NCCL is
/// installed (where the old doctor loaded the system's libnccl instead and passed).
#[test]
fn a_named_nccl_that_does_not_load_is_broken_not_replaced() {
    let named = "/nonexistent/libnccl.so.2";
    let output = command(&["doctor", "--strict"]).env("TQ_NCCL_LIBRARY", named).output().unwrap();
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(text(&output.stderr).contains("broken"), "{}", text(&output.stderr));
    let row = stdout.lines().find(|l| l.contains("NCCL")).unwrap_or_default();
    assert!(row.contains("BROKEN") && row.contains(&format!("TQ_NCCL_LIBRARY={named} does not load")), "{stdout}");

    let output = command(&["doctor", "--json"]).env("TQ_NCCL_LIBRARY", named).output().unwrap();
    let nccl = &json_of(&output)["engines"][0];
    assert_eq!(nccl["verdict"], "broken", "{nccl}");
    assert_eq!(
        (&nccl["path"], &nccl["version"], &nccl["named_by"]),
        (&named.into(), &Value::Null, &"TQ_NCCL_LIBRARY".into())
    );
}

/// The same for the driver: `CUDA_SYS_LIBCUDA` naming a file that does not exist is broken,
/// not "no GPU", and the report names the path.
#[test]
fn a_named_driver_that_does_not_load_is_broken_not_replaced() {
    let named = "/nonexistent/libcuda.so.1";
    let output = command(&["doctor", "--strict"]).env("CUDA_SYS_LIBCUDA", named).output().unwrap();
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let row = stdout.lines().find(|l| l.contains("CUDA driver API")).unwrap_or_default();
    assert!(row.contains("BROKEN") && row.contains(&format!("CUDA_SYS_LIBCUDA={named} does not load")), "{stdout}");
    assert!(stdout.lines().next().unwrap().contains("no GPU"), "{stdout}");
}

/// Issue 25: no line wider than the terminal; not a terminal (a pipe here), 100 columns. The
/// machine as it is (GPU or not), the failure paths with their long messages, and `--measure`.
#[test]
fn no_line_is_wider_than_100_columns_when_not_a_terminal() {
    let as_it_is = Command::new(tq()).args(["doctor"]).output().unwrap();
    assert_fits(&text(&as_it_is.stdout), 100);
    for args in [&["doctor"][..], &["doctor", "--measure"]] {
        let output = command(args)
            .env("TQ_NCCL_LIBRARY", "/nonexistent/a-long-folder-name-that-goes-on/and-on/libnccl.so.2")
            .env("CUDA_SYS_LIBCUDA", "/nonexistent/libcuda.so.1")
            .output()
            .unwrap();
        assert_fits(&text(&output.stdout), 100);
        assert_fits(&text(&run(args).stdout), 100);
    }
    let help = run(&["doctor", "--help"]);
    assert_fits(&text(&help.stdout), 100);
}

/// On a terminal, the terminal's width: 60 columns here, through a pseudo-terminal that
/// util-linux's `script` gives (skipped where there is none).
#[test]
fn on_a_terminal_lines_fit_its_width() {
    let tq = tq().display().to_string().replace('\'', r"'\''");
    let shell = format!("stty cols 60 && '{tq}' doctor");
    let Ok(output) = command(&[])
        .get_envs()
        .fold(Command::new("script"), |mut script, (key, value)| {
            match value {
                Some(value) => script.env(key, value),
                None => script.env_remove(key),
            };
            script
        })
        .args(["-qec", &shell, "/dev/null"])
        .stdin(Stdio::null())
        .output()
    else {
        eprintln!("skipped: no `script` here to give tq a terminal");
        return;
    };
    let stdout = text(&output.stdout).replace('\r', "");
    if !output.status.success() || !stdout.contains("Summary:") {
        eprintln!("skipped: `script` gave no terminal here ({}): {stdout}", text(&output.stderr));
        return;
    }
    assert_fits(&stdout, 60);
    let piped = text(&run(&["doctor"]).stdout);
    assert!(piped.lines().any(|l| l.chars().count() > 60), "off a terminal the width is 100, not 60:\n{piped}");
}

#[test]
fn measure_without_a_gpu_says_nothing_was_measured() {
    let output = run(&["doctor", "--measure"]);
    assert_eq!(output.status.code(), Some(0));
    let stdout = text(&output.stdout);
    let notice = stdout.lines().find(|l| l.starts_with("--measure:")).unwrap_or_default();
    assert!(notice.contains("nothing was measured"), "{stdout}");
    let output = run(&["doctor", "--measure", "--json"]);
    assert_eq!(json_of(&output)["measurement"], "nothing_measured");
    assert!(text(&output.stderr).contains("nothing was measured"), "{}", text(&output.stderr));
    assert!(!text(&run(&["doctor"]).stdout).contains("nothing was measured"), "only when --measure asked");
    // The small-message section says why it measured nothing, and the default that applies.
    let inline = &json_of(&output)["inline"];
    assert_eq!((&inline["measured"], &inline["suggested_up_to"]), (&Value::Bool(false), &Value::Null), "{inline}");
    assert_eq!(inline["default_up_to"], tensor_queue::route::DEFAULT_INLINE_GPU_UP_TO);
    assert_eq!(inline["env"], tensor_queue::route::INLINE_GPU_ENV);
    assert!(inline["note"].as_str().unwrap().contains("no GPU here"), "{inline}");
    let section = stdout.split("Small messages across hosts").nth(1).unwrap_or_default();
    assert!(section.contains("no GPU here") && section.contains("65536 bytes"), "{stdout}");
}

#[test]
fn version_and_dash_dash_version_print_the_same() {
    let version = run(&["version"]);
    let flag = run(&["--version"]);
    assert!(version.status.success() && flag.status.success());
    assert_eq!(text(&version.stdout), text(&flag.stdout));
    assert_eq!(text(&version.stdout), format!("tq {0} (tensor-queue {0})\n", env!("CARGO_PKG_VERSION")));
    assert_eq!(text(&run(&["-V"]).stdout), text(&version.stdout));
}

/// Issue 22 item 10: output that cannot be written (`> /dev/full`) is a message and exit 2 for
/// every command, never a panic (exit 101).
#[test]
fn output_that_cannot_be_written_exits_2_with_a_message() {
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full here");
        return;
    }
    for args in
        [&["version"][..], &["--version"], &["--help"], &["doctor", "--help"], &["doctor"], &["doctor", "--json"]]
    {
        let full = File::options().write(true).open("/dev/full").unwrap();
        let output = command(args).stdout(full).output().unwrap();
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "tq {args:?} > /dev/full: {stderr}");
        assert!(stderr.contains("could not write"), "tq {args:?} > /dev/full: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn usage_errors_exit_2() {
    let output = run(&["doctor", "--no-such-flag"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output.stderr).contains("Usage"), "a usage error says what to type");
    assert_eq!(run(&[]).status.code(), Some(2), "no command");
    let output = run(&["doctor-child"]);
    assert!(!output.status.success(), "the hidden child refuses to run by hand");
}

/// The machine as it is, GPU and NCCL or not: the first line says whether there is a GPU as
/// the JSON does, and `--strict` exits as `summary.strict_fails` says.
#[test]
fn on_this_machine_as_it_is_the_text_json_and_exit_status_agree() {
    let json = json_of(&Command::new(tq()).args(["doctor", "--json"]).output().unwrap());
    let output = Command::new(tq()).args(["doctor", "--strict"]).output().unwrap();
    let first = text(&output.stdout).lines().next().unwrap_or_default().to_string();
    assert_eq!(first.contains("no GPU"), json["gpu"]["available"] == false, "{first}");
    let fails = json["summary"]["strict_fails"].as_bool().unwrap();
    assert_eq!(output.status.code(), Some(if fails { 1 } else { 0 }), "{}", json["summary"]);
}
