//! `pocketflow-loopback`: the loopback limit of the benchmarks, not part of pocketflow's data
//! path. A raw-TCP sink/source server (`serve`) and a client (`client`) that runs timed phases
//! of requests and responses of N bytes (single PUT and GET, pipelined batches of them) over
//! 127.0.0.1 with blocking sockets and no other work: what any storage system on this machine
//! pays at least for the same shapes. The framing is `benchmarks/tcp.py`'s (see `wire`).

mod args;
mod buffer;
mod client;
mod clock;
mod error;
mod server;
mod wire;

use std::io;
use std::process::ExitCode;

use crate::args::Command;

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let outcome = args::parse(&argv).and_then(|command| match command {
        Command::Serve(options) => server::serve(&options),
        Command::Client {
            address,
            object_max_bytes,
        } => client::run_commands(
            address,
            object_max_bytes,
            io::stdin().lock(),
            io::stdout().lock(),
        ),
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pocketflow-loopback: {e}");
            ExitCode::FAILURE
        }
    }
}
