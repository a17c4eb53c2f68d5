//! Finding `libnccl.so.2`, opening it once, checking its version, and resolving each NCCL
//! function on its first call.
//!
//! NCCL is not a system library: it usually arrives inside a Python environment, as the
//! `nvidia-nccl-cu*` wheel that PyTorch depends on, where the dynamic loader does not look. So
//! after the loader's own search, the places pip puts it are tried: the active virtual or conda
//! environment, then the site-packages folders of `python3`. The list is [`LIBRARY_CANDIDATES`].

use std::ffi::{OsString, c_int, c_void};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{MINIMUM_VERSION, NcclError, Version, ncclResult_t};

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
            Candidate::PathInEnv(variable) => match env(variable) {
                Some(path) if !path.is_empty() => Ok(vec![PathBuf::from(path)]),
                _ => Err(format!("{variable} is not set")),
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
    library: libloading::Library,
    path: PathBuf,
    version: Version,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary").field("path", &self.path).field("version", &self.version).finish()
    }
}

impl NcclLibrary {
    /// Opens the first of `candidates` that loads, in the process's environment, and checks it.
    pub fn open(candidates: &[Candidate]) -> Result<NcclLibrary, NcclError> {
        NcclLibrary::open_in(candidates, &|name| std::env::var_os(name))
    }

    /// [`NcclLibrary::open`] with the environment variables that `env` gives.
    pub fn open_in(candidates: &[Candidate], env: &dyn Fn(&str) -> Option<OsString>) -> Result<NcclLibrary, NcclError> {
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
                match open_library(&path) {
                    Ok(library) => return NcclLibrary::checked(library, path),
                    Err(reason) => tried.push(format!("{}: {reason}", path.display())),
                }
            }
        }
        Err(NcclError::LibraryNotFound { tried })
    }

    /// Opens the library at `path` (a path, or a file name for the dynamic loader) and checks it.
    pub fn open_path(path: impl AsRef<Path>) -> Result<NcclLibrary, NcclError> {
        let path = path.as_ref().to_path_buf();
        match open_library(&path) {
            Ok(library) => NcclLibrary::checked(library, path),
            Err(reason) => Err(NcclError::LibraryNotFound { tried: vec![format!("{}: {reason}", path.display())] }),
        }
    }

    /// Asks the opened library for its version and refuses one older than [`MINIMUM_VERSION`].
    fn checked(library: libloading::Library, path: PathBuf) -> Result<NcclLibrary, NcclError> {
        let mut opened = NcclLibrary { library, path, version: Version::new(0, 0, 0) };
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
            library: opened.path.display().to_string(),
        })?;
        if version < MINIMUM_VERSION {
            return Err(NcclError::VersionTooOld {
                found: version,
                required: MINIMUM_VERSION,
                library: opened.path.display().to_string(),
            });
        }
        opened.version = version;
        Ok(opened)
    }

    /// Where the library was found: the path, or the file name the dynamic loader resolved.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The library's version, from `ncclGetVersion`.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The address of `symbol`, or an error naming it.
    pub fn symbol(&self, symbol: &'static str) -> Result<*const c_void, NcclError> {
        // SAFETY: the symbol is read as an opaque address; it is called only through the
        // signature bindgen generated for this name (see `nccl_functions!`).
        let found = unsafe { self.library.get::<*const c_void>(symbol.as_bytes()) };
        match found {
            Ok(address) => Ok(*address),
            Err(error) => Err(NcclError::SymbolNotFound {
                symbol,
                library: self.path.display().to_string(),
                reason: error.to_string(),
            }),
        }
    }
}

fn open_library(path: &Path) -> Result<libloading::Library, String> {
    // SAFETY: loading runs the library's initialisers. The candidates name NCCL (or a library a
    // user named deliberately), whose initialisers are sound; NCCL's only start its own state.
    unsafe { libloading::Library::new(path) }.map_err(|error| error.to_string())
}

/// The process's NCCL, found through [`LIBRARY_CANDIDATES`] and opened on first use.
pub fn library() -> Result<&'static NcclLibrary, NcclError> {
    static LIBRARY: OnceLock<Result<NcclLibrary, NcclError>> = OnceLock::new();
    LIBRARY.get_or_init(|| NcclLibrary::open(LIBRARY_CANDIDATES)).as_ref().map_err(Clone::clone)
}

/// One NCCL function's address, resolved on first use and remembered (errors too).
#[doc(hidden)]
pub struct LazySymbol {
    name: &'static str,
    address: OnceLock<Result<usize, NcclError>>,
}

impl LazySymbol {
    /// A symbol not yet resolved.
    pub const fn new(name: &'static str) -> Self {
        LazySymbol { name, address: OnceLock::new() }
    }

    /// The symbol's address in the process's NCCL.
    pub fn address(&self) -> Result<*const c_void, NcclError> {
        let resolved = self.address.get_or_init(|| library()?.symbol(self.name).map(|address| address as usize));
        match resolved {
            Ok(address) => Ok(*address as *const c_void),
            Err(error) => Err(error.clone()),
        }
    }
}

/// Turns bindgen's list of NCCL functions into lazily resolved wrappers.
macro_rules! nccl_functions {
    ($(pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {$(
        #[doc = concat!("`", stringify!($name), "` of NCCL, resolved on first use.")]
        ///
        /// # Safety
        /// The contract of the C function of this name in `nccl.h`.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) -> Result<$ret, $crate::nccl::NcclError> {
            static SYMBOL: $crate::nccl::loader::LazySymbol =
                $crate::nccl::loader::LazySymbol::new(stringify!($name));
            let address = SYMBOL.address()?;
            // SAFETY: `address` is NCCL's function of this exact name, and this signature is the
            // one bindgen read for it from the pinned `nccl.h`.
            let function: unsafe extern "C" fn($($ty),*) -> $ret =
                unsafe { std::mem::transmute(address) };
            // SAFETY: the caller upholds the C function's contract.
            Ok(unsafe { function($($arg),*) })
        }
    )*};
}
