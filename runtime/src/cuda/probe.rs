//! Is there a usable GPU? [`probe`] loads the CUDA driver, counts the
//! visible devices (`CUDA_VISIBLE_DEVICES` is the driver's to apply) and
//! reads each one's name, compute capability and memory, and checks that
//! the libraries the backend needs (NVRTC, cuBLAS) load. Whatever is
//! missing comes back as a [`CudaUnavailable`] naming it; nothing panics
//! (cudarc panics on a library it cannot load, so each one is looked for
//! first, and any panic left is caught).

use super::kernels::{Target, nvrtc_version};
use std::fmt;

/// One visible GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDevice {
    /// The driver's ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    /// Free when probed (other processes may hold some).
    pub free_memory: usize,
}

impl GpuDevice {
    /// The architecture its kernels are compiled for.
    pub fn target(&self) -> Target {
        Target::for_device(self.compute_capability.0, self.compute_capability.1)
    }
}

impl fmt::Display for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: f64 = (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} (compute {}.{}, {:.1} of {:.1} GiB free)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.free_memory as f64 / GIB,
            self.total_memory as f64 / GIB
        )
    }
}

/// The GPUs this process can use, and the libraries found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub driver_version: i32,
    /// NVRTC's version (major, minor).
    pub nvrtc_version: (i32, i32),
    /// Whether libnccl loads (needed by runs of more than one GPU).
    pub nccl: bool,
    /// At least one, each of compute capability 8.0 or newer.
    pub devices: Vec<GpuDevice>,
}

/// Why no GPU can be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    #[error(
        "no CUDA driver: libcuda could not be loaded (looked for {searched}); install the NVIDIA \
         driver, or train on the CPU"
    )]
    NoDriver { searched: String },
    #[error("the CUDA driver failed: {call}: {message}")]
    Driver { call: &'static str, message: String },
    #[error(
        "no CUDA device is visible (the driver found none; check nvidia-smi and \
         CUDA_VISIBLE_DEVICES), or train on the CPU"
    )]
    NoDevice,
    #[error("NVRTC, which compiles the GPU kernels, is missing: {0}")]
    NvrtcMissing(String),
    #[error(
        "cuBLAS (libcublas.so.13), which runs the GPU matrix products, could not be loaded; \
         install the CUDA toolkit or the `nvidia-cublas` wheel and put its lib directory on \
         LD_LIBRARY_PATH"
    )]
    CublasMissing,
    #[error(
        "{device} is too old: the CUDA backend needs compute capability {}.{} or newer (bf16); \
         hide it with CUDA_VISIBLE_DEVICES, or train on the CPU",
        Target::MIN_COMPUTE_CAPABILITY.0,
        Target::MIN_COMPUTE_CAPABILITY.1
    )]
    TooOld { device: String },
}

/// Looks for usable GPUs; see the module documentation.
pub fn probe() -> Result<GpuInfo, CudaUnavailable> {
    // SAFETY: only tries to open the library under its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver {
            searched: cudarc::get_lib_name_candidates("cuda").join(", "),
        });
    }
    super::catch_cudarc_panic(probe_driver).unwrap_or_else(|message| {
        Err(CudaUnavailable::Driver {
            call: "loading the driver's functions",
            message,
        })
    })
}

fn driver_error(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaUnavailable {
    move |e| CudaUnavailable::Driver {
        call,
        message: e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{e:?}")),
    }
}

fn probe_driver() -> Result<GpuInfo, CudaUnavailable> {
    use cudarc::driver::{CudaContext, result, sys::CUresult};
    match result::init() {
        Ok(()) => {}
        Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => return Err(CudaUnavailable::NoDevice),
        Err(e) => return Err(driver_error("cuInit")(e)),
    }
    let mut driver_version = 0;
    // SAFETY: the driver is loaded and initialised; the call writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(driver_error("cuDriverGetVersion"))?;
    let count = result::device::get_count().map_err(driver_error("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(CudaUnavailable::NoDevice);
    }
    let mut devices = Vec::with_capacity(count as usize);
    for ordinal in 0..count as usize {
        // The primary context: the one the backend uses later, so creating
        // it here costs nothing twice.
        let context =
            CudaContext::new(ordinal).map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
        let name = context.name().map_err(driver_error("cuDeviceGetName"))?;
        let compute_capability = context
            .compute_capability()
            .map_err(driver_error("cuDeviceGetAttribute"))?;
        let (free_memory, total_memory) = context
            .mem_get_info()
            .map_err(driver_error("cuMemGetInfo"))?;
        let device = GpuDevice {
            ordinal,
            name,
            compute_capability,
            total_memory,
            free_memory,
        };
        if compute_capability < Target::MIN_COMPUTE_CAPABILITY {
            return Err(CudaUnavailable::TooOld {
                device: device.to_string(),
            });
        }
        devices.push(device);
    }
    let nvrtc_version =
        nvrtc_version().map_err(|e| CudaUnavailable::NvrtcMissing(e.to_string()))?;
    // SAFETY: only tries to open the libraries under their candidate names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaUnavailable::CublasMissing);
    }
    // NCCL is opened by the communicator's own loader (cudarc's does not
    // try libnccl.so.2, its runtime name).
    let nccl = super::nccl::nccl_version().is_ok();
    Ok(GpuInfo {
        driver_version,
        nvrtc_version,
        nccl,
        devices,
    })
}
