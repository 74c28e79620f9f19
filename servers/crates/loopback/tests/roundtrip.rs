//! The real binary: a server and a client process, every shape, and the failures a benchmark
//! run can meet (a GET larger than the server holds, a bad command, a server that is gone).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const BINARY: &str = env!("CARGO_BIN_EXE_pocketflow-loopback");
/// Bound on a process's exit in these tests.
const EXIT_WAIT_MS: u64 = 10_000;

struct Server {
    child: Child,
    address: String,
}

impl Server {
    fn start(object_max_bytes: usize, lifetime_s: &str) -> Server {
        let mut child = Command::new(BINARY)
            .args(["serve", "--object-max-bytes", &object_max_bytes.to_string()])
            .args(["--lifetime-s", lifetime_s])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .trim()
            .strip_prefix("LOOPBACK_READY ")
            .unwrap()
            .to_string();
        Server { child, address }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    fn start(address: &str, object_max_bytes: usize) -> Client {
        let mut child = Command::new(BINARY)
            .args(["client", "--connect", address])
            .args(["--object-max-bytes", &object_max_bytes.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut ready = String::new();
        stdout.read_line(&mut ready).unwrap();
        assert_eq!(ready.trim(), "LOOPBACK_CLIENT_READY");
        Client {
            child,
            stdin,
            stdout,
        }
    }

    fn command(&mut self, line: &str) -> serde_json::Value {
        writeln!(self.stdin, "{line}").unwrap();
        let mut reply = String::new();
        self.stdout.read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    }

    fn exit_code(mut self) -> Option<i32> {
        drop(self.stdin);
        wait_exit(&mut self.child)
    }
}

fn wait_exit(child: &mut Child) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_millis(EXIT_WAIT_MS);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("process did not exit within {EXIT_WAIT_MS} ms");
}

#[test]
fn every_shape_moves_its_bytes_and_times_each_operation() {
    let server = Server::start(1 << 20, "60");
    let mut client = Client::start(&server.address, 1 << 20);
    for (line, ops, latencies, bytes) in [
        ("phase put 1048576 5 1 0 0", 5, 5, 5 << 20),
        ("phase get 1048576 5 1 0 0", 5, 5, 5 << 20),
        ("phase put 0 3 1 0 0", 3, 3, 0),
        ("phase put_many 1024 250 100 0 0", 250, 3, 250 * 1024),
        ("phase get_many 1024 250 100 0 0", 250, 3, 250 * 1024),
        ("phase get 1 1 1 0 0", 1, 1, 1),
    ] {
        let reply = client.command(line);
        assert_eq!(reply["ops"], ops, "{line}: {reply}");
        assert_eq!(reply["bytes"], bytes, "{line}");
        assert_eq!(
            reply["latencies_ns"].as_array().unwrap().len(),
            latencies,
            "{line}"
        );
        assert!(reply["end_ns"].as_u64().unwrap() >= reply["start_ns"].as_u64().unwrap());
    }
    assert_eq!(client.exit_code(), Some(0));
}

#[test]
fn a_phase_waits_for_its_start_time_and_stops_at_its_time_bound() {
    let server = Server::start(1024, "60");
    let mut client = Client::start(&server.address, 1024);
    let first = client.command("phase get 8 1 1 0 0");
    let start_at = first["end_ns"].as_u64().unwrap() + 50_000_000;
    let reply = client.command(&format!("phase get 8 1 1 {start_at} 0"));
    assert!(reply["start_ns"].as_u64().unwrap() >= start_at);
    // A bound of 1 ns: the first operation always runs, then the phase stops.
    let reply = client.command("phase put 8 1000 1 0 1");
    assert!(reply["ops"].as_u64().unwrap() < 1000, "{reply}");
    assert!(reply["ops"].as_u64().unwrap() >= 1);
}

#[test]
fn failures_are_answered_and_end_the_client() {
    let server = Server::start(1024, "60");
    // The client allows more than the server holds: the server ends the connection.
    let mut client = Client::start(&server.address, 4096);
    let reply = client.command("phase get 2048 1 1 0 0");
    assert!(
        reply["error"].as_str().unwrap().contains("closed"),
        "{reply}"
    );
    assert_eq!(client.exit_code(), Some(1));

    let mut client = Client::start(&server.address, 1024);
    let reply = client.command("phase get 2048 1 1 0 0");
    assert!(
        reply["error"].as_str().unwrap().contains("at most 1024"),
        "{reply}"
    );
    assert_eq!(client.exit_code(), Some(1));

    let mut client = Client::start(&server.address, 1024);
    let reply = client.command("phase delete 1 1 1 0 0");
    assert!(
        reply["error"].as_str().unwrap().contains("bad command"),
        "{reply}"
    );
    assert_eq!(client.exit_code(), Some(1));
}

#[test]
fn the_server_exits_when_its_lifetime_is_over() {
    let mut server = Server::start(16, "0.3");
    assert_eq!(wait_exit(&mut server.child), Some(0));
}
