//! Prometheus metrics of one storage server: counters and histograms bumped by the request
//! paths, gauges read from the store and the service's bounds at scrape time, and the text
//! exposition (`prometheus`'s encoder) served at `GET /metrics` by [`serve`], over HTTPS with
//! the server's own certificate when it has one ([`metrics_tls_config`]).
//!
//! Label values come from closed sets (RPC names, op names, action names, error kinds), so the
//! number of series is bounded whatever clients send.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use pocketflow_store::CapacityLimit;

use crate::bounds::{EXCHANGE_SESSIONS_MAX, TRANSFERS_MAX, WAITS_PARKED_MAX};
use crate::peers::PeerCounts;
use crate::service::{ServiceState, StorageService};

/// Latency buckets of one operation, in seconds: 10 µs to 10 s.
const LATENCY_BUCKETS_S: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Scrapes served at once; further connections wait in the listener's backlog.
const SCRAPES_MAX: usize = 4;
/// Scrapes of one peer address at once; one more is closed as it comes, so one peer cannot
/// hold every place for the request bound.
const PEER_SCRAPES_MAX: usize = SCRAPES_MAX / 2;
/// A scrape's TLS handshake (if any) and request must arrive within this bound.
const SCRAPE_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head read from a scraper.
const SCRAPE_REQUEST_MAX_BYTES: usize = 8 * 1024;

/// The server's metric families.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    latency: HistogramVec,
    bytes_received: IntCounter,
    bytes_sent: IntCounter,
    ttl_evicted_objects: IntCounter,
    ttl_evicted_bytes: IntCounter,
    capacity_refusals: IntCounterVec,
    capacity: IntGauge,
    used: IntGauge,
    objects: IntGauge,
    jobs: IntGauge,
    sessions: IntGauge,
    transfers: IntGauge,
    parked_waits: IntGauge,
    parked_queue_ops: IntGauge,
    draining: IntGauge,
    pins: IntGauge,
    pinned_bytes: IntGauge,
    pin_refusals: IntCounter,
    pins_swept: IntCounter,
    /// One render at a time: it brings the byte counters up to the request paths' totals.
    render_lock: std::sync::Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn must<T>(made: prometheus::Result<T>) -> T {
    // Families are made once from constant, valid names; a failure is a programming error.
    made.expect("metric family definitions are valid")
}

impl Metrics {
    /// The families of a server named `node_id` (a constant label of every series).
    pub fn new(node_id: &str, tier: &str) -> Self {
        let registry = Registry::new_custom(
            Some("pocketflow".to_owned()),
            Some(
                [
                    ("node_id".to_owned(), node_id.to_owned()),
                    ("tier".to_owned(), tier.to_owned()),
                ]
                .into(),
            ),
        );
        let registry = must(registry);
        let requests = must(IntCounterVec::new(
            Opts::new(
                "requests_total",
                "Requests by RPC (exchange, do_get, do_put, do_action, direct_get, direct_put, \
                 direct_read), \
                 op (put/get/delete/lookup, or the action) and result (ok or the error kind).",
            ),
            &["rpc", "op", "result"],
        ));
        let latency = must(HistogramVec::new(
            HistogramOpts::new(
                "op_duration_seconds",
                "Time from a request's arrival to its reply, by op.",
            )
            .buckets(LATENCY_BUCKETS_S.to_vec()),
            &["op"],
        ));
        let capacity_refusals = must(IntCounterVec::new(
            Opts::new(
                "capacity_refusals_total",
                "Writes refused with capacity_exhausted, by the limit they hit: data (the \
                 tier's room for data full), records (the whole tier full), reserved (the free \
                 room held for other jobs' reservation shares), extent (no free extent of the \
                 write's size: free space fragmented), freeing (room held by deleted blocks \
                 still being written to the device).",
            ),
            &["limit"],
        ));
        // Every limit's series exists from the start, at 0, so a rate over it is defined.
        for limit in CapacityLimit::NAMES {
            capacity_refusals.with_label_values(&[limit]);
        }
        let counter = |name: &str, help: &str| must(IntCounter::new(name, help));
        let gauge = |name: &str, help: &str| must(IntGauge::new(name, help));
        let metrics = Metrics {
            requests,
            latency,
            bytes_received: counter("received_bytes_total", "Value bytes received."),
            bytes_sent: counter("sent_bytes_total", "Value bytes sent."),
            ttl_evicted_objects: counter(
                "ttl_evicted_objects_total",
                "PERSIST objects deleted because their time to live passed.",
            ),
            ttl_evicted_bytes: counter(
                "ttl_evicted_bytes_total",
                "Bytes freed by PERSIST objects whose time to live passed.",
            ),
            capacity_refusals,
            capacity: gauge("capacity_bytes", "Capacity of the tier served."),
            used: gauge("used_bytes", "Bytes in use in the tier served."),
            objects: gauge("objects", "Objects stored."),
            jobs: gauge(
                "jobs",
                "Jobs with buckets or a reservation share on this server.",
            ),
            sessions: gauge(
                "sessions",
                "Open exchange sessions (DoExchange and direct).",
            ),
            transfers: gauge(
                "transfers",
                "Block transfers (DoPut, DoGet, direct) in progress.",
            ),
            parked_waits: gauge("parked_waits", "Wait calls parked until their keys exist."),
            parked_queue_ops: gauge(
                "parked_queue_ops",
                "Queue ops parked: dequeues of an empty queue, enqueues into a full one.",
            ),
            draining: gauge("draining", "1 while the server drains, else 0."),
            pins: gauge(
                "pins",
                "Objects pinned in the shared DRAM arena for readers of this host.",
            ),
            pinned_bytes: gauge("pinned_bytes", "Bytes the pins hold."),
            pin_refusals: counter(
                "pin_refusals_total",
                "Pins refused at a bound (server, job or process): those readers copied.",
            ),
            pins_swept: counter(
                "pins_swept_total",
                "Pins released by the sweep because their process was gone.",
            ),
            render_lock: std::sync::Mutex::new(()),
            registry,
        };
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(metrics.requests.clone()),
            Box::new(metrics.latency.clone()),
            Box::new(metrics.bytes_received.clone()),
            Box::new(metrics.bytes_sent.clone()),
            Box::new(metrics.ttl_evicted_objects.clone()),
            Box::new(metrics.ttl_evicted_bytes.clone()),
            Box::new(metrics.capacity_refusals.clone()),
            Box::new(metrics.capacity.clone()),
            Box::new(metrics.used.clone()),
            Box::new(metrics.objects.clone()),
            Box::new(metrics.jobs.clone()),
            Box::new(metrics.sessions.clone()),
            Box::new(metrics.transfers.clone()),
            Box::new(metrics.parked_waits.clone()),
            Box::new(metrics.parked_queue_ops.clone()),
            Box::new(metrics.draining.clone()),
            Box::new(metrics.pins.clone()),
            Box::new(metrics.pinned_bytes.clone()),
            Box::new(metrics.pin_refusals.clone()),
            Box::new(metrics.pins_swept.clone()),
        ];
        for collector in collectors {
            must(metrics.registry.register(collector));
        }
        metrics
    }

    /// Count one request of `rpc`/`op` that ended with `result` (`"ok"` or an error kind) after
    /// `elapsed`.
    pub fn request(&self, rpc: &str, op: &str, result: &str, elapsed: Duration) {
        self.requests.with_label_values(&[rpc, op, result]).inc();
        self.latency
            .with_label_values(&[op])
            .observe(elapsed.as_secs_f64());
    }

    /// Requests counted so far, over every RPC, op and result.
    pub fn requests_total(&self) -> u64 {
        self.requests
            .collect()
            .iter()
            .flat_map(|family| family.get_metric())
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }

    /// Count PERSIST objects (and their bytes) deleted at the end of their time to live.
    pub fn ttl_evicted(&self, objects: u64, bytes: u64) {
        self.ttl_evicted_objects.inc_by(objects);
        self.ttl_evicted_bytes.inc_by(bytes);
    }

    /// Count one request's outcome: `"ok"`, or the kind of `error`.
    pub(crate) fn outcome<T>(
        &self,
        rpc: &str,
        op: &str,
        result: &Result<T, crate::ServiceError>,
        started: std::time::Instant,
    ) {
        let kind = match result {
            Ok(_) => "ok",
            Err(e) => e.kind().as_str(),
        };
        self.request(rpc, op, kind, started.elapsed());
    }

    fn render(&self, state: &ServiceState) -> Vec<u8> {
        let _one = self
            .render_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let usage = state.store.usage();
        let to_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.capacity.set(to_i64(usage.capacity_bytes));
        self.used.set(to_i64(usage.used_bytes));
        // Counters only grow: bring them up to the totals the request paths keep.
        let (received, sent) = state.stats.counters.totals();
        self.bytes_received
            .inc_by(received.saturating_sub(self.bytes_received.get()));
        self.bytes_sent
            .inc_by(sent.saturating_sub(self.bytes_sent.get()));
        for (limit, refused) in usage.refusals.by_name() {
            let counter = self.capacity_refusals.with_label_values(&[limit]);
            counter.inc_by(refused.saturating_sub(counter.get()));
        }
        self.objects.set(to_i64(usage.objects));
        self.jobs.set(to_i64(usage.per_job.len() as u64));
        let in_use = |slots: &Semaphore, max: usize| {
            to_i64(max.saturating_sub(slots.available_permits()) as u64)
        };
        self.sessions
            .set(in_use(&state.sessions, EXCHANGE_SESSIONS_MAX));
        self.transfers.set(in_use(&state.transfers, TRANSFERS_MAX));
        self.parked_waits
            .set(in_use(&state.waits, WAITS_PARKED_MAX));
        self.parked_queue_ops
            .set(to_i64(state.store.parked_queue_ops() as u64));
        self.draining.set(i64::from(state.drain.is_draining()));
        if let Some(pins) = &state.pins {
            let counts = pins.counts();
            self.pins.set(to_i64(counts.pins));
            self.pinned_bytes.set(to_i64(counts.bytes));
            self.pin_refusals
                .inc_by(counts.refused.saturating_sub(self.pin_refusals.get()));
            self.pins_swept
                .inc_by(counts.swept.saturating_sub(self.pins_swept.get()));
        }
        let mut out = Vec::new();
        // Encoding into a Vec fails only on a bad family, which `new` rules out.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

impl StorageService {
    /// The metrics in Prometheus text format, as `GET /metrics` serves them.
    pub fn metrics_text(&self) -> Vec<u8> {
        self.state.metrics.render(&self.state)
    }

    /// Count PERSIST objects deleted at the end of their time to live.
    pub fn count_ttl_evictions(&self, objects: u64, bytes: u64) {
        self.state.metrics.ttl_evicted(objects, bytes);
    }
}

/// Bind `addr` for scrapes; [`serve`] then answers them.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// The TLS configuration of the metrics listener: the server's identity (`server`, from
/// [`crate::tls`]) offering ALPN `http/1.1` instead of the Flight port's protocols.
pub fn metrics_tls_config(server: &rustls::ServerConfig) -> Arc<rustls::ServerConfig> {
    let mut config = server.clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// Answer scrapes on `listener` forever, over TLS with `tls`: `GET /metrics` gets the text
/// exposition, any other path 404, anything else 400. HTTP/1.x, one request per connection, at
/// most `SCRAPES_MAX` at once (`PEER_SCRAPES_MAX` per peer address), each TLS handshake and
/// request within `SCRAPE_REQUEST_TIMEOUT`.
pub async fn serve(listener: TcpListener, service: StorageService, tls: Option<TlsAcceptor>) {
    let slots = Arc::new(Semaphore::new(SCRAPES_MAX));
    let peers = Arc::new(PeerCounts::default());
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((mut stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        // Past its peer's bound: dropped (closed) at once, its slot given back.
        let Some(peer_place) = PeerCounts::enter(&peers, peer.ip(), PEER_SCRAPES_MAX) else {
            continue;
        };
        let service = service.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _peer_place = peer_place;
            // One bound for the whole handshake: TLS, then the request head.
            let answered = tokio::time::timeout(SCRAPE_REQUEST_TIMEOUT, async {
                match tls {
                    Some(acceptor) => {
                        let mut stream = acceptor.accept(stream).await.ok()?;
                        let head = read_head(&mut stream).await?;
                        Some(Scrape::Tls(Box::new(stream), head))
                    }
                    None => {
                        let head = read_head(&mut stream).await?;
                        Some(Scrape::Plain(stream, head))
                    }
                }
            })
            .await;
            // A scraper that does not read its answer is left after the same bound.
            let answering = async {
                match answered {
                    Ok(Some(Scrape::Plain(stream, head))) => answer(stream, &head, &service).await,
                    Ok(Some(Scrape::Tls(stream, head))) => answer(*stream, &head, &service).await,
                    _ => {}
                }
            };
            let _ = tokio::time::timeout(SCRAPE_REQUEST_TIMEOUT, answering).await;
        });
    }
}

/// A scrape whose request head arrived.
enum Scrape {
    Plain(tokio::net::TcpStream, Vec<u8>),
    Tls(
        Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
        Vec<u8>,
    ),
}

/// Send the answer to the request `head` on `stream`, then close it.
async fn answer<S: AsyncWrite + Unpin>(mut stream: S, head: &[u8], service: &StorageService) {
    let (status, content_type, body) = respond(head, service);
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    reply.extend_from_slice(&body);
    let _ = stream.write_all(&reply).await;
    let _ = stream.shutdown().await;
}

/// The request head (up to the blank line), or `None` if the client closed or sent too much.
async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 || head.len() + n > SCRAPE_REQUEST_MAX_BYTES {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Some(head)
}

fn respond(head: &[u8], service: &StorageService) -> (&'static str, &'static str, Vec<u8>) {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next(), parts.next());
    match (method, path) {
        (Some(b"GET"), Some(path)) => {
            let path = path.split(|&b| b == b'?').next().unwrap_or_default();
            if path == b"/metrics" {
                let text = service.metrics_text();
                ("200 OK", prometheus::TEXT_FORMAT, text)
            } else {
                (
                    "404 Not Found",
                    "text/plain",
                    b"only /metrics is served here\n".to_vec(),
                )
            }
        }
        _ => (
            "400 Bad Request",
            "text/plain",
            b"GET /metrics only\n".to_vec(),
        ),
    }
}
