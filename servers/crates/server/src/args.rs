//! Command-line flags of `pocketflow-server`, parsed once at the edge (by clap) into typed values.

use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, RangedU64ValueParser, TypedValueParser};
use clap::Parser;

use pocketflow_protocol::units;
use pocketflow_store::Tier;

/// Everything the flags say, with every default resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Args {
    /// Tier served.
    pub tier: Tier,
    /// Capacity of the tier in bytes.
    pub capacity_bytes: u64,
    /// Where the cluster secret and the TLS identity come from.
    pub keys: KeySource,
    /// Address to listen on (loopback, or a node address with TLS).
    pub listen: SocketAddr,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// Serve metrics over plain HTTP even with TLS or on a node address (explicit opt-in).
    pub metrics_plaintext: bool,
    /// File or block device of the NVMe tier.
    pub nvme_path: Option<PathBuf>,
    /// Whether PERSIST objects are accepted.
    pub long_running: bool,
    /// Whether the DRAM arena is a sealed memfd that readers of this host and uid may map.
    pub shared_dram: bool,
    /// Name of the server in statistics.
    pub node_id: String,
    /// Exit when this process is gone.
    pub parent_pid: Option<i32>,
    /// Runtime worker threads.
    pub threads: usize,
    /// How long PERSIST objects live after they are written (`None`: until the server exits).
    pub persist_ttl: Option<Duration>,
    /// How long a DoPut or DoGet may move nothing before it is ended.
    pub transfer_idle: Duration,
    /// How long an HTTP/2 connection may carry no stream before it is closed.
    pub connection_idle: Duration,
}

/// Where a server's key material comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// Files named on the command line (manual use and tests).
    Files {
        /// File holding the cluster secret (its exact bytes).
        secret: PathBuf,
        /// TLS certificate chain and key files; every connection must then open with TLS.
        tls: Option<TlsFiles>,
    },
    /// One document on stdin (`crate::keys`), so that no key path is on the command line.
    Stdin,
}

/// The PEM files of a TLS listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain, the server's certificate first.
    pub cert: PathBuf,
    /// The certificate's private key.
    pub key: PathBuf,
}

/// A flag value that does not parse, with a message for the user (clap names the flag).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ArgsError(pub String);

fn err<T>(message: impl Into<String>) -> Result<T, ArgsError> {
    Err(ArgsError(message.into()))
}

/// Explains the value syntax below the flag list of `--help`.
const VALUE_SYNTAX: &str = "\
SIZE is bytes, or a number with B, kB, MB, GB, TB, KiB, MiB, GiB or TiB (e.g. 256MiB, 1.5GB).
DURATION is seconds, or a number with us, ms, s, m, min or h (e.g. 500ms, 30s, 1.5h).
Flags take `--flag value` or `--flag=value`; a flag given twice keeps its last value.
Flag errors exit with status 2, startup errors with status 1.";

/// `--listen` when not given.
pub const LISTEN_DEFAULT: &str = "127.0.0.1:0";
/// `--transfer-idle` when not given.
pub const TRANSFER_IDLE_DEFAULT: &str = "30s";
/// Shortest `--transfer-idle`.
pub const TRANSFER_IDLE_MIN: Duration = Duration::from_millis(100);
/// Longest `--transfer-idle`.
pub const TRANSFER_IDLE_MAX: Duration = Duration::from_secs(3600);
/// `--connection-idle` when not given.
pub const CONNECTION_IDLE_DEFAULT: &str = "120s";
/// Shortest `--connection-idle`.
pub const CONNECTION_IDLE_MIN: Duration = Duration::from_millis(100);
/// Longest `--connection-idle`.
pub const CONNECTION_IDLE_MAX: Duration = Duration::from_secs(3600);
/// Longest `--persist-ttl`: 365 days.
pub const PERSIST_TTL_MAX: Duration = Duration::from_secs(365 * 24 * 3600);
/// Longest `--node-id`, in bytes.
pub const NODE_ID_MAX_BYTES: usize = 128;
/// Most `--threads`.
pub const THREADS_MAX: u64 = 1024;

/// The flags as clap declares them; [`Args`] resolves the defaults that depend on other flags.
#[derive(Debug, Parser)]
#[command(
    name = "pocketflow-server",
    about = "One pocketflow storage server: serves one tier over Arrow Flight (and the direct \
             exchange) on a loopback address, or with TLS on a node address.",
    long_about = None,
    after_help = VALUE_SYNTAX,
    args_override_self = true
)]
struct Flags {
    /// Tier served.
    #[arg(
        long,
        value_name = "TIER",
        value_parser = PossibleValuesParser::new(["dram", "nvme"]).try_map(|name| name.parse::<Tier>())
    )]
    tier: Tier,
    /// Capacity of the tier, in bytes (a SIZE).
    #[arg(long = "capacity", value_name = "SIZE", value_parser = parse_size_bytes)]
    capacity_bytes: u64,
    /// File holding the cluster secret (its exact bytes, at least 16).
    #[arg(long, value_name = "PATH", required_unless_present = "keys_from_stdin")]
    secret_file: Option<PathBuf>,
    /// Read the cluster secret, and the TLS certificate chain and key if any, from one JSON
    /// document on stdin at start (`{"secret_hex": .., "tls_cert_pem": .., "tls_key_pem": ..}`)
    /// instead of from files: no key path is then on the command line or in a shared directory.
    #[arg(long, conflicts_with_all = ["secret_file", "tls_cert", "tls_key"])]
    keys_from_stdin: bool,
    /// Address to listen on, port 0 picks one. A loopback address (127.0.0.0/8, [::1],
    /// localhost), or any other specific address together with --tls-cert and --tls-key.
    #[arg(long, value_name = "HOST:PORT", default_value = LISTEN_DEFAULT, value_parser = parse_listen)]
    listen: SocketAddr,
    /// PEM certificate chain (the server's certificate first): every connection must use TLS.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics at HOST:PORT/metrics (port 0 picks one; the ready line then
    /// names it): over HTTPS with the server's certificate when it has TLS, else over plain HTTP,
    /// which a node address (not loopback) allows only with --metrics-plaintext.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_metrics_listen)]
    metrics_listen: Option<SocketAddr>,
    /// Serve metrics over plain HTTP even when the server has TLS or the metrics address is not
    /// loopback (anyone who reaches the address can read them).
    #[arg(long, requires = "metrics_listen")]
    metrics_plaintext: bool,
    /// File or block device of the NVMe tier (required with --tier nvme).
    #[arg(long, value_name = "FILE", required_if_eq("tier", "nvme"))]
    nvme_path: Option<PathBuf>,
    /// Accept PERSIST objects.
    #[arg(long)]
    long_running: bool,
    /// Keep the DRAM arena in a sealed memfd that processes of this host and uid may map
    /// read-only, for zero-copy reads of pinned objects (PIN). Any such process can then read
    /// every job's bytes in the arena: for single-user hosts.
    #[arg(long)]
    shared_dram: bool,
    /// Name of the server in statistics, 1 to 128 bytes [default: <tier>-<pid>].
    #[arg(long, value_name = "NAME", value_parser = parse_node_id)]
    node_id: Option<String>,
    /// Exit when the process with this id is gone.
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(1..))]
    parent_pid: Option<i32>,
    /// Runtime worker threads, 1 to 1024 [default: the number of cores].
    #[arg(
        long,
        value_name = "N",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=THREADS_MAX)
    )]
    threads: Option<usize>,
    /// How long PERSIST objects live after they are written, a DURATION of 1ms to 365 days
    /// [default: until the server exits].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    persist_ttl: Option<Duration>,
    /// A DoPut or DoGet that moves nothing for this long is ended and gives back its transfer
    /// slot; a DURATION of 100ms to 1h.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = TRANSFER_IDLE_DEFAULT,
        value_parser = parse_transfer_idle
    )]
    transfer_idle: Duration,
    /// An HTTP/2 connection that carries no stream (RPC) for this long is closed and gives
    /// back its place; a DURATION of 100ms to 1h.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = CONNECTION_IDLE_DEFAULT,
        value_parser = parse_connection_idle
    )]
    connection_idle: Duration,
}

impl From<Flags> for Args {
    fn from(flags: Flags) -> Args {
        let tier = flags.tier;
        Args {
            tier,
            capacity_bytes: flags.capacity_bytes,
            keys: match (flags.keys_from_stdin, flags.secret_file) {
                (false, Some(secret)) => KeySource::Files {
                    secret,
                    tls: match (flags.tls_cert, flags.tls_key) {
                        (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
                        _ => None,
                    },
                },
                // clap requires --secret-file unless --keys-from-stdin, and forbids both.
                _ => KeySource::Stdin,
            },
            listen: flags.listen,
            metrics_listen: flags.metrics_listen,
            metrics_plaintext: flags.metrics_plaintext,
            nvme_path: flags.nvme_path,
            long_running: flags.long_running,
            shared_dram: flags.shared_dram,
            node_id: flags
                .node_id
                .unwrap_or_else(|| format!("{}-{}", tier.as_str(), std::process::id())),
            parent_pid: flags.parent_pid,
            threads: flags.threads.unwrap_or_else(default_threads),
            persist_ttl: flags.persist_ttl,
            transfer_idle: flags.transfer_idle,
            connection_idle: flags.connection_idle,
        }
    }
}

/// Parse a command line, program name first. `--help` and `-h` come back as an error of kind
/// `DisplayHelp`: its `exit()` prints the help and exits 0, while a flag error's `exit()` prints
/// the error and usage on stderr and exits 2.
pub fn parse<I, T>(argv: I) -> Result<Args, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = Flags::try_parse_from(argv).map(Args::from)?;
    // With keys from stdin the document must carry a TLS identity; checked once it is read.
    let tls_files = matches!(args.keys, KeySource::Files { tls: Some(_), .. });
    if !args.listen.ip().is_loopback() && !tls_files && args.keys != KeySource::Stdin {
        return Err(clap::Error::raw(
            clap::error::ErrorKind::MissingRequiredArgument,
            format!(
                "--listen {} is not a loopback address: a server on a node address needs TLS \
                 (--tls-cert and --tls-key, or --keys-from-stdin with a certificate)\n",
                args.listen
            ),
        ));
    }
    if !tls_files && args.keys != KeySource::Stdin {
        if let Some(message) = plaintext_metrics_refused(&args, false) {
            return Err(clap::Error::raw(
                clap::error::ErrorKind::ArgumentConflict,
                format!("{message}\n"),
            ));
        }
    }
    Ok(args)
}

/// Why metrics may not be served as `args` say, with or without a TLS identity (`has_tls`):
/// plain HTTP on an address other than loopback needs `--metrics-plaintext`.
pub fn plaintext_metrics_refused(args: &Args, has_tls: bool) -> Option<String> {
    let addr = args.metrics_listen?;
    (!has_tls && !args.metrics_plaintext && !addr.ip().is_loopback()).then(|| {
        format!(
            "--metrics-listen {addr} is not a loopback address: metrics there are served over \
             HTTPS with the server's TLS identity, or over plain HTTP only with \
             --metrics-plaintext"
        )
    })
}

/// Parse a size: the one grammar of sizes and durations (`pocketflow_protocol::units`, shared
/// with the Python package), above zero.
pub fn parse_size_bytes(text: &str) -> Result<u64, ArgsError> {
    let bytes = units::parse_size(text).map_err(|e| ArgsError(e.0))?;
    if bytes == 0 {
        return err("size must be greater than zero");
    }
    Ok(bytes)
}

/// Parse a duration: the one grammar (`pocketflow_protocol::units`), 1 ms..=365 days.
pub fn parse_duration(text: &str) -> Result<Duration, ArgsError> {
    let duration = units::parse_duration(text).map_err(|e| ArgsError(e.0))?;
    if duration < Duration::from_millis(1) || duration > PERSIST_TTL_MAX {
        return err(format!("duration {text:?} must be in 1ms..=365 days"));
    }
    Ok(duration)
}

/// Parse a `--transfer-idle` duration: 100 ms..=1 h.
fn parse_transfer_idle(text: &str) -> Result<Duration, ArgsError> {
    let idle = parse_duration(text)?;
    if !(TRANSFER_IDLE_MIN..=TRANSFER_IDLE_MAX).contains(&idle) {
        return err(format!("transfer idle time {text:?} must be in 100ms..=1h"));
    }
    Ok(idle)
}

/// Parse a `--connection-idle` duration: 100 ms..=1 h.
fn parse_connection_idle(text: &str) -> Result<Duration, ArgsError> {
    let idle = parse_duration(text)?;
    if !(CONNECTION_IDLE_MIN..=CONNECTION_IDLE_MAX).contains(&idle) {
        return err(format!(
            "connection idle time {text:?} must be in 100ms..=1h"
        ));
    }
    Ok(idle)
}

/// Parse a listen address: a specific address (`localhost` means 127.0.0.1), never the
/// unspecified one (0.0.0.0 or [::]): a server listens on one node address, not on every
/// interface. Whether a non-loopback address has TLS is checked once all flags are read.
pub fn parse_listen(text: &str) -> Result<SocketAddr, ArgsError> {
    let addr = parse_host_port(text)?;
    if addr.ip().is_unspecified() || addr.ip().is_multicast() {
        return err(format!(
            "{text:?} refused: listen on one node address (the one its clients reach), \
             not on every interface"
        ));
    }
    Ok(addr)
}

/// Parse the metrics address: like `--listen`.
fn parse_metrics_listen(text: &str) -> Result<SocketAddr, ArgsError> {
    parse_listen(text)
}

fn parse_host_port(text: &str) -> Result<SocketAddr, ArgsError> {
    let addr = match text.strip_prefix("localhost:") {
        Some(port) => {
            let port = port
                .parse()
                .map_err(|_| ArgsError(format!("{text:?} has a bad port")))?;
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
        }
        None => text
            .parse()
            .map_err(|_| ArgsError(format!("{text:?} is not HOST:PORT")))?,
    };
    Ok(addr)
}

/// Parse a `--node-id`: 1..=128 bytes.
fn parse_node_id(text: &str) -> Result<String, ArgsError> {
    if text.is_empty() || text.len() > NODE_ID_MAX_BYTES {
        return err(format!("a node id must be 1..={NODE_ID_MAX_BYTES} bytes"));
    }
    Ok(text.to_owned())
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::CommandFactory;

    use super::*;

    /// The program name, then `text` split at whitespace.
    fn argv(text: &str) -> Vec<String> {
        std::iter::once("pocketflow-server")
            .chain(text.split_whitespace())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn clap_declaration_is_consistent() {
        Flags::command().debug_assert();
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size_bytes("268435456"), Ok(268_435_456));
        assert_eq!(parse_size_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size_bytes("64 KiB"), Ok(64 << 10));
        assert_eq!(parse_size_bytes("1tib"), Ok(1 << 40));
        assert_eq!(parse_size_bytes("10B"), Ok(10));
        assert_eq!(parse_size_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size_bytes("2GB"), Ok(2_000_000_000));
        for bad in [
            "",
            "MiB",
            "0",
            "12XB",
            "-5",
            "0.5B",
            "99999999999999999999",
            "20000000TiB",
        ] {
            assert!(parse_size_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(parse_listen("127.0.0.1:0").unwrap().port(), 0);
        assert!(parse_listen("[::1]:9000").is_ok());
        assert!(parse_listen("localhost:7").is_ok());
        assert!(parse_listen("0.0.0.0:9000").is_err());
        assert!(parse_listen("[::]:9000").is_err());
        assert!(parse_listen("10.0.0.1:9000").is_ok());
        assert!(parse_listen("nonsense").is_err());
    }

    #[test]
    fn a_node_address_needs_tls() {
        let plain = parse(argv(
            "--tier dram --capacity 1MiB --secret-file /s --listen 10.0.0.1:0",
        ))
        .unwrap_err();
        assert!(plain.to_string().contains("needs TLS"), "{plain}");
        let args = parse(argv(
            "--tier dram --capacity 1MiB --secret-file /s --listen 10.0.0.1:0 \
             --tls-cert /c.pem --tls-key /k.pem --metrics-listen 127.0.0.1:0",
        ))
        .unwrap();
        assert_eq!(
            args.keys,
            KeySource::Files {
                secret: "/s".into(),
                tls: Some(TlsFiles {
                    cert: "/c.pem".into(),
                    key: "/k.pem".into()
                })
            }
        );
        assert_eq!(args.metrics_listen, Some("127.0.0.1:0".parse().unwrap()));
        let half = parse(argv(
            "--tier dram --capacity 1MiB --secret-file /s --tls-cert /c.pem",
        ))
        .unwrap_err();
        assert!(half.to_string().contains("--tls-key"), "{half}");
    }

    #[test]
    fn full_command_line() {
        let args = parse(argv(
            "--listen 127.0.0.1:0 --node-id n1 --tier nvme --capacity 268435456 --secret-file /s \
             --long-running --nvme-path /tmp/x --threads 2 --parent-pid 42 --persist-ttl 90s \
             --transfer-idle 5s --connection-idle 2m",
        ))
        .unwrap();
        assert_eq!(args.tier, Tier::Nvme);
        assert_eq!(args.capacity_bytes, 256 << 20);
        assert_eq!(
            args.keys,
            KeySource::Files {
                secret: "/s".into(),
                tls: None
            }
        );
        assert_eq!(args.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(args.node_id, "n1");
        assert!(args.long_running);
        assert_eq!(args.parent_pid, Some(42));
        assert_eq!(args.threads, 2);
        assert_eq!(args.persist_ttl, Some(Duration::from_secs(90)));
        assert_eq!(args.transfer_idle, Duration::from_secs(5));
        assert_eq!(args.connection_idle, Duration::from_secs(120));
        assert_eq!(args.nvme_path, Some(PathBuf::from("/tmp/x")));
    }

    #[test]
    fn defaults() {
        let args = parse(argv("--tier=dram --capacity=1MiB --secret-file=/s")).unwrap();
        assert_eq!(args.tier, Tier::Dram);
        assert_eq!(args.capacity_bytes, 1 << 20);
        assert_eq!(args.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(args.nvme_path, None);
        assert!(!args.long_running);
        assert_eq!(args.node_id, format!("dram-{}", std::process::id()));
        assert_eq!(args.parent_pid, None);
        assert_eq!(args.threads, default_threads());
        assert_eq!(args.persist_ttl, None);
        assert_eq!(args.transfer_idle, Duration::from_secs(30));
    }

    #[test]
    fn metrics_on_a_node_address_need_tls_or_the_plaintext_opt_in() {
        let refused = parse(argv(
            "--tier dram --capacity 1MiB --secret-file /s --metrics-listen 10.0.0.1:0",
        ))
        .unwrap_err();
        assert!(
            refused.to_string().contains("--metrics-plaintext"),
            "{refused}"
        );
        let opted_in = parse(argv(
            "--tier dram --capacity 1MiB --secret-file /s --metrics-listen 10.0.0.1:0 \
             --metrics-plaintext",
        ))
        .unwrap();
        assert!(opted_in.metrics_plaintext);
        for fine in [
            "--secret-file /s --metrics-listen 127.0.0.1:0",
            "--secret-file /s --listen 10.0.0.1:0 --tls-cert /c --tls-key /k \
             --metrics-listen 10.0.0.1:0",
            // Known once the keys document is read.
            "--keys-from-stdin --metrics-listen 10.0.0.1:0",
        ] {
            let args = parse(argv(&format!("--tier dram --capacity 1MiB {fine}"))).unwrap();
            assert!(!args.metrics_plaintext, "{fine}");
        }
        let stdin = parse(argv(
            "--tier dram --capacity 1MiB --keys-from-stdin --metrics-listen 10.0.0.1:0",
        ))
        .unwrap();
        assert!(plaintext_metrics_refused(&stdin, false).is_some());
        assert!(plaintext_metrics_refused(&stdin, true).is_none());
        let alone = parse(argv(
            "--tier dram --capacity 1MiB --secret-file /s --metrics-plaintext",
        ))
        .unwrap_err();
        assert!(alone.to_string().contains("--metrics-listen"), "{alone}");
    }

    #[test]
    fn keys_from_stdin_replace_the_key_files() {
        let args = parse(argv("--tier dram --capacity 1MiB --keys-from-stdin")).unwrap();
        assert_eq!(args.keys, KeySource::Stdin);
        // Whether the document holds a certificate is checked when it is read.
        let node = parse(argv(
            "--tier dram --capacity 1MiB --keys-from-stdin --listen 10.0.0.1:0",
        ))
        .unwrap();
        assert_eq!(node.keys, KeySource::Stdin);
    }

    #[test]
    fn a_repeated_flag_keeps_its_last_value() {
        let args = parse(argv(
            "--tier nvme --tier dram --capacity 1MiB --capacity 2MiB --secret-file /s",
        ))
        .unwrap();
        assert_eq!(args.tier, Tier::Dram);
        assert_eq!(args.capacity_bytes, 2 << 20);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(24 * 3600)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in [
            "",
            "0",
            "0s",
            "500us",
            "3d",
            "-1s",
            "9000h",
            "99999999999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_transfer_idle("100ms"), Ok(TRANSFER_IDLE_MIN));
        assert_eq!(parse_transfer_idle("1h"), Ok(TRANSFER_IDLE_MAX));
    }

    #[test]
    fn flag_errors() {
        assert_eq!(
            parse(argv("--help")).unwrap_err().kind(),
            ErrorKind::DisplayHelp
        );
        assert_eq!(
            parse(argv("-h")).unwrap_err().kind(),
            ErrorKind::DisplayHelp
        );
        for (bad, flag) in [
            ("--capacity 1MiB --secret-file /s", "--tier"),
            ("--tier dram --secret-file /s", "--capacity"),
            ("--tier dram --capacity 1MiB", "--secret-file"),
            (
                "--tier dram --capacity 1MiB --secret-file /s --keys-from-stdin",
                "--keys-from-stdin",
            ),
            (
                "--tier dram --capacity 1MiB --keys-from-stdin --tls-cert /c --tls-key /k",
                "--keys-from-stdin",
            ),
            ("--tier tape --capacity 1MiB --secret-file /s", "--tier"),
            (
                "--tier nvme --capacity 1MiB --secret-file /s",
                "--nvme-path",
            ),
            ("--tier dram --capacity 0 --secret-file /s", "--capacity"),
            (
                "--tier dram --capacity 1MiB --secret-file /s --listen 0.0.0.0:1",
                "--listen",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --threads 0",
                "--threads",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --threads 1025",
                "--threads",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --parent-pid x",
                "--parent-pid",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --parent-pid 0",
                "--parent-pid",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --node-id=",
                "--node-id",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --long-running=yes",
                "--long-running",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --bogus",
                "--bogus",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s stray",
                "stray",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --persist-ttl 0s",
                "--persist-ttl",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --transfer-idle 50ms",
                "--transfer-idle",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --transfer-idle 2h",
                "--transfer-idle",
            ),
            (
                "--tier dram --capacity 1MiB --secret-file /s --connection-idle 50ms",
                "--connection-idle",
            ),
            ("--tier dram --capacity", "--capacity"),
        ] {
            let error = parse(argv(bad)).expect_err(bad);
            assert_eq!(error.exit_code(), 2, "{bad}");
            let message = error.to_string();
            assert!(message.contains(flag), "{bad}: {message}");
        }
        let long_name = format!("--node-id={}", "n".repeat(NODE_ID_MAX_BYTES + 1));
        let error = parse(argv(&format!(
            "--tier dram --capacity 1MiB --secret-file /s {long_name}"
        )))
        .unwrap_err();
        assert!(error.to_string().contains("1..=128 bytes"), "{error}");
    }

    #[test]
    fn help_lists_every_flag_with_its_unit_and_default() {
        let help = Flags::command().render_long_help().to_string();
        for flag in [
            "--tier <TIER>",
            "--capacity <SIZE>",
            "--secret-file <PATH>",
            "--keys-from-stdin",
            "--listen <HOST:PORT>",
            "--nvme-path <FILE>",
            "--long-running",
            "--node-id <NAME>",
            "--parent-pid <PID>",
            "--threads <N>",
            "--persist-ttl <DURATION>",
            "--transfer-idle <DURATION>",
            "--connection-idle <DURATION>",
            "[default: 120s]",
            "[possible values: dram, nvme]",
            "[default: 127.0.0.1:0]",
            "[default: 30s]",
            "[default: <tier>-<pid>]",
            "[default: the number of cores]",
            "[default: until the server exits]",
            "SIZE is bytes",
            "DURATION is seconds",
        ] {
            assert!(help.contains(flag), "{flag} missing from:\n{help}");
        }
    }
}
