//! Writing tq's output: every command writes through [`print()`], so output that cannot be
//! written (a full disk, `> /dev/full`, a closed pipe) is reported the same way everywhere:
//! a line on standard error and exit status 2, never a panic.

use std::io::Write;
use std::process::ExitCode;

/// The exit status of output that could not be written (as for a usage error).
pub const WRITE_FAILED: u8 = 2;

/// Writes `text` to standard output and flushes it. On failure, says so on standard error as
/// `<who>: could not write <what> (<error>)` (`who`: `tq doctor`, `tq version`, ...) and returns
/// exit status [`WRITE_FAILED`].
pub fn print(who: &str, what: &str, text: &str) -> Result<(), ExitCode> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()).map_err(|error| {
        warn(&format!("{who}: could not write {what} ({error})"));
        ExitCode::from(WRITE_FAILED)
    })
}

/// Writes `line` to standard error. Where even that fails there is nobody left to tell, so the
/// failure is dropped (`eprintln!` would panic).
pub fn warn(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
