//! Test harness: start the real `pocketflow-server` binary on port 0, talk to it with a Rust
//! Flight client, and stop it with SIGTERM by pid.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{Array, BinaryArray, RecordBatch};
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::utils::{batches_to_flight_data, flight_data_to_arrow_batch};
use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket};
use arrow_schema::{DataType, Field, Schema};
use bytes::Bytes;
use futures::StreamExt;
use pocketflow_protocol::batch::{GetPieceMeta, PutPieceMeta};
use pocketflow_protocol::frame::{
    decode_reply_frame, encode_request_frame, OpCode, Reply, RequestOp, OP_FLAG_PERSIST,
};
use pocketflow_protocol::limits::{ADMIN_JOB_ID, MESSAGE_MAX_BYTES, READY_LINE_PREFIX};
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_protocol::ObjectHeader;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

/// The secret every test server uses.
pub const SECRET: &[u8] = b"integration-test-secret-0123456789";

/// How to start a test server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub capacity: String,
    pub long_running: bool,
    pub nvme: bool,
    pub parent_pid: Option<u32>,
    pub threads: u32,
    pub persist_ttl: Option<String>,
    pub transfer_idle: Option<String>,
    /// Hand the secret over stdin (`--keys-from-stdin`) instead of a file.
    pub keys_from_stdin: bool,
    /// Run the server as this user (the test runs as root).
    pub uid: Option<u32>,
    /// Serve Prometheus metrics on a loopback port ([`TestServer::metrics_addr`]).
    pub metrics: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            capacity: "64MiB".into(),
            long_running: false,
            nvme: false,
            parent_pid: None,
            threads: 2,
            persist_ttl: None,
            transfer_idle: None,
            keys_from_stdin: false,
            uid: None,
            metrics: false,
        }
    }
}

/// A running server process, stopped (SIGTERM by pid) when dropped.
pub struct TestServer {
    pub child: Child,
    pub addr: String,
    /// Where it serves `GET /metrics`, when started with [`ServerOptions::metrics`].
    pub metrics_addr: Option<String>,
    _dir: tempfile::TempDir,
    _stdin: Option<std::process::ChildStdin>,
}

impl TestServer {
    pub fn start(options: ServerOptions) -> TestServer {
        let dir = tempfile::Builder::new()
            .prefix("pocketflow-test")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, SECRET).expect("write secret");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pocketflow-server"));
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--node-id",
            "test-node",
            "--capacity",
            &options.capacity,
        ])
        .args(["--threads", &options.threads.to_string()]);
        if options.keys_from_stdin {
            cmd.arg("--keys-from-stdin").stdin(Stdio::piped());
        } else {
            cmd.arg("--secret-file").arg(&secret_file);
        }
        if let Some(uid) = options.uid {
            std::os::unix::process::CommandExt::uid(&mut cmd, uid);
        }
        if options.nvme {
            let path: PathBuf = dir.path().join("nvme.data");
            cmd.args(["--tier", "nvme", "--nvme-path"]).arg(path);
        } else {
            cmd.args(["--tier", "dram"]);
        }
        if options.long_running {
            cmd.arg("--long-running");
        }
        if let Some(pid) = options.parent_pid {
            cmd.args(["--parent-pid", &pid.to_string()]);
        }
        if let Some(idle) = &options.transfer_idle {
            cmd.args(["--transfer-idle", idle]);
        }
        if options.metrics {
            cmd.args(["--metrics-listen", "127.0.0.1:0"]);
        }
        if let Some(ttl) = &options.persist_ttl {
            cmd.args(["--persist-ttl", ttl]);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn server");
        // stdin stays open with the server: it reads one document, not to the end.
        let stdin = child.stdin.take().map(|mut stdin| {
            let document = json!({"secret_hex": hex_of(SECRET)}).to_string();
            std::io::Write::write_all(&mut stdin, document.as_bytes()).expect("write keys");
            stdin
        });
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read ready line");
        // `POCKETFLOW_SERVER_READY host:port [metrics=host:port ...]`
        let mut words = line
            .trim()
            .strip_prefix(READY_LINE_PREFIX)
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .split_whitespace();
        let addr = words.next().expect("the address").to_owned();
        let metrics_addr = words
            .find_map(|word| word.strip_prefix("metrics="))
            .map(str::to_owned);
        TestServer {
            child,
            addr,
            metrics_addr,
            _dir: dir,
            _stdin: stdin,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Send SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        self.wait_exit(Duration::from_secs(10))
            .expect("server exits after SIGTERM")
    }

    /// Wait up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Resident and peak resident memory of the server, in bytes.
    pub fn memory_bytes(&self) -> (u64, u64) {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("proc status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .expect("kB")
                        * 1024
                })
                .expect("field present")
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.addr).await
    }

    /// The body of `GET /metrics` (plain HTTP; the server must serve metrics).
    pub async fn metrics(&self) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.metrics_addr.as_ref().expect("started with metrics");
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_owned()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own child by its pid.
            unsafe { libc::kill(self.pid(), libc::SIGTERM) };
            if self.wait_exit(Duration::from_secs(5)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// Lowercase hex of `bytes`.
pub fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn token(job: &str) -> String {
    TokenKey::new(SECRET)
        .unwrap()
        .make(job, now_unix_ms() + 600_000)
}

pub fn ctx(job: &str, epoch: u64) -> Value {
    json!({"job": job, "epoch": epoch, "token": token(job)})
}

pub fn admin_ctx() -> Value {
    ctx(ADMIN_JOB_ID, 0)
}

/// A Flight client of one server.
#[derive(Clone)]
pub struct Client {
    pub inner: FlightServiceClient<Channel>,
}

impl Client {
    pub async fn connect(addr: &str) -> Client {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .tcp_nodelay(true)
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(16 << 20)
            .connect()
            .await
            .expect("connect");
        let inner = FlightServiceClient::new(channel)
            .max_decoding_message_size(MESSAGE_MAX_BYTES)
            .max_encoding_message_size(MESSAGE_MAX_BYTES);
        Client { inner }
    }

    /// Run an action; the JSON result or the status.
    pub async fn action(&self, name: &str, body: Value) -> Result<Value, Status> {
        self.action_raw(name, Bytes::from(body.to_string())).await
    }

    pub async fn action_raw(&self, name: &str, body: Bytes) -> Result<Value, Status> {
        let mut client = self.inner.clone();
        let mut results = client
            .do_action(Action {
                r#type: name.into(),
                body,
            })
            .await?
            .into_inner();
        let first = results.next().await.expect("one result")?;
        assert!(results.next().await.is_none(), "exactly one result");
        Ok(serde_json::from_slice(&first.body).expect("JSON result"))
    }

    /// Register `job` on the server as the control plane does (`set_epoch`, epoch 1), unless
    /// it holds a later epoch already: only a registered job writes.
    pub async fn register(&self, job: &str) {
        let told = self
            .action(
                "set_epoch",
                json!({"ctx": admin_ctx(), "job": job, "epoch": 1, "map": {"epoch": 1}}),
            )
            .await;
        if let Err(status) = told {
            assert_eq!(status_kind(&status), "stale_epoch", "set_epoch: {status:?}");
        }
    }

    /// Create a bucket of `job`, registering the job first.
    pub async fn create_bucket(&self, job: &str, bucket: &str) {
        self.register(job).await;
        self.action(
            "create_bucket",
            json!({"ctx": ctx(job, 1), "bucket": bucket}),
        )
        .await
        .expect("create_bucket");
    }

    pub async fn stats(&self) -> Value {
        self.action("stats", json!({"ctx": admin_ctx()}))
            .await
            .expect("stats")
    }

    pub async fn session(&self, job: &str, epoch: u64) -> Result<Session, Status> {
        Session::open(
            self,
            json!({"ctx": ctx(job, epoch)}).to_string().into(),
            None,
        )
        .await
    }

    /// DoPut `blocks` of `(key, version)` in pieces of `piece_bytes`; the PutResult JSON.
    pub async fn put_blocks(
        &self,
        descriptor: Value,
        blocks: &[(u32, Bytes)],
        piece_bytes: usize,
    ) -> Result<Value, Status> {
        let messages = put_messages(descriptor, blocks, piece_bytes);
        let mut client = self.inner.clone();
        let mut results = client
            .do_put(futures::stream::iter(messages))
            .await?
            .into_inner();
        let result = results.next().await.expect("a PutResult")?;
        Ok(serde_json::from_slice(&result.app_metadata).expect("PutResult JSON"))
    }

    /// DoGet a ticket; the pieces as (metadata, bytes).
    pub async fn get_ranges(&self, ticket: Value) -> Result<Vec<(GetPieceMeta, Bytes)>, Status> {
        let mut client = self.inner.clone();
        let mut stream = client
            .do_get(Ticket {
                ticket: ticket.to_string().into(),
            })
            .await?
            .into_inner();
        let schema_message = stream.next().await.expect("schema message")?;
        let schema = Arc::new(Schema::try_from(&schema_message).expect("schema"));
        let mut pieces = Vec::new();
        while let Some(message) = stream.next().await {
            let message = message?;
            let batch = flight_data_to_arrow_batch(&message, schema.clone(), &HashMap::new())
                .expect("batch");
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<BinaryArray>()
                .expect("binary");
            assert_eq!(column.len(), 1);
            let meta = GetPieceMeta::decode(&message.app_metadata).expect("piece metadata");
            pieces.push((meta, Bytes::copy_from_slice(column.value(0))));
        }
        Ok(pieces)
    }
}

pub fn piece_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![Field::new(
        "data",
        DataType::Binary,
        false,
    )]))
}

/// The messages of a DoPut: descriptor with schema, then one-row batches with 12-byte metadata.
pub fn put_messages(
    descriptor: Value,
    blocks: &[(u32, Bytes)],
    piece_bytes: usize,
) -> Vec<FlightData> {
    let schema = piece_schema();
    let mut schema_message = batches_to_flight_data(&schema, []).unwrap().remove(0);
    schema_message.flight_descriptor = Some(FlightDescriptor::new_cmd(descriptor.to_string()));
    let mut messages = vec![schema_message];
    for (index, block) in blocks {
        let meta = PutPieceMeta {
            block_index: *index,
            block_len: block.len() as u64,
        }
        .encode();
        for piece in block.chunks(piece_bytes.max(1)) {
            messages.push(piece_message(piece, Bytes::copy_from_slice(&meta)));
        }
    }
    messages
}

pub fn piece_message(piece: &[u8], app_metadata: Bytes) -> FlightData {
    let array = BinaryArray::from_vec(vec![piece]);
    let batch = RecordBatch::try_new(piece_schema(), vec![Arc::new(array)]).unwrap();
    let mut data = batches_to_flight_data(&piece_schema(), [&batch])
        .unwrap()
        .remove(1);
    data.app_metadata = app_metadata;
    data
}

pub fn put_descriptor(
    job: &str,
    bucket: &str,
    key: &str,
    version: u64,
    block_size: u32,
    persist: bool,
) -> Value {
    json!({"ctx": ctx(job, 1), "bucket": bucket, "key": key, "version": version,
           "block_size": block_size, "persist": persist})
}

/// In job-a's bucket "b": a PERSIST record "kept", a plain record "gone" and a PERSIST one-block
/// object "big" of `block_bytes`; then `delete_job` for job-a, which deletes only "gone".
pub async fn put_kept_and_gone_then_delete_job(
    client: &Client,
    session: &mut Session,
    block_bytes: u32,
) {
    let replies = session
        .run(
            1,
            &[
                put(1, "b", "kept", Bytes::from_static(b"p"), OP_FLAG_PERSIST),
                put(2, "b", "gone", Bytes::from_static(b"x"), 0),
            ],
        )
        .await;
    assert!(replies.values().all(|r| r.status == 0));
    let blocks = client
        .put_blocks(
            put_descriptor("job-a", "b", "big", 5, block_bytes, true),
            &[(1, pattern(block_bytes as usize, 1))],
            block_bytes as usize,
        )
        .await;
    assert_eq!(blocks.unwrap()["blocks"], 1);
    let deleted = client
        .action("delete_job", json!({"ctx": ctx("job-a", 1)}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], 1);
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u64) -> Bytes {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// An open DoExchange session.
pub struct Session {
    pub tx: mpsc::Sender<FlightData>,
    pub rx: Streaming<FlightData>,
}

impl Session {
    /// Open with `descriptor_cmd`; `first_frame` rides on the descriptor message when given.
    pub async fn open(
        client: &Client,
        descriptor_cmd: Bytes,
        first_frame: Option<Bytes>,
    ) -> Result<Session, Status> {
        let (tx, rx) = mpsc::channel(1024);
        let first = FlightData {
            flight_descriptor: Some(FlightDescriptor::new_cmd(descriptor_cmd)),
            app_metadata: first_frame.unwrap_or_default(),
            ..Default::default()
        };
        tx.send(first).await.unwrap();
        let mut inner = client.inner.clone();
        let rx = inner
            .do_exchange(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Session { tx, rx })
    }

    pub async fn send_raw(&self, app_metadata: Bytes) {
        self.tx
            .send(FlightData {
                app_metadata,
                ..Default::default()
            })
            .await
            .expect("session open");
    }

    pub async fn send(&self, epoch: u64, ops: &[RequestOp]) {
        self.send_raw(encode_request_frame(epoch, ops)).await;
    }

    /// Next reply frame's replies; None when the stream ended; Err on a status.
    pub async fn next_replies(&mut self) -> Option<Result<Vec<Reply>, Status>> {
        let message = self.rx.next().await?;
        Some(message.map(|m| decode_reply_frame(&m.app_metadata).expect("reply frame decodes")))
    }

    /// Collect replies until `count` arrived.
    pub async fn collect(&mut self, count: usize) -> HashMap<u64, Reply> {
        let mut replies = HashMap::new();
        while replies.len() < count {
            let frame = self
                .next_replies()
                .await
                .expect("stream open")
                .expect("no status");
            for reply in frame {
                assert!(
                    replies.insert(reply.request_id, reply).is_none(),
                    "one reply per request id"
                );
            }
        }
        replies
    }

    /// Send one frame of ops and wait for all their replies.
    pub async fn run(&mut self, epoch: u64, ops: &[RequestOp]) -> HashMap<u64, Reply> {
        self.send(epoch, ops).await;
        self.collect(ops.len()).await
    }
}

pub fn put(id: u64, bucket: &str, key: &str, value: Bytes, flags: u8) -> RequestOp {
    let persist = flags & pocketflow_protocol::frame::OP_FLAG_PERSIST != 0;
    RequestOp {
        request_id: id,
        op: OpCode::Put,
        flags,
        bucket: bucket.into(),
        key: key.into(),
        header: ObjectHeader {
            version: id + 1,
            size: value.len() as u64,
            flags: if persist {
                pocketflow_protocol::HEADER_FLAG_PERSIST
            } else {
                0
            },
            ..Default::default()
        },
        value,
    }
}

pub fn manifest(id: u64, bucket: &str, key: &str, header: ObjectHeader, flags: u8) -> RequestOp {
    RequestOp {
        request_id: id,
        op: OpCode::Put,
        flags,
        bucket: bucket.into(),
        key: key.into(),
        header,
        value: Bytes::new(),
    }
}

pub fn simple(id: u64, op: OpCode, bucket: &str, key: &str, flags: u8) -> RequestOp {
    RequestOp {
        request_id: id,
        op,
        flags,
        bucket: bucket.into(),
        key: key.into(),
        header: ObjectHeader::default(),
        value: Bytes::new(),
    }
}

/// The kind prefix of an error reply.
pub fn reply_kind(reply: &Reply) -> String {
    let text = std::str::from_utf8(&reply.body).expect("error body is text");
    text.split(": ").next().unwrap().to_owned()
}

/// The kind prefix of a status message.
pub fn status_kind(status: &Status) -> String {
    status.message().split(": ").next().unwrap().to_owned()
}
