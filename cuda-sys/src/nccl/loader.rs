//! Finding `libnccl.so.2` and checking its version; opening it and resolving each NCCL function
//! on its first call go through [`crate::shared_library`], as for the driver.
//!
//! NCCL is not a system library: it usually arrives inside a Python environment, as the
//! `nvidia-nccl-cu*` wheel that PyTorch depends on, where the dynamic loader does not look. So
//! after the loader's own search, the places pip puts it are tried: the active virtual or conda
//! environment, then the site-packages folders of `python3`. The list is [`LIBRARY_CANDIDATES`].
//! A library named by [`LIBRARY_ENV`] is the only one tried: where it does not load, that is the
//! error ([`NcclError::NamedLibraryNotLoaded`]), never a reason to take the system's.

use std::ffi::{OsString, c_int, c_void};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{MINIMUM_VERSION, NcclError, Version, ncclResult_t};
use crate::shared_library::{SharedLibrary, named_path};

/// Environment variable naming the `libnccl.so.2` to try first.
pub const LIBRARY_ENV: &str = "TQ_NCCL_LIBRARY";

/// Where the `nvidia-nccl-cu*` wheels put the library, relative to a site-packages folder.
pub const WHEEL_LIBRARY: &str = "nvidia/nccl/lib/libnccl.so.2";

/// How long asking `python3` for its site-packages folders may take.
pub const PYTHON_TIMEOUT: Duration = Duration::from_secs(10);

/// One place to look for the library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    /// The path held by this environment variable, when it is set and not empty.
    PathInEnv(&'static str),
    /// A file name the dynamic loader looks up (`LD_LIBRARY_PATH`, `ld.so.cache`, system folders).
    LoaderName(&'static str),
    /// `relative` inside each `lib/python3*/site-packages` of the Python environment whose prefix
    /// this variable holds (`VIRTUAL_ENV`, `CONDA_PREFIX`).
    PythonPrefix {
        /// The variable holding the environment's prefix.
        variable: &'static str,
        /// The file inside site-packages.
        relative: &'static str,
    },
    /// `relative` inside each site-packages folder of the `python3` on the `PATH`. `python3` is
    /// asked at most once per process, within [`PYTHON_TIMEOUT`].
    SitePackages {
        /// The file inside site-packages.
        relative: &'static str,
    },
}

/// The places tried, in order; the first library that opens is used (and must be NCCL of at
/// least [`MINIMUM_VERSION`]: one that opens but is not is an error, not a reason to go on).
/// Where [`LIBRARY_ENV`] is set, its path is the only place tried.
pub const LIBRARY_CANDIDATES: &[Candidate] = &[
    Candidate::PathInEnv(LIBRARY_ENV),
    Candidate::LoaderName("libnccl.so.2"),
    Candidate::LoaderName("libnccl.so"),
    Candidate::PythonPrefix { variable: "VIRTUAL_ENV", relative: WHEEL_LIBRARY },
    Candidate::PythonPrefix { variable: "CONDA_PREFIX", relative: WHEEL_LIBRARY },
    Candidate::SitePackages { relative: WHEEL_LIBRARY },
];

impl Candidate {
    /// What this candidate names now, given the environment `env`: paths to try, or why there
    /// are none (a variable not set, a file not there).
    pub fn paths(&self, env: &dyn Fn(&str) -> Option<OsString>) -> Result<Vec<PathBuf>, String> {
        match *self {
            Candidate::PathInEnv(variable) => match named_path(variable, env) {
                Some(path) => Ok(vec![path]),
                None => Err(format!("{variable} is not set")),
            },
            Candidate::LoaderName(name) => Ok(vec![PathBuf::from(name)]),
            Candidate::PythonPrefix { variable, relative } => {
                let Some(prefix) = env(variable).filter(|prefix| !prefix.is_empty()) else {
                    return Err(format!("{variable} is not set"));
                };
                let lib = Path::new(&prefix).join("lib");
                let mut site_packages: Vec<PathBuf> = std::fs::read_dir(&lib)
                    .map_err(|error| format!("{relative} under {} ({variable}): {error}", lib.display()))?
                    .flatten()
                    .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
                    .map(|entry| entry.path().join("site-packages"))
                    .collect();
                site_packages.sort();
                existing(&site_packages, relative, &format!("under {} ({variable})", lib.display()))
            }
            Candidate::SitePackages { relative } => match python_site_packages() {
                Ok(folders) => existing(folders, relative, "in python3's site-packages"),
                Err(reason) => Err(format!("{relative} in python3's site-packages: {reason}")),
            },
        }
    }

    /// The candidate in words, for error messages.
    fn describe(&self) -> String {
        match self {
            Candidate::PathInEnv(variable) => format!("${variable}"),
            Candidate::LoaderName(name) => (*name).to_string(),
            Candidate::PythonPrefix { variable, relative } => {
                format!("${variable}/lib/python3*/site-packages/{relative}")
            }
            Candidate::SitePackages { relative } => format!("{relative} in python3's site-packages"),
        }
    }
}

/// `relative` inside those of `folders` where it exists, or why there is none.
fn existing(folders: &[PathBuf], relative: &str, where_: &str) -> Result<Vec<PathBuf>, String> {
    let found: Vec<PathBuf> =
        folders.iter().map(|folder| folder.join(relative)).filter(|path| path.is_file()).collect();
    if found.is_empty() {
        let searched: Vec<String> = folders.iter().map(|folder| folder.display().to_string()).collect();
        return Err(format!("no {relative} {where_} (searched: {})", searched.join(", ")));
    }
    Ok(found)
}

/// The site-packages folders of `python3` on the `PATH`, asked once per process.
fn python_site_packages() -> Result<&'static [PathBuf], String> {
    static FOLDERS: OnceLock<Result<Vec<PathBuf>, String>> = OnceLock::new();
    FOLDERS.get_or_init(ask_python).as_ref().map(Vec::as_slice).map_err(Clone::clone)
}

fn ask_python() -> Result<Vec<PathBuf>, String> {
    const SCRIPT: &str = "import site,sys; print(\"\\n\".join(site.getsitepackages()+[site.getusersitepackages()]))";
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|error| format!("python3 could not be started: {error}"))?;
    // The answer is a few lines, far less than a pipe holds, so waiting before reading cannot
    // block the child.
    let deadline = Instant::now() + PYTHON_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("python3 did not answer within {PYTHON_TIMEOUT:?}"));
            }
            Err(error) => return Err(format!("waiting for python3: {error}")),
        }
    };
    let mut text = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        stdout.read_to_string(&mut text).map_err(|error| format!("reading python3's answer: {error}"))?;
    }
    if !status.success() {
        return Err(format!("python3 exited with {status}"));
    }
    Ok(text.lines().filter(|line| !line.is_empty()).map(PathBuf::from).collect())
}

/// An opened NCCL library of a supported version.
pub struct NcclLibrary {
    library: SharedLibrary,
    version: Version,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary").field("path", &self.path()).field("version", &self.version).finish()
    }
}

impl NcclLibrary {
    /// Opens the first of `candidates` that loads, in the process's environment, and checks it.
    pub fn open(candidates: &[Candidate]) -> Result<NcclLibrary, NcclError> {
        NcclLibrary::open_in(candidates, &|name| std::env::var_os(name))
    }

    /// [`NcclLibrary::open`] with the environment variables that `env` gives. A
    /// [`Candidate::PathInEnv`] whose variable is set is the only place tried: where its path
    /// does not load, the answer is [`NcclError::NamedLibraryNotLoaded`].
    pub fn open_in(candidates: &[Candidate], env: &dyn Fn(&str) -> Option<OsString>) -> Result<NcclLibrary, NcclError> {
        for candidate in candidates {
            if let Candidate::PathInEnv(variable) = *candidate
                && let Some(path) = named_path(variable, env)
            {
                return match SharedLibrary::open(&path) {
                    Ok(library) => NcclLibrary::checked(library),
                    Err(reason) => {
                        Err(NcclError::NamedLibraryNotLoaded { variable, path: path.display().to_string(), reason })
                    }
                };
            }
        }
        let mut tried = Vec::new();
        for candidate in candidates {
            let paths = match candidate.paths(env) {
                Ok(paths) => paths,
                Err(reason) => {
                    tried.push(format!("{}: {reason}", candidate.describe()));
                    continue;
                }
            };
            for path in paths {
                match SharedLibrary::open(&path) {
                    Ok(library) => return NcclLibrary::checked(library),
                    Err(reason) => tried.push(format!("{}: {reason}", path.display())),
                }
            }
        }
        Err(NcclError::LibraryNotFound { tried })
    }

    /// Opens the library at `path` (a path, or a file name for the dynamic loader) and checks it.
    pub fn open_path(path: impl AsRef<Path>) -> Result<NcclLibrary, NcclError> {
        let path = path.as_ref();
        match SharedLibrary::open(path) {
            Ok(library) => NcclLibrary::checked(library),
            Err(reason) => Err(NcclError::LibraryNotFound { tried: vec![format!("{}: {reason}", path.display())] }),
        }
    }

    /// Asks the opened library for its version and refuses one older than [`MINIMUM_VERSION`].
    fn checked(library: SharedLibrary) -> Result<NcclLibrary, NcclError> {
        let mut opened = NcclLibrary { library, version: Version::new(0, 0, 0) };
        let address = opened.symbol("ncclGetVersion")?;
        // SAFETY: the symbol is NCCL's `ncclResult_t ncclGetVersion(int *version)`, in every NCCL
        // since 2.3 (a library without it failed the lookup above).
        let get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t = unsafe { std::mem::transmute(address) };
        let mut code: c_int = 0;
        // SAFETY: `code` is a valid out-pointer for the call.
        let result = unsafe { get_version(&mut code) };
        if result != ncclResult_t::ncclSuccess {
            return Err(NcclError::failed("ncclGetVersion", result));
        }
        let version = Version::from_code(code).ok_or_else(|| NcclError::VersionTooOld {
            found: Version::new(0, 0, 0),
            required: MINIMUM_VERSION,
            library: opened.path().display().to_string(),
        })?;
        if version < MINIMUM_VERSION {
            return Err(NcclError::VersionTooOld {
                found: version,
                required: MINIMUM_VERSION,
                library: opened.path().display().to_string(),
            });
        }
        opened.version = version;
        Ok(opened)
    }

    /// Where the library was found: the path, or the file name the dynamic loader resolved.
    pub fn path(&self) -> &Path {
        self.library.path()
    }

    /// The library's version, from `ncclGetVersion`.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The address of `symbol`, or an error naming it.
    pub fn symbol(&self, symbol: &'static str) -> Result<*const c_void, NcclError> {
        self.library.symbol(symbol).map_err(|reason| NcclError::SymbolNotFound {
            symbol,
            library: self.path().display().to_string(),
            reason,
        })
    }
}

/// The process's NCCL, found through [`LIBRARY_CANDIDATES`] and opened on first use.
pub fn library() -> Result<&'static NcclLibrary, NcclError> {
    static LIBRARY: OnceLock<Result<NcclLibrary, NcclError>> = OnceLock::new();
    LIBRARY.get_or_init(|| NcclLibrary::open(LIBRARY_CANDIDATES)).as_ref().map_err(Clone::clone)
}

/// The address of the NCCL function `symbol` in [`library`].
#[doc(hidden)]
pub fn resolve(symbol: &'static str) -> Result<*const c_void, NcclError> {
    library()?.symbol(symbol)
}

/// Turns bindgen's list of NCCL functions into lazily resolved wrappers.
macro_rules! nccl_functions {
    ($($functions:tt)*) => {
        lazy_functions! {
            library: "NCCL (`nccl.h`)", error: $crate::nccl::NcclError, resolve: $crate::nccl::resolve;
            $($functions)*
        }
    };
}
