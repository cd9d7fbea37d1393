//! A GPU that `probe` could have found, for tests of `prepare_on` (which
//! touches no device itself) on machines without one.

use hybridgen_runtime::cuda::{GpuDevice, GpuInfo};
use hybridgen_runtime::platform::ChosenDevice;
use hybridgen_runtime::rendezvous::Launch;

/// Two H100s, NCCL present, one process.
pub fn a_gpu() -> ChosenDevice {
    ChosenDevice::Cuda {
        info: GpuInfo {
            driver_version: 13000,
            nvrtc_version: (13, 0),
            nccl: true,
            devices: (0..2)
                .map(|ordinal| GpuDevice {
                    ordinal,
                    name: "NVIDIA H100".into(),
                    compute_capability: (9, 0),
                    total_memory: 80 << 30,
                    free_memory: 79 << 30,
                })
                .collect(),
        },
        launch: Launch::SingleProcess,
    }
}
