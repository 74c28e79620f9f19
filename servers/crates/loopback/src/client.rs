//! The client: one connection, driven over standard input one phase at a time by a benchmark
//! client process (`benchmarks/tcp_native.py`), so that the timed loop is native code.
//!
//! A command is one line, `phase SHAPE SIZE_BYTES OPS BATCH_OPS START_AT_NS PHASE_NS_MAX`
//! (`SHAPE` is `put`, `get`, `put_many` or `get_many`; `PHASE_NS_MAX` 0 means no time bound).
//! The client waits until `START_AT_NS` on the monotonic clock, runs the phase and answers with
//! one JSON line: `{"ops":..,"bytes":..,"start_ns":..,"end_ns":..,"latencies_ns":[..]}`, one
//! latency per operation (per batch for the `_many` shapes). A failure is answered with
//! `{"error":"..."}` and ends the client, as the connection's state is then unknown.

use std::io::{self, BufRead, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::buffer::PageAligned;
use crate::clock::{monotonic_ns, sleep_until};
use crate::error::Error;
use crate::server::closed_or_io;
use crate::wire::{self, Op, ACK, HEADER_BYTES};

/// The line the client prints once it is connected.
pub const READY_LINE: &str = "LOOPBACK_CLIENT_READY";
/// Most operations one phase runs.
pub const PHASE_OPS_MAX: usize = 1_000_000;
/// Most operations one pipelined batch sends before reading replies.
pub const BATCH_OPS_MAX: usize = 4096;
/// Most bytes one pipelined batch sends or receives.
pub const BATCH_BYTES_MAX: usize = 256 * 1024 * 1024;
/// Deadline of every blocking socket call.
const SOCKET_TIMEOUT_MS: u64 = 60_000;

/// What a phase sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// One request, then its acknowledgement, per object.
    Put,
    /// One request, then the object's bytes, per object.
    Get,
    /// Every request of a batch in one send, then every acknowledgement.
    PutMany,
    /// Every request of a batch in one send, then every object's bytes.
    GetMany,
}

/// One timed phase, as a command line describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Phase {
    /// What is sent.
    pub shape: Shape,
    /// Bytes of each object.
    pub size_bytes: usize,
    /// Objects in the phase.
    pub ops: usize,
    /// Objects per batch (1 for the single shapes).
    pub batch_ops: usize,
    /// When the phase starts, on the monotonic clock.
    pub start_at_ns: u64,
    /// No new operation starts after this long (at least one always runs); 0: no bound.
    pub phase_ns_max: u64,
}

impl Phase {
    /// Parse `phase SHAPE SIZE_BYTES OPS BATCH_OPS START_AT_NS PHASE_NS_MAX`.
    pub fn parse(line: &str) -> Result<Phase, Error> {
        let bad = || Error::BadCommand(line.to_string());
        let words: Vec<&str> = line.split_whitespace().collect();
        let [verb, shape, size, ops, batch, start, limit] = words[..] else {
            return Err(bad());
        };
        if verb != "phase" {
            return Err(bad());
        }
        let shape = match shape {
            "put" => Shape::Put,
            "get" => Shape::Get,
            "put_many" => Shape::PutMany,
            "get_many" => Shape::GetMany,
            _ => return Err(bad()),
        };
        let number = |field: &'static str, text: &str| -> Result<u64, Error> {
            text.parse().map_err(|_| Error::BadValue {
                flag: field,
                value: text.to_string(),
            })
        };
        let ops = number("OPS", ops)? as usize;
        let batch_ops = number("BATCH_OPS", batch)? as usize;
        if !(1..=PHASE_OPS_MAX).contains(&ops) {
            return Err(Error::BadValue {
                flag: "OPS",
                value: ops.to_string(),
            });
        }
        if !(1..=BATCH_OPS_MAX).contains(&batch_ops) {
            return Err(Error::BadValue {
                flag: "BATCH_OPS",
                value: batch_ops.to_string(),
            });
        }
        Ok(Phase {
            shape,
            size_bytes: number("SIZE_BYTES", size)? as usize,
            ops,
            batch_ops: if matches!(shape, Shape::Put | Shape::Get) {
                1
            } else {
                batch_ops
            },
            start_at_ns: number("START_AT_NS", start)?,
            phase_ns_max: number("PHASE_NS_MAX", limit)?,
        })
    }
}

/// What one phase measured.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PhaseResult {
    /// Objects moved.
    pub ops: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// When the phase started and ended, on the monotonic clock.
    pub start_ns: u64,
    /// See `start_ns`.
    pub end_ns: u64,
    /// One latency per operation or batch.
    pub latencies_ns: Vec<u64>,
}

impl PhaseResult {
    /// The JSON line the client answers with.
    pub fn to_json(&self) -> String {
        let latencies: Vec<String> = self.latencies_ns.iter().map(u64::to_string).collect();
        format!(
            "{{\"ops\":{},\"bytes\":{},\"start_ns\":{},\"end_ns\":{},\"latencies_ns\":[{}]}}",
            self.ops,
            self.bytes,
            self.start_ns,
            self.end_ns,
            latencies.join(",")
        )
    }
}

/// One connection to a sink/source server (this crate's or `benchmarks/tcp.py`'s).
pub struct Client {
    stream: TcpStream,
    object_max_bytes: usize,
    /// What PUTs send: filled once, grown to the largest object put (page-aligned, as every
    /// buffer the kernel copies to or from here: see `buffer`).
    payload: PageAligned,
    /// Where GETs land: touched once, grown to the largest batch read, reused.
    received: PageAligned,
}

impl Client {
    /// Connect to `address`; objects of at most `object_max_bytes`.
    pub fn connect(address: SocketAddr, object_max_bytes: usize) -> Result<Client, Error> {
        let timeout = Duration::from_millis(SOCKET_TIMEOUT_MS);
        let stream = TcpStream::connect_timeout(&address, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Client {
            stream,
            object_max_bytes,
            payload: PageAligned::default(),
            received: PageAligned::default(),
        })
    }

    /// Run one phase: buffers are made before the start time, so only the transfers are timed.
    pub fn run(&mut self, phase: &Phase) -> Result<PhaseResult, Error> {
        if phase.size_bytes > self.object_max_bytes {
            return Err(Error::TooLarge {
                requested_bytes: phase.size_bytes as u64,
                max_bytes: self.object_max_bytes as u64,
            });
        }
        let batch_bytes = phase.size_bytes.saturating_mul(phase.batch_ops);
        if batch_bytes > BATCH_BYTES_MAX {
            return Err(Error::TooLarge {
                requested_bytes: batch_bytes as u64,
                max_bytes: BATCH_BYTES_MAX as u64,
            });
        }
        if self.payload.as_slice().len() < phase.size_bytes {
            self.payload = PageAligned::copy_of(&wire::filler(phase.size_bytes));
        }
        let put_header = wire::encode(Op::Put, phase.size_bytes as u64);
        let get_header = wire::encode(Op::Get, phase.size_bytes as u64);
        // A batch's requests, ready to go out in one send.
        let mut requests = Vec::new();
        match phase.shape {
            Shape::Put => self.grow_received(1),
            Shape::Get => self.grow_received(phase.size_bytes),
            Shape::PutMany => {
                for _ in 0..phase.batch_ops {
                    requests.extend_from_slice(&put_header);
                    requests.extend_from_slice(&self.payload.as_slice()[..phase.size_bytes]);
                }
                self.grow_received(phase.batch_ops);
            }
            Shape::GetMany => {
                for _ in 0..phase.batch_ops {
                    requests.extend_from_slice(&get_header);
                }
                self.grow_received(batch_bytes);
            }
        }
        sleep_until(phase.start_at_ns);
        let start_ns = monotonic_ns();
        let stop_after_ns =
            (phase.phase_ns_max > 0).then(|| start_ns.saturating_add(phase.phase_ns_max));
        let mut result = PhaseResult {
            start_ns,
            ..PhaseResult::default()
        };
        while result.ops < phase.ops {
            let t0 = monotonic_ns();
            if result.ops > 0 && stop_after_ns.is_some_and(|stop| t0 > stop) {
                break;
            }
            let count = phase.batch_ops.min(phase.ops - result.ops);
            match phase.shape {
                Shape::Put => {
                    let payload = &self.payload.as_slice()[..phase.size_bytes];
                    write_all_vectored(
                        &mut self.stream,
                        &mut [IoSlice::new(&put_header), IoSlice::new(payload)],
                    )?;
                    self.receive_acks(1)?;
                }
                Shape::Get => {
                    self.stream.write_all(&get_header)?;
                    self.receive(phase.size_bytes)?;
                }
                Shape::PutMany => {
                    let frame_bytes = HEADER_BYTES + phase.size_bytes;
                    self.stream.write_all(&requests[..count * frame_bytes])?;
                    self.receive_acks(count)?;
                }
                Shape::GetMany => {
                    self.stream.write_all(&requests[..count * HEADER_BYTES])?;
                    self.receive(count * phase.size_bytes)?;
                }
            }
            result.latencies_ns.push(monotonic_ns() - t0);
            result.ops += count;
        }
        result.end_ns = monotonic_ns();
        result.bytes = (result.ops * phase.size_bytes) as u64;
        Ok(result)
    }

    /// Make the receive buffer at least `length` bytes, every page written once.
    fn grow_received(&mut self, length: usize) {
        self.received.grow(length);
    }

    fn receive(&mut self, length: usize) -> Result<(), Error> {
        self.stream
            .read_exact(&mut self.received.as_mut_slice()[..length])
            .map_err(closed_or_io)
    }

    fn receive_acks(&mut self, count: usize) -> Result<(), Error> {
        self.receive(count)?;
        match self.received.as_slice()[..count]
            .iter()
            .find(|&&b| b != ACK)
        {
            Some(&bad) => Err(Error::BadAck(bad)),
            None => Ok(()),
        }
    }
}

/// Write every slice, as one `writev` where the kernel takes it all.
fn write_all_vectored(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut slices, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Connect, print the ready line, then answer every command of `input` on `output` until the
/// input ends; the first failure is answered and returned.
pub fn run_commands(
    address: SocketAddr,
    object_max_bytes: usize,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<(), Error> {
    let mut client = Client::connect(address, object_max_bytes)?;
    writeln!(output, "{READY_LINE}")?;
    output.flush()?;
    for line in input.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match Phase::parse(&line).and_then(|phase| client.run(&phase)) {
            Ok(result) => writeln!(output, "{}", result.to_json())?,
            Err(e) => {
                writeln!(output, "{{\"error\":\"{}\"}}", json_escape(&e.to_string()))?;
                output.flush()?;
                return Err(e);
            }
        }
        output.flush()?;
    }
    Ok(())
}

/// `text` as the inside of a JSON string.
fn json_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_command_parses() {
        let phase = Phase::parse("phase get_many 1024 200 100 5 0").unwrap();
        assert_eq!(
            phase,
            Phase {
                shape: Shape::GetMany,
                size_bytes: 1024,
                ops: 200,
                batch_ops: 100,
                start_at_ns: 5,
                phase_ns_max: 0,
            }
        );
        // A single shape sends one object per request whatever the batch says.
        assert_eq!(Phase::parse("phase put 1 3 100 0 0").unwrap().batch_ops, 1);
    }

    #[test]
    fn bad_commands_are_refused() {
        for line in [
            "phase",
            "phase put 1 1 1 0",
            "step put 1 1 1 0 0",
            "phase delete 1 1 1 0 0",
            "phase put x 1 1 0 0",
            "phase put 1 0 1 0 0",
            "phase put_many 1 1 5000 0 0",
        ] {
            assert!(Phase::parse(line).is_err(), "{line}");
        }
    }

    #[test]
    fn results_and_errors_are_json() {
        let result = PhaseResult {
            ops: 2,
            bytes: 20,
            start_ns: 1,
            end_ns: 9,
            latencies_ns: vec![3, 4],
        };
        let parsed: serde_json::Value = serde_json::from_str(&result.to_json()).unwrap();
        assert_eq!(parsed["latencies_ns"], serde_json::json!([3, 4]));
        let text = format!("{{\"error\":\"{}\"}}", json_escape("a \"b\" \\ \n"));
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed["error"], "a \"b\" \\ \n");
    }
}
