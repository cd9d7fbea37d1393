//! `cuda::probe` answers on every machine without panicking: a GPU machine
//! gets its devices, anything else an error that names what is missing.

use hybridgen_runtime::cuda::{CudaUnavailable, probe};

#[test]
fn probe_reports_devices_or_what_is_missing() {
    match probe() {
        Ok(info) => {
            assert!(!info.devices.is_empty());
            for device in &info.devices {
                assert!(device.compute_capability >= (8, 0), "{device}");
                assert!(device.free_memory <= device.total_memory, "{device}");
                println!("{device}, kernels for {}", device.target());
            }
            println!(
                "driver {}.{}, NVRTC {}.{}, NCCL {}",
                info.driver_version / 1000,
                info.driver_version % 1000 / 10,
                info.nvrtc_version.0,
                info.nvrtc_version.1,
                if info.nccl { "found" } else { "missing" }
            );
        }
        Err(why) => {
            let message = why.to_string();
            println!("no usable GPU: {message}");
            match why {
                CudaUnavailable::NoDriver { .. } => {
                    assert!(message.contains("libcuda"), "{message}")
                }
                CudaUnavailable::NoDevice => {
                    assert!(message.contains("no CUDA device"), "{message}")
                }
                CudaUnavailable::NvrtcMissing(_) => assert!(message.contains("NVRTC"), "{message}"),
                CudaUnavailable::CublasMissing => assert!(message.contains("cuBLAS"), "{message}"),
                CudaUnavailable::TooOld { .. } => {
                    assert!(message.contains("compute capability"), "{message}")
                }
                CudaUnavailable::Driver { call, .. } => {
                    assert!(message.contains(call), "{message}")
                }
            }
        }
    }
}
