//! What a transport's calls fail with: [`TransportError`], in plain words, with the provider's call and code as its
//! source ([`CallError`]).

use std::io;

use std::net::SocketAddr;

/// A synchronous transport failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// No such device or provider; the list says what this machine has.
    #[error("not found: {wanted}; available: {}", if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    NotFound {
        /// What was asked for.
        wanted: String,
        /// What exists.
        available: Vec<String>,
    },
    /// The address is in use.
    #[error("address in use: {0}")]
    AddrInUse(SocketAddr),
    /// The address cannot be used here.
    #[error("address not available: {0}")]
    AddrNotAvailable(String),
    /// Out of a resource (queue entries, memory registrations, endpoints).
    #[error("out of resources: {0}")]
    Resource(String),
    /// The transport cannot do that.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Invalid argument reached the transport (a bug in the caller, reported instead of crashing).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The endpoint is unknown or gone.
    #[error("no such endpoint")]
    NoEndpoint,
    /// The device failed one of our work requests for a reason of its own (not a flush, a retry limit or the
    /// peer's refusal, which say more): the connection it was posted on goes down. `EIO` in the C API.
    #[error("the device failed a work request: {0}")]
    RequestFailed(crate::WcError),
    /// A backend that was chosen (named by the user, or picked because it could serve) failed to open; `why`
    /// says how it was chosen.
    #[error("the {backend} backend ({why}) did not open: {error}")]
    Backend {
        /// The backend (`verbs`, `fabric`, `sim`).
        backend: String,
        /// How it was chosen, in plain words (`EXS_BACKEND=verbs`, `the only backend compiled in`).
        why: String,
        /// What opening it returned.
        error: Box<TransportError>,
    },
    /// A system or provider call failed. The message is the error's plain text; the call and its code are the
    /// error's `source()`.
    #[error("{message}")]
    Os {
        /// Which call, and the code it returned.
        #[source]
        call: CallError,
        /// `std::io::ErrorKind` of the code.
        kind: io::ErrorKind,
        /// The error's text, in lower case and without the code.
        message: String,
    },
}

/// The system or provider call behind a [`TransportError::Os`], and its code: for logs and `source()` chains, not
/// for the message a user reads first.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} returned {code}")]
pub struct CallError {
    /// The call (`fi_getinfo`, `ibv_reg_mr`, `epoll_create`).
    pub call: String,
    /// What it returned (a negative libfabric code, or an errno).
    pub code: i64,
}

/// `text` as a message: the first letter in lower case (unless the word is an acronym), without a trailing
/// `(os error N)` or `(-N)`.
pub fn plain_text(text: &str) -> String {
    let t = text.split(" (os error").next().unwrap_or(text);
    let t = match t.rfind(" (") {
        Some(i) if t.ends_with(')') && t[i + 2..t.len() - 1].parse::<i64>().is_ok() => &t[..i],
        _ => t,
    };
    let mut c = t.chars();
    match (c.next(), c.next()) {
        (Some(a), Some(b)) if a.is_uppercase() && !b.is_uppercase() => {
            a.to_lowercase().chain(t[a.len_utf8()..].chars()).collect()
        }
        _ => t.to_string(),
    }
}

impl TransportError {
    /// Builds an OS error from a call name and an `io::Error`.
    pub fn os(call: impl Into<String>, e: io::Error) -> Self {
        let call = call.into();
        tracing::debug!(call, error = %e, "call failed");
        TransportError::Os {
            call: CallError {
                call,
                code: e.raw_os_error().unwrap_or(0).into(),
            },
            kind: e.kind(),
            message: plain_text(&e.to_string()),
        }
    }

    /// The closest `std::io::ErrorKind`.
    pub fn io_kind(&self) -> io::ErrorKind {
        match self {
            TransportError::NotFound { .. } => io::ErrorKind::NotFound,
            TransportError::AddrInUse(_) => io::ErrorKind::AddrInUse,
            TransportError::AddrNotAvailable(_) => io::ErrorKind::AddrNotAvailable,
            TransportError::Resource(_) => io::ErrorKind::OutOfMemory,
            TransportError::Unsupported(_) => io::ErrorKind::Unsupported,
            TransportError::Invalid(_) => io::ErrorKind::InvalidInput,
            TransportError::NoEndpoint => io::ErrorKind::NotConnected,
            TransportError::RequestFailed(_) => io::ErrorKind::Other,
            TransportError::Os { kind, .. } => *kind,
            TransportError::Backend { error, .. } => error.io_kind(),
        }
    }
}

impl From<TransportError> for io::Error {
    fn from(e: TransportError) -> Self {
        io::Error::new(e.io_kind(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn a_failed_call_reads_in_plain_words_with_the_call_and_code_as_its_source() {
        let e = TransportError::os("epoll_create", io::Error::from_raw_os_error(24));
        assert_eq!(e.to_string(), "too many open files");
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("epoll_create returned 24")
        );
        assert_eq!(
            plain_text("Address already in use (-98)"),
            "address already in use"
        );
        assert_eq!(
            plain_text("RDMA device (rxe0) busy"),
            "RDMA device (rxe0) busy"
        );
    }

    #[test]
    fn a_backend_that_did_not_open_says_which_and_how_it_was_chosen() {
        let e = TransportError::Backend {
            backend: "verbs".into(),
            why: "EXS_BACKEND=verbs".into(),
            error: Box::new(TransportError::NotFound {
                wanted: "an RDMA device for 10.0.0.1".into(),
                available: Vec::new(),
            }),
        };
        assert_eq!(
            e.to_string(),
            "the verbs backend (EXS_BACKEND=verbs) did not open: not found: an RDMA device for 10.0.0.1; \
             available: none"
        );
        assert_eq!(e.io_kind(), io::ErrorKind::NotFound);
    }
}
