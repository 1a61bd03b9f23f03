//! Opening a CUDA device through the driver and loading the libraries a user of it needs: one
//! implementation for the executor and the GPU model (`bgs-model-gpu`), so both give the same
//! errors for a missing driver, device or library.

use std::path::{Path, PathBuf};

use cudarc::driver::sys as cu;

use crate::{GpuError, libs};

/// A driver call's result as a [`GpuError::Cuda`] naming the call and the error.
pub fn check(r: cu::CUresult, what: &str) -> Result<(), GpuError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            what: what.to_string(),
            name: format!("{r:?}"),
        })
    }
}

/// A device the driver opened (no context yet).
#[derive(Debug, Clone)]
pub struct OpenedDevice {
    /// The driver's handle.
    pub dev: cu::CUdevice,
    /// Device name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Driver version (e.g. 13000).
    pub driver_version: i32,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED`.
    pub host_native_atomics: bool,
    /// Streaming multiprocessors (`CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`).
    pub multiprocessors: u32,
}

/// Load the driver, initialise it and open device `ordinal`. Without the driver library,
/// without a device or with an ordinal past the last, a [`GpuError`] says which.
pub fn open(ordinal: usize) -> Result<OpenedDevice, GpuError> {
    // SAFETY: only tries to dlopen the driver library; nothing is called through it yet.
    if !unsafe { cu::is_culib_present() } {
        return Err(GpuError::MissingDriver(
            "libcuda.so.1 (the NVIDIA driver library) could not be loaded".into(),
        ));
    }
    // SAFETY: the driver library is present (checked above); cuInit may be called any time.
    let r = unsafe { cu::cuInit(0) };
    if r == cu::CUresult::CUDA_ERROR_NO_DEVICE {
        return Err(GpuError::NoDevice(
            "cuInit reported CUDA_ERROR_NO_DEVICE (no GPU, or CUDA_VISIBLE_DEVICES hides them)"
                .into(),
        ));
    }
    check(r, "cuInit")?;
    let mut count = 0;
    check(
        // SAFETY: initialized driver; valid out-pointer.
        unsafe { cu::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )?;
    if count <= 0 {
        return Err(GpuError::NoDevice("the driver sees no CUDA device".into()));
    }
    if ordinal >= count as usize {
        return Err(GpuError::NoDevice(format!(
            "device {ordinal} requested, {count} present"
        )));
    }
    let mut dev: cu::CUdevice = 0;
    let mut name = [0 as std::ffi::c_char; 256];
    let (mut major, mut minor, mut native, mut driver, mut sms) = (0, 0, 0, 0, 0);
    // SAFETY: initialized driver, valid ordinal, valid out-pointers and buffer length.
    unsafe {
        use cu::CUdevice_attribute as A;
        check(cu::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
        check(
            cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
            "cuDeviceGetName",
        )?;
        for (out, attr, what) in [
            (
                &mut major,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "cuDeviceGetAttribute(compute capability major)",
            ),
            (
                &mut minor,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "cuDeviceGetAttribute(compute capability minor)",
            ),
            (
                &mut native,
                A::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED,
                "cuDeviceGetAttribute(host native atomics)",
            ),
            (
                &mut sms,
                A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "cuDeviceGetAttribute(multiprocessor count)",
            ),
        ] {
            check(cu::cuDeviceGetAttribute(out, attr, dev), what)?;
        }
        check(cu::cuDriverGetVersion(&mut driver), "cuDriverGetVersion")?;
    }
    // SAFETY: cuDeviceGetName wrote a NUL-terminated string into `name`.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok(OpenedDevice {
        dev,
        name,
        compute_capability: (major, minor),
        driver_version: driver,
        host_native_atomics: native != 0,
        multiprocessors: sms.max(1) as u32,
    })
}

/// The libraries loaded: the directories searched, and per library (what, path).
pub type Loaded = (Vec<PathBuf>, Vec<(String, String)>);

/// A probe of whether cudarc finds a library by soname.
type SonameProbe = unsafe fn() -> bool;

/// Load `specs` by path (`libs::search_dirs` of `cuda_home` and `$CUDA_HOME`), then make sure
/// cudarc, which opens cuBLAS, cuFFT and NVRTC by soname, finds the copies loaded (it would
/// panic otherwise). Returns the directories searched and, per library, where it came from.
pub fn load_libraries(
    cuda_home: Option<&Path>,
    specs: &[libs::LibSpec],
) -> Result<Loaded, GpuError> {
    let env_home = std::env::var("CUDA_HOME").ok();
    let dirs = libs::search_dirs(cuda_home, env_home.as_deref());
    let mut loaded = Vec::with_capacity(specs.len());
    for spec in specs {
        loaded.push((spec.what.to_string(), libs::load(spec, &dirs)?));
    }
    // (Only the wanted ones are probed: a probe dlopens by soname.)
    let probes: [(&libs::LibSpec, &str, SonameProbe); 3] = [
        (
            &libs::CUBLAS,
            "cuBLAS",
            cudarc::cublas::sys::is_culib_present,
        ),
        (&libs::CUFFT, "cuFFT", cudarc::cufft::sys::is_culib_present),
        (&libs::NVRTC, "NVRTC", cudarc::nvrtc::sys::is_culib_present),
    ];
    for (lib, what, present) in probes {
        if !specs.iter().any(|s| s.what == lib.what) {
            continue;
        }
        // SAFETY: the probe only dlopens; the library was opened by path above.
        if !unsafe { present() } {
            return Err(GpuError::MissingLibrary {
                what: what.into(),
                detail: "loaded by path but not found by soname (set LD_LIBRARY_PATH)".into(),
            });
        }
    }
    Ok((dirs, loaded))
}
