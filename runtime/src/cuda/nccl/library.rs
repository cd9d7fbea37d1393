//! NCCL itself: loading it at run time, its functions, its version, its
//! unique id, its configuration and its error messages.
//!
//! The library is opened here rather than through cudarc's loader, for two
//! reasons. cudarc looks for `libnccl.so` and `libnccl.so.<CUDA major>`,
//! but NCCL's runtime library is `libnccl.so.2` (the only name a system
//! with the runtime package and no development package has, and the one
//! the `nvidia-nccl-cu13` wheel ships). And cudarc panics when a library or
//! a symbol is missing, in the middle of whatever first called it. So
//! [`nccl_version`] opens the library once, looks up every function the
//! communicator calls, checks the version and remembers the answer; a
//! machine without NCCL (or with one too old) gets an error naming what is
//! missing and what to install. cudarc's bindings still give the C types.
//!
//! NCCL's results come back as plain numbers ([`NcclStatus`]), never as a
//! Rust enum: a library newer than the bindings may return codes they do
//! not know.

use crate::error::{Result, RuntimeError};
use cudarc::nccl::sys;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::sync::OnceLock;

/// An NCCL release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NcclVersion {
    /// The oldest release with everything the communicator calls
    /// (`ncclCommSplit` came in 2.18).
    pub const MINIMUM: NcclVersion = NcclVersion::new(2, 18, 0);
    /// The release whose `ncclConfig_t` cudarc's bindings describe.
    const BINDINGS: NcclVersion = NcclVersion::new(2, 30, 0);

    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        NcclVersion {
            major,
            minor,
            patch,
        }
    }

    /// Decodes `ncclGetVersion`'s number (`NCCL_VERSION_CODE`): 2.8.4 and
    /// older as `X*1000 + Y*100 + Z`, later ones as `X*10000 + Y*100 + Z`.
    pub fn from_code(code: i32) -> Self {
        let code = code.max(0) as u32;
        if code >= 10_000 {
            NcclVersion::new(code / 10_000, code % 10_000 / 100, code % 100)
        } else {
            NcclVersion::new(code / 1000, code % 1000 / 100, code % 100)
        }
    }

    /// `NCCL_VERSION(major, minor, patch)`.
    pub fn code(self) -> u32 {
        if self.major <= 2 && self.minor <= 8 {
            self.major * 1000 + self.minor * 100 + self.patch
        } else {
            self.major * 10_000 + self.minor * 100 + self.patch
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// An `ncclResult_t` as NCCL returned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NcclStatus(pub u32);

impl NcclStatus {
    pub const SUCCESS: NcclStatus = NcclStatus(0);
    pub const IN_PROGRESS: NcclStatus = NcclStatus(7);

    pub fn is_success(self) -> bool {
        self == Self::SUCCESS
    }

    /// Success, or still running in the background (non-blocking mode).
    pub fn is_accepted(self) -> bool {
        self == Self::SUCCESS || self == Self::IN_PROGRESS
    }
}

type Status = u32;
type Comm = sys::ncclComm_t;
type Stream = sys::cudaStream_t;
type DataType = sys::ncclDataType_t;
type RedOp = sys::ncclRedOp_t;

/// The NCCL functions the communicator calls, looked up once.
pub(super) struct NcclApi {
    pub version: NcclVersion,
    pub get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> Status,
    pub get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    pub comm_init_rank_config: unsafe extern "C" fn(
        *mut Comm,
        c_int,
        sys::ncclUniqueId,
        c_int,
        *mut sys::ncclConfig_t,
    ) -> Status,
    pub comm_split:
        unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut sys::ncclConfig_t) -> Status,
    pub comm_abort: unsafe extern "C" fn(Comm) -> Status,
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut Status) -> Status,
    pub comm_count: unsafe extern "C" fn(Comm, *mut c_int) -> Status,
    pub comm_user_rank: unsafe extern "C" fn(Comm, *mut c_int) -> Status,
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, DataType, Comm, Stream) -> Status,
    pub reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        DataType,
        RedOp,
        Comm,
        Stream,
    ) -> Status,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        DataType,
        RedOp,
        Comm,
        Stream,
    ) -> Status,
    pub send: unsafe extern "C" fn(*const c_void, usize, DataType, c_int, Comm, Stream) -> Status,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, DataType, c_int, Comm, Stream) -> Status,
    pub group_start: unsafe extern "C" fn() -> Status,
    pub group_end: unsafe extern "C" fn() -> Status,
    /// Keeps the functions above loaded (for the whole process).
    _library: libloading::Library,
}

/// The names NCCL's library goes by: the runtime's soname first, then the
/// development link and the names cudarc tries.
fn library_names() -> Vec<String> {
    let mut names = vec!["libnccl.so.2".to_string()];
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

const INSTALL: &str = "install NCCL 2.18 or newer (the system's libnccl2 package, or the \
                       `nvidia-nccl-cu13` wheel with its lib directory on LD_LIBRARY_PATH); a \
                       run on one GPU does not need it";

fn unavailable(what: String) -> RuntimeError {
    RuntimeError::Unsupported(format!("NCCL, which runs collectives between GPUs: {what}"))
}

/// The loaded library's functions, after checking that it loads, has every
/// function the communicator calls and is at least
/// [`NcclVersion::MINIMUM`]. Loaded once per process; cheap afterwards.
pub(super) fn api() -> Result<&'static NcclApi> {
    static LOADED: OnceLock<std::result::Result<NcclApi, String>> = OnceLock::new();
    LOADED
        .get_or_init(load)
        .as_ref()
        .map_err(|what| unavailable(what.clone()))
}

/// The loaded library's version; see `api`.
pub fn nccl_version() -> Result<NcclVersion> {
    api().map(|api| api.version)
}

fn load() -> std::result::Result<NcclApi, String> {
    let names = library_names();
    let library = names
        .iter()
        // SAFETY: opening NCCL runs its initialisers, which only set up
        // NCCL's own state.
        .find_map(|name| unsafe { libloading::Library::new(name) }.ok())
        .ok_or_else(|| {
            format!(
                "libnccl could not be loaded (looked for {}); {INSTALL}",
                names.join(", ")
            )
        })?;
    // Every function first, so the error names all that are missing.
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        // SAFETY: only looks the symbol up.
        .filter(|name| unsafe { library.get::<*const c_void>(name.as_bytes()) }.is_err())
        .collect();
    let version = if missing.contains(&"ncclGetVersion") {
        None
    } else {
        let mut code: c_int = 0;
        // SAFETY: NCCL's `ncclResult_t ncclGetVersion(int*)`; writes one int.
        let read = unsafe {
            library
                .get::<unsafe extern "C" fn(*mut c_int) -> Status>(b"ncclGetVersion")
                .map(|get| (*get)(&mut code))
        };
        matches!(read, Ok(0)).then(|| NcclVersion::from_code(code))
    };
    match version {
        Some(version) if version < NcclVersion::MINIMUM => {
            return Err(format!(
                "the libnccl found is version {version}, older than {} which the \
                 communicator needs; {INSTALL}",
                NcclVersion::MINIMUM
            ));
        }
        _ if !missing.is_empty() => {
            return Err(format!(
                "the libnccl found{} lacks {}; {INSTALL}",
                version
                    .map(|v| format!(" (version {v})"))
                    .unwrap_or_default(),
                missing.join(", ")
            ));
        }
        None => return Err(format!("ncclGetVersion failed; {INSTALL}")),
        Some(_) => {}
    }
    macro_rules! function {
        ($name:literal) => {
            // SAFETY: NCCL's C function of that name, whose signature
            // (nccl.h, 2.18 to 2.30) is the field's type; present (checked
            // above).
            *unsafe { library.get($name.as_bytes()) }
                .map_err(|e| format!("looking up {}: {e}", $name))?
        };
    }
    Ok(NcclApi {
        version: version.unwrap_or(NcclVersion::MINIMUM),
        get_unique_id: function!("ncclGetUniqueId"),
        get_error_string: function!("ncclGetErrorString"),
        get_last_error: function!("ncclGetLastError"),
        comm_init_rank_config: function!("ncclCommInitRankConfig"),
        comm_split: function!("ncclCommSplit"),
        comm_abort: function!("ncclCommAbort"),
        comm_get_async_error: function!("ncclCommGetAsyncError"),
        comm_count: function!("ncclCommCount"),
        comm_user_rank: function!("ncclCommUserRank"),
        all_gather: function!("ncclAllGather"),
        reduce_scatter: function!("ncclReduceScatter"),
        all_reduce: function!("ncclAllReduce"),
        send: function!("ncclSend"),
        recv: function!("ncclRecv"),
        group_start: function!("ncclGroupStart"),
        group_end: function!("ncclGroupEnd"),
        _library: library,
    })
}

/// Every NCCL function the communicator calls (the fields of [`NcclApi`],
/// and the version query).
const SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommInitRankConfig",
    "ncclCommSplit",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclAllReduce",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// The identity of one NCCL communicator in the making: rank 0 creates it
/// ([`NcclUniqueId::new`]) and every rank passes the same bytes to
/// [`crate::cuda::NcclComm::from_unique_id`]. Across processes it travels
/// through [`crate::rendezvous::hand_out`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId([u8; NcclUniqueId::BYTES]);

impl NcclUniqueId {
    /// `NCCL_UNIQUE_ID_BYTES`.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`; it also starts the bootstrap listener
    /// the ranks meet at, in this process).
    pub fn new() -> Result<Self> {
        let api = api()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        let status = NcclStatus(unsafe { (api.get_unique_id)(&mut id) });
        if !status.is_success() {
            return Err(RuntimeError::Unsupported(format!(
                "ncclGetUniqueId failed: {} (NCCL looks for a network interface to bootstrap \
                 on; set NCCL_SOCKET_IFNAME if it picks a wrong one)",
                error_text(api, status, None)
            )));
        }
        Ok(NcclUniqueId(id.internal.map(|c| c as u8)))
    }

    /// The id as bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// An id received from rank 0.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bytes: [u8; Self::BYTES] = bytes.try_into().map_err(|_| {
            RuntimeError::InvalidArgument(format!(
                "an NCCL unique id is {} bytes, but {} were given (what rank 0 sent is not \
                 an id made by NcclUniqueId::new)",
                Self::BYTES,
                bytes.len()
            ))
        })?;
        Ok(NcclUniqueId(bytes))
    }

    pub(super) fn to_sys(self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The bytes hold the bootstrap address; printing them helps nobody.
        f.write_str("NcclUniqueId(..)")
    }
}

/// A configuration of non-blocking communicators: every NCCL call returns
/// at once (`ncclInProgress` while NCCL still works in the background) and
/// the caller polls `ncclCommGetAsyncError`, so no wait on a peer is ever
/// unbounded. Fields left undefined take NCCL's defaults (including its
/// environment variables).
pub(super) fn nonblocking_config(loaded: NcclVersion) -> sys::ncclConfig_t {
    const UNDEF_INT: c_int = c_int::MIN;
    const MAGIC: u32 = 0xcafe_beef;
    // NCCL reads `size` bytes (at most its own struct's) and trusts fields
    // by `version`: the older of the struct these bindings describe and the
    // library loaded is right for both.
    let version = loaded.min(NcclVersion::BINDINGS).code();
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: MAGIC,
        version,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// NCCL's words for `status`, and its last error message when it has one
/// (`ncclGetLastError`: the detail, such as which peer or which call).
pub(super) fn error_text(api: &NcclApi, status: NcclStatus, comm: Option<Comm>) -> String {
    let text = |ptr: *const c_char| {
        // SAFETY: NCCL returns static or library-owned NUL-terminated
        // strings (or null).
        (!ptr.is_null()).then(|| {
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        })
    };
    // SAFETY: both only read NCCL's tables; ncclGetLastError does not
    // dereference its communicator argument.
    let what = text(unsafe { (api.get_error_string)(status.0) })
        .unwrap_or_else(|| format!("NCCL error {}", status.0));
    let last = text(unsafe { (api.get_last_error)(comm.unwrap_or(std::ptr::null_mut())) });
    match last.map(|l| l.trim().to_string()).filter(|l| !l.is_empty()) {
        Some(last) => format!("{what} ({last})"),
        None => what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(NcclVersion::from_code(22809), NcclVersion::new(2, 28, 9));
        assert_eq!(NcclVersion::from_code(2804), NcclVersion::new(2, 8, 4));
        assert_eq!(NcclVersion::new(2, 28, 9).code(), 22809);
        assert_eq!(NcclVersion::new(2, 8, 4).code(), 2804);
        assert!(NcclVersion::from_code(21703) < NcclVersion::MINIMUM);
        assert!(NcclVersion::from_code(21803) >= NcclVersion::MINIMUM);
        assert_eq!(NcclVersion::new(2, 30, 1).to_string(), "2.30.1");
    }

    #[test]
    fn the_config_is_nonblocking_and_versioned_for_the_older_side() {
        let config = nonblocking_config(NcclVersion::new(2, 28, 9));
        assert_eq!(config.blocking, 0);
        assert_eq!(config.version, 22809);
        assert_eq!(config.magic, 0xcafe_beef);
        assert_eq!(config.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(config.splitShare, c_int::MIN);
        let newer = nonblocking_config(NcclVersion::new(2, 31, 0));
        assert_eq!(newer.version, NcclVersion::BINDINGS.code());
    }

    #[test]
    fn unique_ids_round_trip_and_refuse_other_lengths() {
        let bytes: Vec<u8> = (0..128u8).collect();
        let id = NcclUniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes(), &bytes[..]);
        assert_eq!(id.to_sys().internal[5] as u8, 5);
        assert_eq!(format!("{id:?}"), "NcclUniqueId(..)");
        let err = NcclUniqueId::from_bytes(&bytes[..100])
            .unwrap_err()
            .to_string();
        assert!(err.contains("128 bytes, but 100 were given"), "{err}");
    }
}
