//! The sink/source server: one thread per connection, blocking sockets, nothing stored. PUT
//! bytes are read into a scratch buffer and dropped; GET bytes come from one buffer filled at
//! start (both page-aligned: see `buffer`). Every request whose bytes one receive brought is answered before the replies are
//! flushed together, so pipelined batches cost one send per receive, as in `benchmarks/tcp.py`.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::buffer::PageAligned;
use crate::clock::monotonic_ns;
use crate::error::Error;
use crate::wire::{self, Op, ACK, HEADER_BYTES};

/// The line the server prints (then its address) once it listens.
pub const READY_PREFIX: &str = "LOOPBACK_READY ";
/// Most connections served at once; more wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 64;
/// Receive buffer of a connection: requests that arrive together are answered together.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Replies are gathered up to this many bytes before a send; larger ones go out directly.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;
/// Where a PUT's bytes are dropped, this much per receive.
const SCRATCH_BYTES: usize = 4 * 1024 * 1024;
/// Deadline of every blocking send.
const SOCKET_TIMEOUT_MS: u64 = 60_000;
/// Deadline of every blocking receive, the wait for a client's next request included: longer
/// than a connection idles in the side-by-side runner, whose clients keep their connections
/// while the other peers take their rounds of a cell (over a minute for the 64 KiB cells of a
/// full run, which a 60 s receive deadline cut). The parent watch and the lifetime still end
/// the server.
const IDLE_TIMEOUT_MS: u64 = 30 * 60 * 1000;
/// How often the server checks that its parent still lives and its lifetime is not over.
const WATCH_INTERVAL_MS: u64 = 500;

/// What `serve` needs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The largest GET answered (the source buffer's size).
    pub object_max_bytes: usize,
    /// Exit when this process is no longer the parent.
    pub parent_pid: Option<u32>,
    /// Exit after this long whatever happens.
    pub lifetime_ms: u64,
}

/// A counting semaphore bounding the connections served at once.
struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    fn acquire(&self) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        *free -= 1;
    }

    fn release(&self) {
        *self.free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.freed.notify_one();
    }
}

/// Listen on 127.0.0.1 (a free port), print the ready line, serve until the process ends.
pub fn serve(options: &ServeOptions) -> Result<(), Error> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let source = Arc::new(PageAligned::copy_of(&wire::filler(
        options.object_max_bytes,
    )));
    let mut stdout = io::stdout();
    writeln!(stdout, "{READY_PREFIX}{}", listener.local_addr()?)?;
    stdout.flush()?;
    watch(options.parent_pid, options.lifetime_ms);
    let slots = Arc::new(Slots {
        free: Mutex::new(CONNECTIONS_MAX),
        freed: Condvar::new(),
    });
    loop {
        slots.acquire();
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                slots.release();
                eprintln!("pocketflow-loopback: accept failed: {e}");
                continue;
            }
        };
        let source = Arc::clone(&source);
        let slots = Arc::clone(&slots);
        std::thread::spawn(move || {
            if let Err(e) = serve_connection(&stream, source.as_slice()) {
                eprintln!("pocketflow-loopback: connection ended: {e}");
            }
            slots.release();
        });
    }
}

/// A thread that ends the process when the parent is gone or the lifetime is over.
fn watch(parent_pid: Option<u32>, lifetime_ms: u64) {
    let deadline_ns = monotonic_ns().saturating_add(lifetime_ms.saturating_mul(1_000_000));
    std::thread::spawn(move || loop {
        let orphaned = parent_pid.is_some_and(|pid| std::os::unix::process::parent_id() != pid);
        if orphaned || monotonic_ns() >= deadline_ns {
            std::process::exit(0);
        }
        std::thread::sleep(Duration::from_millis(WATCH_INTERVAL_MS));
    });
}

/// Answer one connection's requests until it closes; a malformed request ends it.
fn serve_connection(stream: &TcpStream, source: &[u8]) -> Result<(), Error> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_millis(IDLE_TIMEOUT_MS)))?;
    stream.set_write_timeout(Some(Duration::from_millis(SOCKET_TIMEOUT_MS)))?;
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, stream);
    let mut writer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, stream);
    let mut scratch = PageAligned::zeroed(SCRATCH_BYTES);
    let mut header = [0u8; HEADER_BYTES];
    while read_header(&mut reader, &mut header)? {
        match wire::decode(&header)? {
            (Op::Put, length) => {
                drop_bytes(&mut reader, length, scratch.as_mut_slice())?;
                writer.write_all(&[ACK])?;
            }
            (Op::Get, length) => {
                let reply = usize::try_from(length)
                    .ok()
                    .and_then(|n| source.get(..n))
                    .ok_or(Error::TooLarge {
                        requested_bytes: length,
                        max_bytes: source.len() as u64,
                    })?;
                writer.write_all(reply)?;
            }
        }
        // Nothing more has arrived: the client waits for these replies.
        if reader.buffer().is_empty() {
            writer.flush()?;
        }
    }
    writer.flush()?;
    Ok(())
}

/// Fill `header`; `false` when the connection closed cleanly before a new request.
fn read_header(
    reader: &mut BufReader<&TcpStream>,
    header: &mut [u8; HEADER_BYTES],
) -> Result<bool, Error> {
    if reader.fill_buf()?.is_empty() {
        return Ok(false);
    }
    reader.read_exact(header).map_err(closed_or_io)?;
    Ok(true)
}

/// Read and drop `length` bytes.
fn drop_bytes(
    reader: &mut BufReader<&TcpStream>,
    length: u64,
    scratch: &mut [u8],
) -> Result<(), Error> {
    let mut left = length;
    while left > 0 {
        let take = usize::try_from(left).map_or(scratch.len(), |l| l.min(scratch.len()));
        let got = reader.read(&mut scratch[..take])?;
        if got == 0 {
            return Err(Error::Closed);
        }
        left -= got as u64;
    }
    Ok(())
}

/// An end of file in the middle of a message is [`Error::Closed`]; other failures stay I/O.
pub fn closed_or_io(error: io::Error) -> Error {
    if error.kind() == io::ErrorKind::UnexpectedEof {
        Error::Closed
    } else {
        Error::Io(error)
    }
}
