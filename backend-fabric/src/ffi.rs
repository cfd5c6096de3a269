//! Raw bindings (bindgen over the system headers plus our C shim) and the few helpers every call site needs.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    missing_debug_implementations
)]

include!(concat!(env!("OUT_DIR"), "/fi.rs"));

/// The API version we are written against.
pub const API_VERSION: u32 = (1 << 16) | 17;

/// libfabric's text for a (positive or negative) error code.
pub fn strerror(code: i64) -> String {
    let code = code.unsigned_abs() as i32;
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string for any code.
    let p = unsafe { exs_fi_strerror(code) };
    if p.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-null static C string (see above).
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}
