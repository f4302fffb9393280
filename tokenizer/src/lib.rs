//! Placeholder: the Unigram tokenizer lands with issue 3.
#![deny(missing_docs)]

#[cfg(feature = "python")]
use pyo3::prelude::*;

/// The Python extension module `tokenizer._native`.
#[cfg(feature = "python")]
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
