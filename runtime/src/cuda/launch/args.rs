//! One kernel launch: its arguments, and the launch itself through
//! `cuLaunchKernelEx`, so a launch can carry programmatic stream
//! serialisation (programmatic dependent launch, PDL).
//!
//! With PDL a kernel may start while the kernel before it on the stream
//! drains: its blocks are scheduled once every block of the one before has
//! started (each kernel lets its dependants launch at its top, after its
//! own wait), and they wait in `grid_dependency_sync()` (`common.cuh`)
//! until that kernel has finished and its writes are visible. What this
//! hides is the launch gap between two kernels of a stream, a microsecond
//! or two each, thousands of times a step. Every kernel must begin with
//! that wait (a test holds the sources to it); without the attribute the
//! wait returns at once, so the same kernels run either way.
//!
//! cudarc's launch builder has no launch attributes, hence this one. The
//! arguments live in a fixed array (no allocation a launch).

use cudarc::driver::sys::{self, CUlaunchAttributeID};
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, DriverError, LaunchConfig};
use std::ffi::c_void;
use std::marker::PhantomData;

/// The most arguments a launch carries: more than any of our kernels
/// takes (a test over the sources holds them to it).
pub(crate) const MAX_ARGS: usize = 40;

/// A kernel's arguments in the order of its C signature, borrowed until
/// the launch (the driver copies them at the call).
pub(crate) struct KernelArgs<'a> {
    stream: &'a CudaStream,
    function: &'a CudaFunction,
    args: [*mut c_void; MAX_ARGS],
    len: usize,
    _values: PhantomData<&'a ()>,
}

impl<'a> KernelArgs<'a> {
    pub(crate) fn new(stream: &'a CudaStream, function: &'a CudaFunction) -> KernelArgs<'a> {
        KernelArgs {
            stream,
            function,
            args: [std::ptr::null_mut(); MAX_ARGS],
            len: 0,
            _values: PhantomData,
        }
    }

    /// Pushes the next argument. Past [`MAX_ARGS`] the launch fails
    /// (counted here, refused at [`KernelArgs::launch`]).
    pub(crate) fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        if let Some(slot) = self.args.get_mut(self.len) {
            *slot = value as *const T as *mut c_void;
        }
        self.len += 1;
        self
    }

    /// Enqueues the kernel on the stream; `dependent` sets programmatic
    /// stream serialisation (sm_90 and later).
    ///
    /// # Safety
    /// The arguments must match the kernel's C signature in number, order
    /// and type, and every address among them must be valid for what the
    /// kernel does with it at the dimensions it is given.
    pub(crate) unsafe fn launch(
        &mut self,
        config: LaunchConfig,
        dependent: bool,
    ) -> Result<(), DriverError> {
        if self.len > MAX_ARGS {
            return Err(DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE));
        }
        self.stream.context().bind_to_thread()?;
        let mut attribute = sys::CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let (grid, block) = (config.grid_dim, config.block_dim);
        let launch = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: u32::from(dependent),
        };
        // SAFETY: `launch` and `attribute` outlive the call, the function
        // belongs to the stream's context (bound above), and the caller
        // vouches for the arguments.
        unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                self.function.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
