//! A failed object operation ([`Failure`]: the error and the server it concerns) and the small
//! conversions between a session's replies and errors that every path of the object layer uses.

use bytes::Bytes;
use tonic::Code;

use crate::connection::ExchangeReply;
use crate::error::ClientError;

/// A failed object operation: the error and the server it concerns (its address; empty when
/// no server is involved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What went wrong.
    pub error: ClientError,
    /// The server's address.
    pub server: String,
}

impl Failure {
    pub(crate) fn at(error: ClientError, server: &str) -> Failure {
        Failure {
            error,
            server: server.to_string(),
        }
    }

    pub(crate) fn local(error: ClientError) -> Failure {
        Failure {
            error,
            server: String::new(),
        }
    }
}

pub(crate) fn kind_of(error: &ClientError) -> &str {
    match error {
        ClientError::Server { message, .. } => message.split_once(": ").map_or("", |(k, _)| k),
        _ => "",
    }
}

pub(crate) fn server_error(code: i32, kind: &str, message: String) -> ClientError {
    ClientError::Server {
        code,
        message: format!("{kind}: {message}"),
    }
}

/// The error a non-zero reply stands for.
pub(crate) fn reply_error(reply: &ExchangeReply) -> ClientError {
    ClientError::Server {
        code: i32::from(reply.status),
        message: String::from_utf8_lossy(&reply.body).into_owned(),
    }
}

/// A reply standing for a session that failed before running the op (a stale opening context).
pub(crate) fn failure_reply(error: &ClientError) -> ExchangeReply {
    ExchangeReply {
        status: u8::try_from(error.code()).unwrap_or(Code::Internal as u8),
        header: None,
        body: Bytes::from(error.to_string()),
    }
}

/// A JSON request body (a ticket, an action's body).
pub(crate) fn body<T: serde::Serialize>(request: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(request).expect("a request serializes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_their_kind() {
        let e = server_error(5, "not_found", "b/k".into());
        assert_eq!(kind_of(&e), "not_found");
        assert!(e.is_not_found());
        let reply = failure_reply(&ClientError::Server {
            code: 9,
            message: "stale_epoch: {\"epoch\":2}".into(),
        });
        assert_eq!(reply.status, 9);
        assert!(reply_error(&reply).is_stale_epoch());
    }
}
