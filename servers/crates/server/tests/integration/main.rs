//! Integration tests of the real `pocketflow-server` binary over Arrow Flight.

mod actions;
mod blocks;
mod exchange;
mod garbage;
mod harness;
mod lifecycle;
mod lifetimes;
mod memory;
mod refusals;
mod registration;
