//! NCCL itself: loading it at run time, its version, its unique id, its
//! configuration and its error messages.
//!
//! cudarc loads libnccl on first use and panics when the library or one of
//! its symbols is missing. [`nccl_version`] therefore opens the library
//! once, checks every symbol the communicator calls and the version, and
//! remembers the answer; every entry point calls it first, so a machine
//! without NCCL (or with one too old) gets an error naming what is missing
//! and what to install, never a panic in the middle of a run.

use crate::error::{Result, RuntimeError};
use cudarc::nccl::sys;
use std::ffi::{CStr, c_int};
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

/// Every NCCL function the communicator calls: each is looked up when the
/// library is first loaded.
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

const INSTALL: &str = "install NCCL 2.18 or newer (the system's libnccl2 package, or the \
                       `nvidia-nccl-cu13` wheel with its lib directory on LD_LIBRARY_PATH); a \
                       run on one GPU does not need it";

fn unavailable(what: String) -> RuntimeError {
    RuntimeError::Unsupported(format!("NCCL, which runs collectives between GPUs: {what}"))
}

/// The loaded library's version, after checking that libnccl loads, has
/// every function the communicator calls and is at least
/// [`NcclVersion::MINIMUM`]. Checked once per process; cheap afterwards.
pub fn nccl_version() -> Result<NcclVersion> {
    static LOADED: OnceLock<std::result::Result<NcclVersion, String>> = OnceLock::new();
    LOADED.get_or_init(load).clone().map_err(unavailable)
}

fn load() -> std::result::Result<NcclVersion, String> {
    // SAFETY: only tries to open the library under its candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "libnccl could not be loaded (looked for {}); {INSTALL}",
            cudarc::get_lib_name_candidates("nccl").join(", ")
        ));
    }
    let missing = crate::cuda::catch_cudarc_panic(|| {
        // SAFETY: the library is present (checked above); `get` only looks
        // a symbol up, it calls nothing.
        let library = unsafe { sys::culib() };
        SYMBOLS
            .iter()
            .filter(|name| {
                // SAFETY: as above; the symbol is not called through this
                // type.
                unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err()
            })
            .copied()
            .collect::<Vec<&str>>()
    })?;
    let mut code: c_int = 0;
    let version = if missing.contains(&"ncclGetVersion") {
        None
    } else {
        // SAFETY: the symbol exists; the call writes one int.
        let result = crate::cuda::catch_cudarc_panic(|| unsafe { sys::ncclGetVersion(&mut code) })?;
        (result == sys::ncclResult_t::ncclSuccess).then(|| NcclVersion::from_code(code))
    };
    match version {
        Some(version) if version < NcclVersion::MINIMUM => Err(format!(
            "the libnccl found is version {version}, older than {} which the communicator \
             needs; {INSTALL}",
            NcclVersion::MINIMUM
        )),
        _ if !missing.is_empty() => Err(format!(
            "the libnccl found{} lacks {}; {INSTALL}",
            version
                .map(|v| format!(" (version {v})"))
                .unwrap_or_default(),
            missing.join(", ")
        )),
        Some(version) => Ok(version),
        None => Err(format!("ncclGetVersion failed; {INSTALL}")),
    }
}

/// The identity of one NCCL communicator in the making: rank 0 creates it
/// ([`NcclUniqueId::new`]) and every rank passes the same bytes to
/// [`crate::cuda::NcclComm::from_unique_id`]. Across processes it travels
/// through [`crate::launch::rendezvous`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId([u8; NcclUniqueId::BYTES]);

impl NcclUniqueId {
    /// `NCCL_UNIQUE_ID_BYTES`.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`; it also starts the bootstrap listener
    /// the ranks meet at, in this process).
    pub fn new() -> Result<Self> {
        nccl_version()?;
        let id = crate::cuda::catch_cudarc_panic(cudarc::nccl::result::get_uniqueid)
            .map_err(unavailable)?
            .map_err(|e| {
                RuntimeError::Unsupported(format!(
                    "ncclGetUniqueId failed: {} (NCCL looks for a network interface to \
                     bootstrap on; set NCCL_SOCKET_IFNAME if it picks a wrong one)",
                    error_text(e.0, None)
                ))
            })?;
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

/// NCCL's words for `result`, and its last error message when it has one
/// (`ncclGetLastError`: the detail, such as which peer or which call).
pub(super) fn error_text(result: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    let text = |ptr: *const std::ffi::c_char| {
        // SAFETY: NCCL returns static or library-owned NUL-terminated
        // strings (or null).
        (!ptr.is_null()).then(|| {
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        })
    };
    let texts = crate::cuda::catch_cudarc_panic(|| {
        // SAFETY: both calls only read NCCL's tables; the comm argument of
        // ncclGetLastError is not dereferenced when null.
        let what = text(unsafe { sys::ncclGetErrorString(result) });
        let last = text(unsafe { sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut())) });
        (what, last)
    });
    let (what, last) = texts.unwrap_or((None, None));
    let what = what.unwrap_or_else(|| format!("{result:?}"));
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
