//! `pocketflow-server`: one storage server process serving one tier over Arrow Flight (and the
//! direct exchange) on a loopback address, or with TLS on a node address; optionally Prometheus
//! metrics over HTTPS (or plain HTTP without TLS on loopback, or by explicit opt-in).

mod args;
mod keys;
mod lifecycle;
mod link;
mod listener;
mod sweeper;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use pocketflow_flight::bounds::{
    HTTP2_CONNECTION_WINDOW_BYTES, HTTP2_STREAMS_PER_CONNECTION_MAX, HTTP2_STREAM_WINDOW_BYTES,
    SHUTDOWN_GRACE_MS,
};
use pocketflow_flight::{ServiceConfig, StorageService};
use pocketflow_protocol::limits::READY_LINE_PREFIX;
use pocketflow_store::{Store, StoreConfig, Throughput, Tier};

use crate::args::{Args, KeySource};

/// Largest HTTP/2 frame the server accepts; large frames cut per-frame work on block transfers.
const HTTP2_FRAME_MAX_BYTES: u32 = 1024 * 1024;
/// Idle connections are pinged this often, so a vanished client frees its connection slot.
const HTTP2_KEEPALIVE_INTERVAL_MS: u64 = 30_000;
/// A ping unanswered for this long closes the connection.
const HTTP2_KEEPALIVE_TIMEOUT_MS: u64 = 20_000;
/// How long runtime shutdown waits for blocking tasks before the process exits anyway.
const RUNTIME_SHUTDOWN_MS: u64 = 500;

fn main() -> ExitCode {
    // Before any key is read, so that no other process of the user can read one back.
    if let Err(e) = keys::forbid_dumps() {
        eprintln!("pocketflow-server: cannot make the process non-dumpable: {e}");
        return ExitCode::FAILURE;
    }
    keep_transfer_buffers();
    // `--help` prints the help and exits 0; a flag error prints itself and the usage and exits 2.
    let args = args::parse(std::env::args_os()).unwrap_or_else(|e| e.exit());
    let keys = match keys::load(&args.keys, std::io::stdin().lock()) {
        Ok(keys) => keys,
        Err(e) => {
            eprintln!("pocketflow-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    if !args.listen.ip().is_loopback() && keys.tls.is_none() {
        // The flags checked this already for key files; a keys document is checked here.
        debug_assert_eq!(args.keys, KeySource::Stdin);
        eprintln!(
            "pocketflow-server: --listen {} is not a loopback address: a server on a node \
             address needs TLS, and the keys document has no tls_cert_pem and tls_key_pem",
            args.listen
        );
        return ExitCode::FAILURE;
    }
    if let Some(message) = args::plaintext_metrics_refused(&args, keys.tls.is_some()) {
        eprintln!("pocketflow-server: {message}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .thread_name("pocketflow-worker")
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("pocketflow-server: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(serve(args, keys));
    runtime.shutdown_timeout(Duration::from_millis(RUNTIME_SHUTDOWN_MS));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pocketflow-server: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args, keys: keys::Keys) -> Result<(), String> {
    let keys::Keys { token_key, tls } = keys;
    let store = Store::open(StoreConfig {
        tier: args.tier,
        capacity_bytes: args.capacity_bytes,
        nvme_path: args.nvme_path.clone(),
        long_running: args.long_running,
        persist_ttl: args.persist_ttl,
        shared_dram: args.shared_dram,
    })
    .map_err(|e| format!("cannot open the {} store: {e}", args.tier))?;
    // What the tier moves, measured before serving so the test block meets no job.
    let measured = store
        .measure_throughput()
        .await
        .map_err(|e| format!("cannot measure the {} store: {e}", args.tier))?;
    pocketflow_flight::cores::init(args.threads);
    let has_tls = tls.is_some();
    let metrics_tls = match &tls {
        Some(config) if !args.metrics_plaintext => Some(tokio_rustls::TlsAcceptor::from(
            pocketflow_flight::metrics::metrics_tls_config(config),
        )),
        _ => None,
    };
    let metrics_https = metrics_tls.is_some();
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let service = StorageService::new(
        store.clone(),
        ServiceConfig {
            node_id: args.node_id.clone(),
            token_key,
            transfer_idle: args.transfer_idle,
        },
    );
    service.set_connection_idle(args.connection_idle);
    tokio::spawn(sweeper::run(store, service.clone()));
    // Local clusters ask for a shared arena by default: a host that refuses its socket still
    // gets a server, whose readers copy.
    if let Err(e) = service.serve_shared_arena() {
        eprintln!("pocketflow-server: warning: cannot serve the shared arena ({e}); readers copy");
    }
    tokio::spawn(service.clone().sweep_pins());
    let signals = lifecycle::StopSignals::install()
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the listening address: {e}"))?;
    report_throughput(&service, args.tier, measured, local.ip());
    let metrics_at = match args.metrics_listen {
        Some(addr) => {
            let (metrics_listener, at) = pocketflow_flight::metrics::bind(addr)
                .await
                .map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?;
            tokio::spawn(pocketflow_flight::metrics::serve(
                metrics_listener,
                service.clone(),
                metrics_tls,
            ));
            Some(at)
        }
        None => None,
    };

    tokio::spawn({
        let service = service.clone();
        async move { service.run_sampler().await }
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop = tokio::spawn({
        let service = service.clone();
        let parent_pid = args.parent_pid;
        async move {
            let reason = lifecycle::stop_reason(signals, service, parent_pid).await;
            let _ = stop_tx.send(true);
            reason
        }
    });

    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(HTTP2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW_BYTES)
        .max_concurrent_streams(HTTP2_STREAMS_PER_CONNECTION_MAX)
        .max_frame_size(HTTP2_FRAME_MAX_BYTES)
        .http2_keepalive_interval(Some(Duration::from_millis(HTTP2_KEEPALIVE_INTERVAL_MS)))
        .http2_keepalive_timeout(Some(Duration::from_millis(HTTP2_KEEPALIVE_TIMEOUT_MS)))
        .add_service(service.clone().into_server())
        .serve_with_incoming_shutdown(
            pocketflow_flight::route::route(listener::incoming(listener), service.clone(), tls),
            wait_for(stop_rx.clone()),
        );

    // `POCKETFLOW_SERVER_READY host:port [metrics=host:port [metrics_tls]] [tls]`
    let mut ready = format!("{READY_LINE_PREFIX} {local}");
    if let Some(at) = metrics_at {
        ready.push_str(&format!(" metrics={at}"));
        if metrics_https {
            ready.push_str(" metrics_tls");
        }
    }
    if has_tls {
        ready.push_str(" tls");
    }
    println!("{ready}");
    std::io::stdout()
        .flush()
        .map_err(|e| format!("cannot write the ready line: {e}"))?;

    // Graceful shutdown waits for open connections; long-lived sessions get a bounded grace.
    let grace = async {
        wait_for(stop_rx).await;
        tokio::time::sleep(Duration::from_millis(SHUTDOWN_GRACE_MS)).await;
    };
    tokio::select! {
        served = server => served.map_err(|e| format!("server failed: {e}"))?,
        () = grace => {}
    }
    match stop.await {
        Ok(reason) => {
            eprintln!("pocketflow-server: stopping ({reason:?})");
            Ok(())
        }
        Err(e) => Err(format!("shutdown watcher failed: {e}")),
    }
}

/// Give `service` the throughput it reports: the slower direction of the start-up self-test,
/// capped by the link speed of the interface it listens on (none on loopback), and log it.
fn report_throughput(
    service: &StorageService,
    tier: Tier,
    measured: Option<Throughput>,
    listen: std::net::IpAddr,
) {
    let Some(measured) = measured else {
        eprintln!("pocketflow-server: {tier} too small for a throughput self-test");
        return;
    };
    let cap = link::throughput_cap_bytes_per_s(listen);
    let reported = measured.bytes_per_s().min(cap.unwrap_or(u64::MAX));
    eprintln!(
        "pocketflow-server: {tier} self-test ({} MiB): write {} MB/s, read {} MB/s; link cap {}; \
         reporting {} MB/s",
        measured.test_bytes >> 20,
        measured.write_bytes_per_s / 1_000_000,
        measured.read_bytes_per_s / 1_000_000,
        cap.map_or("none".to_owned(), |cap| format!("{} MB/s", cap / 1_000_000)),
        reported / 1_000_000,
    );
    service.set_measured_throughput(reported);
}

async fn wait_for(mut stop: tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

/// Keep freed megabyte-sized buffers in the process. Every DoPut and DoGet piece is a buffer of
/// up to `BATCH_MAX_BYTES`; with glibc's defaults each one is mapped and unmapped again (and the
/// kernel zeroes its pages on every reuse), which made a 1 MiB transfer about 1.5x slower.
/// Buffers up to 32 MiB come from the heap, and up to 128 MiB of free heap top is kept.
fn keep_transfer_buffers() {
    const MMAP_THRESHOLD_BYTES: libc::c_int = 32 << 20;
    const TRIM_THRESHOLD_BYTES: libc::c_int = 128 << 20;
    // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
    }
}
