//! A helper program as a test talks to it: the lines it prints (each waited for with a deadline),
//! the lines written to its stdin, and a SIGKILL (and reaping) when it goes out of scope, so that
//! no child outlives its test. The tests' own wrappers (`reliability`'s `tq-user`, `tcp_host`'s
//! `tcp-peer`) start it and add what only they need.

use std::io::Write as _;
use std::process::{Child, ChildStdin, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running helper program: its stdout lines, its stdin, and a kill when it goes out of scope.
pub struct Talking {
    /// The program's name, for messages.
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    stdin: Option<ChildStdin>,
    /// The lines read so far that no `expect` asked for.
    seen: Vec<String>,
}

impl Talking {
    /// Takes over `child` (started with piped stdin and stdout), the program `name`; its lines
    /// are echoed to stderr tagged with `tag`.
    pub fn adopt(name: &str, mut child: Child, tag: String) -> Talking {
        let stdin = child.stdin.take();
        let lines = crate::stdout_lines(&mut child, Some(tag));
        Talking { name: name.to_string(), child, lines, stdin, seen: Vec::new() }
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The next line starting with `prefix` within `timeout`; panics (with everything the child
    /// said) when none comes.
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        self.expect_any(&[prefix], timeout)
    }

    /// The next line starting with any of `prefixes` within `timeout`; panics (with everything
    /// the child said) when none comes.
    pub fn expect_any(&mut self, prefixes: &[&str], timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if prefixes.iter().any(|p| line.starts_with(p)) => return line,
                Ok(line) => self.seen.push(line),
                Err(_) => {
                    let status = self.child.try_wait().ok().flatten();
                    panic!(
                        "{} {} never said {prefixes:?} within {timeout:?}; exit {status:?}; it said {:#?}",
                        self.name,
                        self.child.id(),
                        self.seen
                    );
                }
            }
        }
    }

    /// Every line said so far that no `expect` took (without waiting).
    pub fn drain(&mut self) -> &[String] {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        &self.seen
    }

    /// Writes a command line to the child's stdin.
    pub fn tell(&mut self, line: &str) {
        let name = &self.name;
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).unwrap_or_else(|e| panic!("writing to {name}: {e}"));
    }

    /// Closes the child's stdin.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The exit status within `timeout`, or `None` while it still runs.
    pub fn exit_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The lines read so far that no `expect` took.
    pub fn seen(&self) -> &[String] {
        &self.seen
    }

    /// Forgets the lines read so far.
    pub fn clear_seen(&mut self) {
        self.seen.clear();
    }

    /// Its exit status if it has ended (without waiting).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Whether it is still running.
    pub fn alive(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// SIGKILL, and the wait for it.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
    }
}

impl Drop for Talking {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Declares `struct $name(Talking)`, which derefs to [`Talking`]: a test's own helper program, to
/// which the test adds the constructors (and checks) only it needs.
#[macro_export]
macro_rules! talking {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        struct $name($crate::talk::Talking);

        impl std::ops::Deref for $name {
            type Target = $crate::talk::Talking;
            fn deref(&self) -> &$crate::talk::Talking {
                &self.0
            }
        }

        impl std::ops::DerefMut for $name {
            fn deref_mut(&mut self) -> &mut $crate::talk::Talking {
                &mut self.0
            }
        }
    };
}
