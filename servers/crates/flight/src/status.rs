//! The service's one error type and its single mapping to gRPC statuses and DoExchange status
//! bytes: code fixed by the error's kind, message `"<kind>: <message>"`.

use bytes::Bytes;
use pocketflow_protocol::error::grpc_code;
use pocketflow_protocol::{ErrorKind, ProtocolError};
use pocketflow_store::StoreError;
use tonic::{Code, Status};

use crate::ipc::IpcError;

/// Every way a request can fail in the Flight service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The store refused or failed the operation.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The request did not decode or validate.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A DoPut or DoGet record batch is not a one-row binary batch.
    #[error(transparent)]
    Ipc(#[from] IpcError),
    /// The request's epoch is older than the job's current one; carries the current map.
    #[error("{map_json}")]
    StaleEpoch {
        /// The job's current weight map as JSON text.
        map_json: std::sync::Arc<str>,
    },
    /// The server is draining and refuses writes.
    #[error("server {node_id} is draining and refuses writes")]
    Draining {
        /// This server's node id.
        node_id: String,
    },
    /// A PERSIST write reached a server that is not long-running.
    #[error("server {node_id} is not long-running and refuses PERSIST objects")]
    PersistRefused {
        /// This server's node id.
        node_id: String,
    },
    /// A control-plane action without the admin token.
    #[error("action {0} needs the admin token")]
    AdminRequired(&'static str),
    /// A job-scoped request made with the admin token, or naming another job.
    #[error("token of job {token_job:?} cannot reach job {target_job:?}")]
    ForeignJob {
        /// Job the token was made for.
        token_job: String,
        /// Job the request names.
        target_job: String,
    },
    /// The control plane ended (deregistered) the job on this server.
    #[error(
        "job {job:?} was deregistered: it ended on server {node_id}, and its tokens no longer \
         write there"
    )]
    JobEnded {
        /// The job.
        job: String,
        /// This server's node id.
        node_id: String,
    },
    /// A write of a job the control plane has not told this server about (`set_epoch`): not
    /// registered yet, never, or ended and forgotten.
    #[error(
        "job {job:?} is not registered on server {node_id} (the control plane has not told it \
         the job's epoch)"
    )]
    JobNotRegistered {
        /// The job.
        job: String,
        /// This server's node id.
        node_id: String,
    },
    /// A bounded server resource (sessions, epoch table) is full.
    #[error("server has the maximum of {max} {what}")]
    ResourceBound {
        /// What is full.
        what: &'static str,
        /// The bound.
        max: usize,
    },
    /// A DoPut or DoGet moved nothing for the server's transfer idle time and was ended.
    #[error("{transfer} moved nothing for {idle_ms} ms and was ended")]
    TransferIdle {
        /// `DoPut` or `DoGet`.
        transfer: &'static str,
        /// The idle time.
        idle_ms: u64,
    },
    /// A request stream sent no message within its bound after it opened.
    #[error("the request sent nothing for {timeout_ms} ms after it opened and was ended")]
    RequestSilent {
        /// The bound.
        timeout_ms: u64,
    },
    /// A DoPut stream ended or changed blocks before a block was complete.
    #[error("block {index} ended after {written} of {declared} bytes")]
    BlockIncomplete {
        /// Block index.
        index: u32,
        /// Bytes received.
        written: u64,
        /// Declared block length.
        declared: u64,
    },
    /// A stream message is missing, or lacks what it must carry, or carries what it must not.
    #[error("{0}")]
    StreamShape(&'static str),
    /// A request message the transport could not take (over the message size bound): the
    /// transport's own words.
    #[error("request message refused: {0}")]
    MessageRefused(String),
    /// `set_cores` asked for an impossible number of cores or the kernel refused it.
    #[error(transparent)]
    Cores(#[from] crate::cores::CoresError),
}

impl ServiceError {
    /// The wire kind that fixes the status code.
    pub fn kind(&self) -> ErrorKind {
        match self {
            // The store names its kinds by string; an unknown name would be a store bug.
            ServiceError::Store(e) => ErrorKind::from_name(e.kind()).unwrap_or(ErrorKind::Internal),
            ServiceError::Protocol(e) => e.kind(),
            ServiceError::Ipc(_)
            | ServiceError::BlockIncomplete { .. }
            | ServiceError::StreamShape(_)
            | ServiceError::MessageRefused(_)
            | ServiceError::TransferIdle { .. }
            | ServiceError::RequestSilent { .. } => ErrorKind::InvalidArgument,
            ServiceError::StaleEpoch { .. } => ErrorKind::StaleEpoch,
            ServiceError::Draining { .. } => ErrorKind::Draining,
            ServiceError::PersistRefused { .. } => ErrorKind::PersistRefused,
            ServiceError::AdminRequired(_) | ServiceError::ForeignJob { .. } => {
                ErrorKind::PermissionDenied
            }
            ServiceError::ResourceBound { .. } => ErrorKind::CapacityExhausted,
            ServiceError::JobEnded { .. } | ServiceError::JobNotRegistered { .. } => {
                ErrorKind::JobNotRegistered
            }
            ServiceError::Cores(crate::cores::CoresError::OutOfRange { .. }) => {
                ErrorKind::InvalidArgument
            }
            ServiceError::Cores(crate::cores::CoresError::Affinity { .. }) => ErrorKind::Internal,
        }
    }

    /// `"<kind>: <message>"`, the text of statuses and of DoExchange error bodies.
    pub fn wire_message(&self) -> String {
        format!("{}: {}", self.kind().as_str(), self)
    }

    /// The gRPC status of this error.
    pub fn to_status(&self) -> Status {
        Status::new(code_of(self.kind()), self.wire_message())
    }

    /// The DoExchange status byte of this error (the gRPC code of its kind).
    pub fn status_byte(&self) -> u8 {
        self.kind().grpc_code()
    }

    /// The DoExchange reply body of this error.
    pub fn reply_body(&self) -> Bytes {
        Bytes::from(self.wire_message())
    }
}

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Self {
        e.to_status()
    }
}

fn code_of(kind: ErrorKind) -> Code {
    match kind.grpc_code() {
        grpc_code::INVALID_ARGUMENT => Code::InvalidArgument,
        grpc_code::NOT_FOUND => Code::NotFound,
        grpc_code::ALREADY_EXISTS => Code::AlreadyExists,
        grpc_code::PERMISSION_DENIED => Code::PermissionDenied,
        grpc_code::RESOURCE_EXHAUSTED => Code::ResourceExhausted,
        grpc_code::FAILED_PRECONDITION => Code::FailedPrecondition,
        grpc_code::UNAVAILABLE => Code::Unavailable,
        grpc_code::DATA_LOSS => Code::DataLoss,
        _ => Code::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_maps_to_its_code() {
        for kind in ErrorKind::ALL {
            assert_eq!(code_of(kind) as i32, i32::from(kind.grpc_code()), "{kind}");
        }
    }

    #[test]
    fn messages_start_with_the_kind() {
        let e = ServiceError::StaleEpoch {
            map_json: r#"{"servers":[]}"#.into(),
        };
        assert_eq!(e.wire_message(), r#"stale_epoch: {"servers":[]}"#);
        assert_eq!(e.to_status().code(), Code::FailedPrecondition);
        assert_eq!(e.status_byte(), 9);
        let e = ServiceError::Draining {
            node_id: "n".into(),
        };
        assert_eq!(e.to_status().code(), Code::Unavailable);
        assert!(e.to_status().message().starts_with("draining: "));
        let e = ServiceError::Store(StoreError::NotFound {
            bucket: "b".into(),
            key: "k".into(),
        });
        assert_eq!(e.to_status().code(), Code::NotFound);
        assert_eq!(
            e.to_status().message(),
            "not_found: no object 'k' in bucket 'b'"
        );
        let e = ServiceError::Store(StoreError::CapacityExhausted {
            requested: 1,
            available: 0,
            limit: pocketflow_store::CapacityLimit::Records { capacity_bytes: 8 },
        });
        assert_eq!(e.to_status().code(), Code::ResourceExhausted);
        let e = ServiceError::Protocol(ProtocolError::Token(
            pocketflow_protocol::TokenError::Missing,
        ));
        assert_eq!(e.to_status().code(), Code::PermissionDenied);
        assert_eq!(
            e.reply_body(),
            Bytes::from_static(b"permission_denied: capability token missing")
        );
    }
}
