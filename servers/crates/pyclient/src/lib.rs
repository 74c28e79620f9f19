//! `pocketflow._core`: the Python face of the client core. Thin on purpose: it converts
//! arguments, releases the GIL around every blocking call, and maps the core's errors to
//! `pocketflow.errors` in one function (`errors::to_py_err`).

use std::time::Duration;

use pocketflow_client::channels::PLACED_OPS_MAX;
use pyo3::prelude::*;

mod connection;
mod convert;
mod errors;
mod listing;
mod memory;
mod objects;
mod placement;
mod shared;
mod units;
mod upload;

/// How often a long call looks at Python's pending signals (Ctrl-C), with the GIL taken briefly.
pub(crate) const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Keep freed megabyte-sized buffers in the process (unless `POCKETFLOW_MALLOC_TUNING=0`).
/// Every DoPut and DoGet piece is a buffer of up to `BATCH_MAX_BYTES`; with glibc's defaults each
/// one is mapped and unmapped again, and the kernel zeroes its pages on every reuse: a 1 MiB put
/// took 2.7 ms instead of 1.7 ms. Buffers up to 32 MiB then come from the heap, and up to
/// 128 MiB of free heap top is kept. This is process-wide, hence the switch.
fn keep_transfer_buffers() {
    const MMAP_THRESHOLD_BYTES: libc::c_int = 32 << 20;
    const TRIM_THRESHOLD_BYTES: libc::c_int = 128 << 20;
    if std::env::var_os("POCKETFLOW_MALLOC_TUNING").is_some_and(|v| v == "0") {
        return;
    }
    // SAFETY: mallopt only changes allocator parameters, under glibc's own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
    }
}

/// The native client core of pocketflow.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    keep_transfer_buffers();
    m.add_class::<connection::PyConnection>()?;
    m.add_class::<placement::PyPlacement>()?;
    m.add_class::<objects::PyObjects>()?;
    m.add_class::<listing::PyListing>()?;
    m.add_class::<upload::PyUpload>()?;
    m.add_class::<shared::PySharedView>()?;
    m.add_function(wrap_pyfunction!(placement::placed_block, m)?)?;
    m.add_function(wrap_pyfunction!(units::parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(units::parse_duration_ns, m)?)?;
    m.add("PLACED_OPS_MAX", PLACED_OPS_MAX)?;
    Ok(())
}
