//! The pocketflow storage server's Arrow Flight service: DoExchange sessions of small ops,
//! DoPut/DoGet of data blocks, actions, capability checks, statistics, drain and CPU cores. It
//! knows the store's API, not how the store keeps bytes.

#![warn(missing_docs)]

mod action;
pub mod activity;
pub mod auth;
pub mod bounds;
pub mod cores;
pub mod direct;
mod doget;
mod doget_wire;
mod doput;
pub mod drain;
mod exchange;
pub mod handshake;
pub mod metrics;
pub mod peers;
mod pin;
mod read;
pub use pocketflow_protocol::ipc;
mod refusal;
mod request_start;
pub mod route;
mod service;
pub mod stats;
pub mod status;
pub mod tls;

pub use doget_wire::FlightServer;
pub use service::{ServiceConfig, StorageService};
pub use status::ServiceError;
