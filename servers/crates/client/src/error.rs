//! The client core's one error type; the Python binding maps each variant to one exception class.

use tonic::Code;

/// Why a client operation failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ClientError {
    /// The server answered with an error status; `message` starts with the error kind
    /// (`"not_found: ..."`), as every pocketflow server status does.
    #[error("{message}")]
    Server {
        /// The gRPC status code.
        code: i32,
        /// The status message.
        message: String,
    },
    /// The server could not be reached, went away, or did not answer within its bound.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The server broke the protocol (a reply nobody asked for, a malformed frame or piece).
    #[error("internal: protocol violation: {0}")]
    Protocol(String),
    /// The caller's request cannot be sent as given (sizes, a closed connection, another process).
    #[error("invalid_argument: {0}")]
    InvalidArgument(String),
    /// Every session this client may open to the server stayed busy with the client's own
    /// other calls for the whole wait: the client is overloaded, not the server (nothing was
    /// sent, so nothing happened).
    #[error("client_busy: {0}")]
    Busy(String),
    /// The kernel gave no random bytes for a new object's version within its bounded retries
    /// (nothing was sent).
    #[error("internal: no random version: {0}")]
    Randomness(String),
}

impl ClientError {
    /// The gRPC code this error corresponds to (14 UNAVAILABLE for transport failures).
    pub fn code(&self) -> i32 {
        match self {
            ClientError::Server { code, .. } => *code,
            ClientError::Unavailable(_) => Code::Unavailable as i32,
            ClientError::Protocol(_) => Code::Internal as i32,
            ClientError::InvalidArgument(_) => Code::InvalidArgument as i32,
            ClientError::Busy(_) => Code::Unavailable as i32,
            ClientError::Randomness(_) => Code::Internal as i32,
        }
    }

    /// Whether the server refused a new session for its bound on sessions
    /// (`capacity_exhausted` before any operation of the session ran).
    pub fn is_capacity_exhausted(&self) -> bool {
        matches!(self, ClientError::Server { code, .. } if *code == Code::ResourceExhausted as i32)
    }

    /// Whether this is a transport failure (unreachable, reset, timed out).
    pub fn is_unavailable(&self) -> bool {
        match self {
            ClientError::Unavailable(_) => true,
            // A draining server and a check refused for a suspect answered: nothing happened.
            ClientError::Server { code, message } => {
                transport_code(*code)
                    && !message.starts_with("draining: ")
                    && !message.starts_with("suspect_server: ")
            }
            _ => false,
        }
    }

    /// Whether the server said the job's epoch is stale.
    pub fn is_stale_epoch(&self) -> bool {
        matches!(self, ClientError::Server { message, .. } if message.starts_with("stale_epoch: "))
    }

    /// Whether the server said a block or record is not there.
    pub fn is_not_found(&self) -> bool {
        matches!(self, ClientError::Server { code, .. } if *code == Code::NotFound as i32)
    }

    /// Whether the server said it accepted the object's bytes and then lost them (`data_lost`,
    /// DATA_LOSS: a write behind the put failed in the device). The object stays unreadable
    /// until written again; it is a definite answer, not a transport failure.
    pub fn is_data_lost(&self) -> bool {
        matches!(self, ClientError::Server { code, .. } if *code == Code::DataLoss as i32)
    }

    /// Whether the server (or a write-once check) said the key already holds an object.
    pub fn is_already_exists(&self) -> bool {
        matches!(self, ClientError::Server { code, .. } if *code == Code::AlreadyExists as i32)
    }
}

fn transport_code(code: i32) -> bool {
    code == Code::Unavailable as i32
        || code == Code::DeadlineExceeded as i32
        || code == Code::Cancelled as i32
        || code == Code::Unknown as i32
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        let code = status.code();
        let message = status.message().to_string();
        // A pocketflow server opens every message with its error kind; a status without one
        // comes from the transport (connection refused or reset, h2 errors).
        let has_kind = message.split_once(": ").is_some_and(|(kind, _)| {
            !kind.is_empty() && kind.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        });
        if !has_kind {
            // A TLS failure (untrusted, expired or misnamed certificate, a plaintext peer) is
            // not transient: name it instead of reporting the server unreachable.
            if let Some(cause) = crate::tls::tls_cause(&status) {
                return ClientError::Server {
                    code: Code::PermissionDenied as i32,
                    message: format!("permission_denied: {}{cause}", crate::tls::TLS_ERROR_PREFIX),
                };
            }
        }
        if transport_code(code as i32) && !has_kind {
            let detail = if message.is_empty() {
                format!("{code:?}")
            } else {
                message
            };
            return ClientError::Unavailable(detail);
        }
        ClientError::Server {
            code: code as i32,
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_lost_is_its_own_answer() {
        let err = ClientError::from(tonic::Status::data_loss(
            "data_lost: the block's bytes were accepted but never reached /dev/loop0: EIO",
        ));
        assert!(err.is_data_lost());
        assert_eq!(err.code(), 15);
        assert!(!err.is_unavailable());
        assert!(!err.is_not_found());
        assert!(crate::writes::refused(&err));
        assert!(!ClientError::Unavailable("reset".into()).is_data_lost());
    }

    #[test]
    fn statuses_with_a_kind_stay_server_errors() {
        let err = ClientError::from(tonic::Status::not_found("not_found: b/k"));
        assert!(err.is_not_found());
        assert_eq!(err.code(), 5);
        let err = ClientError::from(tonic::Status::unavailable("draining: bye"));
        assert!(!err.is_unavailable());
        let err = ClientError::from(tonic::Status::failed_precondition("stale_epoch: {}"));
        assert!(err.is_stale_epoch());
    }

    #[test]
    fn transport_statuses_are_unavailable() {
        let err = ClientError::from(tonic::Status::unavailable("tcp connect error"));
        assert!(matches!(err, ClientError::Unavailable(_)));
        assert!(err.is_unavailable());
        let err = ClientError::from(tonic::Status::unknown(""));
        assert!(err.is_unavailable());
        let err = ClientError::from(tonic::Status::resource_exhausted("capacity_exhausted: x"));
        assert!(err.is_capacity_exhausted());
    }
}
